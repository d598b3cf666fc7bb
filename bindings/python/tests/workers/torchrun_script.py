"""An ordinary torch.distributed script, as users have them: nothing
rdist-specific but the backend name (from BACKEND, default "rdist"). The
backend is found through the torch.distributed.backends entry point."""

import json
import os

import torch
import torch.distributed as dist

dist.init_process_group(backend=os.environ.get("BACKEND", "rdist"))
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)] * 3)
dist.all_reduce(t)
out = [torch.empty(1) for _ in range(size)]
dist.all_gather(out, torch.tensor([float(rank)]))
result = json.dumps({
    "rank": rank, "size": size, "sum": t.tolist(), "gathered": [o.item() for o in out],
    "backend": str(dist.get_backend()),
    "cpu_backend": dist.group.WORLD._get_backend(torch.device("cpu")).name(),
})
if os.environ.get("RESULT_DIR"):  # the test's; torchrun interleaves the ranks' stdout
    with open(os.path.join(os.environ["RESULT_DIR"], f"{rank}.json"), "w") as f:
        f.write(result)
dist.destroy_process_group()
