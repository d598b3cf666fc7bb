"""A torchrun job as users run them: DDP on the "rdist" backend and on a
gloo group from the same seed (final weights must be bitwise equal), and
beside torch's process group, in the same processes, rdist's own
communicator made through env:// (it joins torchrun's agent store).
Writes RESULT_DIR/<rank>.json."""

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rdist
import rdist.torch  # noqa: F401

torch.set_num_threads(1)
dist.init_process_group("rdist", timeout=timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")


def train(pg, steps=5, **options):
    torch.manual_seed(1234)
    net = DDP(nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 8)), process_group=pg,
              **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.module.parameters()]


# Bitwise equal where both sum in the same order (2 ranks); with more
# ranks gloo's ring and rdist's algorithms add in different orders, so the
# weights agree within float rounding: the largest difference is reported.
equal, max_diff = {}, {}
for name, options in {"default": {}, "small_buckets": {"bucket_cap_mb": 0.001}}.items():
    mine, theirs = train(dist.group.WORLD, **options), train(gloo, **options)
    equal[name] = all(torch.equal(a, b) for a, b in zip(mine, theirs))
    max_diff[name] = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))

# rdist's C API through env://, beside torch's process group.
comm = rdist.init_process_group(timeout_ms=60000)
t = torch.full((4,), float(rank + 1))
rdist.all_reduce(t)
c_api = {"rank": comm.rank, "size": comm.size, "sum": t.tolist()}
dist.barrier()
rdist.destroy_process_group()

result = {"rank": rank, "size": size, "ddp_equal": equal, "ddp_max_diff": max_diff,
          "c_api": c_api,
          "cpu_backend": dist.group.WORLD._get_backend(torch.device("cpu")).name()}
with open(os.path.join(os.environ["RESULT_DIR"], f"{rank}.json"), "w") as f:
    f.write(json.dumps(result))
dist.destroy_process_group()
# Without the interpreter's teardown, where torch 2.4's gloo can abort a
# rank that is done (see tests/workers/_worker.py, exit_without_teardown).
os._exit(0)
