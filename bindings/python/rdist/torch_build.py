"""Builds rdist's compiled torch backend for this Python's torch ahead of
first use (``init_process_group("rdist")`` builds it otherwise, about a
minute on two cores, once per torch release):

    python -m rdist.torch_build          # prints where it was cached

Exits 1, saying why, when it cannot be built here (no compiler, no torch);
``rdist.torch`` then falls back to its pure-Python backend.
"""

import sys
import time


def main():
    try:
        import torch
    except ImportError:
        print("rdist.torch_build: torch is not installed in this Python", file=sys.stderr)
        return 1
    from . import _extension

    started = time.monotonic()
    try:
        module = _extension.load()
    except _extension.BuildError as error:
        print(f"rdist.torch_build: cannot build for torch {torch.__version__}: {error}", file=sys.stderr)
        return 1
    print(f"rdist.torch_build: torch {torch.__version__}: {module.__file__} "
          f"({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
