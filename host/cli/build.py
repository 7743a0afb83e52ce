"""`pie-build`: build a Python inferlet into a WebAssembly component with componentize-py.

The user's module (`app.py` in a source folder, or a single .py file) is staged together with
the `inferlet` SDK and a small entry module that exports `WitWorld` (see sources.py). Builds are
cached under `default_cache_dir()/builds` (`$PIE_CACHE_DIR`, default `~/.cache/pie-python`), keyed
by a hash of the WIT, the SDK, the sources and the componentize-py version, so rebuilding unchanged
source is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from host.cli.sources import (
    ENTRY_MODULE,
    WORLD,
    BuildError,
    build_key,
    entry_source,
    sdk_files,
    source_files,
    standard_dir,
    wit_dir,
    wit_files,
)
from host.config import default_cache_dir

__all__ = ["BuildError", "build_inferlet", "resolve_inferlet", "standard_inferlets", "main"]

log = logging.getLogger(__name__)


def _run_with_progress(
    cmd: list[str], env: dict[str, str], label: str, quiet: bool
) -> subprocess.CompletedProcess[str]:
    """Run componentize-py, showing a live elapsed-time line unless quiet."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout or []), daemon=True)
    reader.start()
    if not quiet:
        log.info("%s: running componentize-py (about 10 s)", label)
    if quiet or not sys.stderr.isatty():
        proc.wait()
    else:
        from tqdm import tqdm

        with tqdm(desc=label, bar_format="{desc}: {elapsed} elapsed", file=sys.stderr, leave=False) as bar:
            while proc.poll() is None:
                time.sleep(0.1)  # progress display refresh, not synchronisation
                bar.refresh()
    reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out), "")


def build_inferlet(src: Path, out: Path | None = None, quiet: bool = False) -> Path:
    """Build the inferlet at `src` (folder with app.py, or a .py file); returns the .wasm path.

    The result is cached; with `out` it is also copied there and `out` is returned.
    Raises BuildError with componentize-py's output when the build fails.
    """
    src = Path(src).resolve()
    if not src.exists():
        raise BuildError(f"{src}: no such file or folder")
    user = source_files(src)
    entry = entry_source(user)
    key = build_key(wit_files() + sdk_files() + user, entry)
    cached = default_cache_dir() / "builds" / f"{key}.wasm"
    failed = cached.with_suffix(".error")  # a failed build is cached too: same source, same error
    if cached.is_file():
        log.info("pie-build: %s is cached at %s", src, cached)
    elif failed.is_file():
        raise BuildError(failed.read_text())
    else:
        try:
            _componentize(src, user, entry, cached, quiet)
        except BuildError as e:
            failed.write_text(str(e))
            raise
    if out is None:
        return cached
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, out)
    return out


def _componentize(src: Path, user: list[tuple[str, Path]], entry: str, dest: Path, quiet: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    exe = shutil.which("componentize-py", path=os.path.dirname(sys.executable)) or shutil.which(
        "componentize-py"
    )
    if exe is None:
        raise BuildError("componentize-py not found: pip install componentize-py==0.25.1")
    with tempfile.TemporaryDirectory(prefix="pie-build-") as tmp:
        stage = Path(tmp) / "app"
        for name, path in sdk_files() + user:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, stage / name)
        (stage / f"{ENTRY_MODULE}.py").write_text(entry)
        part = Path(tmp) / "out.wasm"
        cmd = [exe, "-d", str(wit_dir()), "-w", WORLD, "componentize", "-p", str(stage), ENTRY_MODULE,
               "-o", str(part)]
        # Without VIRTUAL_ENV, componentize-py does not add the host venv's site-packages to the guest.
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        start = time.monotonic()
        res = _run_with_progress(cmd, env, f"pie-build {src.name}", quiet)
        if res.returncode != 0 or not part.is_file():
            raise BuildError(
                f"building {src} failed (componentize-py exit {res.returncode}):\n{_guest_error(res.stdout)}"
            )
        os.replace(part, dest) if part.stat().st_dev == dest.parent.stat().st_dev else shutil.move(part, dest)
        log.info("pie-build: built %s in %.1f s (%.1f MB)", src, time.monotonic() - start,
                 dest.stat().st_size / 1e6)


def _guest_error(output: str) -> str:
    """The useful part of componentize-py's output: the guest's Python traceback if there is one.

    componentize-py imports the app while building; an exception there (a syntax error, a
    failing import) is reported as `AssertionError: <traceback>` followed by a Rust backtrace.
    """
    marker = "AssertionError: "
    if marker in output:
        text = output.split(marker, 1)[1]
        for end in ("\n\nCaused by:", "\nStack backtrace:"):
            text = text.split(end, 1)[0]
        return text.strip()
    return output.strip()


def standard_inferlets() -> list[str]:
    """Names of the standard inferlets (folders in inferlets/ with an app.py)."""
    return sorted(p.parent.name for p in standard_dir().glob("*/app.py"))


def _standard(name: str | Path) -> Path | None:
    """The source folder of standard inferlet `name`, or None if there is none by that name."""
    text = str(name)
    if "/" in text or not text:
        return None
    folder = standard_dir() / text
    return folder if (folder / "app.py").is_file() else None


def resolve_inferlet(name_or_path: str | Path, quiet: bool = False) -> Path:
    """A .wasm path for a .wasm file, an inferlet source folder or .py file, or a standard name."""
    path = Path(name_or_path)
    if path.suffix == ".wasm":
        if not path.is_file():
            raise BuildError(f"{path}: no such component")
        return path
    if path.exists():
        return build_inferlet(path, quiet=quiet)
    std = _standard(name_or_path)
    if std is not None:
        return build_inferlet(std, quiet=quiet)
    raise BuildError(
        f"{name_or_path!r} is not a .wasm file, an inferlet folder or a standard inferlet "
        f"(standard: {', '.join(standard_inferlets()) or 'none'})"
    )


def main(argv: list[str] | None = None) -> int:
    """`pie-build SRC [-o OUT.wasm] [-q]`."""
    p = argparse.ArgumentParser(prog="pie-build", description="Build a Python inferlet into a .wasm component.")
    p.add_argument("src", help="inferlet folder with app.py, a .py file, or a standard inferlet name")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="where to write the .wasm (default: print the cached path)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    try:
        src, standard = Path(a.src), standard_dir() / a.src
        if not src.exists() and (standard / "app.py").is_file():
            src = standard
        out = build_inferlet(src, a.output, quiet=a.quiet)
    except BuildError as e:
        print(f"pie-build: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
