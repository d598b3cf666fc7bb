"""Helpers shared by the rdist binding tests: starting real multi-process
jobs (through rdistrun, or by spawning the ranks directly), each bounded by a
timeout, and reading the `RESULT {json}` lines their ranks print."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import rdist

TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "workers"
BINDINGS = TESTS.parent
REPO = BINDINGS.parent.parent
RDISTRUN = REPO / "target" / "debug" / "rdistrun"

# Variables a launcher sets; cleared so a test's job never inherits them.
_LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "RDIST_LAUNCHER",
)


def child_env(**extra):
    """The environment for a rank: this package and the very library this
    test process loaded, no inherited launcher or RDIST_* settings. `extra`
    values of None remove a variable."""
    # RDIST_TORCH_BACKEND picks the torch backend the ranks use (the suite
    # runs once per choice); every other RDIST_* setting stays out.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RDIST_") or k == "RDIST_TORCH_BACKEND"}
    for name in _LAUNCHER_VARS:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BINDINGS), str(WORKERS)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    )
    env["RDIST_LIBRARY"] = rdist.library_path
    env["PYTHONUNBUFFERED"] = "1"
    for name, value in extra.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


def free_port():
    """A loopback TCP port held for the job that is about to listen on it.

    A port merely released after bind(0) goes back to the kernel's pool: a
    parallel test's connect() or bind(0) can take it before torch's store
    listens (EADDRINUSE, then the other ranks wait out their timeout). Closing
    an accepted connection from the listening side first leaves the port in
    TIME_WAIT for a minute: the kernel hands it to no bind(0) and no connect(),
    while a listener that sets SO_REUSEADDR (torch's TCPStore, libuv, Rust's
    std, rdist's store) still binds it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        # Bounded: a stranger's connection accepted instead would never close.
        listener.settimeout(5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            accepted, _ = listener.accept()
            accepted.close()
            try:
                client.recv(1)
            except OSError:
                pass
    return port


def parse_results(text):
    """The JSON of every `RESULT ` line (rdistrun's `[rank R] ` prefix allowed)."""
    return [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT {" in line]


@dataclass
class Rank:
    """How one spawned rank ended."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    results: list = field(default_factory=list)

    @property
    def result(self):
        """Its one RESULT line."""
        assert len(self.results) == 1, f"rank {self.rank} printed {len(self.results)} RESULT lines:\n{self.describe()}"
        return self.results[0]

    def describe(self):
        return (
            f"--- rank {self.rank} exited {self.returncode}\n"
            f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"
        )


def describe_all(ranks):
    return "\n".join(r.describe() for r in ranks)


# torch's store when its port was taken between `free_port` and its listen
# (a race outside rdist: the job is launched once more on another port).
TORCH_STORE_PORT_TAKEN = "The server socket has failed to listen on any local network address"


def run_ranks(args, world_size, timeout=30, env=None, per_rank_env=None, python=None):
    """Spawns `python ARGS...` once per rank with env:// variables on a free
    port and waits for all of them (killing every one after `timeout` s).
    Returns a Rank per rank; outputs go through files, so a chatty rank can
    never block on a full pipe. `python` is the interpreter (default: this
    one). A job whose torch store found its port taken runs once more."""
    ranks, timed_out = _run_ranks_once(args, world_size, timeout, env, per_rank_env, python)
    if _port_taken(ranks):
        ranks, timed_out = _run_ranks_once(args, world_size, timeout, env, per_rank_env, python)
        if _port_taken(ranks):
            pytest.fail(f"job {args}: its torch store found its port taken twice\n{describe_all(ranks)}")
    if timed_out:
        pytest.fail(f"job {args} did not finish within {timeout} s\n{describe_all(ranks)}")
    return ranks


def _port_taken(ranks):
    return any(r.returncode != 0 and TORCH_STORE_PORT_TAKEN in r.stderr for r in ranks)


def _run_ranks_once(args, world_size, timeout, env, per_rank_env, python):
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="rdist-ranks-") as scratch:
        try:
            for rank in range(world_size):
                rank_env = child_env(
                    RANK=rank, WORLD_SIZE=world_size, LOCAL_RANK=rank,
                    LOCAL_WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    **(env or {}),
                    **((per_rank_env or {}).get(rank, {})),
                )
                out = open(Path(scratch, f"{rank}.out"), "w+")
                err = open(Path(scratch, f"{rank}.err"), "w+")
                proc = subprocess.Popen(
                    [python or sys.executable, *map(str, args)], env=rank_env, stdout=out,
                    stderr=err, stdin=subprocess.DEVNULL, cwd=REPO,
                )
                procs.append((proc, out, err))
            deadline = time.monotonic() + timeout
            timed_out = False
            # The other ranks wait for a store that never came up (its
            # port was taken): stop at once, the caller launches again.
            looked = set()
            taken = False
            while not taken and any(proc.poll() is None for proc, _, _ in procs):
                for i, (proc, _, err) in enumerate(procs):
                    if i not in looked and proc.poll() not in (None, 0):
                        looked.add(i)
                        taken = taken or _says_port_taken(err)
                if taken:
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        ranks = []
        for rank, (proc, out, err) in enumerate(procs):
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
            ranks.append(Rank(rank, proc.returncode, stdout, stderr, parse_results(stdout)))
    return ranks, timed_out and not _port_taken(ranks)


def _says_port_taken(err):
    """Whether a rank's stderr file says its torch store's port was taken."""
    with open(err.name) as f:
        return TORCH_STORE_PORT_TAKEN in f.read()


def expect_success(ranks):
    """Asserts every rank exited 0; returns their single RESULT dicts."""
    assert all(r.returncode == 0 for r in ranks), describe_all(ranks)
    return [r.result for r in ranks]


def run_rdistrun(args, nproc, timeout=30, env=None):
    """`rdistrun --nproc-per-node N python ARGS...`; returns the completed
    process (stdout holds every rank's `[rank R] ` lines)."""
    if not RDISTRUN.exists():
        pytest.fail(f"{RDISTRUN} is missing; run `cargo build` first")
    command = [str(RDISTRUN), "--nproc-per-node", str(nproc), "--grace-s", "1", sys.executable, *map(str, args)]
    try:
        return subprocess.run(
            command, env=child_env(**(env or {})), capture_output=True, text=True,
            timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s\n{expired.stdout}\n{expired.stderr}")
