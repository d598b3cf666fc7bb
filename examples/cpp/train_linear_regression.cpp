// Data-parallel training of a linear model y = w.x + b with gradient
// descent, in C++: every rank computes the gradient on its shard of the
// batch and allreduce(AVG) turns the shard gradients into the whole
// batch's, so each step equals one process training on the whole batch,
// which this program also does and compares against (exit 1 on mismatch).
//   rdistrun --nproc-per-node 4 ./train_linear_regression_cpp
#include <rdist.hpp>

#include <array>
#include <cmath>
#include <cstdio>

constexpr int kFeatures = 3, kBatch = 96, kSteps = 300;
constexpr double kLearningRate = 0.1;
constexpr std::array<double, kFeatures> kTrueW{2.0, -3.0, 0.5};
constexpr double kTrueB = 1.0;

using Params = std::array<double, kFeatures + 1>;  // [w..., b]

// Sample i of the data set, the same on every rank: x in [-1, 1), y with a little noise.
double sample(int i, std::array<double, kFeatures>& x) {
  unsigned s = 2654435761u * static_cast<unsigned>(i + 1);
  double y = kTrueB;
  for (int j = 0; j < kFeatures; j++) {
    s = s * 1664525u + 1013904223u;
    x[j] = static_cast<double>(s >> 8) / static_cast<double>(1u << 24) * 2.0 - 1.0;
    y += kTrueW[j] * x[j];
  }
  return y + 0.01 * std::sin(i);
}

// Mean-squared-error gradient over samples [first, last), averaged.
Params gradient(const Params& p, int first, int last) {
  Params g{};
  for (int i = first; i < last; i++) {
    std::array<double, kFeatures> x;
    const double y = sample(i, x);
    double err = p[kFeatures] - y;
    for (int j = 0; j < kFeatures; j++) err += p[j] * x[j];
    for (int j = 0; j < kFeatures; j++) g[j] += 2 * err * x[j] / (last - first);
    g[kFeatures] += 2 * err / (last - first);
  }
  return g;
}

int main() try {
  auto comm = rdist::Comm::init();
  const int rank = comm.rank(), size = comm.size();
  if (kBatch % size != 0) {
    std::fprintf(stderr, "the batch of %d does not split evenly over %d ranks\n", kBatch, size);
    return 1;
  }
  const int shard = kBatch / size, first = rank * shard;  // equal shards: mean of means = mean

  Params params{}, alone{};
  for (int step = 0; step < kSteps; step++) {
    Params grad = gradient(params, first, first + shard);      // my shard
    comm.allreduce(grad.data(), grad.size(), RDIST_AVG);       // the whole batch's gradient
    for (std::size_t k = 0; k < params.size(); k++) params[k] -= kLearningRate * grad[k];

    const Params ref = gradient(alone, 0, kBatch);              // the single-process reference
    for (std::size_t k = 0; k < alone.size(); k++) alone[k] -= kLearningRate * ref[k];
  }

  bool ok = true;
  for (std::size_t k = 0; k < params.size(); k++) {
    const double truth = k < kFeatures ? kTrueW[k] : kTrueB;
    ok = ok && std::fabs(params[k] - alone[k]) <= 1e-9 && std::fabs(params[k] - truth) < 0.05;
  }
  std::printf("rank %d of %d: w = [%.4f %.4f %.4f] b = %.4f, single process: w = [%.4f %.4f %.4f] b = %.4f: %s\n",
              rank, size, params[0], params[1], params[2], params[3], alone[0], alone[1], alone[2], alone[3],
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
} catch (const rdist::Error& e) {
  std::fprintf(stderr, "rdist error %d: %s\n", static_cast<int>(e.code()), e.what());
  return 1;
}
