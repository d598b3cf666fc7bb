/* A 4-rank job through rdistrun --on-failure continue (env://): rank 1
 * is killed in the middle of a run of allreduces; the others shrink with
 * no list (they agree who failed), check their new ranks and a sum over
 * the survivors, then shrink once more leaving a live rank out, while the
 * parent goes on. Argument errors through the committed header.
 * Compiled with -Wall -Wextra -Wpedantic -Werror by tests/c_api.rs. */
#include "rdist.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank = -1;

#define CHECK(call)                                                                  \
  do {                                                                               \
    rdist_result_t rc_ = (call);                                                     \
    if (rc_ != RDIST_SUCCESS) {                                                      \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", g_rank, #call,                 \
              rdist_result_string(rc_), rdist_last_error());                         \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

#define EXPECT(cond, ...)                                                            \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      fprintf(stderr, "rank %d: check failed: %s: ", g_rank, #cond);                 \
      fprintf(stderr, __VA_ARGS__);                                                  \
      fprintf(stderr, "\n");                                                         \
      exit(2);                                                                       \
    }                                                                                \
  } while (0)

int main(void) {
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, NULL));
  int rank = -1, size = -1;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  g_rank = rank;
  EXPECT(size == 4, "size %d", size);

  /* bad arguments are refused before anything happens */
  rdist_comm_t* child = NULL;
  int me = rank;
  EXPECT(rdist_comm_shrink(comm, NULL, 0, &child, NULL, 7) == RDIST_ERR_INVALID_ARGUMENT, "flags 7");
  EXPECT(strstr(rdist_last_error(), "RDIST_SHRINK_ABORT"), "%s", rdist_last_error());
  EXPECT(rdist_comm_shrink(comm, NULL, 1, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "NULL list");
  EXPECT(rdist_comm_shrink(comm, &me, -1, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "count -1");
  EXPECT(rdist_comm_shrink(comm, &me, 1, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "itself");
  EXPECT(strstr(rdist_last_error(), "excludes itself"), "%s", rdist_last_error());
  EXPECT(rdist_comm_shrink(comm, NULL, 0, NULL, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "NULL out");
  EXPECT(rdist_comm_shrink(NULL, NULL, 0, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "NULL comm");
  int all[4] = {0, 1, 2, 3};
  EXPECT(rdist_comm_shrink(comm, all, 4, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "everyone");
  EXPECT(strstr(rdist_last_error(), "leaves none"), "%s", rdist_last_error());
  int beyond[2] = {(rank + 1) % 4, 9};
  EXPECT(rdist_comm_shrink(comm, beyond, 2, &child, NULL, 0) == RDIST_ERR_INVALID_ARGUMENT, "rank 9");
  EXPECT(child == NULL, "out written on failure");

  float x[256];
  for (int i = 0;; i++) {
    if (rank == 1 && i == 25) raise(SIGKILL);
    for (int k = 0; k < 256; k++) x[k] = 1.0f;
    rdist_result_t rc = rdist_allreduce(x, x, 256, RDIST_FLOAT32, RDIST_SUM, comm, NULL);
    if (rc != RDIST_SUCCESS) {
      EXPECT(rc == RDIST_ERR_PEER_LOST || rc == RDIST_ERR_ABORTED, "%s", rdist_last_error());
      break;
    }
    EXPECT(i < 100000, "rank 1's death was never noticed");
  }

  /* The survivors agree: 0, 2, 3 become 0, 1, 2. */
  CHECK(rdist_comm_shrink(comm, NULL, 0, &child, NULL, RDIST_SHRINK_DEFAULT));
  int crank = -1, csize = -1;
  CHECK(rdist_comm_rank(child, &crank));
  CHECK(rdist_comm_size(child, &csize));
  EXPECT(csize == 3 && crank == (rank == 0 ? 0 : rank - 1), "rank %d size %d", crank, csize);
  double v = rank + 1;
  CHECK(rdist_allreduce(&v, &v, 1, RDIST_FLOAT64, RDIST_SUM, child, NULL));
  EXPECT(v == 1 + 3 + 4, "sum %g", v);
  int failed[4], nfailed = 0;
  CHECK(rdist_comm_failed_ranks(comm, failed, 4, &nfailed));

  /* A healthy shrink of the child leaving its rank 2 out; the child goes
     on with all three. */
  if (crank != 2) {
    int out_rank = 2;
    rdist_comm_t* pair = NULL;
    CHECK(rdist_comm_shrink(child, &out_rank, 1, &pair, NULL, RDIST_SHRINK_DEFAULT));
    int prank = -1, psize = -1;
    CHECK(rdist_comm_rank(pair, &prank));
    CHECK(rdist_comm_size(pair, &psize));
    EXPECT(psize == 2 && prank == crank, "rank %d size %d", prank, psize);
    CHECK(rdist_comm_destroy(pair));
  }
  double w = crank;
  CHECK(rdist_allreduce(&w, &w, 1, RDIST_FLOAT64, RDIST_MAX, child, NULL));
  EXPECT(w == 2, "max %g", w);
  CHECK(rdist_comm_destroy(child));
  CHECK(rdist_comm_destroy(comm));
  printf("rank %d: shrunk ok (knew of %d failed)\n", rank, nfailed);
  return 0;
}
