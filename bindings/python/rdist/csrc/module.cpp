// The Python module of the compiled backend (rdist/_extension.py loads
// it as rdist._c10d): RdistBackend as a subclass of torch's Backend, so
// that torch.distributed takes it from the creator rdist.torch registers.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend.hpp"

namespace py = pybind11;
using rdist_torch::RdistBackend;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rdist's c10d backend, compiled against this torch";
  py::module_::import("torch._C._distributed_c10d");
  py::class_<RdistBackend, c10d::Backend, c10::intrusive_ptr<RdistBackend>>(
      m, "RdistBackend")
      .def(
          py::init([](const std::string& library, uintptr_t comm, int64_t timeoutMs) {
            return c10::make_intrusive<RdistBackend>(
                library,
                reinterpret_cast<rdist_comm_t*>(comm),
                std::chrono::milliseconds(timeoutMs));
          }),
          py::arg("library"),
          py::arg("comm"),
          py::arg("timeout_ms"),
          "Takes over the rdist_comm_t* `comm` (an int) of the librdist at "
          "`library`.")
      .def(
          "failed_ranks",
          &RdistBackend::failedRanks,
          py::call_guard<py::gil_scoped_release>(),
          "The ranks of this group that this rank knows failed.")
      .def(
          "shrink_to",
          &RdistBackend::shrinkTo,
          py::arg("ranks_to_exclude"),
          py::arg("shrink_flags") = 0,
          py::arg("timeout_ms") = 0,
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("comm_handle", &RdistBackend::commHandle)
      .def_property_readonly("compiled", [](const RdistBackend&) { return true; });
}
