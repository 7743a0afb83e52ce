"""host/state: pub/sub topics and the key-value store, without a host."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.state.kvstore import KeyValueStore
from host.state.topics import Topics


class Inbox:
    def __init__(self) -> None:
        self.got: list[tuple[str, str]] = []

    def deliver(self, topic: str, message: str) -> None:
        self.got.append((topic, message))


def test_publish_reaches_current_subscribers_only() -> None:
    t = Topics()
    a, b = Inbox(), Inbox()
    t.subscribe(a, "news")
    t.subscribe(b, "news")
    t.subscribe(b, "other")
    assert t.publish("news", "1") == 2
    t.unsubscribe(a, "news")
    assert t.publish("news", "2") == 1
    assert t.publish("nobody", "x") == 0
    assert a.got == [("news", "1")]
    assert b.got == [("news", "1"), ("news", "2")]


def test_drop_forgets_every_subscription_and_empty_topics() -> None:
    t = Topics()
    a = Inbox()
    t.subscribe(a, "x")
    t.subscribe(a, "y")
    assert t.topic_count() == 2
    t.drop(a)
    assert t.topic_count() == 0
    assert t.publish("x", "m") == 0 and a.got == []


def test_kvstore_persists_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "kv.sqlite3"
    s = KeyValueStore(path)
    s.set("b", "2")
    s.set("a", "1")
    s.set("a", "3")
    s.delete("b")
    s.close()
    s = KeyValueStore(path)
    assert s.get("a") == "3" and s.get("b") is None and s.keys() == ["a"]
    s.close()


def test_kvstore_keeps_one_namespace_per_tenant_with_a_byte_limit(tmp_path: Path) -> None:
    from host.state.kvstore import StoreFull

    s = KeyValueStore(tmp_path / "kv.sqlite3", max_bytes_per_tenant=20)
    s.set("k", "alice's", tenant="alice")
    assert s.get("k", tenant="bob") is None and s.keys(tenant="bob") == []
    s.set("k", "bob's", tenant="bob")
    assert s.get("k", tenant="alice") == "alice's" and s.usage("alice") == 8
    with pytest.raises(StoreFull, match="past its limit of 20 bytes"):
        s.set("big", "x" * 30, tenant="alice")
    assert s.keys(tenant="alice") == ["k"]  # nothing changed
    s.set("k", "y" * 19, tenant="alice")  # replacing counts the new value only: 1 + 19
    s.delete("k", tenant="alice")
    assert s.usage("alice") == 0 and s.get("k", tenant="bob") == "bob's"
    s.close()


def test_kvstore_moves_a_store_from_before_tenants_into_local(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO kv VALUES ('a', '1')")
    db.commit()
    db.close()
    s = KeyValueStore(path)
    assert s.get("a") == "1" and s.get("a", tenant="alice") is None
    s.close()


def test_mailbox_drops_the_oldest_when_full_by_count_or_bytes() -> None:
    from host.state.topics import Mailbox

    m = Mailbox(max_messages=3, max_bytes=20)
    for i in range(5):
        m.put("t", f"m{i}")  # 3 bytes each
    assert len(m) == 3 and m.dropped == 2 and m.bytes == 9
    m.put("t", "x" * 15)  # 16 bytes: the two oldest must go to fit it
    assert [m.get() for _ in range(len(m))] == [("t", "m4"), ("t", "x" * 15)]
    m.put("t", "y" * 30)  # larger than the whole budget: dropped itself
    assert len(m) == 0 and m.dropped == 5 and m.bytes == 0 and m.get() is None
