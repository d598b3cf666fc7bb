/* Rank programs for tests/rdistrun.rs: what a C program's stdio and rdist's
 * errors look like through rdistrun, and env:// with no launcher at all.
 * Compiled with -Wall -Wextra -Wpedantic -Werror.
 *
 *   rdistrun_ranks tick          printf one line (no fflush), sleep 4 s, exit 0
 *   rdistrun_ranks fail          allreduce in a loop; rank 1 gives up before
 *                                allreduce #20 and exits 3, so the others are
 *                                blocked in it and report rdist's error
 *   rdistrun_ranks alone X...    rdist_init("env://", -1, -1, NULL), then an
 *                                allreduce (sum) of the numbers X... */
#define _POSIX_C_SOURCE 200809L
#include "rdist.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void sleep_ms(long ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&t, &t) != 0) {
  }
}

static int tick(void) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  long long ms = (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000;
  /* No fflush: on a pipe this line would wait in stdio's buffer until exit. */
  printf("tick %lld\n", ms);
  sleep_ms(4000);
  printf("done\n");
  return 0;
}

static int fail(void) {
  rdist_options_t* opts = NULL;
  rdist_comm_t* comm = NULL;
  int rank = -1, size = -1;
  rdist_result_t rc = rdist_options_create(&opts);
  if (rc == RDIST_SUCCESS) rc = rdist_options_set(opts, "timeout_ms", "30000");
  if (rc == RDIST_SUCCESS) rc = rdist_init(&comm, "env://", -1, -1, opts);
  if (rc == RDIST_SUCCESS) rc = rdist_comm_rank(comm, &rank);
  if (rc == RDIST_SUCCESS) rc = rdist_comm_size(comm, &size);
  rdist_options_destroy(opts);
  if (rc != RDIST_SUCCESS) {
    fprintf(stderr, "setup failed: %s: %s\n", rdist_result_string(rc), rdist_last_error());
    return 2;
  }
  enum { N = 1024 };
  static float buf[N];
  /* Numbered from 1, as rdist numbers a communicator's calls. */
  for (int i = 1;; i++) {
    if (rank == 1 && i == 20) {
      fprintf(stderr, "rank 1: error: giving up on purpose before allreduce #%d\n", i);
      exit(3);
    }
    for (int j = 0; j < N; j++) buf[j] = (float)(rank + i + j % 3);
    rc = rdist_allreduce(buf, buf, N, RDIST_FLOAT32, RDIST_SUM, comm, NULL);
    if (rc != RDIST_SUCCESS) {
      fprintf(stderr, "rank %d: rdist_allreduce #%d failed: %s: %s\n", rank, i, rdist_result_string(rc),
              rdist_last_error());
      return 1;
    }
    for (int j = 0; j < N; j++) {
      float want = (float)(size * (i + j % 3) + size * (size - 1) / 2);
      if (buf[j] != want) {
        fprintf(stderr, "rank %d: allreduce #%d: element %d is %g, not %g\n", rank, i, j, buf[j], want);
        return 4;
      }
    }
    printf("rank %d: allreduce #%d ok\n", rank, i);
    if (i == 1000) {
      fprintf(stderr, "rank %d: rank 1 never went away\n", rank);
      return 5;
    }
  }
}

static int alone(int count, char** numbers) {
  rdist_comm_t* comm = NULL;
  int rank = -1, size = -1;
  rdist_result_t rc = rdist_init(&comm, "env://", -1, -1, NULL);
  if (rc == RDIST_SUCCESS) rc = rdist_comm_rank(comm, &rank);
  if (rc == RDIST_SUCCESS) rc = rdist_comm_size(comm, &size);
  if (rc != RDIST_SUCCESS) {
    fprintf(stderr, "alone: rdist_init failed: %s: %s\n", rdist_result_string(rc), rdist_last_error());
    return 2;
  }
  double* in = calloc((size_t)count + 1, sizeof(double));
  double* out = calloc((size_t)count + 1, sizeof(double));
  for (int i = 0; i < count; i++) in[i] = strtod(numbers[i], NULL);
  rc = rdist_allreduce(in, out, (size_t)count, RDIST_FLOAT64, RDIST_SUM, comm, NULL);
  if (rc != RDIST_SUCCESS) {
    fprintf(stderr, "alone: rdist_allreduce failed: %s: %s\n", rdist_result_string(rc), rdist_last_error());
    return 1;
  }
  printf("rank %d size %d sum", rank, size);
  for (int i = 0; i < count; i++) printf(" %.17g", out[i]);
  printf("\n");
  free(in);
  free(out);
  rc = rdist_comm_destroy(comm);
  return rc == RDIST_SUCCESS ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc >= 2 && strcmp(argv[1], "tick") == 0) return tick();
  if (argc >= 2 && strcmp(argv[1], "fail") == 0) return fail();
  if (argc >= 2 && strcmp(argv[1], "alone") == 0) return alone(argc - 2, argv + 2);
  fprintf(stderr, "usage: rdistrun_ranks tick | fail | alone X...\n");
  return 64;
}
