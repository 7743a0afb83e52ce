"""WIT 0.5.0 end to end: an inferlet's outbound HTTP (allowlist, SSRF rules, bounds, counters) and
child inferlets (messages both ways, results, depth, count, parent's end), on a host with the
stand-in backend (and in worker processes with `pytest --workers N`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeBackend
from helpers import Run, run_to_end, wait_for, wasm_bytes

from host import Host, HostConfig
from host.children import ChildLimits
from host.net.limits import HttpLimits

pytestmark = pytest.mark.build


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        _Handler.seen.append({"path": self.path, "host": self.headers.get("host"),
                              "x-test": self.headers.get("x-test")})
        path = self.path
        if path == "/hello":
            self._reply(200, b"hi there", {"X-Reply": "yes"})
        elif path == "/missing":
            self._reply(404, b"nope")
        elif path == "/big":
            self._reply(200, b"x" * 300_000)
        elif path == "/slow":
            time.sleep(3)
            self._reply(200, b"late")
        elif path.startswith("/redirect?to="):
            self._reply(302, b"", {"Location": path.split("=", 1)[1]})
        else:
            self._reply(200, f"path {path}".encode())

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n)
        self._reply(201, b"got " + body)


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()


def _host(tmp: Path, allow: tuple[str, ...], **kw: Any) -> Host:
    return Host(HostConfig(data_dir=tmp, http_allow=allow, **kw), backend=FakeBackend(page_size=4, num_pages=64))


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, server: int) -> Iterator[Host]:
    # the server's own port on loopback is listed by address; `*` lets names reach public addresses only
    h = _host(tmp_path_factory.mktemp("outbound"), (f"127.0.0.1:{server}", "*"),
              http_limits=HttpLimits(max_response_bytes=100_000, timeout_s=1.0),
              child_limits=ChildLimits(max_depth=3, per_parent=4))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def prog(host: Host) -> str:
    return host.compile(wasm_bytes("outbound"))


def _fetch(host: Host, prog: str, *args: str) -> dict[str, Any]:
    end = run_to_end(host, prog, ["fetch", *args])
    assert end.event == "completed", end
    return json.loads(end.message)


def test_fetch_get_and_post_to_an_allowed_address(host: Host, prog: str, server: int) -> None:
    got = _fetch(host, prog, f"http://127.0.0.1:{server}/hello")
    assert got["status"] == 200 and got["body"] == "hi there" and got["headers"]["x-reply"] == "yes"
    assert _Handler.seen[-1] == {"path": "/hello", "host": f"127.0.0.1:{server}", "x-test": "1"}
    assert _fetch(host, prog, f"http://127.0.0.1:{server}/missing")["status"] == 404  # a response, not an error
    posted = _fetch(host, prog, f"http://127.0.0.1:{server}/echo", "POST", "payload")
    assert posted == {"status": 201, "body": "got payload", "headers": posted["headers"]}
    stats = host.stats()["http"]
    assert stats["requests"]["ok"] >= 3 and stats["bytes_received"] >= len("hi there")


@pytest.fixture(scope="module")
def open_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """A host whose operator allows every name (`*`) and lists no address."""
    h = _host(tmp_path_factory.mktemp("open"), ("*",))
    yield h
    h.shutdown()


@pytest.mark.parametrize("url", [
    "http://localhost:{port}/hello",  # a name resolving to loopback: `*` reaches public addresses only
    "http://2130706433:{port}/hello",  # decimal 127.0.0.1
    "http://0x7f.1:{port}/hello",  # hex and short forms of it
    "http://127.1:{port}/hello",
    "http://127.0.0.1:{port}/hello",
    "http://[::1]:{port}/hello",
    "http://[::ffff:127.0.0.1]:{port}/hello",  # IPv4-mapped IPv6
    "http://[::ffff:7f00:1]:{port}/hello",
    "http://169.254.169.254/latest/meta-data/",  # the cloud metadata address
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://10.0.0.1/",
    "http://192.168.0.1/",
    "http://0.0.0.0:{port}/hello",
    "ftp://127.0.0.1:{port}/",
])
def test_ssrf_forms_are_blocked_as_an_error_the_guest_sees(open_host: Host, server: int, url: str) -> None:
    prog = open_host.compile(wasm_bytes("outbound"))
    got = _fetch(open_host, prog, url.format(port=server))
    assert got.get("kind") == "blocked", got
    assert got["error"].startswith("blocked: ")


def test_an_address_listed_by_the_operator_is_reached_in_any_spelling(host: Host, prog: str, server: int) -> None:
    """`127.0.0.1:PORT` listed: its decimal spelling resolves to it (allowed); its other ports are not."""
    assert _fetch(host, prog, f"http://2130706433:{server}/hello")["status"] == 200
    other = server + 1 if server < 65535 else server - 1
    assert _fetch(host, prog, f"http://127.0.0.1:{other}/hello")["kind"] == "blocked"
    assert _fetch(host, prog, f"http://user:pw@127.0.0.1:{server}/hello")["kind"] == "blocked"


def test_redirects_are_checked_on_every_hop(host: Host, prog: str, server: int) -> None:
    ok = _fetch(host, prog, f"http://127.0.0.1:{server}/redirect?to=/hello")
    assert ok["status"] == 200 and ok["body"] == "hi there"
    other = server + 1 if server < 65535 else server - 1
    for target in ("http://169.254.169.254/", f"http://localhost:{other}/hello", "http://[::1]/",
                   "http://192.168.1.1/admin", "http://2130706433/", "file:///etc/passwd"):
        got = _fetch(host, prog, f"http://127.0.0.1:{server}/redirect?to={target}")
        assert got["kind"] == "blocked", (target, got)


def test_bounds_size_and_time(host: Host, prog: str, server: int) -> None:
    big = _fetch(host, prog, f"http://127.0.0.1:{server}/big")
    assert big["kind"] == "too-large" and "100000" in big["error"]
    t0 = time.monotonic()
    slow = _fetch(host, prog, f"http://127.0.0.1:{server}/slow")
    assert slow["kind"] == "timeout" and time.monotonic() - t0 < 2.9
    bad = _fetch(host, prog, f"http://127.0.0.1:{server}/x", "BREW")
    assert bad["kind"] == "invalid"
    counts = host.stats()["http"]["requests"]
    assert counts["too-large"] >= 1 and counts["timeout"] >= 1 and counts["blocked"] >= 1


def test_no_allowlist_means_no_network(tmp_path: Path, server: int) -> None:
    with _host(tmp_path, ()) as h:
        prog = h.compile(wasm_bytes("outbound"))
        got = _fetch(h, prog, f"http://127.0.0.1:{server}/hello")
        assert got["kind"] == "blocked" and "--http-allow" in got["error"]


def test_a_tenants_own_patterns_apply_to_it_only(tmp_path: Path, server: int) -> None:
    cfg = HostConfig(data_dir=tmp_path, http_tenant_allow=(("alice", f"127.0.0.1:{server}"),))
    with Host(cfg, backend=FakeBackend(page_size=4, num_pages=64)) as h:
        prog = h.compile(wasm_bytes("outbound"))
        url = f"http://127.0.0.1:{server}/hello"
        alice = Run(h, prog, ["fetch", url], tenant="alice").finish()
        bob = Run(h, prog, ["fetch", url], tenant="bob").finish()
        assert json.loads(alice.message)["status"] == 200
        assert json.loads(bob.message)["kind"] == "blocked"


# ---- child inferlets ----
def test_children_talk_both_ways_and_return(host: Host, prog: str) -> None:
    r = Run(host, prog, ["parent", "3"], tenant="t1")
    end = r.finish()
    assert end.event == "completed", end
    got = json.loads(end.message)
    assert got["replies"] == ["2", "4", "6"] and got["results"] == ["done 1", "done 2", "done 3"]
    assert len(set(got["ids"])) == 3 and r.id not in got["ids"]
    assert host.stats()["children"]["launched"] >= 3


def test_a_child_knows_its_parent(host: Host, prog: str) -> None:
    r = Run(host, prog, ["launch", ""], tenant="t1")
    assert r.finish().message == "handle 1"
    top = json.loads(run_to_end(host, prog, ["whoami"]).message)
    assert top["parent"] is None


def test_depth_is_bounded(host: Host, prog: str) -> None:
    end = run_to_end(host, prog, ["nest", "0"])
    assert end.event == "completed"
    assert end.message.startswith("stopped at 3:") and "--max-child-depth" in end.message


def test_count_per_parent_is_bounded(host: Host, prog: str) -> None:
    end = run_to_end(host, prog, ["parent", "5"])  # per_parent=4: the fifth launch fails
    assert end.event == "exception" and "--max-children" in end.message


def test_a_failed_child_is_an_error_result(host: Host, prog: str) -> None:
    end = run_to_end(host, prog, ["fail-child"])
    assert end.event == "completed" and end.message.startswith("failed: exception:") and "on purpose" in end.message


def test_children_end_with_their_parent(host: Host, prog: str) -> None:
    r = Run(host, prog, ["orphan"])
    assert r.finish().event == "completed"
    child = r.messages[0]
    assert host.wait(child, timeout=30)  # terminated with its parent, not left waiting forever
    wait_for(lambda: host.stats()["children"]["running"] == 0, what="children to be counted out")


def test_detached_children_need_the_operator(host: Host, prog: str, tmp_path: Path) -> None:
    end = run_to_end(host, prog, ["detach"])
    assert end.message.startswith("error:") and "--allow-detached-children" in end.message
    with _host(tmp_path, (), child_limits=ChildLimits(allow_detached=True)) as h:
        p = h.compile(wasm_bytes("outbound"))
        r = Run(h, p, ["detach"])
        assert r.finish().message == "left"
        child = r.messages[0]
        assert not h.wait(child, timeout=0.5)  # outlives its parent
        h.signal(child, "bye")
        assert h.wait(child, timeout=30)


def test_unknown_program_and_bad_handle(host: Host, prog: str) -> None:
    end = run_to_end(host, prog, ["launch", "0" * 64])
    assert end.event == "completed" and end.message.startswith("error: unknown program")
    trap = run_to_end(host, prog, ["bad-handle"])
    assert trap.event == "exception" and "no child with handle 12345" in trap.message


def test_a_child_is_of_its_parents_tenant(host: Host, prog: str) -> None:
    r = Run(host, prog, ["orphan"], tenant="carol")
    r.finish()
    child = r.messages[0]
    tenants = {i["id"]: i.get("tenant") for i in host.instances()}
    if child in tenants:  # (it may have ended already)
        assert tenants[child] == "carol"


def test_a_child_starts_only_what_its_tenant_may_launch(host: Host, prog: str) -> None:
    """The server's rule (Server._may_launch: the tenant's uploads) through `Children.access`; the
    parent's own program is always allowed."""
    other = host.compile(wasm_bytes("echo"))
    host.children.access = lambda tenant, program: tenant == "alice"
    try:
        assert Run(host, prog, ["launch", other], tenant="alice").finish().message == "handle 1"
        assert Run(host, prog, ["launch", other], tenant="bob").finish().message.startswith("error: unknown program")
        assert Run(host, prog, ["launch", ""], tenant="bob").finish().message == "handle 1"
    finally:
        host.children.access = None


def test_an_inferlet_lists_and_calls_an_mcp_servers_tools(tmp_path: Path) -> None:
    """The SDK's MCP client (inferlet.mcp) inside the sandbox, through the `http` import, against an
    MCP server of the official `mcp` package on loopback (listed by address)."""
    from mcp_server import TOOL_NAMES, serve_mcp

    with serve_mcp() as url:
        port = int(url.split(":")[2].split("/")[0])
        with _host(tmp_path, (f"127.0.0.1:{port}",)) as h:
            end = run_to_end(h, h.compile(wasm_bytes("outbound")), ["mcp", url])
            assert end.event == "completed", end
            assert json.loads(end.message) == {"tools": sorted(TOOL_NAMES), "add": "5"}
            assert h.stats()["http"]["requests"]["ok"] >= 4  # initialize, initialized, tools/list, tools/call
