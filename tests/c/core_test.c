/* A 4-rank job through rdistrun (env://): allreduce, broadcast and
 * send/recv results, plus argument errors, through the committed header.
 * Compiled with -Wall -Wextra -Wpedantic -Werror by tests/c_api.rs. */
#include "rdist.h"

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
  EXPECT(rdist_version() == RDIST_VERSION_MAJOR * 10000 + RDIST_VERSION_MINOR * 100 + RDIST_VERSION_PATCH,
         "header and library versions differ");
  rdist_options_t* opts = NULL;
  CHECK(rdist_options_create(&opts));
  CHECK(rdist_options_set(opts, "timeout_ms", "30000"));
  EXPECT(rdist_options_set(opts, "no_such_key", "1") == RDIST_ERR_INVALID_ARGUMENT, "unknown key accepted");
  EXPECT(strstr(rdist_last_error(), "no_such_key") != NULL, "message: %s", rdist_last_error());

  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, opts));
  rdist_options_destroy(opts);
  int rank = -1, size = -1, local = -1;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  CHECK(rdist_comm_local_rank(comm, &local));
  g_rank = rank;
  EXPECT(size == 4, "size %d", size);
  EXPECT(rank == atoi(getenv("RANK")) && local == atoi(getenv("LOCAL_RANK")), "rank %d local %d", rank, local);
  rdist_backend_t backend;
  CHECK(rdist_comm_backend(comm, &backend));
  EXPECT(backend == RDIST_BACKEND_SOCKET, "backend %d", (int)backend);

  /* allreduce: float sum out of place, int64 max in place */
  enum { N = 100003 };
  float* send = malloc(N * sizeof(float));
  float* recv = malloc(N * sizeof(float));
  for (int i = 0; i < N; i++) send[i] = (float)(rank + 1) * (float)(i % 7);
  CHECK(rdist_allreduce(send, recv, N, RDIST_FLOAT32, RDIST_SUM, comm, NULL));
  for (int i = 0; i < N; i++) EXPECT(recv[i] == 10.0f * (float)(i % 7), "allreduce[%d] = %g", i, recv[i]);
  int64_t m[3] = {rank, -rank, 100 * rank};
  CHECK(rdist_allreduce(m, m, 3, RDIST_INT64, RDIST_MAX, comm, NULL));
  EXPECT(m[0] == 3 && m[1] == 0 && m[2] == 300, "max %lld %lld %lld", (long long)m[0], (long long)m[1], (long long)m[2]);

  /* broadcast from rank 2 */
  double b[5];
  for (int i = 0; i < 5; i++) b[i] = rank == 2 ? 1.5 * i : -1.0;
  CHECK(rdist_broadcast(b, b, 5, RDIST_FLOAT64, 2, comm, NULL));
  for (int i = 0; i < 5; i++) EXPECT(b[i] == 1.5 * i, "broadcast[%d] = %g", i, b[i]);

  /* send/recv: 0 -> 3 blocking, 3 -> 0 non-blocking */
  int32_t msg[4] = {0, 0, 0, 0};
  if (rank == 0) {
    int32_t out[4] = {11, 22, 33, 44};
    CHECK(rdist_send(out, 4, RDIST_INT32, 3, comm, NULL));
    rdist_request_t* req = NULL;
    CHECK(rdist_irecv(msg, 4, RDIST_INT32, 3, comm, &req));
    CHECK(rdist_wait(req));
    rdist_request_free(req);
    EXPECT(msg[0] == 44 && msg[3] == 11, "irecv %d %d", msg[0], msg[3]);
  } else if (rank == 3) {
    CHECK(rdist_recv(msg, 4, RDIST_INT32, 0, comm, NULL));
    EXPECT(msg[0] == 11 && msg[3] == 44, "recv %d %d", msg[0], msg[3]);
    int32_t back[4] = {44, 33, 22, 11};
    rdist_request_t* req = NULL;
    CHECK(rdist_isend(back, 4, RDIST_INT32, 0, comm, &req));
    int done = 0;
    while (!done) CHECK(rdist_test(req, &done));
    rdist_request_free(req);
    /* a freed request: an error with a message, not a crash */
    EXPECT(rdist_wait(req) == RDIST_ERR_INVALID_ARGUMENT, "wait after free");
    EXPECT(strstr(rdist_last_error(), "rdist_request_free"), "%s", rdist_last_error());
    rdist_request_free(req);
    EXPECT(strstr(rdist_last_error(), "freed twice") || strstr(rdist_last_error(), "destroyed twice"), "%s", rdist_last_error());
  }

  /* bad arguments fail locally, name the function, and change nothing */
  EXPECT(rdist_allreduce(send, recv, N, (rdist_dtype_t)99, RDIST_SUM, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "dtype 99");
  EXPECT(strstr(rdist_last_error(), "rdist_allreduce") && strstr(rdist_last_error(), "99"), "%s", rdist_last_error());
  EXPECT(rdist_allreduce(NULL, recv, 8, RDIST_FLOAT32, RDIST_SUM, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "NULL sendbuf");
  EXPECT(rdist_broadcast(b, b, 5, RDIST_FLOAT64, 4, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "root 4");
  EXPECT(rdist_allreduce(send, recv, N, RDIST_FLOAT32, RDIST_SUM, NULL, NULL) == RDIST_ERR_INVALID_ARGUMENT, "NULL comm");
  EXPECT(rdist_allreduce(send, recv, (size_t)-1, RDIST_FLOAT32, RDIST_SUM, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "overflow");

  CHECK(rdist_barrier(comm));
  /* no rank failed; bad arguments are refused */
  int failed[4] = {-1, -1, -1, -1}, nfailed = -1;
  CHECK(rdist_comm_failed_ranks(comm, failed, 4, &nfailed));
  EXPECT(nfailed == 0 && failed[0] == -1, "failed ranks %d", nfailed);
  CHECK(rdist_comm_failed_ranks(comm, NULL, 0, &nfailed));
  EXPECT(rdist_comm_failed_ranks(comm, NULL, 2, &nfailed) == RDIST_ERR_INVALID_ARGUMENT, "NULL ranks");
  EXPECT(rdist_comm_failed_ranks(comm, failed, -1, &nfailed) == RDIST_ERR_INVALID_ARGUMENT, "capacity -1");
  EXPECT(rdist_comm_failed_ranks(comm, failed, 4, NULL) == RDIST_ERR_INVALID_ARGUMENT, "NULL count");
  CHECK(rdist_comm_destroy(comm));
  CHECK(rdist_comm_destroy(NULL));
  /* a destroyed communicator, and options: errors with a message, not crashes */
  EXPECT(rdist_barrier(comm) == RDIST_ERR_INVALID_ARGUMENT, "barrier after destroy");
  EXPECT(strstr(rdist_last_error(), "rdist_comm_destroy"), "%s", rdist_last_error());
  EXPECT(rdist_comm_rank(comm, &rank) == RDIST_ERR_INVALID_ARGUMENT, "rank after destroy");
  EXPECT(rdist_send(msg, 4, RDIST_INT32, 0, comm, NULL) == RDIST_ERR_INVALID_ARGUMENT, "send after destroy");
  EXPECT(rdist_comm_destroy(comm) == RDIST_ERR_INVALID_ARGUMENT, "destroyed twice");
  EXPECT(strstr(rdist_last_error(), "destroyed twice"), "%s", rdist_last_error());
  EXPECT(rdist_options_set(opts, "timeout_ms", "1") == RDIST_ERR_INVALID_ARGUMENT, "options after destroy");
  rdist_options_destroy(opts);
  EXPECT(strstr(rdist_last_error(), "destroyed twice"), "%s", rdist_last_error());
  free(send);
  free(recv);
  printf("rank %d: ok\n", rank);
  return 0;
}
