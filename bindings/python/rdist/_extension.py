"""Builds and loads rdist's compiled c10d backend (``rdist/csrc``) for the
torch in this process.

The backend is compiled against the user's own torch with torch's flags
(its include paths, C++ ABI and pybind11 ABI), once per torch release,
Python and source, and cached in rdist's cache directory
(``$RDIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/rdist``, else
``~/.cache/rdist``): ``torch-backend/<key>/_rdist_c10d.so``. Ranks that
start together build it once (a file lock) and load the same file.
``python -m rdist.torch --build`` builds it ahead (pip install does,
where torch and a compiler are there).

:func:`load` returns the module, or raises :class:`BuildError` saying why
(no compiler, no headers, the compiler's output), in which case
``rdist.torch`` falls back to its pure-Python backend and says so.
"""

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["BuildError", "build_dir", "load"]

MODULE = "_rdist_c10d"
_SOURCES = ("work.cpp", "backend.cpp", "module.cpp")
_HEADERS = ("api.hpp", "backend.hpp")
_here = os.path.dirname(os.path.abspath(__file__))
_loaded = None
_lock = threading.Lock()


class BuildError(RuntimeError):
    """The compiled backend could not be built or loaded here."""


def _csrc():
    return os.path.join(_here, "csrc")


def _rdist_header_dir():
    """Where rdist.h is: bundled in the package, or the checkout's include/."""
    for candidate in (
        os.path.join(_here, "include"),
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_here))), "include"),
    ):
        if os.path.isfile(os.path.join(candidate, "rdist.h")):
            return candidate
    raise BuildError("rdist.h is neither in the package (rdist/include) nor in a source checkout")


def cache_root():
    """rdist's cache directory (as librdist's options::cache_dir)."""
    explicit = os.environ.get("RDIST_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return os.path.join(xdg, "rdist")
    home = os.path.expanduser("~")
    if home and home != "~" and os.path.isdir(home):
        return os.path.join(home, ".cache", "rdist")
    return os.path.join(tempfile.gettempdir(), f"rdist-cache-{os.getuid()}")


def _compiler():
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags(torch):
    from torch.utils import cpp_extension

    flags = [
        "-O2",
        "-fPIC",
        "-std=c++20",
        "-fvisibility=hidden",
        f"-DTORCH_EXTENSION_NAME={MODULE}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]
    abi = getattr(cpp_extension, "_get_pybind11_abi_build_flags", None)
    # torch writes them for a shell (\\"...\\"); no shell runs here.
    flags += [flag.replace('\\"', '"') for flag in (abi() if abi is not None else [])]
    includes = cpp_extension.include_paths() + [
        sysconfig.get_paths()["include"],
        _rdist_header_dir(),
    ]
    return flags + [f"-I{path}" for path in includes]


def _key(torch):
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_csrc(), name), "rb") as f:
            digest.update(f.read())
    with open(os.path.join(_rdist_header_dir(), "rdist.h"), "rb") as f:
        digest.update(f.read())
    # The release (with its local tag, e.g. +cu126) and the C++ ABI say
    # what the module links against; not where torch is, so that a cache
    # built elsewhere for the same torch (a bundle) is used as it is.
    digest.update(torch.__version__.encode())
    digest.update(str(int(torch._C._GLIBCXX_USE_CXX11_ABI)).encode())
    tag = sys.implementation.cache_tag
    return f"torch-{torch.__version__.replace('+', '_')}-{tag}-{digest.hexdigest()[:12]}"


def build_dir(torch=None):
    """The directory the backend for this torch is (or will be) cached in."""
    if torch is None:
        import torch  # noqa: PLC0415 - only when asked
    return os.path.join(cache_root(), "torch-backend", _key(torch))


def _build(torch, target, log):
    compiler = _compiler()
    if compiler is None:
        raise BuildError("no C++ compiler (set CXX, or install g++)")
    from torch.utils import cpp_extension

    flags = _flags(torch)
    work = tempfile.mkdtemp(prefix="build-", dir=os.path.dirname(target))
    try:
        def compile_one(name):
            obj = os.path.join(work, name + ".o")
            cmd = [compiler, *flags, "-c", os.path.join(_csrc(), name), "-o", obj]
            done = subprocess.run(cmd, capture_output=True, text=True)
            return obj, cmd, done

        with ThreadPoolExecutor(max_workers=max(1, min(len(_SOURCES), os.cpu_count() or 1))) as pool:
            results = list(pool.map(compile_one, _SOURCES))
        for _obj, cmd, done in results:
            log.write(" ".join(cmd) + "\n" + done.stdout + done.stderr)
            if done.returncode != 0:
                raise BuildError(
                    f"compiling {os.path.basename(cmd[-3])} failed:\n{done.stderr[-4000:]}"
                )
        libdirs = cpp_extension.library_paths()
        link = [compiler, "-shared", *[obj for obj, _, _ in results], "-o", os.path.join(work, MODULE + ".so")]
        for d in libdirs:
            link += [f"-L{d}", f"-Wl,-rpath,{d}"]
        link += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
        done = subprocess.run(link, capture_output=True, text=True)
        log.write(" ".join(link) + "\n" + done.stdout + done.stderr)
        if done.returncode != 0:
            raise BuildError(f"linking failed:\n{done.stderr[-4000:]}")
        os.replace(os.path.join(work, MODULE + ".so"), target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _import(path):
    loader = importlib.machinery.ExtensionFileLoader(f"rdist.{MODULE}", path)
    spec = importlib.util.spec_from_file_location(f"rdist.{MODULE}", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[f"rdist.{MODULE}"] = module
    return module


def load(build=True):
    """The compiled backend's module for this process's torch, built first
    if need be (``build=False``: only if cached). Raises BuildError."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import torch  # noqa: PLC0415

        directory = build_dir(torch)
        target = os.path.join(directory, MODULE + ".so")
        if not os.path.isfile(target):
            if not build:
                raise BuildError(f"not built for torch {torch.__version__} ({target})")
            os.makedirs(directory, mode=0o700, exist_ok=True)
            with open(os.path.join(directory, "build.lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one rank builds, the others wait
                if not os.path.isfile(target):
                    with open(os.path.join(directory, "build.log"), "w") as log:
                        _build(torch, target, log)
        try:
            _loaded = _import(target)
        except ImportError as error:
            raise BuildError(f"{target} does not load: {error}") from error
        return _loaded
