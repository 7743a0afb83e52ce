"""File arguments: inferlet options whose value pie-run reads from a local file (the sandbox has no files).

An inferlet folder may hold `inferlet.toml` with `file-arguments = ["--schema", ...]`: for each such
option, `pie-run NAME -- --schema FILE` (or `--schema=FILE`) passes the text of FILE as the option's
value; `binary-file-arguments = ["--image"]` passes a file's bytes in base64 (an image). Inferlets
given as a .wasm file have no manifest and get their arguments unchanged.
"""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path

from host.cli.build import _standard

__all__ = ["expand_file_arguments", "file_arguments"]

MANIFEST = "inferlet.toml"


def file_arguments(inferlet: str, key: str = "file-arguments") -> set[str]:
    """The options the inferlet (a source folder or a standard name) declares as file arguments
    (`key` "binary-file-arguments": those passed in base64)."""
    path = Path(inferlet)
    folder = path if path.is_dir() else _standard(inferlet)
    manifest = None if folder is None else folder / MANIFEST
    if manifest is None or not manifest.is_file():
        return set()
    try:
        names = tomllib.loads(manifest.read_text()).get(key, [])
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{manifest}: {e}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) and n.startswith("-") for n in names):
        raise ValueError(f"{manifest}: {key} must be a list of option names, got {names!r}")
    return set(names)


def expand_file_arguments(inferlet: str, args: list[str]) -> list[str]:
    """`args` with each declared file argument's FILE replaced by its text; ValueError naming a bad FILE."""
    names = file_arguments(inferlet)
    binary = file_arguments(inferlet, "binary-file-arguments")
    names |= binary
    if not names:
        return list(args)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        opt, eq, value = arg.partition("=")
        if opt in names and (eq or i + 1 < len(args)):
            if not eq:
                i += 1
                value = args[i]
            out += [opt, _read(opt, value, opt in binary)]
        else:
            out.append(arg)
        i += 1
    return out


def _read(opt: str, file: str, binary: bool = False) -> str:
    try:
        if binary:
            return base64.b64encode(Path(file).read_bytes()).decode()
        return Path(file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{opt} {file}: cannot read the file: {e}") from None
