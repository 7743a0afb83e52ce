"""Launches past --max-instances wait in the launch queue (host/host.py), through the server: the
WebSocket protocol's launch and the OpenAI routes queue the same way; only a full queue is refused
(HTTP 503)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeBackend
from helpers import Run, wait_for, wasm_bytes

from host import Host, HostConfig
from host.server.config import ServerConfig
from host.server.server import Server

pytestmark = pytest.mark.build


def test_openai_requests_past_max_instances_queue_and_a_full_queue_is_503(tmp_path: Path) -> None:
    host = Host(HostConfig(max_instances=1, launch_queue=1, warm_auto=0, data_dir=tmp_path / "h"),
                backend=FakeBackend(page_size=4, num_pages=64))
    server = Server(host, ServerConfig(port=0, data_dir=tmp_path / "s"),
                    openai_program=host.compile(wasm_bytes("openai_upper")), model_name="upper")
    server.start_background()
    try:
        hog = Run(host, host.compile(wasm_bytes("misbehave")), ["hog", "1"])  # takes the only slot
        assert hog.events.get(timeout=60).message == "holding"
        body = {"model": "upper", "prompt": "shout this"}
        first: dict[str, Any] = {}

        def post() -> None:
            r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
            first["status"], first["json"] = r.status_code, r.json()

        waiter = threading.Thread(target=post)
        waiter.start()
        wait_for(lambda: host.stats()["launch_queue"]["queued"] == 1, 30)
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)  # the queue is full
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert "launch queue" in r.json()["error"]["message"]
        time.sleep(0.2)
        assert not first  # still queued
        host.signal(hog.id, "go")
        waiter.join(60)
        assert first["status"] == 200 and first["json"]["choices"][0]["text"] == "SHOUT THIS"
        assert hog.finish(30).event == "completed"
        assert host.stats()["launch_queue"]["queued_total"] == 1
    finally:
        server.stop_background()
        host.shutdown()
