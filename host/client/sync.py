"""`SyncPieClient`: the blocking client, for scripts and threads that do not run an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from host.client.client import Event, PieClient

__all__ = ["SyncPieClient"]

T = TypeVar("T")


class SyncPieClient:
    """Blocking wrapper around `PieClient`; runs its own event loop in a daemon thread."""

    def __init__(self, url: str, *, token: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pie-client", daemon=True)
        self._thread.start()
        self._client: PieClient = self._call(PieClient.connect(url, token=token))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SyncPieClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def ping(self) -> float:
        return self._call(self._client.ping())

    def logs(self, instance_id: str) -> list[dict[str, Any]]:
        return list(self._call(self._client.logs(instance_id)))

    def query(self, subject: str, record: Any = None) -> Any:
        return self._call(self._client.query(subject, record))

    def program_exists(self, program_hash: str) -> bool:
        return self._call(self._client.program_exists(program_hash))

    def upload_program(self, data: bytes) -> str:
        return self._call(self._client.upload_program(data))

    def ensure_program(self, data: bytes) -> str:
        return self._call(self._client.ensure_program(data))

    def launch(self, program_hash: str, arguments: Iterable[str] = (), *, detached: bool = False,
               priority: int = 0, record: bool = False) -> str:
        return self._call(self._client.launch(program_hash, arguments, detached=detached, priority=priority,
                                              record=record))

    def recording(self, instance_id: str) -> bytes:
        return self._call(self._client.recording(instance_id))

    def signal(self, instance_id: str, message: str) -> None:
        self._call(self._client.signal(instance_id, message))

    def terminate(self, instance_id: str) -> None:
        self._call(self._client.terminate(instance_id))

    def attach(self, instance_id: str) -> None:
        self._call(self._client.attach(instance_id))

    def events(self, instance_id: str) -> Iterator[Event]:
        """The instance's events, blocking, ending with its terminal event."""
        stream = self._client.events(instance_id)

        async def step() -> Event | None:
            return await anext(stream, None)

        while (event := self._call(step())) is not None:
            yield event
