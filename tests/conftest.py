"""Shared pytest fixtures and markers. Keep this small: what more than one test module uses.

Markers: `slow` = needs the real default model (added automatically to every test that uses
the `backend` fixture), `build` = needs a componentize-py build, `gpu` = needs CUDA, `heavy` =
needs none of those but takes seconds (engine or worker processes started, a wheel built and
installed, a bench script run, full collections, deliberately slow steps). `make test-fast` runs
everything else; `make test` runs them all.

PIE_TEST_TUNE_GC=0 (`make test-fast` sets it): a HostConfig made without `tune_gc` gets False
(`_host_gc_tuning`). A tuned host collects fully when it starts and when its warm pool refills,
and each collection scans the whole test process (~600k objects: torch, transformers, the test
modules; ~0.3 s of CPU each, ~130 a run); in a server they are the start-up objects it freezes
once. tests/test_host_gc.py keeps the default; `make test` runs everything with it.
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


@pytest.fixture(scope="session", autouse=True)
def _host_gc_tuning() -> Iterator[None]:
    """Where PIE_TEST_TUNE_GC=0 (read at each HostConfig made), `tune_gc` defaults to False."""
    from host import HostConfig

    init = HostConfig.__init__

    def maybe_untuned(self: HostConfig, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("PIE_TEST_TUNE_GC") == "0":
            kwargs.setdefault("tune_gc", False)
        init(self, *args, **kwargs)

    HostConfig.__init__ = maybe_untuned  # type: ignore[method-assign]
    yield
    HostConfig.__init__ = init  # type: ignore[method-assign]


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
    config.addinivalue_line("markers", "heavy: takes seconds, needs neither the model nor a build "
                                       "(not in make test-fast; make test runs it)")
    config.addinivalue_line("markers", "build: needs a componentize-py build of an inferlet (not in make test-fast)")
    workers = config.getoption("--workers")
    # HostConfig's default (host/config.py: "auto" where unset); the suite's own default is in-process
    os.environ["PIE_WORKERS"] = "0" if workers is None else str(workers)
