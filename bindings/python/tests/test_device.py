"""Device arrays (``__cuda_array_interface__``) through the binding, on a
machine with no GPU: the ranks load rdist's GPU test doubles
(tests/gpu_stub: a CUDA driver and NCCL whose device memory the CPU cannot
touch), so a device pointer read on the host would crash the rank. With
backend=socket the device arrays are staged through host memory by rdist;
the results are checked against numpy references in the worker."""

import subprocess

import pytest

from jobs import REPO, WORKERS, expect_success, run_ranks


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
