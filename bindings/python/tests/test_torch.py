"""rdist inside PyTorch: the "rdist" torch.distributed backend (rdist.torch)
on real multi-process jobs, each call against an independent reference and
against gloo in the same job (workers/torch_ops.py), DDP and
ZeroRedundancyOptimizer bitwise equal to gloo's (workers/torch_train.py),
async Work, torchrun running an unchanged script, and torch tensors in the
plain binding.

The ranks run with the torch venv's Python: $RDIST_TORCH_PYTHON
(scripts/test-python.sh sets it from scripts/torch-env.sh), else this
Python if it has torch. Without one every test here is skipped, saying so.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from jobs import REPO, WORKERS, child_env, describe_all, expect_success, free_port, run_ranks


def _torch_python():
    if "RDIST_TORCH_PYTHON" in os.environ:  # set empty: skip the torch tests
        return os.environ["RDIST_TORCH_PYTHON"] or None
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    return None


TORCH_PYTHON = _torch_python()
pytestmark = pytest.mark.skipif(
    TORCH_PYTHON is None,
    reason="skipped: no Python with torch (set RDIST_TORCH_PYTHON, or run scripts/test-python.sh, "
    "which installs one with scripts/torch-env.sh)",
)

_jobs = {}


def job(worker, size, timeout=150):
    """Runs a worker once per session per size; returns the ranks' reports."""
    key = (worker, size)
    if key not in _jobs:
        ranks = run_ranks([WORKERS / worker], size, timeout=timeout, python=TORCH_PYTHON,
                          env={"OMP_NUM_THREADS": 1})
        reports = expect_success(ranks)
        assert len(reports) == size, describe_all(ranks)
        _jobs[key] = reports
    return _jobs[key]


def _failures(report, ids):
    return {k: v for k, v in report["failures"].items() if k in ids}


@pytest.mark.parametrize("size", [2, 3])
def test_every_call_matches_the_reference_and_gloo(size):
    for report in job("torch_ops.py", size):
        assert len(report["cases"]) >= 60, report["cases"]
        # The compiled backend unless the run asks for the Python fallback.
        assert report["compiled"] == (os.environ.get("RDIST_TORCH_BACKEND") != "python")
        failed = _failures(report, set(report["cases"]))
        assert not failed, f"rank {report['rank']} of {size}:\n" + "\n".join(
            f"--- {case}\n{why}" for case, why in failed.items()
        )


@pytest.mark.needs_0_2
@pytest.mark.parametrize("size", [2, 3])
def test_calls_on_the_0_2_api_match_the_reference(size):
    """Bitwise reductions, bool/int16/uint16 reductions, uneven all_to_all,
    tagged send/recv and recv from any source."""
    for report in job("torch_ops.py", size):
        assert len(report["cases_0_2"]) >= 20
        assert not report["unavailable"], report["unavailable"]
        failed = _failures(report, set(report["cases_0_2"]))
        assert not failed, f"rank {report['rank']} of {size}:\n" + "\n".join(
            f"--- {case}\n{why}" for case, why in failed.items()
        )


def _train_case(case_id):
    reports = job("torch_train.py", 2)
    for report in reports:
        assert case_id in report["cases"]
        assert case_id not in report["failures"], report["failures"][case_id]
    return reports


@pytest.mark.parametrize(
    "case_id",
    ["ddp/default", "ddp/small_buckets", "ddp/small_buckets/grad_views", "ddp/static_graph"],
)
def test_ddp_weights_equal_gloos_bitwise(case_id):
    reports = _train_case(case_id)
    if "small_buckets" in case_id:
        assert all(r["buckets"][case_id] >= 2 for r in reports), [r["buckets"] for r in reports]


def test_zero_redundancy_optimizer_equals_gloos():
    _train_case("zero/adam")


def test_fsdp_fully_shard_equals_gloos():
    if not _torch_has("torch.distributed.fsdp", "fully_shard"):
        pytest.skip("skipped: this torch's FSDP2 (before 2.6) needs CUDA")
    _train_case("fsdp/fully_shard")


def test_async_work_completes_from_rdist_while_the_rank_computes():
    _train_case("async/overlap")


def _fake_install(directory):
    """What an installed rdist adds for torch: its entry point (so that an
    unchanged script finds the backend). The package itself comes from
    PYTHONPATH, i.e. this checkout."""
    info = Path(directory, "rdist-0.0.0.dist-info")
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rdist\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[torch.distributed.backends]\nrdist = rdist.torch:register\n"
    )


def _torch_has(module, name):
    done = subprocess.run(
        [TORCH_PYTHON, "-c", f"import {module} as m; print(hasattr(m, {name!r}))"],
        capture_output=True, text=True, timeout=60)
    return done.stdout.strip() == "True"


def _torch_loads_backend_entry_points():
    done = subprocess.run(
        [TORCH_PYTHON, "-c", "import inspect, torch.distributed.distributed_c10d as c; "
         "print('torch.distributed.backends' in inspect.getsource(c))"],
        capture_output=True, text=True, timeout=60)
    return done.stdout.strip() == "True"


def _cuda_devices():
    done = subprocess.run([TORCH_PYTHON, "-c", "import torch; print(torch.cuda.device_count())"],
                          capture_output=True, text=True, timeout=60)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def _cuda_job(size, on_cpu):
    ranks = run_ranks([WORKERS / "torch_cuda.py"], size, timeout=300, python=TORCH_PYTHON,
                      env={"OMP_NUM_THREADS": 1, "RDIST_CUDA_WORKER_ON_CPU": int(on_cpu)})
    reports = expect_success(ranks)
    assert len(reports) == size, describe_all(ranks)
    for report in reports:
        assert report["compiled"] == (os.environ.get("RDIST_TORCH_BACKEND") != "python")
        assert len(report["cases"]) >= 10, report["cases"]
        assert not report["failures"], f"rank {report['rank']} of {size}:\n" + "\n".join(
            f"--- {case}\n{why}" for case, why in report["failures"].items()
        )
    return reports


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_cuda_workers_references_hold_on_cpu(size):
    """workers/torch_cuda.py on CPU tensors: what it checks on a GPU machine
    is right here first (its references, its send/recv pairs)."""
    _cuda_job(size, on_cpu=True)


@pytest.mark.parametrize("size", [1, 2])
def test_cuda_tensors_through_rdist_keep_torchs_stream_order_and_equal_nccl(size):
    """init_process_group("rdist") with CUDA tensors: NCCL under rdist (one
    rank per device) or staged through rdist's sockets (ranks sharing a
    device); inputs still being made on the current stream, results read
    after it; at world size 1 bitwise equal to torch's nccl backend."""
    if _cuda_devices() == 0:
        pytest.skip("skipped: no CUDA device (torch CUDA tensors through rdist need one)")
    for report in _cuda_job(size, on_cpu=False):
        print(f"rank {report['rank']} of {size} on {report['device']}: all_reduce us per call "
              f"{report['per_call_us']}")


def _torchrun(options, script, nproc, env, scratch, timeout):
    """Runs torchrun with `options` on WORKERS/script (bounded) and returns
    each rank's report from RESULT_DIR (= scratch)."""
    torchrun = Path(TORCH_PYTHON).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"skipped: no torchrun beside {TORCH_PYTHON}")
    # The port was free when picked; an outgoing connection may take it as
    # its own before torchrun's store binds it (it comes from the same
    # range). Then nothing ran yet, and a new port is tried.
    for _ in range(3):
        command = [str(torchrun), "--nproc-per-node", str(nproc), *options,
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                   str(WORKERS / script)]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                                  cwd=scratch, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as expired:
            pytest.fail(f"torchrun did not finish in {timeout} s\n{expired.stdout}\n{expired.stderr}")
        if done.returncode == 0 or "EADDRINUSE" not in done.stderr:
            break
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return [json.loads(Path(scratch, f"{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("backend", ["rdist", "cpu:rdist,cuda:gloo", "cpu:rdist,cuda:nccl"])
def test_torchrun_runs_an_unchanged_script(backend):
    if "nccl" in backend and _cuda_devices() == 0:
        pytest.skip("skipped: torch's NCCL backend needs a CUDA device")
    if not _torch_loads_backend_entry_points():
        pytest.skip("skipped: this torch loads no torch.distributed.backends entry points "
                    "(2.15 does; 2.11 and older do not): scripts there `import rdist.torch`")
    with tempfile.TemporaryDirectory(prefix="rdist-torchrun-") as scratch:
        _fake_install(scratch)
        env = child_env(BACKEND=backend, OMP_NUM_THREADS=1, RESULT_DIR=scratch)
        env["PYTHONPATH"] = os.pathsep.join([scratch, env["PYTHONPATH"]])
        reports = _torchrun([], "torchrun_script.py", 2, env, scratch, 120)
    for report in reports:
        assert report["sum"] == [3.0, 3.0, 3.0]
        assert report["gathered"] == [0.0, 1.0]
        assert report["cpu_backend"] == "rdist"


def test_torchrun_restarts_a_job_that_lost_a_rank_and_rdist_meets_again():
    """torchrun --max-restarts 2: rank 1 is killed on the first attempt; the
    restarted ranks meet through rdist (env://) on the agent's store, and
    the first attempt's keys there never confuse the second's."""
    with tempfile.TemporaryDirectory(prefix="rdist-elastic-") as scratch:
        env = child_env(OMP_NUM_THREADS=1, RESULT_DIR=scratch)
        reports = _torchrun(["--max-restarts", "2"], "torchrun_elastic.py", 3, env, scratch, 180)
    for report in reports:
        assert report["attempt"] == 1, report
        assert report["sum"] == [6.0] * 4, report


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_ddp_equals_gloo_beside_rdists_own_communicator(nproc):
    """DDP under torchrun equal to gloo's, and in the same processes an
    rdist communicator made through env:// (joining torchrun's store)."""
    with tempfile.TemporaryDirectory(prefix="rdist-torchrun-") as scratch:
        env = child_env(OMP_NUM_THREADS=1, RESULT_DIR=scratch)
        reports = _torchrun([], "torchrun_train.py", nproc, env, scratch, 240)
    total = float(sum(range(1, nproc + 1)))
    for r, report in enumerate(reports):
        if nproc == 2:  # one addition per element: the same order as gloo's
            assert report["ddp_equal"] == {"default": True, "small_buckets": True}, report
        # Weights of order 0.1 after 5 steps; float32 rounding of sums in
        # another order is ~1e-7 per step.
        assert all(d < 1e-5 for d in report["ddp_max_diff"].values()), report
        print(f"rank {r} of {nproc}: DDP bitwise equal to gloo {report['ddp_equal']}, "
              f"largest difference {report['ddp_max_diff']}")
        assert report["c_api"] == {"rank": r, "size": nproc, "sum": [total] * 4}, report
        assert report["cpu_backend"] == "rdist"


# -- the plain binding with torch tensors, the default communicator, init_from_store


def _run_snippet(code, size, timeout=90, env=None):
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False, dir=tempfile.gettempdir()) as f:
        f.write(textwrap.dedent(code))
    try:
        ranks = run_ranks([f.name], size, timeout=timeout, python=TORCH_PYTHON,
                          env={"OMP_NUM_THREADS": 1, **(env or {})})
    finally:
        os.unlink(f.name)
    return expect_success(ranks)


def test_tensors_default_communicator_new_group_and_init_from_store():
    reports = _run_snippet(
        """
        import os
        from datetime import timedelta
        import numpy as np
        import torch
        import torch.distributed as dist
        import rdist
        from _worker import report

        checks = {}
        comm = rdist.init_process_group(timeout_ms=60000)
        rank, size = rdist.get_rank(), rdist.get_world_size()
        checks["initialized"] = rdist.is_initialized() and comm is rdist.get_default_comm()

        # torch tensors go by data pointer: in place, no copy.
        t = torch.full((5,), float(rank + 1))
        ptr = t.data_ptr()
        rdist.all_reduce(t)
        checks["cpu_tensor_in_place"] = t.data_ptr() == ptr and t.tolist() == [3.0] * 5
        for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
                      torch.int64, torch.float64, torch.uint32, torch.uint64):
            x = torch.full((3,), rank + 1, dtype=dtype)
            comm.allreduce(x, op="max")
            checks[f"dtype_{dtype}"] = x.tolist() == [2] * 3
        # bool and int16 move (broadcast) on any library, as their bytes.
        b = torch.tensor([True, False, rank == 0])
        comm.broadcast(b, root=0, dtype="uint8")
        checks["bool_bytes"] = b.tolist() == [True, False, True]
        # Non-contiguous: a clear error, nothing written.
        m = torch.zeros(4, 4)
        try:
            comm.allreduce(m.t()[0])
            checks["non_contiguous"] = False
        except rdist.InvalidArgumentError as error:
            checks["non_contiguous"] = "contiguous" in str(error)
        # DLPack producers without the buffer protocol.
        class Producer:
            def __init__(self, t):
                self.t = t
            def __dlpack__(self, stream=None):
                return self.t.__dlpack__()
            def __dlpack_device__(self):
                return self.t.__dlpack_device__()
        d = torch.full((4,), float(rank))
        comm.allreduce(Producer(d))
        checks["dlpack"] = d.tolist() == [1.0] * 4
        # async, module level
        a = torch.ones(3)
        req = rdist.all_reduce(a, async_op=True)
        req.wait()
        checks["async"] = a.tolist() == [2.0] * 3

        # new_group on rdist_comm_split: non-members get NON_GROUP_MEMBER.
        g = rdist.new_group([1])
        if rank == 1:
            checks["group_member"] = rdist.get_world_size(g) == 1 and rdist.get_rank(g) == 0
            rdist.all_reduce(torch.ones(1), group=g)
        else:
            checks["group_nonmember"] = g is rdist.NON_GROUP_MEMBER and rdist.get_rank(g) == -1
            checks["nonmember_noop"] = rdist.all_reduce(torch.ones(1), group=g) is None

        # init_from_store, twice in one process (distinct keys), from torch's store.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["TORCH_STORE_PORT"]),
                              size, rank == 0, timeout=timedelta(seconds=60))
        for i in range(2):
            c = rdist.init_from_store(store, rank, size, timeout_ms=60000)
            v = np.array([rank + i], np.int64)
            c.allreduce(v)
            checks[f"from_store_{i}"] = int(v[0]) == 1 + 2 * i
            c.destroy()
        rdist.destroy_process_group()
        checks["destroyed"] = not rdist.is_initialized()
        report(rank=rank, checks=checks)
        """,
        2,
        # A port from the OS for torch's store (MASTER_PORT + 1 may be taken).
        env={"TORCH_STORE_PORT": free_port()},
    )
    for report in reports:
        failed = [k for k, ok in report["checks"].items() if not ok]
        assert not failed, f"rank {report['rank']}: {failed}"


def test_the_flight_recorder_tells_finished_calls_from_a_hung_one(tmp_path):
    """torch's flight recorder on rdist (torch with backend hooks, 2.15):
    finished calls read "completed" with their duration (a broadcast whose
    root waited 0.3 s says so), none reads active; a non-blocking call
    that times out (rank 1 never makes it) runs the abort hooks, which
    write the trace to TORCH_FR_DUMP_TEMP_FILE<rank>, where it is the one
    entry not completed."""
    if not _torch_has("torch.distributed.distributed_c10d", "_maybe_attach_flight_recorder"):
        pytest.skip("skipped: this torch has no backend hooks for its flight recorder (2.15 added them)")
    reports = _run_snippet(
        """
        import json, os, pickle, time
        from datetime import timedelta
        import torch
        import torch.distributed as dist
        import rdist.torch  # noqa: F401
        from _worker import report

        rank = int(os.environ["RANK"])
        dist.init_process_group("rdist", timeout=timedelta(seconds=3))
        store = dist.distributed_c10d._get_default_store()
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        if rank == 0:
            dist.send(torch.ones(2), 1)
        else:
            dist.recv(torch.zeros(2), 0)
            time.sleep(0.3)  # the root's broadcast waits for this rank to enter
        dist.broadcast(t, 0)
        c10d = torch._C._distributed_c10d
        trace = pickle.loads(c10d._dump_fr_trace(True, False, backend="rdist"))
        entries = [(e["profiling_name"], e["state"], e.get("duration_ms")) for e in trace["entries"]]
        active = json.loads(c10d._dump_fr_trace_json(True, True, backend="rdist"))
        facts = {"entries": entries, "active": active.get("entries", [])}
        if rank == 0:
            try:
                # Non-blocking: the failure is met in the work's wait.
                dist.all_reduce(t, async_op=True).wait()
                facts["error"] = None
            except Exception as error:
                facts["error"] = type(error).__name__
            dump = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "0"
            deadline = time.monotonic() + 10
            while "dumped" not in facts and time.monotonic() < deadline:
                try:
                    with open(dump, "rb") as f:
                        entries = pickle.load(f)["entries"]
                    facts["dumped"] = [(e["profiling_name"], e["state"]) for e in entries]
                except (OSError, EOFError, pickle.UnpicklingError):
                    time.sleep(0.05)  # not written yet, or not whole
            store.set("rank 0 is done", "1")
        else:
            store.wait(["rank 0 is done"], timedelta(seconds=60))
        report(rank=rank, **facts)
        """,
        2,
        env={"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")},
    )
    for r in reports:
        names = [name for name, _, _ in r["entries"]]
        assert names[:2] == ["rdist:all_reduce"] * 2 and names[3] == "rdist:broadcast", names
        assert len(names) == 4 and names[2].startswith("rdist:" + ("send" if r["rank"] == 0 else "recv"))
        for name, state, ms in r["entries"]:
            assert state == "completed" and ms is not None and ms >= 0, (r["rank"], name, state, ms)
        assert r["active"] == [], r["active"]
    first = reports[0]
    assert first["entries"][3][2] >= 200, f"the root's broadcast waited 0.3 s: {first['entries']}"
    assert first["error"] == "DistBackendError", first
    assert first.get("dumped"), f"no trace at {tmp_path}: {sorted(os.listdir(tmp_path))}"
    assert [s for _, s in first["dumped"]] == ["completed"] * 4 + ["scheduled"], first["dumped"]
    assert first["dumped"][-1][0] == "rdist:all_reduce", first["dumped"]


_AGENT_STORE = (
    "import sys, time, datetime, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False,"
    " timeout=datetime.timedelta(seconds=120))\n"
    "print('ready', flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.mark.parametrize("victim", [0, 2])
def test_shrink_group_on_rdist_lets_the_survivors_go_on(victim):
    """torch.distributed.shrink_group on the default group after a rank
    died (the store's host, rank 0, too): the backend says it supports
    shrinking and the survivors all-reduce on the shrunk group."""
    if not _torch_has("torch.distributed.distributed_c10d", "shrink_group"):
        pytest.skip("skipped: this torch has no torch.distributed shrink_group (2.10 added it)")
    env = {}
    store = None
    if victim == 0:
        # torch's shrink_group clones the old group's store: with rank 0
        # hosting it (plain env://) it dies with rank 0. Hosted outside the
        # ranks, as torchrun's agent does, it survives.
        port = free_port()
        store = subprocess.Popen(
            [TORCH_PYTHON, "-c", _AGENT_STORE, str(port)], stdout=subprocess.PIPE, text=True,
            env=child_env(), stdin=subprocess.DEVNULL,
        )
        assert store.stdout.readline().strip() == "ready"
        env["RDIST_TEST_AGENT_STORE_PORT"] = port
    try:
        ranks = run_ranks([WORKERS / "torch_shrink.py", victim], 4, timeout=120, python=TORCH_PYTHON, env=env)
    finally:
        if store is not None:
            store.kill()
            store.wait()
    assert ranks[victim].returncode == 7, describe_all(ranks)
    survivors = [r for r in range(4) if r != victim]
    for new_rank, old_rank in enumerate(survivors):
        assert ranks[old_rank].returncode == 0, describe_all(ranks)
        result = ranks[old_rank].result
        assert result["error"], result  # the failure was seen first
        assert result["new_rank"] == new_rank and result["size"] == 3, result
        assert result["default"] is True, result
        assert result["sum"] == sum(r + 1 for r in survivors), result


def _backend_job(size, detail=False):
    key = ("torch_backend.py", size, detail)
    if key not in _jobs:
        env = {"OMP_NUM_THREADS": 1}
        if detail:
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        ranks = run_ranks([WORKERS / "torch_backend.py"], size, timeout=150, python=TORCH_PYTHON,
                          env=env)
        reports = expect_success(ranks)
        assert len(reports) == size, describe_all(ranks)
        _jobs[key] = reports
    return _jobs[key]


@pytest.mark.parametrize("size,detail", [(2, False), (3, False), (2, True)],
                         ids=["2", "3", "2-detail"])
def test_the_backend_as_torch_sees_it(size, detail):
    """all_gather_coalesced's layout, Work state, the sender of an any-source
    receive, coalescing, sparse all_reduce, torch's error types, monitored
    barrier, profiler names and DDP's logging; under DETAIL torch wraps the
    group in its checking wrapper and every call still works."""
    for report in _backend_job(size, detail):
        assert len(report["cases"]) >= 9, report["cases"]
        assert not report["failures"], f"rank {report['rank']} of {size}:\n" + "\n".join(
            f"--- {case}\n{why}" for case, why in report["failures"].items()
        )
        assert report["facts"]["get_backend"] == "rdist"
        if os.environ.get("RDIST_TORCH_BACKEND", "").lower() != "python":
            assert report["facts"]["compiled"], report["facts"]
