"""Fixtures of the rdist binding tests (the job helpers are in jobs.py), and
the ``needs_0_2`` marker: tests of the 0.2 additions to the C API
(docs/api.md, "since 0.2": bool/int16/uint16, bitwise reductions,
allgatherv/alltoallv, tagged point-to-point, request status) skip, saying
so, while the loaded librdist lacks them."""

import sys
from pathlib import Path

import pytest

# Test this checkout's package, whatever else is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rdist  # noqa: E402
from rdist import _library  # noqa: E402
from jobs import free_port  # noqa: E402


def missing_0_2():
    """What the loaded library lacks of the 0.2 API ([] when it has it all)."""
    missing = sorted(name for name in _library.OPTIONAL if not _library.has(name))
    if rdist.library_version() < (0, 2, 0):
        missing.insert(0, "version >= 0.2 (RDIST_BOOL/INT16/UINT16, RDIST_BAND/BOR/BXOR)")
    return missing


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "needs_0_2: needs the 0.2 additions to the C API; skipped (with the reason) "
        "while the loaded librdist lacks them",
    )


def pytest_collection_modifyitems(config, items):
    missing = missing_0_2()
    if not missing:
        return
    skip = pytest.mark.skip(
        reason=f"needs_0_2: {rdist.library_path} lacks {', '.join(missing)}"
    )
    for item in items:
        if "needs_0_2" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def solo():
    """A one-rank communicator in the test process itself, for checks that
    need no peer (argument validation, buffer handling)."""
    comm = rdist.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout_ms=10000)
    yield comm
    comm.destroy()
