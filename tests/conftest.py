"""Shared pytest fixtures and markers. Keep this small: what more than one test module uses.

Markers: `slow` = needs the real default model (added automatically to every test that uses
the `backend` fixture), `build` = needs a componentize-py build, `gpu` = needs CUDA.
`make test-fast` runs everything else.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def backend() -> Any:
    """The default model (SmolLM2-135M GGUF) on CPU, float32: loaded once per test session."""
    import torch

    from gpu_backend import load_backend

    return load_backend(device="cpu", dtype=torch.float32, page_size=16, num_pages=2048, progress=False)


@pytest.fixture(scope="module")
def real_host(backend: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Host on the session's real model, one per test module."""
    from host import Host, HostConfig

    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("host-data")), backend=backend)
    yield h
    h.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--workers", default=None, metavar="N",
                     help="run every host's instances in N worker processes (HostConfig.workers, through "
                          "$PIE_WORKERS; N or auto); without it, 0 = in-process. Tests about one mode say so "
                          "and pin it.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "build: needs a componentize-py build of an inferlet (not in make test-fast)")
    workers = config.getoption("--workers")
    # HostConfig's default (host/config.py: "auto" where unset); the suite's own default is in-process
    os.environ["PIE_WORKERS"] = "0" if workers is None else str(workers)
