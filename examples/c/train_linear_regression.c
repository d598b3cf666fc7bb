/* Data-parallel training of a linear model y = w.x + b with gradient
 * descent: every rank computes the gradient on its shard of the batch and
 * an allreduce(AVG) turns the shard gradients into the whole batch's, so
 * each step equals one process training on the whole batch, which this
 * program also does and compares against (exiting non-zero on a mismatch).
 *   rdistrun --nproc-per-node 4 ./train_linear_regression */
#include <rdist.h>

#include <math.h>
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

enum { FEATURES = 3, PARAMS = FEATURES + 1, BATCH = 96, STEPS = 300 };
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

int main(void) {
  rdist_comm_t* comm = NULL;
  CHECK(rdist_init(&comm, "env://", -1, -1, NULL));
  int rank = 0, size = 0;
  CHECK(rdist_comm_rank(comm, &rank));
  CHECK(rdist_comm_size(comm, &size));
  if (BATCH % size != 0) {
    fprintf(stderr, "the batch of %d does not split evenly over %d ranks\n", BATCH, size);
    return 1;
  }
  const int shard = BATCH / size, first = rank * shard; /* equal shards: mean of means = mean */

  double params[PARAMS] = {0}, alone[PARAMS] = {0}, grad[PARAMS];
  for (int step = 0; step < STEPS; step++) {
    gradient(params, first, first + shard, grad);                               /* my shard */
    CHECK(rdist_allreduce(grad, grad, PARAMS, RDIST_FLOAT64, RDIST_AVG, comm, NULL)); /* whole batch */
    for (int k = 0; k < PARAMS; k++) params[k] -= LEARNING_RATE * grad[k];

    gradient(alone, 0, BATCH, grad); /* the single-process reference */
    for (int k = 0; k < PARAMS; k++) alone[k] -= LEARNING_RATE * grad[k];
  }

  int ok = 1;
  for (int k = 0; k < PARAMS; k++) {
    double truth = k < FEATURES ? TRUE_W[k] : TRUE_B;
    ok = ok && fabs(params[k] - alone[k]) <= 1e-9 && fabs(params[k] - truth) < 0.05;
  }
  printf("rank %d of %d: w = [%.4f %.4f %.4f] b = %.4f, single process: w = [%.4f %.4f %.4f] b = %.4f: %s\n",
         rank, size, params[0], params[1], params[2], params[3], alone[0], alone[1], alone[2], alone[3],
         ok ? "ok" : "WRONG");
  CHECK(rdist_comm_destroy(comm));
  return ok ? 0 : 1;
}
