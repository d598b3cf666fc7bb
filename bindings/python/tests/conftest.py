"""Fixtures of the rdist binding tests (the job helpers are in jobs.py)."""

import sys
from pathlib import Path

import pytest

# Test this checkout's package, whatever else is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rdist  # noqa: E402
from jobs import free_port  # noqa: E402


@pytest.fixture(scope="session")
def solo():
    """A one-rank communicator in the test process itself, for checks that
    need no peer (argument validation, buffer handling)."""
    comm = rdist.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout_ms=10000)
    yield comm
    comm.destroy()
