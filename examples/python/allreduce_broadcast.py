"""Averages a per-rank vector across all ranks (allreduce with op="avg"),
then shares rank 0's settings with everyone (broadcast).

Run from the repository root, after `cargo build`:

    PYTHONPATH=bindings/python target/debug/rdistrun --nproc-per-node 4 \
        python3 examples/python/allreduce_broadcast.py
"""

import numpy as np

import rdist


def main():
    # env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which
    # rdistrun (or torchrun, or Slurm) sets for every rank.
    with rdist.init() as comm:
        # Each rank measured something different; average it everywhere.
        local = np.arange(8, dtype=np.float32) + comm.rank
        average = comm.allreduce(local.copy(), op="avg")  # in place on the copy
        assert np.array_equal(average, np.arange(8, dtype=np.float32) + (comm.size - 1) / 2)

        # Rank 0 decides (e.g. hyperparameters or a seed); the others receive.
        settings = np.zeros(3, np.float64)
        if comm.rank == 0:
            settings[:] = [0.05, 0.9, 1234]
        comm.broadcast(settings, root=0)
        assert settings.tolist() == [0.05, 0.9, 1234]

        print(f"rank {comm.rank}/{comm.size}: average[:3] = {average[:3]}, settings = {settings.tolist()}")


if __name__ == "__main__":
    main()
