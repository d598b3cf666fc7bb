/* The rank program of tests/slurm.rs: a C program started by `srun -n N`
 * that meets through env:// with nothing set by hand (rdist reads Slurm's
 * variables). Compiled with -Wall -Wextra -Wpedantic -Werror.
 *
 *   slurm_ranks run    allreduce and broadcast, checked; prints "ok"
 *   slurm_ranks kill   after one allreduce, task 1 kills itself (SIGKILL);
 *                      the others' next call must fail with PEER_LOST, and
 *                      rdist_comm_failed_ranks must name rank 1; they then
 *                      shrink the communicator and all-reduce on it */
#define _POSIX_C_SOURCE 200809L
#include "rdist.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fail(int rank, const char* what, rdist_result_t rc) {
  const char* why = rdist_last_error(); /* before any other call */
  printf("rank %d: %s: %s: %s\n", rank, what, rdist_result_string(rc), why);
  return 1;
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "run";
  rdist_options_t* opts = NULL;
  rdist_options_create(&opts);
  rdist_options_set(opts, "timeout_ms", "30000");
  rdist_comm_t* comm = NULL;
  rdist_result_t rc = rdist_init(&comm, "env://", -1, -1, opts);
  rdist_options_destroy(opts);
  if (rc != RDIST_SUCCESS) return fail(-1, "rdist_init", rc);
  int rank = -1, size = -1;
  rdist_comm_rank(comm, &rank);
  rdist_comm_size(comm, &size);
  const char* procid = getenv("SLURM_PROCID");
  const char* ntasks = getenv("SLURM_NTASKS");
  if (!procid || !ntasks || atoi(procid) != rank || atoi(ntasks) != size) {
    printf("rank %d of %d: Slurm says %s of %s\n", rank, size, procid ? procid : "?", ntasks ? ntasks : "?");
    return 1;
  }
  double v[3] = {rank + 1.0, 2.0 * rank, 1.0};
  rc = rdist_allreduce(v, v, 3, RDIST_FLOAT64, RDIST_SUM, comm, NULL);
  if (rc != RDIST_SUCCESS) return fail(rank, "allreduce", rc);
  double n = size;
  if (v[0] != n * (n + 1) / 2 || v[1] != n * (n - 1) || v[2] != n) {
    printf("rank %d: allreduce gave %g %g %g\n", rank, v[0], v[1], v[2]);
    return 1;
  }
  if (strcmp(mode, "kill") == 0) {
    if (rank == 1) {
      fflush(stdout);
      kill(getpid(), SIGKILL);
    }
    rc = rdist_barrier(comm);
    char why[512];
    snprintf(why, sizeof why, "%s", rdist_last_error());
    int failed[8], count = -1;
    rdist_comm_failed_ranks(comm, failed, 8, &count);
    printf("rank %d: after the kill: %s; failed ranks:", rank, rdist_result_string(rc));
    for (int i = 0; i < count && i < 8; i++) printf(" %d", failed[i]);
    printf(" (%s)\n", why);
    /* The survivors go on without it. */
    rdist_comm_t* survivors = NULL;
    rdist_result_t shrunk = rdist_comm_shrink(comm, NULL, 0, &survivors, NULL, RDIST_SHRINK_DEFAULT);
    if (shrunk != RDIST_SUCCESS) return fail(rank, "rdist_comm_shrink", shrunk);
    int new_rank = -1, new_size = -1;
    rdist_comm_rank(survivors, &new_rank);
    rdist_comm_size(survivors, &new_size);
    double sum = rank + 1.0; /* the survivors' old ranks + 1: 1 + 3 + 4 */
    shrunk = rdist_allreduce(&sum, &sum, 1, RDIST_FLOAT64, RDIST_SUM, survivors, NULL);
    if (shrunk != RDIST_SUCCESS) return fail(rank, "allreduce after the shrink", shrunk);
    printf("rank %d: shrunk: rank %d of %d, sum %g\n", rank, new_rank, new_size, sum);
    rdist_comm_destroy(survivors);
    rdist_comm_destroy(comm);
    return rc == RDIST_ERR_PEER_LOST && count == 1 && failed[0] == 1 ? 0 : 1;
  }
  int b[4] = {0, 0, 0, 0};
  if (rank == size - 1) {
    for (int i = 0; i < 4; i++) b[i] = 100 + i;
  }
  rc = rdist_broadcast(b, b, 4, RDIST_INT32, size - 1, comm, NULL);
  if (rc != RDIST_SUCCESS) return fail(rank, "broadcast", rc);
  if (b[0] != 100 || b[3] != 103) {
    printf("rank %d: broadcast gave %d %d\n", rank, b[0], b[3]);
    return 1;
  }
  rc = rdist_comm_destroy(comm);
  if (rc != RDIST_SUCCESS) return fail(rank, "destroy", rc);
  printf("rank %d of %d: ok\n", rank, size);
  return 0;
}
