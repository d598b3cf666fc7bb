// An installed-rdist consumer in C++ (rdist.hpp): allreduce across the job.
#include <rdist.hpp>

#include <cstdio>
#include <vector>

int main() {
  try {
    auto comm = rdist::Comm::init();
    std::vector<double> v(4, comm.rank() + 1.0);
    comm.allreduce(v, RDIST_AVG);
    if (v[3] != (comm.size() + 1) / 2.0) {
      std::fprintf(stderr, "allreduce gave %g\n", v[3]);
      return 1;
    }
    std::printf("consumer_cpp rank %d: ok\n", comm.rank());
  } catch (const rdist::Error& e) {
    std::fprintf(stderr, "rdist error %d: %s\n", static_cast<int>(e.code()), e.what());
    return 1;
  }
  return 0;
}
