// librdist's C API as the torch backend reaches it: a table of the
// functions of the library the Python binding already loaded (found by
// its path with dlopen, so both use one instance and one
// rdist_last_error), rather than a link against some librdist at build
// time. Functions a 0.1 library lacks are null; their callers say so.
#pragma once

#include <string>

#include "rdist.h"

namespace rdist_torch {

#define RDIST_TORCH_FUNCTIONS(X) \
  X(rdist_last_error)            \
  X(rdist_comm_rank)             \
  X(rdist_comm_size)             \
  X(rdist_comm_backend)          \
  X(rdist_comm_shrink)           \
  X(rdist_options_create)        \
  X(rdist_options_set)           \
  X(rdist_options_destroy)       \
  X(rdist_comm_failed_ranks)     \
  X(rdist_comm_abort)            \
  X(rdist_comm_destroy)          \
  X(rdist_allreduce)             \
  X(rdist_iallreduce)            \
  X(rdist_broadcast)             \
  X(rdist_ibroadcast)            \
  X(rdist_reduce)                \
  X(rdist_ireduce)               \
  X(rdist_allgather)             \
  X(rdist_iallgather)            \
  X(rdist_allgatherv)            \
  X(rdist_iallgatherv)           \
  X(rdist_reduce_scatter)        \
  X(rdist_ireduce_scatter)       \
  X(rdist_gather)                \
  X(rdist_igather)               \
  X(rdist_scatter)               \
  X(rdist_iscatter)              \
  X(rdist_alltoall)              \
  X(rdist_ialltoall)             \
  X(rdist_alltoallv)             \
  X(rdist_ialltoallv)            \
  X(rdist_barrier)               \
  X(rdist_ibarrier)              \
  X(rdist_send)                  \
  X(rdist_recv)                  \
  X(rdist_send_tagged)           \
  X(rdist_recv_tagged)           \
  X(rdist_isend)                 \
  X(rdist_irecv)                 \
  X(rdist_isend_tagged)          \
  X(rdist_irecv_tagged)          \
  X(rdist_wait)                  \
  X(rdist_test)                  \
  X(rdist_request_free)          \
  X(rdist_request_status)        \
  X(rdist_group_start)           \
  X(rdist_group_end)

struct Api {
#define RDIST_TORCH_MEMBER(name) decltype(&::name) name = nullptr;
  RDIST_TORCH_FUNCTIONS(RDIST_TORCH_MEMBER)
#undef RDIST_TORCH_MEMBER

  // The table of the library at `path` (already loaded by the binding).
  // Throws when it cannot be opened or lacks a 0.1 function.
  static const Api& load(const std::string& path);

  // rdist_last_error() of this thread, or a fallback before any call.
  std::string lastError() const;
};

}  // namespace rdist_torch
