"""host/api: the imports registered are exactly the functions `wit/inferlet.wit` declares."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fakes import FakeBackend

from host.api import PACKAGE, WIT_VERSION, WIT_VERSIONS, ApiServices, import_tables, version_tables
from host.batching.scheduler import Scheduler
from host.replicas import Replica
from host.state.kvstore import KeyValueStore
from host.state.pages import PageManager
from host.state.topics import Topics

WIT = Path(__file__).resolve().parents[1] / "wit" / "inferlet.wit"
WIT_0_1 = Path(__file__).resolve().parents[1] / "wit" / "v0.1.0" / "inferlet.wit"
WIT_0_2 = Path(__file__).resolve().parents[1] / "wit" / "v0.2.0" / "inferlet.wit"
WIT_0_3 = Path(__file__).resolve().parents[1] / "wit" / "v0.3.0" / "inferlet.wit"
WIT_0_4 = Path(__file__).resolve().parents[1] / "wit" / "v0.4.0" / "inferlet.wit"


def declared(path: Path = WIT) -> dict[str, set[str]]:
    """Interface -> function names, read from the WIT text (independently of the host's code)."""
    text = path.read_text()
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"^interface ([\w-]+) \{(.*?)^\}", text, re.S | re.M):
        body = m.group(2)
        names = set(re.findall(r"^    ([\w-]+): func\(", body, re.M))
        for res in re.finditer(r"^    resource ([\w-]+) \{(.*?)^    \}", body, re.S | re.M):
            for fn, static in re.findall(r"^        ([\w-]+): (static )?func\(", res.group(2), re.M):
                names.add(f"[{'static' if static else 'method'}]{res.group(1)}.{fn}")
        out[m.group(1)] = names
    return out


@pytest.fixture
def services() -> ApiServices:
    fb = FakeBackend()
    return ApiServices(info=fb.info, tokenizer=fb.tokenizer,
                       replicas=[Replica(0, PageManager(fb.info.num_pages), Scheduler())],
                       kvstore=KeyValueStore(None), topics=Topics())


def test_registered_imports_equal_the_wit_declarations(services: ApiServices) -> None:
    wit = declared()
    assert set(wit) == {"runtime", "messaging", "store", "model", "kv", "grammar", "forward", "http", "embed"}
    assert "[static]grammar.from-json-schema" in wit["grammar"] and "[method]matcher.fork" in wit["grammar"]
    assert all(wit.values())  # the parser found functions in every interface
    registered = {iface: set(table) for iface, table in import_tables(services).items()}
    assert registered == wit
    services.replicas[0].scheduler.stop()


def test_every_version_shipped_is_served_with_exactly_its_functions(services: ApiServices) -> None:
    tables = version_tables(services)
    assert set(tables) == set(WIT_VERSIONS) == {"0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"}
    for version, path in (("0.5.0", WIT), ("0.4.0", WIT_0_4), ("0.3.0", WIT_0_3), ("0.2.0", WIT_0_2),
                          ("0.1.0", WIT_0_1)):
        head = re.search(r"^package [\w:-]+@([\d.]+);", path.read_text(), re.M)
        assert head is not None and head.group(1) == version
        assert {iface: set(t) for iface, t in tables[version].items()} == declared(path), version
    assert {"set-priority", "priority"} <= set(tables["0.4.0"]["runtime"])
    assert not {"set-priority", "priority"} & set(tables["0.3.0"]["runtime"])
    assert {"launch", "child-wait", "parent"} <= set(tables["0.5.0"]["runtime"]) and "http" in tables["0.5.0"]
    assert not {"launch", "child-wait", "parent"} & set(tables["0.4.0"]["runtime"]) and "http" not in tables["0.4.0"]
    services.replicas[0].scheduler.stop()


def test_wit_package_and_version_match_the_linker() -> None:
    head = re.search(r"^package ([\w:-]+)@([\d.]+);", WIT.read_text(), re.M)
    assert head is not None and (head.group(1), head.group(2)) == (PACKAGE, WIT_VERSION)
