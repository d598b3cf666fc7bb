/* Tagged point-to-point through the C API, as a multi-rank job under
 * rdistrun (any world size >= 2; ctest runs 3): a receive posted before a
 * collective and matched by a send made after it, wildcards with the
 * status they fill in, a shorter message into a larger buffer, and bad
 * arguments. Built with -Wall -Wextra -Wpedantic -Werror. */
#include "rdist.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank = -1, size = -1;

#define CHECK(call)                                                                     \
  do {                                                                                  \
    rdist_result_t rc_ = (call);                                                        \
    if (rc_ != RDIST_SUCCESS) {                                                         \
      fprintf(stderr, "rank %d: %s:%d: %s failed: %s: %s\n", rank, __FILE__, __LINE__, \
              #call, rdist_result_string(rc_), rdist_last_error());                     \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

#define EXPECT(cond, ...)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", rank, __FILE__, __LINE__, \
              #cond);                                                                  \
      fprintf(stderr, __VA_ARGS__);                                                    \
      fprintf(stderr, "\n");                                                           \
      exit(2);                                                                         \
    }                                                                                  \
  } while (0)

enum { N = 1000 };

/* irecv from the left; allreduce; send to the right; wait (legal in MPI). */
static void test_receive_across_a_collective(rdist_comm_t* comm) {
  int left = (rank + size - 1) % size, right = (rank + 1) % size;
  int32_t got[N], mine[N];
  for (int i = 0; i < N; i++) {
    got[i] = -1;
    mine[i] = rank * 10000 + i;
  }
  rdist_request_t* req = NULL;
  CHECK(rdist_irecv_tagged(got, N, RDIST_INT32, left, 11, comm, &req));
  double x = 1.0;
  CHECK(rdist_allreduce(&x, &x, 1, RDIST_FLOAT64, RDIST_SUM, comm, NULL));
  EXPECT(x == (double)size, "allreduce gave %f", x);
  CHECK(rdist_send_tagged(mine, N, RDIST_INT32, right, 11, comm, NULL));
  CHECK(rdist_wait(req));
  rdist_status_t st;
  CHECK(rdist_request_status(req, &st));
  EXPECT(st.source == left && st.tag == 11 && st.count == N, "status %d %d %zu", st.source, st.tag,
         st.count);
  rdist_request_free(req);
  for (int i = 0; i < N; i++) EXPECT(got[i] == left * 10000 + i, "got[%d] = %d", i, (int)got[i]);
}

/* Every rank but 0 sends rank 0 a message with tag = its rank and
 * (rank) elements; rank 0 takes them in any order with wildcards. */
static void test_wildcards(rdist_comm_t* comm) {
  if (rank != 0) {
    int64_t msg[64];
    for (int i = 0; i < rank; i++) msg[i] = rank * 100 + i;
    CHECK(rdist_send_tagged(msg, (size_t)rank, RDIST_INT64, 0, rank, comm, NULL));
  } else {
    int seen = 0;
    for (int k = 1; k < size; k++) {
      int64_t buf[64];
      rdist_status_t st;
      memset(&st, 0, sizeof st);
      CHECK(rdist_recv_tagged(buf, 64, RDIST_INT64, RDIST_ANY_SOURCE, RDIST_ANY_TAG, comm, NULL, &st));
      EXPECT(st.source >= 1 && st.source < size && st.tag == st.source && st.count == (size_t)st.source,
             "status %d %d %zu", st.source, st.tag, st.count);
      for (size_t i = 0; i < st.count; i++)
        EXPECT(buf[i] == st.source * 100 + (int64_t)i, "buf[%zu] = %lld", i, (long long)buf[i]);
      EXPECT(!(seen & (1 << st.source)), "rank %d twice", st.source);
      seen |= 1 << st.source;
    }
  }
  CHECK(rdist_barrier(comm));
}

static void test_bad_arguments(rdist_comm_t* comm) {
  uint8_t b[4] = {0};
  rdist_request_t* req = NULL;
  EXPECT(rdist_send_tagged(b, 4, RDIST_UINT8, 0, -1, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "tag -1");
  EXPECT(strstr(rdist_last_error(), "tag -1") != NULL, "message: %s", rdist_last_error());
  EXPECT(rdist_irecv_tagged(b, 4, RDIST_UINT8, size, 0, comm, &req) == RDIST_ERR_INVALID_ARGUMENT, "peer = size");
  EXPECT(rdist_irecv_tagged(b, 4, RDIST_UINT8, -5, 0, comm, &req) == RDIST_ERR_INVALID_ARGUMENT, "peer -5");
  EXPECT(rdist_irecv_tagged(NULL, 4, RDIST_UINT8, 0, 0, comm, &req) == RDIST_ERR_INVALID_ARGUMENT, "NULL buf");
  EXPECT(rdist_irecv_tagged(b, 4, (rdist_dtype_t)99, 0, 0, comm, &req) == RDIST_ERR_INVALID_ARGUMENT, "dtype 99");
  EXPECT(rdist_isend_tagged(b, 4, RDIST_UINT8, 0, 0, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "NULL req");
  EXPECT(req == NULL, "req written on failure");
  EXPECT(rdist_request_status(NULL, NULL) == RDIST_ERR_INVALID_ARGUMENT, "NULL request");
  /* A collective's request has no status. */
  CHECK(rdist_ibarrier(comm, &req));
  CHECK(rdist_wait(req));
  rdist_status_t st;
  EXPECT(rdist_request_status(req, &st) == RDIST_ERR_INVALID_USAGE, "status of a barrier");
  rdist_request_free(req);
}

int main(void) {
  rdist_options_t* opts = NULL;
  CHECK(rdist_options_create(&opts));
  CHECK(rdist_options_set(opts, "timeout_ms", "60000"));
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, opts));
  rdist_options_destroy(opts);
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  EXPECT(size >= 2 && size <= 30, "size %d", size);
  test_receive_across_a_collective(comm);
  test_wildcards(comm);
  test_bad_arguments(comm);
  CHECK(rdist_barrier(comm));
  CHECK(rdist_comm_destroy(comm));
  printf("rank %d of %d: C point-to-point ok\n", rank, size);
  return 0;
}
