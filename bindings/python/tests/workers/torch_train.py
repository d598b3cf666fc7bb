"""A rank of the training job: DistributedDataParallel (several bucket
configurations), ZeroRedundancyOptimizer and FSDP (fully_shard) on the
"rdist" backend and on a gloo group in the same job, from the same seed: the final weights must
be bitwise equal. Then async overlap: a Work's future completes from
rdist's completion while the rank computes, without anyone waiting.
Reports one `RESULT` line: {"rank", "size", "cases", "failures", "buckets"}."""

import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import rdist.torch  # noqa: F401
from _worker import exit_without_teardown, report

torch.set_num_threads(1)
dist.init_process_group("rdist", timeout=timedelta(seconds=60))
RANK, SIZE = dist.get_rank(), dist.get_world_size()
GLOO = dist.new_group(backend="gloo")
WORLD = dist.group.WORLD
cases, failures, buckets = [], {}, {}


def model():
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 8))


def batch(step):
    g = torch.Generator().manual_seed(1000 * RANK + step)
    return torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)


def train_ddp(pg, steps=6, **options):
    net = DDP(model(), process_group=pg, **options)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    stats = net._get_ddp_logging_data()
    buckets = stats.get("num_buckets_reduced")
    if buckets is None:  # torch before 2.6 does not log it
        buckets = len(net.reducer._get_zeros_like_grad_buckets())
    return [p.detach().clone() for p in net.module.parameters()], buckets


def train_zero(pg, steps=6):
    net = DDP(model(), process_group=pg)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=0.01,
                                  process_group=pg)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.module.parameters()], 0


def train_fsdp(pg, steps=4):
    """FSDP2 (fully_shard) on CPU: parameters sharded across the group,
    all_gather_into_tensor forward, reduce_scatter_tensor backward."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(pg, "cpu")
    net = model()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in net.parameters()], 0


def compare(case_id, train, **options):
    cases.append(case_id)
    try:
        ours, nb = train(WORLD, **options)
        theirs, _ = train(GLOO, **options)
        buckets[case_id] = nb
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if not torch.equal(a, b):
                failures[case_id] = (f"parameter {i} differs from gloo's: max |diff| "
                                     f"{(a - b).abs().max().item()}")
                return
        # ... and across ranks (DDP keeps replicas identical).
        flat = torch.cat([p.reshape(-1) for p in ours])
        first = flat.clone()
        dist.broadcast(first, 0)
        if not torch.equal(flat, first):
            failures[case_id] = "replicas differ across ranks"
    except Exception:  # noqa: BLE001
        failures[case_id] = traceback.format_exc()[-2000:]


compare("ddp/default", train_ddp)
compare("ddp/small_buckets", train_ddp, bucket_cap_mb=0.004)
compare("ddp/small_buckets/grad_views", train_ddp, bucket_cap_mb=0.004, gradient_as_bucket_view=True)
compare("ddp/static_graph", train_ddp, static_graph=True)
compare("zero/adam", train_zero)
if hasattr(torch.distributed.fsdp, "fully_shard"):
    compare("fsdp/fully_shard", train_fsdp)  # FSDP2 on CPU: torch 2.6 on


def overlap():
    cases.append("async/overlap")
    try:
        big = torch.full((4 << 20,), float(RANK + 1))  # 16 MiB
        work = dist.all_reduce(big, async_op=True)
        fut = work.get_future()
        chained = fut.then(lambda f: f.value()[0][:4].sum().item())
        a = torch.randn(256, 256)
        spins = 0
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:
            a = torch.tanh(a @ a)  # compute while the collective runs
            spins += 1
        if not fut.done():
            failures["async/overlap"] = "the future never completed without a wait"
            return
        work.wait()
        want = float(sum(range(1, SIZE + 1)))
        if not (big == want).all() or chained.wait() != 4 * want:
            failures["async/overlap"] = f"wrong result {big[:4].tolist()}"
        # The backend's own Work (what torch wraps): is_completed, wait, result.
        backend = WORLD._get_backend(torch.device("cpu"))
        t = torch.ones(8)
        opts = dist.AllreduceOptions()
        w = backend.allreduce([t], opts)
        deadline = time.monotonic() + 30
        w.get_future()
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not (w.is_completed() and w.wait() and w.is_success() and (t == SIZE).all()):
            failures["async/overlap"] = f"backend Work: completed {w.is_completed()}, {t.tolist()}"
    except Exception:  # noqa: BLE001
        failures["async/overlap"] = traceback.format_exc()[-2000:]


overlap()
dist.barrier()
report(rank=RANK, size=SIZE, cases=cases, failures=failures, buckets=buckets)
dist.destroy_process_group()
exit_without_teardown()
