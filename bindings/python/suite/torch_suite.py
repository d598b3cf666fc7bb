"""PyTorch's own generic distributed suite on rdist.

torch runs `torch.testing._internal.distributed.distributed_test` once per
backend through test/distributed/test_distributed_spawn.py; this drives it
the same way (a TestCase spawning WORLD_SIZE ranks per test) with gloo's
skip lists (BACKEND=gloo), and with RDIST_SUITE_BACKEND=rdist (the default)
every gloo process group swapped for rdist: init_process_group and
new_group get "rdist" where the test asks for gloo. A test that compares the
backend's name with its BACKEND (test_get_backend) is told rdist's, and
the profiler checks look for rdist's event names. RDIST_SUITE_BACKEND=gloo runs the suite as torch
does, for the counts to compare with.

    BACKEND=gloo WORLD_SIZE=2 python suite/torch_suite.py [unittest args]

scripts/torch-suite.sh runs it for both backends and world sizes and
prints the counts.
"""

import os

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

import torch.distributed as dist  # noqa: E402

if os.environ.get("RDIST_SUITE_BACKEND", "rdist") == "rdist":
    import rdist.torch  # noqa: F401 - registers "rdist"

    _init, _new_group = dist.init_process_group, dist.new_group

    def _swap(backend):
        return "rdist" if isinstance(backend, str) and backend.lower() == "gloo" else backend

    def init_process_group(*args, backend=None, **kwargs):
        return _init(*args, backend=_swap(backend), **kwargs)

    def new_group(*args, backend=None, **kwargs):
        return _new_group(*args, backend=_swap(backend), **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if os.environ.get("RDIST_SUITE_BACKEND", "rdist") == "rdist":
    # The profiler checks look for "<backend>:<op>" events, as rdist names
    # its own ("rdist:all_reduce").
    distributed_test.PROFILING_SUPPORTED_BACKENDS.append("rdist")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    if os.environ.get("RDIST_SUITE_BACKEND", "rdist") == "rdist":

        def test_get_backend(self):
            # It compares get_backend() with BACKEND, which stays "gloo" for
            # the skip lists: told rdist's name, in this rank's process only.
            distributed_test.BACKEND = "rdist"
            super().test_get_backend()


if __name__ == "__main__":
    run_tests()
