/* Allreduce average, then broadcast from rank 0, across N ranks:
 *   rdistrun --nproc-per-node 4 ./allreduce_average
 * Every rank contributes a vector; RDIST_AVG leaves the element-wise mean
 * on every rank. Then rank 0 picks a value and broadcasts it. */
#include <rdist.h>

#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                              \
  do {                                                                           \
    rdist_result_t rc_ = (call);                                                 \
    if (rc_ != RDIST_SUCCESS) {                                                  \
      fprintf(stderr, "%s failed: %s\n", #call, rdist_last_error());             \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

int main(void) {
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, NULL)); /* RANK, WORLD_SIZE, MASTER_* from rdistrun */
  int rank = 0, size = 0;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));

  /* Rank r holds r + i at index i; the mean over ranks is (size-1)/2 + i. */
  enum { N = 4 };
  float values[N];
  for (int i = 0; i < N; i++) values[i] = (float)(rank + i);
  CHECK(rdist_allreduce(values, values, N, RDIST_FLOAT32, RDIST_AVG, comm, NULL)); /* in place */

  /* Rank 0 decides something (a seed, a learning rate) and tells everyone. */
  double learning_rate = rank == 0 ? 0.05 : 0.0;
  CHECK(rdist_broadcast(&learning_rate, &learning_rate, 1, RDIST_FLOAT64, 0, comm, NULL));

  int ok = learning_rate == 0.05;
  for (int i = 0; i < N; i++) ok = ok && values[i] == (float)(size - 1) / 2 + (float)i;
  printf("rank %d of %d: mean = [%g %g %g %g], learning rate %g: %s\n", rank, size, values[0], values[1],
         values[2], values[3], learning_rate, ok ? "ok" : "WRONG");
  CHECK(rdist_comm_destroy(comm));
  return ok ? 0 : 1;
}
