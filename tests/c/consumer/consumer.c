/* An installed-rdist consumer in C: allreduce across the job. */
#include <rdist.h>

#include <stdio.h>

int main(void) {
  rdist_comm_t* comm = NULL;
  int rank = -1, size = -1;
  if (rdist_init(&comm, "env://", -1, -1, NULL) != RDIST_SUCCESS || rdist_comm_rank(comm, &rank) != RDIST_SUCCESS ||
      rdist_comm_size(comm, &size) != RDIST_SUCCESS) {
    fprintf(stderr, "init: %s\n", rdist_last_error());
    return 1;
  }
  int64_t x = rank + 1;
  if (rdist_allreduce(&x, &x, 1, RDIST_INT64, RDIST_SUM, comm, NULL) != RDIST_SUCCESS) {
    fprintf(stderr, "allreduce: %s\n", rdist_last_error());
    return 1;
  }
  rdist_comm_destroy(comm);
  if (x != (int64_t)size * (size + 1) / 2) {
    fprintf(stderr, "allreduce gave %lld\n", (long long)x);
    return 1;
  }
  printf("consumer_c rank %d: ok (library %d)\n", rank, rdist_version());
  return 0;
}
