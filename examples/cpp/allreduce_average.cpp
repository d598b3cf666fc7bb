// Allreduce average, then broadcast from rank 0, across N ranks, in C++:
//   rdistrun --nproc-per-node 4 ./allreduce_average_cpp
// Every rank contributes a vector; RDIST_AVG leaves the element-wise mean
// on every rank. Then rank 0 picks a value and broadcasts it.
#include <rdist.hpp>

#include <cstdio>
#include <vector>

int main() try {
  auto comm = rdist::Comm::init();  // env://: RANK, WORLD_SIZE, MASTER_* from rdistrun
  const int rank = comm.rank(), size = comm.size();

  // Rank r holds r + i at index i; the mean over ranks is (size-1)/2 + i.
  std::vector<float> values{0, 1, 2, 3};
  for (float& v : values) v += static_cast<float>(rank);
  comm.allreduce(values, RDIST_AVG);  // in place; the dtype comes from float

  // Rank 0 decides something (a seed, a learning rate) and tells everyone.
  std::vector<double> learning_rate{rank == 0 ? 0.05 : 0.0};
  comm.broadcast(learning_rate, 0);

  bool ok = learning_rate[0] == 0.05;
  for (std::size_t i = 0; i < values.size(); i++)
    ok = ok && values[i] == static_cast<float>(size - 1) / 2 + static_cast<float>(i);
  std::printf("rank %d of %d: mean = [%g %g %g %g], learning rate %g: %s\n", rank, size, values[0], values[1],
              values[2], values[3], learning_rate[0], ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
} catch (const rdist::Error& e) {  // every failure: the result code and the library's message
  std::fprintf(stderr, "rdist error %d: %s\n", static_cast<int>(e.code()), e.what());
  return 1;
}
