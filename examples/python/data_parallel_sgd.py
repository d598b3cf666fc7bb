"""Data-parallel training of a tiny model: linear regression by gradient
descent, numpy only.

Every rank holds one shard of the batch and computes the gradient of its
shard; allreduce with op="avg" averages the gradients, so every rank applies
the same update. With equal shards the average of the shard gradients is
the gradient of the whole batch, so the weights match those of one process
training on the whole batch, which the example checks at the end.

Run from the repository root, after `cargo build`:

    PYTHONPATH=bindings/python target/debug/rdistrun --nproc-per-node 4 \
        python3 examples/python/data_parallel_sgd.py
"""

import numpy as np

import rdist

SAMPLES, FEATURES = 240, 5  # 240 splits evenly over 1, 2, 3, 4, 5, 6 or 8 ranks
STEPS, LEARNING_RATE = 200, 0.1


def make_dataset():
    """The same data on every rank (a fixed seed): y = X @ true_w + 0.5 + noise."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(SAMPLES, FEATURES))
    true_weights = np.array([2.0, -1.0, 0.5, 3.0, -2.5])
    targets = features @ true_weights + 0.5 + 0.01 * rng.normal(size=SAMPLES)
    return features, targets


def gradient(params, features, targets):
    """Gradient of the mean squared error 1/n * |X w + b - y|^2 w.r.t. [w, b]."""
    weights, bias = params[:-1], params[-1]
    error = features @ weights + bias - targets
    scale = 2.0 / len(targets)
    return np.append(scale * features.T @ error, scale * error.sum())


def train(params, features, targets, comm=None):
    """Gradient descent; with a comm, each step uses the ranks' average gradient."""
    for _ in range(STEPS):
        grad = gradient(params, features, targets)
        if comm is not None:
            comm.allreduce(grad, op="avg")  # in place: now the whole batch's gradient
        params -= LEARNING_RATE * grad
    return params


def main():
    features, targets = make_dataset()
    with rdist.init() as comm:
        if SAMPLES % comm.size:
            raise SystemExit(f"{SAMPLES} samples do not split evenly over {comm.size} ranks")
        shard = slice(comm.rank * SAMPLES // comm.size, (comm.rank + 1) * SAMPLES // comm.size)

        # Rank 0 initialises the model; broadcast gives every rank the same start.
        params = np.zeros(FEATURES + 1)
        if comm.rank == 0:
            params[:] = np.random.default_rng(1).normal(size=FEATURES + 1)
        comm.broadcast(params, root=0)
        start = params.copy()

        params = train(params, features[shard], targets[shard], comm)

        # The same training in one process on the whole batch.
        reference = train(start.copy(), features, targets)
        assert np.allclose(params, reference, rtol=1e-9, atol=1e-12), (params, reference)
        # Every rank ends with bit-identical weights (they applied the same updates).
        gathered = np.zeros((comm.size, FEATURES + 1))
        comm.allgather(params, gathered)
        assert (gathered == params).all()

        loss = np.mean((features @ params[:-1] + params[-1] - targets) ** 2)
        print(
            f"rank {comm.rank}/{comm.size}: loss {loss:.6f}, weights {np.round(params[:-1], 3)}, "
            f"bias {params[-1]:.3f}; matches single-process training"
        )


if __name__ == "__main__":
    main()
