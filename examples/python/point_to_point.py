"""Point to point: rank 0 sends to rank 3, first with blocking send/recv,
then with non-blocking isend/irecv that overlap with other work.

Run from the repository root, after `cargo build` (needs 4 or more ranks):

    PYTHONPATH=bindings/python target/debug/rdistrun --nproc-per-node 4 \
        python3 examples/python/point_to_point.py
"""

import numpy as np

import rdist

SOURCE, DESTINATION = 0, 3


def main():
    with rdist.init() as comm:
        if comm.size <= DESTINATION:
            raise SystemExit(f"this example needs at least {DESTINATION + 1} ranks, got {comm.size}")

        # Blocking: send returns once the buffer may be reused; recv once the
        # data has arrived. Counts and dtypes must match on both sides.
        if comm.rank == SOURCE:
            comm.send(np.arange(10, dtype=np.int64), DESTINATION)
        elif comm.rank == DESTINATION:
            received = comm.recv(np.empty(10, np.int64), SOURCE)
            assert received.tolist() == list(range(10))
            print(f"rank {comm.rank}: blocking recv got {received.tolist()}")

        # Non-blocking: start several transfers, compute meanwhile, then wait.
        # A Request keeps its buffer alive until it completes.
        chunks = 4
        if comm.rank == SOURCE:
            requests = [
                comm.isend(np.full(1000, chunk, np.float32), DESTINATION) for chunk in range(chunks)
            ]
            busy_work = sum(i * i for i in range(10_000))  # overlaps with the sends
            rdist.wait_all(requests)
            print(f"rank {comm.rank}: sent {chunks} chunks (and computed {busy_work})")
        elif comm.rank == DESTINATION:
            requests = [comm.irecv(np.empty(1000, np.float32), SOURCE) for _ in range(chunks)]
            # Calls on one communicator complete in the order they were issued.
            for chunk, buffer in enumerate(rdist.wait_all(requests)):
                assert np.all(buffer == chunk)
            print(f"rank {comm.rank}: non-blocking recv got {chunks} chunks of 1000 floats")

        comm.barrier()  # the other ranks just wait for the transfers to finish


if __name__ == "__main__":
    main()
