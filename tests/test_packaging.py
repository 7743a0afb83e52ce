"""Packaging: the package list in pyproject.toml matches the tree, and a wheel carries what
pie-build needs (the WIT, the SDK, the standard inferlets), found through importlib.resources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_in_tree() -> set[str]:
    """Package names the tree holds: code packages by their folders, then the three mapped ones."""
    found = set()
    for top, name in (("host", "host"), ("gpu_backend", "gpu_backend"), ("inferlets/inferlet", "inferlet")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([name, *rel.parts]))
    found |= {"host.wit", "host.inferlets"}
    found |= {f"host.inferlets.{app.parent.name}" for app in (ROOT / "inferlets").glob("*/app.py")}
    return found


def test_every_package_is_listed() -> None:
    listed = set(SETUPTOOLS["packages"])
    assert _packages_in_tree() == listed, "update [tool.setuptools] packages in pyproject.toml"
    for package, folder in SETUPTOOLS["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{package} maps to {folder}, which is no package"


def test_installed_package_data_is_found() -> None:
    from host.cli.build import standard_inferlets
    from host.cli.sources import sdk_dir, standard_dir, wit_dir

    assert (wit_dir() / "inferlet.wit").is_file()
    assert (sdk_dir() / "entry.py").is_file()
    assert (standard_dir() / "text_completion" / "app.py").is_file()
    assert "text_completion" in standard_inferlets() and "inferlet" not in standard_inferlets()


def _copy_source(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.wasm")
    for name in ("host", "gpu_backend", "inferlets", "wit"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the source (so the build leaves nothing in the checkout)."""
    pytest.importorskip("setuptools", reason="building a wheel without build isolation needs setuptools")
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    _copy_source(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist)], check=True, capture_output=True, timeout=300)
    return next(dist.glob("pie_python-*.whl"))


@pytest.mark.heavy  # (the wheel is built: ~5 s, installed: ~3 s; make test runs it)
def test_wheel_carries_wit_sdk_and_standard_inferlets(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("host/wit/inferlet.wit", "host/inferlets/text_completion/app.py", "inferlet/__init__.py",
                 "inferlet/testing/__init__.py", "host/cli/run.py", "host/client/protocol.py",
                 "host/server/static/dashboard.html"):
        assert name in names
    assert not any(n.startswith("host/inferlets/inferlet/") for n in names)  # the SDK ships once
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "pie-run = host.cli.run:main" in scripts and "pie-build = host.cli.build:main" in scripts


@pytest.mark.heavy  # (the wheel is built: ~5 s, installed: ~3 s; make test runs it)
def test_wheel_install_finds_its_own_package_data(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", str(wheel), "--no-deps", "-q", "--target", str(target)],
                   check=True, capture_output=True, timeout=300)
    code = ("from host.cli.sources import sdk_dir, standard_dir, wit_dir; import inferlet; "
            "print(wit_dir(), sdk_dir(), standard_dir(), inferlet.__file__, sep='\\n')")
    env = dict(os.environ, PYTHONPATH=str(target))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    for line in res.stdout.split():
        assert Path(line).is_relative_to(target), line
