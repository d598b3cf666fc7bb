"""`pip install ./bindings/python` as a user runs it: into a fresh virtual
environment, offline. The wheel must bundle a stripped librdist and the
rdistrun launcher, the installed package must find its library from any
directory with no environment variable (and still honour RDIST_LIBRARY),
a 2-rank allreduce through the installed rdistrun must work, an editable
install must use the checkout's target/, and the source tree must be left
exactly as it was (no build/, *.egg-info, __pycache__ of the backend...).

cargo builds into this checkout's target directory with the dev profile
(RDIST_CARGO_TARGET_DIR, RDIST_CARGO_PROFILE, which the build backend
honours), so it reuses the `cargo build` the suite already did instead of
compiling a second time; RDIST_TEST_WHEEL_FRESH=1 builds as users do
(release, in a temporary target directory). Every step is bounded in time.
"""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from jobs import BINDINGS, REPO, free_port

FRESH = os.environ.get("RDIST_TEST_WHEEL_FRESH") == "1"

ALLREDUCE = """
import array, os, sys
import rdist
with rdist.init(timeout_ms=30000) as comm:
    buf = array.array("f", [comm.rank + 1.0] * 8)
    comm.allreduce(buf)
    print("RANK", comm.rank, comm.size, buf.tolist()[0], rdist.library_path, flush=True)
"""


def clean_env(**extra):
    """The environment of a user who set nothing up: no RDIST_*, no
    PYTHONPATH, no LD_LIBRARY_PATH, no virtualenv or launcher variables."""
    drop = ("PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDIST_", "PIP_")) and k not in drop}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(command, timeout, **kwargs):
    try:
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{' '.join(map(str, command))} did not finish within {timeout} s\n"
                    f"{expired.stdout}\n{expired.stderr}")
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done


def tree_state():
    """`git status --porcelain --ignored` of the checkout, or None without git."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    done = subprocess.run(["git", "status", "--porcelain", "--ignored"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def site_packages(env_dir):
    (found,) = Path(env_dir).glob("lib/python3*/site-packages")
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with `pip install ./bindings/python` done in it."""
    before = tree_state()
    root = tmp_path_factory.mktemp("wheel")
    env_dir = root / "venv"
    try:
        venv.EnvBuilder(with_pip=True, symlinks=True).create(env_dir)
    except (subprocess.CalledProcessError, OSError, SystemExit) as error:
        pytest.fail(f"cannot create a venv with pip ({error}): {sys.executable} lacks ensurepip; "
                    "on Debian install python3-venv (scripts/setup.sh does)")
    python = env_dir / "bin" / "python"
    build_env = clean_env(PIP_DISABLE_PIP_VERSION_CHECK=1, PIP_NO_CACHE_DIR=1)
    # As users build: Python writes bytecode (the backend must take its own back).
    build_env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not FRESH:
        build_env["RDIST_CARGO_TARGET_DIR"] = os.path.abspath(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
        build_env["RDIST_CARGO_PROFILE"] = "dev"
    # Offline (--no-index): the backend needs nothing but the standard library.
    run([python, "-m", "pip", "install", "--no-index", "./bindings/python"],
        timeout=900 if FRESH else 300, cwd=REPO, env=build_env)
    after = tree_state()
    return {"root": root, "python": python, "bin": env_dir / "bin",
            "site": site_packages(env_dir), "before": before, "after": after}


def test_install_leaves_the_source_tree_as_it_was(installed):
    for litter in ("build", "dist", "rdist.egg-info", "__pycache__", "rdist/lib"):
        assert not (BINDINGS / litter).exists(), f"pip install left bindings/python/{litter}"
    assert not list(BINDINGS.glob("*.egg-info"))
    if installed["before"] is None:
        pytest.skip("no git checkout to compare")
    assert installed["after"] == installed["before"], (
        "pip install changed the checkout (git status --porcelain --ignored):\n"
        f"before:\n{installed['before']}\nafter:\n{installed['after']}"
    )


def test_the_wheel_bundles_a_stripped_library_and_the_launcher(installed):
    library = installed["site"] / "rdist" / "lib" / "librdist.so"
    assert library.is_file()
    launcher = installed["bin"] / "rdistrun"
    assert launcher.is_file() and os.access(launcher, os.X_OK)
    tracer = installed["bin"] / "rdist-trace"
    assert tracer.is_file() and os.access(tracer, os.X_OK)
    readelf = shutil.which("readelf")
    if readelf:
        for binary in (library, launcher, tracer):
            sections = run([readelf, "-S", "-W", binary], timeout=30).stdout
            assert ".debug_info" not in sections and " .symtab " not in sections, f"{binary} is not stripped"
    assert library.stat().st_size < 4 << 20, f"{library}: {library.stat().st_size} bytes"
    record = next(installed["site"].glob("rdist-*.dist-info")) / "RECORD"
    assert "rdist/lib/librdist.so," in record.read_text()


def test_the_installed_package_runs_a_job_from_anywhere_with_no_environment(installed, tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = run([installed["bin"] / "rdistrun", "--nproc-per-node", 2, installed["python"], script],
               timeout=120, cwd=elsewhere, env=clean_env())
    lines = [line.split("RANK ", 1)[1].split() for line in done.stdout.splitlines() if "RANK " in line]
    assert sorted(int(rank) for rank, *_ in lines) == [0, 1], done.stdout
    bundled = str(installed["site"] / "rdist" / "lib" / "librdist.so")
    for _, size, value, path in lines:
        assert (size, float(value), path) == ("2", 3.0, bundled), done.stdout
    # One rank, straight from the interpreter, no launcher.
    done = run([installed["python"], "-c", "import rdist, array; c = rdist.init("
                f"'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1); b = array.array('d', [2.5]); "
                "c.allreduce(b); print(b[0], rdist.library_path); c.destroy()"],
               timeout=60, cwd=elsewhere, env=clean_env())
    assert done.stdout.split() == ["2.5", bundled], done.stdout


def test_rdist_library_still_overrides_the_bundled_copy(installed, tmp_path):
    own = REPO / "target" / "debug" / "librdist.so"
    if "CARGO_TARGET_DIR" in os.environ:
        own = Path(os.environ["CARGO_TARGET_DIR"]) / "debug" / "librdist.so"
    if not own.is_file():
        pytest.skip(f"{own} not built")
    done = run([installed["python"], "-c", "import rdist; print(rdist.library_path)"],
               timeout=60, cwd=tmp_path, env=clean_env(RDIST_LIBRARY=own))
    assert done.stdout.strip() == str(own)


def test_an_editable_install_uses_the_checkout(installed, tmp_path):
    built = [REPO / "target" / p / "librdist.so" for p in ("release", "debug")]
    if not any(b.is_file() for b in built):
        pytest.skip("no librdist in the checkout's target/ (cargo build)")
    before = tree_state()
    build_env = clean_env(PIP_DISABLE_PIP_VERSION_CHECK=1, PIP_NO_CACHE_DIR=1)
    build_env.pop("PYTHONDONTWRITEBYTECODE", None)
    run([installed["python"], "-m", "pip", "install", "--no-index", "-e", "./bindings/python"],
        timeout=120, cwd=REPO, env=build_env)
    assert tree_state() == before
    assert not (BINDINGS / "__pycache__").exists()
    # (Importing from the checkout would write rdist/__pycache__ there: not here.)
    done = run([installed["python"], "-c", "import rdist; print(rdist.__file__); print(rdist.library_path)"],
               timeout=60, cwd=tmp_path, env=clean_env(PYTHONDONTWRITEBYTECODE=1))
    package, library = done.stdout.split()
    assert Path(package) == BINDINGS / "rdist" / "__init__.py", done.stdout
    assert library in map(str, built), library
