"""`FakeHost`: the host interfaces in memory, over a `TinyBackend`."""

from __future__ import annotations

from inferlet import _host
from inferlet.testing.embed import FakeEmbed
from inferlet.testing.forward import FakeForward
from inferlet.testing.grammar import FakeGrammarInterface
from inferlet.testing.http import FakeHttp, Handler
from inferlet.testing.kv import FakeKv
from inferlet.testing.services import FakeMessaging, FakeModel, FakeRuntime, FakeStore
from inferlet.testing.tiny import TinyBackend

__all__ = ["FakeHost"]


class FakeHost:
    """The host interfaces (but child inferlets), faked in memory. `install()` binds them into the SDK.

    `backend` is the model behind `model` and `forward`: a `TinyBackend` unless one is given.
    """

    def __init__(self, page_size: int = 4, num_pages: int = 64, args: list[str] | None = None,
                 max_pages: int | None = None, backend: TinyBackend | None = None,
                 http: Handler | None = None, image_tokens: int = 0) -> None:  # fmt: skip
        self.backend = backend or TinyBackend(page_size=page_size, num_pages=num_pages)
        self.runtime = FakeRuntime(args or [])
        self.messaging = FakeMessaging()
        self.store = FakeStore()
        self.model = FakeModel(self.backend)
        self.kv = FakeKv(self.backend, max_pages)
        self.forward = FakeForward(self.kv, self.backend, self.messaging.send)
        self.grammar = FakeGrammarInterface(self.backend.info)
        self.embed = FakeEmbed(self.forward, self.backend.info.vocab_size, image_tokens)  # (inferlet.testing.embed)
        self.http = FakeHttp(http)  # `http`: answers requests (see inferlet.testing.http); None blocks them all

    def install(self) -> FakeHost:
        """Bind this host into the SDK and forget the SDK's cached host state."""
        from inferlet.model import get_model
        from inferlet.pages import PAGES

        _host.bind(runtime=self.runtime, messaging=self.messaging, store=self.store,
                   model=self.model, kv=self.kv, forward=self.forward, grammar=self.grammar, http=self.http,
                   embed=self.embed)  # fmt: skip
        PAGES.reset()
        get_model()._reset()
        return self
