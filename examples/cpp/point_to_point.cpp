// Point to point from rank 0 to rank 3, blocking and non-blocking, in C++:
//   rdistrun --nproc-per-node 4 ./point_to_point_cpp
// A send and its recv name each other's rank and agree on count and type.
// isend/irecv return an rdist::Request at once; the buffer must stay
// untouched until the request is done (its destructor waits, too).
#include <rdist.hpp>

#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

constexpr int kFrom = 0, kTo = 3;

int main() try {
  auto comm = rdist::Comm::init();
  const int rank = comm.rank();
  if (comm.size() < 4) {
    std::fprintf(stderr, "run with at least 4 ranks\n");
    return 1;
  }

  std::vector<std::int32_t> blocking(8), nonblocking(8);
  bool ok = true;
  if (rank == kFrom) {
    std::iota(blocking.begin(), blocking.end(), 0);
    std::iota(nonblocking.begin(), nonblocking.end(), 100);
    comm.send(blocking, kTo);  // returns when `blocking` is reusable

    rdist::Request req = comm.isend(nonblocking, kTo);
    // ... other work here; leave `nonblocking` alone ...
    req.wait();
    std::printf("rank %d: sent two messages to rank %d: ok\n", rank, kTo);
  } else if (rank == kTo) {
    comm.recv(blocking, kFrom);  // receives blocking.size() elements

    rdist::Request req = comm.irecv(nonblocking, kFrom);
    while (!req.test()) {
      // poll, doing other work; or just req.wait()
    }
    for (int i = 0; i < 8; i++) ok = ok && blocking[i] == i && nonblocking[i] == 100 + i;
    std::printf("rank %d: received [%d..%d] and [%d..%d]: %s\n", rank, blocking.front(), blocking.back(),
                nonblocking.front(), nonblocking.back(), ok ? "ok" : "WRONG");
  } else {
    std::printf("rank %d: not involved: ok\n", rank);
  }
  return ok ? 0 : 1;
} catch (const rdist::Error& e) {
  std::fprintf(stderr, "rdist error %d: %s\n", static_cast<int>(e.code()), e.what());
  return 1;
}
