"""rdist's PEP 517 build backend (pyproject.toml: build-backend, backend-path).

``pip install ./bindings/python`` (or ``pip wheel``, ``python -m build
--wheel``) builds librdist and the rdistrun launcher with cargo from the
repository this directory belongs to, and writes a wheel holding

    rdist/*.py                         the ctypes binding
    rdist/lib/librdist.so              the library, stripped (found first at import)
    rdist-<v>.data/scripts/rdistrun    the launcher, installed on PATH (bin/)
    rdist-<v>.data/scripts/rdist-trace the trace merger (stragglers), on PATH

so the installed package needs no environment variable and no checkout.
Nothing is written into the source tree: cargo builds in a temporary
directory (removed afterwards) unless told otherwise, and the wheel is
written with zipfile (standard library only; no setuptools, no build/ or
*.egg-info).

Settings, as environment variables or ``pip install -C key=value``
(``--config-settings``; the setting wins):

    RDIST_CARGO_TARGET_DIR / cargo-target-dir
        cargo's target directory (an absolute path), kept between builds,
        e.g. the checkout's target/, to reuse a build instead of compiling
        from scratch
    RDIST_CARGO_PROFILE / cargo-profile
        the cargo profile: release (default), or dev/debug (tests)

``pip install -e ./bindings/python`` (editable) builds nothing: it puts this
directory on sys.path, and the package finds librdist in the checkout's
target/ (run ``cargo build``), as it does when run from the source tree.
"""

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path


def _forget_own_bytecode():
    """Importing this module wrote __pycache__/ next to it: take it back,
    so that building leaves the source tree exactly as it was."""
    cached = globals().get("__cached__")
    if not cached or not os.path.isfile(cached):
        return
    try:
        os.remove(cached)
        os.rmdir(os.path.dirname(cached))  # only if nothing else is there
    except OSError:
        pass


_forget_own_bytecode()

HERE = Path(__file__).resolve().parent  # bindings/python
REPO = HERE.parent.parent  # the rdist repository (Cargo.toml)
PACKAGE = "rdist"

__all__ = [
    "build_editable",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]


# ---- metadata: pyproject.toml's [project] table -------------------------------------


def _read_toml(path):
    text = path.read_text(encoding="utf-8")
    try:
        import tomllib  # Python >= 3.11
    except ImportError:
        return _parse_simple_toml(text)
    return tomllib.loads(text)


def _parse_simple_toml(text):
    """The part of TOML pyproject.toml uses, for Pythons without tomllib:
    [tables], key = "string" | [array of strings, possibly multi-line] |
    { key = "string" }, and # comments."""
    doc = table = {}
    pending = None  # (key, text so far) of a multi-line array
    for raw in text.splitlines():
        line = raw.strip()
        if pending:
            pending = (pending[0], pending[1] + " " + line)
            if not line.endswith("]"):
                continue
            key, value = pending
            pending = None
            table[key] = _simple_value(value)
            continue
        if not line or line.startswith("#"):
            continue
        header = re.fullmatch(r'\[([A-Za-z0-9_."-]+)\]', line)
        if header:
            table = doc
            for quoted, bare in re.findall(r'"([^"]*)"|([^."]+)', header.group(1)):
                table = table.setdefault(quoted or bare, {})
            continue
        key, _, value = (s.strip() for s in line.partition("="))
        key = key.strip('"')
        if value.startswith("[") and not value.rstrip().endswith("]"):
            pending = (key, value)
            continue
        table[key] = _simple_value(value)
    return doc


def _simple_value(value):
    value = value.strip()
    if value.startswith("["):
        return re.findall(r'"((?:[^"\\]|\\.)*)"', value)
    if value.startswith("{"):
        return dict(re.findall(r'([A-Za-z0-9_-]+)\s*=\s*"((?:[^"\\]|\\.)*)"', value))
    if value.startswith('"'):
        return re.match(r'"((?:[^"\\]|\\.)*)"', value).group(1)
    if value in ("true", "false"):
        return value == "true"
    return value


def _project():
    return _read_toml(HERE / "pyproject.toml")["project"]


def _dist_info_name(project):
    return f"{project['name']}-{project['version']}.dist-info"


def _metadata(project):
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project.get('description', '')}",
    ]
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    license_ = project.get("license")
    if isinstance(license_, dict) and "text" in license_:
        lines.append(f"License: {license_['text']}")
    lines += [f"Classifier: {c}" for c in project.get("classifiers", [])]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]
    readme = project.get("readme")
    body = ""
    if isinstance(readme, str) and (HERE / readme).is_file():
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + (HERE / readme).read_text(encoding="utf-8")
    return "\n".join(lines) + "\n" + body


def _entry_points(project):
    """entry_points.txt, or None when the project declares none."""
    groups = project.get("entry-points", {})
    if not groups:
        return None
    text = ""
    for group, entries in groups.items():
        text += f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
    return text


def _wheel_file(tag):
    return (
        "Wheel-Version: 1.0\n"
        "Generator: rdist _rdist_build\n"
        f"Root-Is-Purelib: {'true' if tag.endswith('-any') else 'false'}\n"
        f"Tag: {tag}\n"
    )


def _platform_tag():
    return re.sub(r"[^A-Za-z0-9_]", "_", sysconfig.get_platform())


def _write_metadata_dir(metadata_directory, tag):
    project = _project()
    dist_info = Path(metadata_directory) / _dist_info_name(project)
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(_metadata(project), encoding="utf-8")
    (dist_info / "WHEEL").write_text(_wheel_file(tag), encoding="utf-8")
    if _entry_points(project):
        (dist_info / "entry_points.txt").write_text(_entry_points(project), encoding="utf-8")
    return dist_info.name


# ---- the wheel ----------------------------------------------------------------------------


class _Wheel:
    """A wheel written entry by entry, RECORD last."""

    def __init__(self, directory, project, tag):
        self.name = f"{project['name']}-{project['version']}-{tag}.whl"
        self.path = Path(directory) / self.name
        self.zip = zipfile.ZipFile(self.path, "w", compression=zipfile.ZIP_DEFLATED)
        self.records = []
        # Reproducible: SOURCE_DATE_EPOCH if set, else 1980-01-01.
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
        self.date_time = time.gmtime(max(epoch, 315532800))[:6]

    def add(self, arcname, data, executable=False):
        info = zipfile.ZipInfo(arcname, self.date_time)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = ((0o755 if executable else 0o644) | 0o100000) << 16
        self.zip.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        self.records.append(f"{arcname},sha256={digest},{len(data)}")

    def close(self, dist_info):
        record = f"{dist_info}/RECORD"
        text = "\n".join(self.records + [f"{record},,"]) + "\n"
        info = zipfile.ZipInfo(record, self.date_time)
        info.external_attr = (0o644 | 0o100000) << 16
        self.zip.writestr(info, text)
        self.zip.close()
        return self.name


def _setting(config_settings, key, env):
    value = (config_settings or {}).get(key)
    return value if value else os.environ.get(env) or None


def _say(message):
    print(f"rdist build: {message}", file=sys.stderr, flush=True)


def _find_cargo():
    for candidate in (os.environ.get("CARGO"), shutil.which("cargo"),
                      str(Path.home() / ".cargo" / "bin" / "cargo")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        "rdist build: cargo not found. The wheel bundles librdist, built from the rdist "
        "repository with cargo: install Rust (https://rustup.rs), or set CARGO to cargo's path."
    )


def _cargo_build(config_settings):
    """Builds librdist and rdistrun; returns (librdist.so, rdistrun, temporary
    target directory to remove or None)."""
    manifest = REPO / "Cargo.toml"
    if not manifest.is_file() or 'name = "rdist"' not in manifest.read_text(encoding="utf-8"):
        raise RuntimeError(
            f"rdist build: {REPO} is not the rdist repository (no rdist Cargo.toml). The wheel "
            "is built from bindings/python inside an rdist checkout, in place: use "
            "`pip install /path/to/rdist/bindings/python` with pip >= 21.3."
        )
    cargo = _find_cargo()
    profile = _setting(config_settings, "cargo-profile", "RDIST_CARGO_PROFILE") or "release"
    profile = "dev" if profile == "debug" else profile
    out_name = {"dev": "debug", "test": "debug", "bench": "release"}.get(profile, profile)
    target = _setting(config_settings, "cargo-target-dir", "RDIST_CARGO_TARGET_DIR")
    temporary = None
    if target is None:
        temporary = tempfile.mkdtemp(prefix="rdist-wheel-cargo-")
        target = temporary
    elif not os.path.isabs(target):
        # pip runs this hook in bindings/python, not where the user stood.
        raise RuntimeError(f"rdist build: RDIST_CARGO_TARGET_DIR / cargo-target-dir must be an "
                           f"absolute path, not {target!r}")
    command = [cargo, "build", "--locked", "--profile", profile, "--manifest-path", str(manifest),
               "--target-dir", target, "--lib", "--bin", "rdistrun", "--bin", "rdist-trace"]
    _say(" ".join(command))
    try:
        # cargo's progress goes to stderr; keep stdout (the hook's) clean.
        subprocess.run(command, cwd=str(REPO), check=True, stdout=sys.stderr)
    except BaseException:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    out = Path(target) / out_name
    return out / "librdist.so", out / "rdistrun", temporary


def _stripped(path, scratch):
    """The bytes of `path` with debug info and symbol table removed (the
    dynamic symbols stay); unstripped, with a warning, without strip."""
    strip = os.environ.get("STRIP") or shutil.which("strip")
    if strip:
        copy = Path(scratch) / (path.name + ".stripped")
        done = subprocess.run([strip, "--strip-unneeded", "-o", str(copy), str(path)],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return copy.read_bytes()
        _say(f"warning: {strip} failed on {path} ({done.stderr.strip()}); bundling it unstripped")
    else:
        _say(f"warning: no strip found; bundling {path} unstripped")
    return path.read_bytes()


def _add_package_sources(wheel):
    source = HERE / PACKAGE
    for path in sorted(source.rglob("*")):
        if "__pycache__" in path.parts or path.suffix not in (".py", ".cpp", ".hpp"):
            continue
        wheel.add(path.relative_to(HERE).as_posix(), path.read_bytes())
    # The compiled torch backend (rdist/csrc) is built on the user's machine
    # against their torch, and includes the C API's header.
    wheel.add(f"{PACKAGE}/include/rdist.h", (HERE.parent.parent / "include" / "rdist.h").read_bytes())


# ---- the PEP 517 / 660 hooks --------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _write_metadata_dir(metadata_directory, f"py3-none-{_platform_tag()}")


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _write_metadata_dir(metadata_directory, "py3-none-any")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    dist_info = _dist_info_name(project)
    tag = f"py3-none-{_platform_tag()}"
    library, launcher, temporary = _cargo_build(config_settings)
    scratch = tempfile.mkdtemp(prefix="rdist-wheel-")
    try:
        wheel = _Wheel(wheel_directory, project, tag)
        _add_package_sources(wheel)
        wheel.add(f"{PACKAGE}/lib/librdist.so", _stripped(library, scratch), executable=True)
        data = f"{project['name']}-{project['version']}.data"
        wheel.add(f"{data}/scripts/rdistrun", _stripped(launcher, scratch), executable=True)
        wheel.add(f"{data}/scripts/rdist-trace",
                  _stripped(launcher.with_name("rdist-trace"), scratch), executable=True)
        wheel.add(f"{dist_info}/METADATA", _metadata(project).encode())
        wheel.add(f"{dist_info}/WHEEL", _wheel_file(tag).encode())
        if _entry_points(project):
            wheel.add(f"{dist_info}/entry_points.txt", _entry_points(project).encode())
        name = wheel.close(dist_info)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    _say(f"wrote {name}")
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    dist_info = _dist_info_name(project)
    tag = "py3-none-any"
    wheel = _Wheel(wheel_directory, project, tag)
    # This directory on sys.path: `import rdist` runs the checkout's package,
    # which finds librdist in the checkout's target/ (cargo build).
    wheel.add(f"_{PACKAGE}_editable.pth", (str(HERE) + "\n").encode())
    wheel.add(f"{dist_info}/METADATA", _metadata(project).encode())
    wheel.add(f"{dist_info}/WHEEL", _wheel_file(tag).encode())
    if _entry_points(project):
        wheel.add(f"{dist_info}/entry_points.txt", _entry_points(project).encode())
    return wheel.close(dist_info)
