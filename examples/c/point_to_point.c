/* Point to point from rank 0 to rank 3, blocking and non-blocking:
 *   rdistrun --nproc-per-node 4 ./point_to_point
 * A send and its recv name each other's rank and agree on count and type.
 * The non-blocking pair returns at once with a request: the buffer must
 * stay untouched until rdist_wait says the transfer is done. */
#include <rdist.h>

#include <stdint.h>
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

enum { N = 8, FROM = 0, TO = 3 };

int main(void) {
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, NULL));
  int rank = 0, size = 0;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  if (size < 4) {
    fprintf(stderr, "run with at least 4 ranks\n");
    return 1;
  }

  int32_t blocking[N], nonblocking[N];
  int ok = 1;
  if (rank == FROM) {
    for (int i = 0; i < N; i++) blocking[i] = i, nonblocking[i] = 100 + i;
    CHECK(rdist_send(blocking, N, RDIST_INT32, TO, comm, NULL)); /* returns when blocking[] is reusable */

    rdist_request_t* req = NULL;
    CHECK(rdist_isend(nonblocking, N, RDIST_INT32, TO, comm, &req));
    /* ... other work here; leave nonblocking[] alone ... */
    CHECK(rdist_wait(req));
    rdist_request_free(req);
    printf("rank %d: sent two messages to rank %d: ok\n", rank, TO);
  } else if (rank == TO) {
    CHECK(rdist_recv(blocking, N, RDIST_INT32, FROM, comm, NULL));

    rdist_request_t* req = NULL;
    CHECK(rdist_irecv(nonblocking, N, RDIST_INT32, FROM, comm, &req));
    int done = 0;
    while (!done) CHECK(rdist_test(req, &done)); /* poll; or just rdist_wait(req) */
    rdist_request_free(req);
    for (int i = 0; i < N; i++) ok = ok && blocking[i] == i && nonblocking[i] == 100 + i;
    printf("rank %d: received [%d..%d] and [%d..%d]: %s\n", rank, blocking[0], blocking[N - 1], nonblocking[0],
           nonblocking[N - 1], ok ? "ok" : "WRONG");
  } else {
    printf("rank %d: not involved: ok\n", rank);
  }
  CHECK(rdist_comm_destroy(comm));
  return ok ? 0 : 1;
}
