"""A rank of a torch.distributed job on the "rdist" backend that loses
rank `victim` (argv[1]): the survivors see the failure, ask the backend
which ranks failed, shrink the default group with
torch.distributed.shrink_group, and all-reduce on the shrunk group.
Reports one `RESULT` line."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import rdist.torch  # noqa: F401 - registers the backend
from _worker import report

victim = int(sys.argv[1])
if "RDIST_TEST_AGENT_STORE_PORT" in os.environ:
    # The store lives outside the ranks, as torchrun's agent hosts it
    # (TORCHELASTIC_USE_AGENT_STORE): torch's shrink_group needs the old
    # group's store, which rank 0's death would take with it otherwise.
    os.environ["MASTER_PORT"] = os.environ["RDIST_TEST_AGENT_STORE_PORT"]
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
dist.init_process_group("rdist", timeout=timedelta(seconds=30))
old_rank = dist.get_rank()
dist.barrier()
if old_rank == victim:
    os._exit(7)
time.sleep(0.2)
error = None
try:
    dist.all_reduce(torch.ones(1000))
except Exception as e:  # noqa: BLE001 - torch re-raises the backend's error as it likes
    error = f"{type(e).__name__}: {e}"
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
failed = backend.failed_ranks()
started = time.monotonic()
group = c10d.shrink_group(failed or [victim])
took = time.monotonic() - started
total = torch.tensor([old_rank + 1.0])
dist.all_reduce(total)
report(
    rank=old_rank, new_rank=dist.get_rank(), size=dist.get_world_size(), failed=failed,
    default=group is dist.group.WORLD, sum=float(total[0]), error=error, took=took,
)
dist.destroy_process_group()
