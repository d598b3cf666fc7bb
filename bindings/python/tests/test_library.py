"""The binding against include/rdist.h (every function declared, every enum
value equal), and how the library is found: RDIST_LIBRARY, next to the
package, the source checkout, the system."""

import ctypes
import ctypes.util
import re
import shutil
import subprocess
import sys

import pytest

import rdist
from rdist import _library
from jobs import REPO, child_env

HEADER = (REPO / "include" / "rdist.h").read_text()


def header_functions():
    """name -> number of parameters, for every function the header declares."""
    found = {}
    for match in re.finditer(r"^[a-z_ ]+?\**\s*\b(rdist_\w+)\(([^)]*)\);", HEADER, re.M | re.S):
        params = match.group(2).strip()
        found[match.group(1)] = 0 if params in ("", "void") else params.count(",") + 1
    return found


def header_enum(prefix):
    return {name: int(value) for name, value in re.findall(rf"\b({prefix}\w+) = (\d+)", HEADER)}


def test_every_header_function_is_declared_with_its_arity():
    functions = header_functions()
    assert len(functions) >= 40, sorted(functions)
    # The 0.2 functions are declared before the header has them (see
    # test_header_has_the_0_2_functions); everything else matches exactly.
    assert set(functions) - _library.OPTIONAL == set(_library.SIGNATURES) - _library.OPTIONAL
    assert set(functions) <= set(_library.SIGNATURES)
    for name, arity in functions.items():
        function = getattr(rdist._lib, name)
        assert function.argtypes is not None and len(function.argtypes) == arity, name


def test_enums_and_constants_equal_the_header():
    results = header_enum("RDIST_SUCCESS|RDIST_ERR_")
    assert {f"RDIST_{'ERR_' if r else ''}{r.name}": int(r) for r in rdist.Result} == results
    # The 0.2 members may be missing from a 0.1 header (test_header_has_the_0_2_enums).
    new = {"BOOL", "INT16", "UINT16", "BAND", "BOR", "BXOR"}
    assert {f"RDIST_{d.name}": int(d) for d in rdist.DType if d.name not in new} == {
        k: v for k, v in header_enum("RDIST_").items()
        if k[6:] in rdist.DType.__members__ and k[6:] not in new
    }
    assert {f"RDIST_{o.name}": int(o) for o in rdist.Op if o.name not in new} == {
        k: v for k, v in header_enum("RDIST_").items()
        if k[6:] in rdist.Op.__members__ and k[6:] not in new
    }
    found = header_enum("RDIST_")
    for member in list(rdist.DType) + list(rdist.Op):
        name = f"RDIST_{member.name}"
        if name in found:
            assert found[name] == int(member), name
    assert {f"RDIST_BACKEND_{b.name}": int(b) for b in rdist.Backend} == header_enum("RDIST_BACKEND_")
    assert f"#define RDIST_UNIQUE_ID_BYTES {_library.UNIQUE_ID_BYTES}" in HEADER
    assert f"#define RDIST_SPLIT_NOCOLOR {rdist.SPLIT_NOCOLOR}" in HEADER
    version = tuple(int(re.search(rf"#define RDIST_VERSION_{part} (\d+)", HEADER).group(1))
                    for part in ("MAJOR", "MINOR", "PATCH"))
    assert rdist.library_version() == version


@pytest.mark.needs_0_2
def test_header_has_the_0_2_functions_and_enums():
    functions = header_functions()
    assert _library.OPTIONAL <= set(functions)
    for name in _library.OPTIONAL:
        assert len(getattr(rdist._lib, name).argtypes) == functions[name], name
    found = header_enum("RDIST_")
    for member in (rdist.DType.BOOL, rdist.DType.INT16, rdist.DType.UINT16,
                   rdist.Op.BAND, rdist.Op.BOR, rdist.Op.BXOR):
        assert found[f"RDIST_{member.name}"] == int(member)


def test_every_result_code_has_its_own_exception_class():
    for result in rdist.Result:
        if result == rdist.Result.SUCCESS:
            continue
        error = rdist._errors.error_for(int(result), "")
        assert isinstance(error, rdist.Error) and error.code is result
        assert type(error) is not rdist.Error
        assert str(error) == result.description  # no detail: the library's short text
    assert issubclass(rdist.CommTimeoutError, TimeoutError)
    assert issubclass(rdist.InvalidArgumentError, ValueError)


def import_rdist(env, cwd, code="import rdist; print(rdist.library_path)"):
    """Imports rdist in a fresh interpreter; returns the completed process."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=30,
    )


@pytest.fixture
def package_copy(tmp_path):
    """A copy of the package outside the checkout, so that only the places
    a test arranges can supply the library."""
    shutil.copytree(REPO / "bindings" / "python" / "rdist", tmp_path / "rdist",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_rdist_library_pointing_at_a_bad_path_is_a_clear_import_error(tmp_path):
    missing = tmp_path / "nowhere" / "librdist.so"
    done = import_rdist(child_env(RDIST_LIBRARY=missing), tmp_path)
    assert done.returncode != 0
    assert "ImportError" in done.stderr or "LibraryNotFoundError" in done.stderr, done.stderr
    assert f"RDIST_LIBRARY={str(missing)!r}" in done.stderr, done.stderr
    # Not a library at all: also refused, never replaced by another copy.
    not_a_library = tmp_path / "librdist.so"
    not_a_library.write_text("not ELF")
    done = import_rdist(child_env(RDIST_LIBRARY=not_a_library), tmp_path)
    assert done.returncode != 0 and "RDIST_LIBRARY" in done.stderr, done.stderr


def test_rdist_library_wins(package_copy):
    done = import_rdist(child_env(RDIST_LIBRARY=rdist.library_path), package_copy)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == rdist.library_path


def test_a_checkout_finds_its_own_target_directory(tmp_path):
    done = import_rdist(child_env(RDIST_LIBRARY=None), tmp_path)
    assert done.returncode == 0, done.stderr
    found = done.stdout.strip()
    assert found in (str(REPO / "target" / p / "librdist.so") for p in ("release", "debug")), found


@pytest.mark.parametrize("where", ["lib/librdist.so", "librdist.so"])
def test_a_library_next_to_the_package_is_found_first(package_copy, where):
    bundled = package_copy / "rdist" / where
    bundled.parent.mkdir(exist_ok=True)
    bundled.symlink_to(rdist.library_path)
    done = import_rdist(child_env(RDIST_LIBRARY=None, PYTHONPATH=None), package_copy)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(bundled)


def test_the_system_loader_path_is_searched_last(package_copy):
    library_dir = package_copy / "system-lib"
    library_dir.mkdir()
    (library_dir / "librdist.so").symlink_to(rdist.library_path)
    env = child_env(RDIST_LIBRARY=None, PYTHONPATH=None, LD_LIBRARY_PATH=library_dir)
    done = import_rdist(env, package_copy, "import rdist; print(rdist.library_version())")
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(ctypes.util.find_library("rdist") is not None, reason="librdist is installed system-wide")
def test_nothing_found_lists_every_place_looked(package_copy):
    env = child_env(RDIST_LIBRARY=None, PYTHONPATH=None, LD_LIBRARY_PATH=None)
    done = import_rdist(env, package_copy)
    assert done.returncode != 0
    message = done.stderr
    assert "cannot find the rdist shared library" in message, message
    for place in ("RDIST_LIBRARY: not set", "rdist/lib/librdist.so", "rdist/librdist.so",
                  "librdist.so.0", "cargo build"):
        assert place in message, message
    # An installed package (no checkout around it) is told how to get a library.
    assert "has no bundled library" in message and "pip install --force-reinstall" in message, message


def test_library_path_is_loadable():
    assert ctypes.CDLL(rdist.library_path).rdist_version() == rdist._lib.rdist_version()


def operation_calls(source):
    """The librdist operation functions (collectives, sends, receives) a
    module's source names, and whether it looks at the caller's frames."""
    from rdist import _issue

    ops = "|".join(sorted(_issue._BASES, key=len, reverse=True))
    named = set(re.findall(rf"\b_?lib\.(rdist_i?(?:{ops}))\b", source))
    return named, "_getframe" in source or "inspect.stack" in source


def test_every_call_takes_the_one_call_path():
    # rdist.Comm, the default group and rdist.torch issue every operation
    # through rdist._issue; none decides blocking or not from stack frames.
    package = REPO / "bindings" / "python" / "rdist"
    offenders = {}
    for path in sorted(package.glob("*.py")):
        if path.name in ("_issue.py", "_library.py"):
            continue
        named, frames = operation_calls(path.read_text())
        if named or frames:
            offenders[path.name] = (sorted(named), frames)
    assert not offenders, offenders
    # The check itself finds a direct call and a frame inspection.
    assert operation_calls("lib.rdist_iallreduce(a, b)")[0] == {"rdist_iallreduce"}
    assert operation_calls("sys._getframe(3)")[1]
