"""KV pages held by this instance, ref-counted across the contexts that share them.

Forked contexts share their full pages; a page goes back to the host when the last context
holding it lets go. All page traffic of the SDK goes through the one `PAGES` table.
"""

from __future__ import annotations

import time

from inferlet import _host

__all__ = ["OutOfPages", "PageTable", "PAGES"]


class OutOfPages(RuntimeError):
    """The host had no KV pages for this instance, even after waiting `PageTable.wait_s` seconds."""


class PageTable:
    """Reference counts of the pages this instance holds (allocated or imported).

    `refs[p]` counts the contexts using page p; `holds[p]` counts the host's holds on it (one per
    allocation or import: importing a page held already adds a hold). When the last context lets
    go, every hold is dropped in one `kv.release` call (a page id repeated once per hold).
    """

    def __init__(self, wait_s: float = 30.0) -> None:
        self.refs: dict[int, int] = {}
        self.holds: dict[int, int] = {}
        self.wait_s = wait_s  # how long `allocate` waits for pages to free up before raising
        self.generation = 0  # bumped by `reset`: contexts of an older generation hold nothing here

    def allocate(self, count: int) -> list[int]:
        """`count` fresh pages with one reference each.

        When the host is out of pages, wait with backoff (up to `wait_s`) for other instances to
        release some, then raise OutOfPages with the host's reason.
        """
        if count <= 0:
            return []
        deadline = None  # set at the first refusal: the clock is a host call, not needed when pages are there
        delay = 0.005
        while True:
            try:
                pages = list(_host.kv.allocate(count))
                break
            except _host.Err as e:
                reason = str(e.value)
            if deadline is None:
                deadline = time.monotonic() + self.wait_s
            # Only "out of KV pages" can pass by waiting; a request larger than the whole cache
            # or this instance's own page limit cannot (nor a refusal while enough pages are free).
            transient = reason.startswith("out of KV pages") and _host.kv.free_pages() < count
            if not transient or time.monotonic() + delay > deadline:
                raise OutOfPages(
                    f"kv.allocate({count}) failed: {reason} (held by this instance: {len(self.refs)}, "
                    f"waited up to {self.wait_s:.0f} s)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        for p in pages:
            self.refs[p] = self.holds[p] = 1
        return pages

    def adopt(self, pages: list[int]) -> None:
        """Count pages the host handed over another way (imported): one more reference and hold."""
        for p in pages:
            self.refs[p] = self.refs.get(p, 0) + 1
            self.holds[p] = self.holds.get(p, 0) + 1

    def share(self, pages: list[int]) -> None:
        """One more reference to pages already held."""
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; pages with none left go back to the host in one call."""
        free: list[int] = []
        for p in pages:
            n = self.refs[p] - 1
            if n == 0:
                del self.refs[p]
                free.extend([p] * self.holds.pop(p))
            else:
                self.refs[p] = n
        if free:
            _host.kv.release(free)

    def reset(self) -> None:
        """Forget all pages (a fresh host was bound, e.g. by inferlet.testing.FakeHost)."""
        self.refs.clear()
        self.holds.clear()
        self.generation += 1

    def held(self) -> int:
        """Number of distinct pages held."""
        return len(self.refs)


PAGES = PageTable()
