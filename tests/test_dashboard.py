"""The dashboard (issue 54): its JSON over plain HTTP on a scripted host (keys, tenant filtering,
401s, SSE framing, stream bounds), then the page itself in headless chromium over a real host
on the stand-in backend (loads, changes while a burst runs, a tenant sees its own, a bad token is
refused). The browser tests need Debian's chromium and chromedriver (`make test` installs them)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeBackend
from helpers import Run, wait_for, wasm_bytes
from server_support import WASM, FakeHost, running_server

from host import Host, HostConfig
from host.events import InstanceEvent
from host.server import dashboard
from host.state.pages import InstancePages, PageManager

ADMIN, ALICE, BOB = "admin-tok", "tok-alice", "tok-bob"
TENANTS = (("alice", ALICE), ("bob", BOB))


def _ignore(_event: InstanceEvent) -> None:
    pass


# ---- plain HTTP, on the scripted host ---------------------------------------------------------------


class LoggingHost(FakeHost):
    """A scripted host that keeps one log line per instance (`Host.logs`' shape) and lists the
    instances in `gone` as ended (`Host.ended_instances`' shape)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gone: list[dict[str, Any]] = []

    def ended_instances(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.gone[:limit]

    def logs(self, instance_id: str, tenant: str | None = None) -> list[dict[str, Any]] | None:
        owner = self.tenants.get(instance_id)
        if owner is None or tenant not in (None, owner):  # as Host.logs: another tenant's is unknown
            return None
        return [{"t": 1.0, "stream": "stdout", "text": f"hello from {owner}"}]


@pytest.fixture
def fake() -> LoggingHost:
    return LoggingHost(total_pages=64)


@pytest.fixture
def server(tmp_path: Path, fake: LoggingHost) -> Iterator[Any]:
    with running_server(tmp_path, host=fake, auth_token=ADMIN, tenants=TENANTS) as srv:
        yield srv


def _get(srv: Any, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(srv.http_url + path, headers=headers, timeout=10, **kw)


def test_the_snapshot_shows_the_admin_everything_and_a_tenant_its_own(server: Any, fake: LoggingHost) -> None:
    prog = fake.compile(WASM)
    mine = fake.launch(prog, ["hold", "ALICE-SECRET"], _ignore, tenant="alice")
    theirs = fake.launch(prog, ["hold", "BOB-SECRET"], _ignore, tenant="bob")
    try:
        full = _get(server, "/dashboard/snapshot", ADMIN).json()
        assert {"time", "instances", "scheduler", "kv", "launch_queue", "prefix_cache", "tenants", "workers",
                "server", "viewer"} <= set(full)
        assert full["viewer"] == {"tenant": "default", "admin": True}
        assert {i["id"] for i in full["instances"]} == {mine, theirs}
        assert set(full["instances"][0]) == {"id", "program", "tenant", "state", "age_s", "priority", "pages",
                                             "tokens", "swapped"}
        assert full["kv"] == {**full["kv"], "total": 64, "used": 4, "free": 60}
        assert set(full["tenants"]) == {"alice", "bob"} and full["tenants"]["bob"]["running"] == 1
        r = _get(server, f"/dashboard/snapshot?token={ALICE}")  # the query parameter, as EventSource sends it
        own = r.json()
        assert [i["id"] for i in own["instances"]] == [mine]
        assert list(own["tenants"]) == ["alice"] and own["viewer"] == {"tenant": "alice", "admin": False}
        assert theirs not in r.text and "bob" not in r.text and "SECRET" not in r.text
        assert not {"workers", "http", "children", "server"} & set(own)
        assert own["kv"]["total"] == 64  # the host-wide gauges, as the stats query shows every tenant
    finally:
        fake.terminate(mine)
        fake.terminate(theirs)


def test_a_bad_or_missing_token_is_refused_but_the_page_is_served(server: Any) -> None:
    for path in ("/dashboard/snapshot", "/dashboard/events", "/dashboard/logs?id=x"):
        for token in (None, "wrong"):
            r = _get(server, path, token)
            assert r.status_code == 401 and "token" in r.text and r.headers["www-authenticate"] == "Bearer"
        assert _get(server, path + ("&" if "?" in path else "?") + "token=wrong").status_code == 401
    page = _get(server, "/dashboard")  # static, no data in it
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "<canvas" in page.text and "://" not in page.text  # loads nothing from elsewhere


def test_without_tokens_everyone_sees_everything(tmp_path: Path) -> None:
    fake = FakeHost()
    with running_server(tmp_path, host=fake, openai=True) as srv:  # (the routes are there with the OpenAI ones too)
        iid = fake.launch(fake.compile(WASM), ["hold"], _ignore)
        try:
            snap = _get(srv, "/dashboard/snapshot").json()
            assert snap["viewer"] == {"tenant": "local", "admin": True}
            assert [i["id"] for i in snap["instances"]] == [iid]
        finally:
            fake.terminate(iid)


def _events(lines: Iterator[str], n: int) -> list[dict[str, Any]]:
    """The next `n` data events of an SSE response's `iter_lines()`, checking the framing on the way
    (the caller keeps `lines`: dropping it closes the connection)."""
    out = []
    while len(out) < n:
        line = next(lines)
        if line.startswith("retry: "):  # the stream's first field
            assert line == "retry: 2000" and next(lines) == ""
            continue
        assert line.startswith("data: ")
        out.append(json.loads(line[len("data: "):]))
        assert next(lines) == ""
    return out


def test_events_are_one_snapshot_a_second_and_a_stream_counts_as_a_connection(server: Any) -> None:
    t0 = time.monotonic()
    with httpx.stream("GET", f"{server.http_url}/dashboard/events?token={ADMIN}", timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        first, second = _events(r.iter_lines(), 2)
        assert second["time"] > first["time"] and 0.8 < time.monotonic() - t0 < 5
        assert second["server"]["dashboards"] == 1 and second["tenants"]["default"]["connections"] == 1
    wait_for(lambda: server.dashboard.streams == 0 and not server.limits.connections, 5, "the stream to be given back")


def test_streams_are_capped_per_tenant_and_in_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashboard, "MAX_STREAMS", 2)
    with running_server(tmp_path, host=FakeHost(), auth_token=ADMIN, tenants=TENANTS,
                        max_connections_per_tenant=1) as srv:
        url = f"{srv.http_url}/dashboard/events?token="
        with httpx.stream("GET", url + ALICE, timeout=10) as a:
            alice = a.iter_lines()
            _events(alice, 1)
            second = httpx.get(url + ALICE, timeout=10)
            assert second.status_code == 429 and "--max-connections-per-tenant" in second.text
            with httpx.stream("GET", url + BOB, timeout=10) as b:
                bob = b.iter_lines()
                _events(bob, 1)
                third = httpx.get(url + ADMIN, timeout=10)
                assert third.status_code == 503 and "maximum of 2 viewers" in third.text
        t0 = time.monotonic()
        with httpx.stream("GET", url + ALICE, timeout=10) as a:
            again = a.iter_lines()
            _events(again, 1)
            srv.stop_background()  # an open stream ends with the server, not after uvicorn's grace period
            assert time.monotonic() - t0 < 4


def test_logs_of_an_instance_are_its_tenants_only(server: Any, fake: LoggingHost) -> None:
    iid = fake.launch(fake.compile(WASM), ["hold"], _ignore, tenant="alice")
    try:
        assert _get(server, "/dashboard/snapshot", ADMIN).json()["logs"] is True
        for token in (ALICE, ADMIN):
            r = _get(server, f"/dashboard/logs?id={iid}", token)
            assert r.status_code == 200 and r.json()["lines"][0]["text"] == "hello from alice"
        r = _get(server, f"/dashboard/logs?id={iid}", BOB)
        assert r.status_code == 404 and "unknown instance" in r.text
        assert _get(server, "/dashboard/logs?id=nope", ADMIN).status_code == 404
    finally:
        fake.terminate(iid)


def test_ended_instances_are_listed_for_their_logs_to_their_tenant_only(server: Any, fake: LoggingHost) -> None:
    now = time.time()
    fake.gone = [{"id": f"{owner}-{k}", "program": "p" * 64, "tenant": owner, "state": "completed",
                  "started_at": now - 5, "ended_at": now - 2, "log_lines": 3}
                 for k in range(dashboard.MAX_ENDED + 5) for owner in ("bob", "alice")]
    full = _get(server, "/dashboard/snapshot", ADMIN).json()
    first = full["ended"][0]
    assert len(full["ended"]) == dashboard.MAX_ENDED and 2.0 <= first.pop("ended_s") < 10 and first == {
        "id": "bob-0", "program": "p" * 12, "tenant": "bob", "state": "completed", "ran_s": 3.0, "log_lines": 3}
    own = _get(server, "/dashboard/snapshot", ALICE).json()["ended"]
    assert [i["id"] for i in own] == [f"alice-{k}" for k in range(dashboard.MAX_ENDED)]  # hers, not the newest 100


def test_page_usage_counts_the_pages_held_and_the_tokens_written_in_them() -> None:
    pm = PageManager(8)
    table = InstancePages("a")
    pages = pm.allocate(table, 3)
    assert isinstance(pages, list) and pm.usage(table) == (3, 0, 0)
    pm.note_copy(table, pages[0], 4)
    pm.note_copy(table, pages[1], 2)
    assert pm.usage(table) == (3, 6, 0)
    pm.release(table, [pages[1]])
    assert pm.usage(table) == (2, 4, 0)


# ---- the page, in headless chromium, over a real host on the stand-in backend ----------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: the dashboard's browser tests need them "
                    "(apt-get install chromium chromium-driver; `make test` does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(shutil.which("chromium"))
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(shutil.which("chromedriver"))), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Any]]:
    """A host on the stand-in backend (10 ms a batch) behind a server with an admin and two tenants."""
    data = tmp_path_factory.mktemp("dashboard")
    host = Host(HostConfig(warm_auto=0, data_dir=data / "h"),
                backend=FakeBackend(page_size=16, num_pages=1024, delay_s=0.01))
    try:
        with running_server(data / "s", host=host, auth_token=ADMIN, tenants=TENANTS) as srv:
            yield host, srv
    finally:
        host.shutdown()


def _open(driver: Any, srv: Any, token: str) -> None:
    driver.get(f"{srv.http_url}/dashboard?token={token}")
    _until(driver, lambda d: d.find_element("id", "status").text == "live", "the page to go live")


def _until(driver: Any, cond: Any, what: str, timeout: float = 10) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(cond, f"timed out waiting for {what}")


def _line_pixels(driver: Any, canvas_id: str) -> int:
    """Pixels of a plot's canvas in its line's colour (#2f6fd6, give or take antialiasing)."""
    return int(driver.execute_script("""
        const c = document.getElementById(arguments[0]);
        const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let k = 0; k < d.length; k += 4) {
          if (Math.abs(d[k] - 47) < 40 && Math.abs(d[k + 1] - 111) < 40 && Math.abs(d[k + 2] - 214) < 40
              && d[k + 3] > 128) n++;
        }
        return n;""", canvas_id))


def _number(driver: Any, element_id: str) -> int:
    text = driver.find_element("id", element_id).text
    return int(text) if text.isdigit() else -1


@pytest.mark.heavy  # (a browser: not in make test-fast)
def test_the_page_loads_and_shows_the_hosts_numbers(browser: Any, live: tuple[Host, Any]) -> None:
    _host, srv = live
    _open(browser, srv, ADMIN)
    assert "token" not in browser.current_url  # kept for the tab, out of the address bar
    assert _number(browser, "kv-total") == 1024 and _number(browser, "kv-free") == 1024
    assert "default (admin" in browser.find_element("id", "viewer").text
    assert browser.find_element("id", "model").text != "-"
    assert browser.find_element("id", "admin").is_displayed()


@pytest.mark.heavy  # (a browser: not in make test-fast)
def test_the_numbers_follow_a_burst_of_instances(browser: Any, live: tuple[Host, Any]) -> None:
    host, srv = live
    prog = host.compile(wasm_bytes("blocked_receive"))
    _open(browser, srv, ADMIN)
    ids = [host.launch(prog, [], _ignore, tenant=("alice", "bob")[k % 2]) for k in range(20)]
    try:
        _until(browser, lambda d: _number(d, "running") == 20, "20 instances running")
        rows = browser.find_elements("css selector", "#instances-body tr")
        assert {r.get_attribute("data-id") for r in rows} == set(ids)
        tenants = browser.find_element("id", "tenants-body").text
        assert "alice 10" in tenants and "bob 10" in tenants
        # the plot of instances running has drawn its line (the page's line colour, #2f6fd6) up to 20
        _until(browser, lambda d: _line_pixels(d, "plot-running") > 20, "the plot of instances running")
    finally:
        for iid in ids:
            host.terminate(iid)
    _until(browser, lambda d: _number(d, "running") == 0, "the burst to end")


@pytest.mark.build
def test_the_batch_counters_move_while_instances_generate(browser: Any, live: tuple[Host, Any]) -> None:
    host, srv = live
    prog = host.compile(wasm_bytes("pressure"))  # "host N SEED TOKEN...": a host-side loop of N tokens
    _open(browser, srv, ADMIN)
    before = _number(browser, "batches-total")
    ids = [host.launch(prog, ["host", "250", "-1", "1", "2", "3"], _ignore, tenant="alice") for _ in range(20)]
    try:
        _until(browser, lambda d: _number(d, "batches-total") > before and _number(d, "running") > 0,
               "batches to be counted while instances run")
        _until(browser, lambda d: d.find_element("id", "batches-rate").text not in ("-", "0.0"), "a batch rate")
        _until(browser, lambda d: d.find_element("id", "batch-size").text not in ("-", "0.00"), "a batch size")
        assert _number(browser, "batch-max") >= 1
        _until(browser, lambda d: _number(d, "kv-used") > 0, "KV pages in use")
        _until(browser, lambda d: _number(d, "running") == 0, "the instances to end", timeout=30)
        assert _number(browser, "batches-total") > before
    finally:
        for iid in ids:
            try:
                host.terminate(iid)
            except KeyError:
                pass  # it has ended


@pytest.mark.build
def test_an_instance_shows_the_pages_it_holds_and_the_tokens_in_them(live: tuple[Host, Any]) -> None:
    host, srv = live
    prog = host.compile(wasm_bytes("pressure"))  # "export NAME TOKEN...": prefill, export, hold until a message
    run = Run(host, prog, ["export", "dash", *map(str, range(1, 21))], tenant="alice")
    try:
        assert run.events.get(timeout=30).message == "exported"
        row = next(i for i in _get(srv, "/dashboard/snapshot", ALICE).json()["instances"] if i["id"] == run.id)
        # 20 tokens, pages of 16; `flush` runs all but the last (the next step's input): 19 K/V slots written
        assert (row["pages"], row["tokens"], row["swapped"]) == (2, 19, 0)
    finally:
        host.signal(run.id, "go")
    assert run.finish(30).event == "completed"


@pytest.mark.heavy  # (a browser: not in make test-fast)
def test_a_tenants_token_shows_its_own_instances_only(browser: Any, live: tuple[Host, Any]) -> None:
    host, srv = live
    prog = host.compile(wasm_bytes("blocked_receive"))
    mine = host.launch(prog, [], _ignore, tenant="alice")
    theirs = host.launch(prog, [], _ignore, tenant="bob")
    try:
        _open(browser, srv, ALICE)
        _until(browser, lambda d: d.find_elements("css selector", f"#instances-body tr[data-id='{mine}']"),
               "alice's instance")
        time.sleep(1.2)  # another event: still only hers
        assert theirs not in browser.page_source and "bob" not in browser.find_element("tag name", "main").text
        assert browser.find_element("id", "tenants-body").text.split()[0] == "alice"
        assert browser.find_element("id", "viewer").text == "alice"
        assert not browser.find_element("id", "admin").is_displayed()
        browser.find_element("css selector", f"#instances-body tr[data-id='{mine}']").click()  # its log (Host.logs)
        _until(browser, lambda d: d.find_element("id", "logs").text == "(no log lines yet)", "its log panel")
        assert browser.find_element("id", "logs-id").text == mine
    finally:
        host.terminate(mine)
        host.terminate(theirs)


@pytest.mark.heavy  # (a browser: not in make test-fast)
def test_a_bad_token_is_refused_and_the_login_box_takes_a_good_one(browser: Any, live: tuple[Host, Any]) -> None:
    _host, srv = live
    browser.get(f"{srv.http_url}/dashboard?token=not-a-token")
    _until(browser, lambda d: "refused" in d.find_element("id", "status").text, "the refusal")
    assert "401" in browser.find_element("id", "status").text
    assert "invalid or missing token" in browser.find_element("id", "message").text
    assert browser.find_element("id", "running").text == "-"
    box = browser.find_element("id", "token")
    box.send_keys(BOB)
    box.submit()
    _until(browser, lambda d: d.find_element("id", "status").text == "live", "the page to go live")
    assert browser.find_element("id", "viewer").text == "bob"


@pytest.mark.build
def test_an_ended_instance_is_listed_and_its_log_read_after_its_end(browser: Any, live: tuple[Host, Any]) -> None:
    host, srv = live
    run = Run(host, host.compile(wasm_bytes("chatty")), ["lines", "2"], tenant="alice")
    assert run.finish(60).event == "completed"
    _open(browser, srv, ALICE)
    row = f"#ended-body tr[data-id='{run.id}']"
    _until(browser, lambda d: d.find_elements("css selector", row), "the ended instance's row")
    assert "completed" in browser.find_element("css selector", row).text
    browser.find_element("css selector", row).click()
    _until(browser, lambda d: "stdout out 1" in d.find_element("id", "logs").text, "its log lines")
    assert "stderr err line" in browser.find_element("id", "logs").text
    _open(browser, srv, BOB)  # another tenant: not listed
    time.sleep(1.2)
    assert not browser.find_elements("css selector", row) and run.id not in browser.page_source


@pytest.mark.heavy  # (a browser and a host of its own)
def test_the_launch_queue_shows_launches_waiting(browser: Any, tmp_path: Path) -> None:
    with Host(HostConfig(warm_auto=0, max_instances=1, data_dir=tmp_path / "h"),
              backend=FakeBackend(page_size=16, num_pages=64)) as host, \
            running_server(tmp_path / "s", host=host, auth_token=ADMIN, tenants=TENANTS) as srv:
        prog = host.compile(wasm_bytes("blocked_receive"))
        ids = [host.launch(prog, [], _ignore, tenant="alice") for _ in range(3)]
        try:
            _open(browser, srv, ADMIN)
            _until(browser, lambda d: _number(d, "queued") == 2 and _number(d, "running") == 1, "2 launches queued")
            assert _number(browser, "queue-limit") == host.stats()["launch_queue"]["limit"]
            states = [r.text.split()[3] for r in browser.find_elements("css selector", "#instances-body tr")]
            assert sorted(states) == ["queued", "queued", "running"]
            assert "alice 1 2" in browser.find_element("id", "tenants-body").text  # running 1, queued 2
        finally:
            for iid in ids:
                host.terminate(iid)


@pytest.mark.build
def test_the_prefix_cache_hit_rate_follows_a_repeated_prompt(browser: Any, live: tuple[Host, Any]) -> None:
    host, srv = live
    prog = host.compile(wasm_bytes("text_completion"))
    prompt = "Tell me about the lighthouse lens in the maritime museum and its keeper " * 3
    _open(browser, srv, ADMIN)
    assert browser.find_element("id", "cache-hit").text != "off"
    hits = _number(browser, "cache-hits")
    for _ in range(2):  # the second run finds the first's full pages
        assert Run(host, prog, ["--prompt", prompt, "--max-tokens", "2"], tenant="alice").finish(60).event == "completed"
    _until(browser, lambda d: _number(d, "cache-hits") > hits, "a prefix cache hit")
    rate = browser.find_element("id", "cache-hit").text
    assert rate.endswith("%") and float(rate[:-1]) > 0


@pytest.mark.build
def test_kv_pages_used_free_and_swapped_out(browser: Any, tmp_path: Path) -> None:
    """Two instances of 10 pages on a pool of 16: the second's growth suspends the first, its 10
    pages swapped out to host memory (as tests/test_kv_pressure.py)."""
    with Host(HostConfig(warm_auto=0, data_dir=tmp_path / "h"),
              backend=FakeBackend(page_size=4, num_pages=16, delay_s=0.001, reads=True)) as host, \
            running_server(tmp_path / "s", host=host, auth_token=ADMIN, tenants=TENANTS) as srv:
        prog = host.compile(wasm_bytes("pressure"))
        first = Run(host, prog, ["grow", "10"], tenant="alice")
        assert first.events.get(timeout=60).message == "held"
        second = Run(host, prog, ["grow", "10"], tenant="alice")
        assert second.events.get(timeout=60).message == "held"  # the first is suspended
        try:
            _open(browser, srv, ALICE)
            _until(browser, lambda d: _number(d, "kv-swapped") == 10, "10 pages swapped out")
            assert (_number(browser, "kv-used"), _number(browser, "kv-free"), _number(browser, "kv-total")) == \
                (10, 6, 16)
            assert _number(browser, "kv-suspended") == 1
            row = browser.find_element("css selector", f"#instances-body tr[data-id='{first.id}']").text.split()
            assert row[-2:] == ["10", "0"]  # swapped 10, priority 0
        finally:
            host.signal(second.id, "go")
            host.signal(first.id, "go")
            assert second.finish(30).event == "completed" and first.finish(30).event == "completed"
