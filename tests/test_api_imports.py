"""host/api: the imports registered are exactly the functions `wit/inferlet.wit` declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import FakeBackend

from host.api import PACKAGE, WIT_VERSION, ApiServices, import_tables
from host.batching.scheduler import Scheduler
from host.state.kvstore import KeyValueStore
from host.state.pages import PageManager
from host.state.topics import Topics

WIT = Path(__file__).resolve().parents[1] / "wit" / "inferlet.wit"


def declared() -> dict[str, set[str]]:
    """Interface -> function names, read from the WIT text (independently of the host's code)."""
    text = WIT.read_text()
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^interface ([\w-]+) \{(.*?)^\}", text, re.S | re.M):
        out[m.group(1)] = set(re.findall(r"^\s*([\w-]+): func\(", m.group(2), re.M))
    return out


@pytest.fixture
def services() -> ApiServices:
    fb = FakeBackend()
    return ApiServices(info=fb.info, tokenizer=fb.tokenizer, pages=PageManager(fb.info.num_pages),
                       scheduler=Scheduler(), kvstore=KeyValueStore(None), topics=Topics())


def test_registered_imports_equal_the_wit_declarations(services: ApiServices) -> None:
    wit = declared()
    assert set(wit) == {"runtime", "messaging", "store", "model", "kv", "forward"}
    assert all(wit.values())  # the parser found functions in every interface
    registered = {iface: set(table) for iface, table in import_tables(services).items()}
    assert registered == wit
    services.scheduler.stop()


def test_wit_package_and_version_match_the_linker() -> None:
    head = re.search(r"^package ([\w:-]+)@([\d.]+);", WIT.read_text(), re.M)
    assert head is not None and (head.group(1), head.group(2)) == (PACKAGE, WIT_VERSION)
