"""Device arrays (``__cuda_array_interface__``) through the binding, on a
machine with no GPU: the ranks load rdist's GPU test doubles
(tests/gpu_stub: a CUDA driver and NCCL whose device memory the CPU cannot
touch), so a device pointer read on the host would crash the rank. With
backend=socket the device arrays are staged through host memory by rdist;
the results are checked against numpy references in the worker.

The ``real_gpu`` tests run the same worker on the machine's own CUDA driver
and the NCCL wheel scripts/setup.sh installs (build/nccl, or
RDIST_TEST_NCCL_DIR); without a CUDA device they skip, saying why
(scripts/gpu-check.sh runs them on a GPU machine)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import REPO, WORKERS, expect_success, run_ranks

_PROBE = """
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as error:
    sys.exit(f"no CUDA driver ({error})")
rc = cuda.cuInit(0)
if rc != 0:
    sys.exit(f"cuInit failed: CUresult {rc}")
count = ctypes.c_int(0)
rc = cuda.cuDeviceGetCount(ctypes.byref(count))
if rc != 0 or count.value == 0:
    sys.exit(f"no CUDA device (cuDeviceGetCount: CUresult {rc}, {count.value} devices)")
print(count.value)
"""


def real_cuda_devices():
    """The number of CUDA devices the real driver sees; skips the test,
    saying why, when there are none. Probed in a child process, so that
    this one never loads the driver."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["probe failed"]
        pytest.skip(f"no CUDA device ({why[0]})")
    return int(done.stdout.strip())


def nccl_wheel_library():
    """scripts/setup.sh's NCCL (RDIST_TEST_NCCL_DIR, else build/nccl), or skip."""
    wheel_dir = Path(os.environ.get("RDIST_TEST_NCCL_DIR") or REPO / "build" / "nccl")
    library = wheel_dir / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    if not library.is_file():
        pytest.skip(f"NCCL not installed ({library} is missing; scripts/setup.sh installs it)")
    return library


@pytest.fixture(scope="module")
def stub_dir():
    out = REPO / "target" / "gpu-stub-python"
    done = subprocess.run(
        ["bash", str(REPO / "tests" / "gpu_stub" / "build.sh"), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"building the GPU test doubles failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.parametrize("world_size", [1, 3])
def test_device_arrays_are_staged_on_the_socket_backend(stub_dir, world_size):
    pytest.importorskip("numpy")
    ranks = run_ranks(
        [WORKERS / "device.py"], world_size, timeout=60,
        env={"LD_LIBRARY_PATH": stub_dir, "RDIST_BACKEND": "socket"},
    )
    results = expect_success(ranks)
    for r in results:
        assert r["checked"] == ["float32", "float16", "int64", "uint8"]
        assert "must be C-contiguous" in r["refused"], r["refused"]
        assert r["ordered"], "a non-blocking call did not wait for its array's stream"


def test_device_arrays_go_to_nccl_on_one_rank(stub_dir):
    pytest.importorskip("numpy")
    ranks = run_ranks(
        [WORKERS / "device.py"], 1, timeout=60,
        env={
            "LD_LIBRARY_PATH": stub_dir,
            "RDIST_NCCL_LIBRARY": stub_dir / "libnccl.so.2",
            "RDIST_BACKEND": "nccl",
        },
    )
    (result,) = expect_success(ranks)
    assert result["backend"].lower().endswith("nccl"), result
    assert result["ordered"], "a non-blocking call did not wait for its array's stream"


def _python(code, **env):
    import sys

    from jobs import child_env

    return subprocess.run(
        [sys.executable, "-c", code], env=child_env(**env), capture_output=True, text=True, timeout=60,
    )


def test_nccl_version_reads_the_library_rdist_would_load(stub_dir):
    done = _python("import rdist; print(rdist.nccl_version())", RDIST_NCCL_LIBRARY=stub_dir / "libnccl.so.2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(2, 21, 5)"
    missing = _python(
        "import rdist\n"
        "try:\n    rdist.nccl_version()\n"
        "except rdist.UnavailableError as e:\n    print('UNAVAILABLE', e)\n",
        RDIST_NCCL_LIBRARY="/no/such/libnccl.so.2",
    )
    assert "UNAVAILABLE" in missing.stdout and "/no/such/libnccl.so.2" in missing.stdout, missing


def test_real_gpu_device_arrays_go_to_nccl_on_one_rank():
    pytest.importorskip("numpy")
    real_cuda_devices()
    library = nccl_wheel_library()
    ranks = run_ranks(
        [WORKERS / "device.py"], 1, timeout=180,
        env={"RDIST_NCCL_LIBRARY": library, "RDIST_BACKEND": "nccl", "RDIST_DEVICE": 0},
    )
    (result,) = expect_success(ranks)
    assert result["backend"].lower().endswith("nccl"), result
    assert result["checked"] == ["float32", "float16", "int64", "uint8"]
    assert "must be C-contiguous" in result["refused"], result["refused"]


def test_real_gpu_ranks_sharing_one_device_stage_through_the_socket_backend():
    pytest.importorskip("numpy")
    real_cuda_devices()
    ranks = run_ranks(
        [WORKERS / "device.py"], 2, timeout=180,
        env={"RDIST_BACKEND": "socket", "RDIST_DEVICE": 0},
    )
    for result in expect_success(ranks):
        assert result["backend"].lower().endswith("socket"), result
        assert result["checked"] == ["float32", "float16", "int64", "uint8"]
