/* Data-parallel training that survives a lost rank. The model and data are
 * train_linear_regression's: each rank computes the gradient on its shard
 * of the batch and an allreduce(AVG) makes the batch's. At step KILL_STEP
 * one rank (argv[1], default 1; 0 is the rendezvous store's host) dies.
 * The others' allreduce fails with RDIST_ERR_PEER_LOST; they shrink the
 * communicator (rdist_comm_shrink with no list: they agree who failed),
 * agree on the last step every survivor finished (a rank may have finished
 * a step another had not), and go on with their own shards: from the
 * failure on, a step averages the survivors' gradients. Each survivor
 * checks its weights against a single-process reference that applies the
 * same steps (all shards before the failure, the survivors' after).
 *   rdistrun --on-failure continue --nproc-per-node 4 ./train_through_failure 2 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <rdist.h>

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(call)                                                              \
  do {                                                                           \
    rdist_result_t rc_ = (call);                                                 \
    if (rc_ != RDIST_SUCCESS) {                                                  \
      fprintf(stderr, "%s failed: %s\n", #call, rdist_last_error());             \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

enum { FEATURES = 3, PARAMS = FEATURES + 1, BATCH = 96, STEPS = 300, KILL_STEP = 100, MAX_RANKS = 64 };
static const double TRUE_W[FEATURES] = {2.0, -3.0, 0.5}, TRUE_B = 1.0, LEARNING_RATE = 0.1;

/* Sample i of the data set, the same on every rank: x in [-1, 1), y with a little noise. */
static double sample(int i, double x[FEATURES]) {
  unsigned s = 2654435761u * (unsigned)(i + 1);
  double y = TRUE_B;
  for (int j = 0; j < FEATURES; j++) {
    s = s * 1664525u + 1013904223u;
    x[j] = (double)(s >> 8) / (double)(1u << 24) * 2.0 - 1.0;
    y += TRUE_W[j] * x[j];
  }
  return y + 0.01 * sin(i);
}

/* Mean-squared-error gradient over samples [first, last), averaged: [dw..., db]. */
static void gradient(const double params[PARAMS], int first, int last, double grad[PARAMS]) {
  for (int k = 0; k < PARAMS; k++) grad[k] = 0;
  for (int i = first; i < last; i++) {
    double x[FEATURES], y = sample(i, x), err = params[FEATURES] - y;
    for (int j = 0; j < FEATURES; j++) err += params[j] * x[j];
    for (int j = 0; j < FEATURES; j++) grad[j] += 2 * err * x[j] / (last - first);
    grad[FEATURES] += 2 * err / (last - first);
  }
}

/* The reference's step: the average of the shard gradients of `ranks`. */
static void reference_step(double params[PARAMS], const int* ranks, int n, int shard) {
  double sum[PARAMS] = {0}, grad[PARAMS];
  for (int r = 0; r < n; r++) {
    gradient(params, ranks[r] * shard, (ranks[r] + 1) * shard, grad);
    for (int k = 0; k < PARAMS; k++) sum[k] += grad[k];
  }
  for (int k = 0; k < PARAMS; k++) params[k] -= LEARNING_RATE * sum[k] / n;
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char** argv) {
  const int victim = argc > 1 ? atoi(argv[1]) : 1;
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, NULL));
  int rank = 0, size = 0;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  if (BATCH % size != 0 || size > MAX_RANKS || victim < 0 || victim >= size) {
    fprintf(stderr, "needs at most %d ranks dividing %d, and a victim among them\n", MAX_RANKS, BATCH);
    return 1;
  }
  const int shard = BATCH / size, first = rank * shard;
  /* Before the failure every rank's shard counts. */
  int contributors[MAX_RANKS], ncontributors = size;
  for (int r = 0; r < size; r++) contributors[r] = r;

  double params[PARAMS] = {0}, before[PARAMS] = {0}, grad[PARAMS];
  int step = 0, failed_step = -1;
  double last_good_ms = now_ms(), shrink_ms = 0, recovery_ms = 0;
  while (step < STEPS) {
    if (rank == victim && step == KILL_STEP) {
      printf("rank %d: dying at step %d\n", rank, step);
      fflush(stdout);
      raise(SIGKILL); /* no goodbye, as an OOM kill or a lost host */
    }
    gradient(params, first, first + shard, grad);
    rdist_result_t rc = rdist_allreduce(grad, grad, PARAMS, RDIST_FLOAT64, RDIST_AVG, comm, NULL);
    if (rc == RDIST_SUCCESS) {
      memcpy(before, params, sizeof params); /* to undo this step if the others did not finish it */
      for (int k = 0; k < PARAMS; k++) params[k] -= LEARNING_RATE * grad[k];
      step++;
      if (failed_step >= 0 && recovery_ms == 0) recovery_ms = now_ms() - last_good_ms;
      if (failed_step < 0) last_good_ms = now_ms();
      continue;
    }
    if (rc != RDIST_ERR_PEER_LOST && rc != RDIST_ERR_ABORTED) {
      fprintf(stderr, "rank %d: step %d: %s\n", rank, step, rdist_last_error());
      return 1;
    }
    /* A rank died: the survivors agree on a communicator without it. */
    double t0 = now_ms();
    rdist_comm_t* survivors = NULL;
    CHECK(rdist_comm_shrink(comm, NULL, 0, &survivors, NULL, RDIST_SHRINK_DEFAULT));
    shrink_ms = now_ms() - t0;
    CHECK(rdist_comm_destroy(comm));
    comm = survivors;
    /* Which old ranks go on (their shards keep counting), and the last
       step all of them finished: a rank ahead rolls its step back. */
    int old_rank = rank, new_size = 0;
    CHECK(rdist_comm_size(comm, &new_size));
    CHECK(rdist_allgather(&old_rank, contributors, 1, RDIST_INT32, comm, NULL));
    ncontributors = new_size;
    int agreed = step;
    CHECK(rdist_allreduce(&agreed, &agreed, 1, RDIST_INT32, RDIST_MIN, comm, NULL));
    if (agreed < step) memcpy(params, before, sizeof params); /* one step ahead: undo it */
    step = agreed;
    failed_step = step;
  }

  /* The reference: one process, every shard before the failure, the
     survivors' shards after. */
  double alone[PARAMS] = {0};
  int everyone[MAX_RANKS];
  for (int r = 0; r < size; r++) everyone[r] = r;
  for (int s = 0; s < STEPS; s++) {
    int after = failed_step >= 0 && s >= failed_step;
    reference_step(alone, after ? contributors : everyone, after ? ncontributors : size, shard);
  }
  int ok = 1;
  for (int k = 0; k < PARAMS; k++) ok = ok && fabs(params[k] - alone[k]) <= 1e-9;
  int new_rank = 0, all_ok = ok;
  CHECK(rdist_comm_rank(comm, &new_rank));
  CHECK(rdist_allreduce(&all_ok, &all_ok, 1, RDIST_INT32, RDIST_MIN, comm, NULL));
  printf("rank %d (now %d of %d): failure at step %d; shrink %.2f ms, last good step to first step on the "
         "shrunk communicator %.2f ms; w = [%.4f %.4f %.4f] b = %.4f, reference: w = [%.4f %.4f %.4f] b = %.4f: %s\n",
         rank, new_rank, ncontributors, failed_step, shrink_ms, recovery_ms, params[0], params[1], params[2],
         params[3], alone[0], alone[1], alone[2], alone[3], ok ? "ok" : "WRONG");
  if (new_rank == 0 && all_ok) {
    printf("all %d survivors' weights equal the reference\n", ncontributors);
  }
  CHECK(rdist_comm_destroy(comm));
  return ok ? 0 : 1;
}
