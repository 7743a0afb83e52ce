"""What the OpenAI routes need to serve (`OpenAIHandler`, `ModelFacts`) and who is asking (`tenant_of`).

host/server/openai_api.py builds the routes over one handler; host/server/server.py makes it from
`ServerConfig`. Nothing here runs a request (host/server/openai_run.py does).
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from host.server.metrics import ServerMetrics
from host.server.openai_budget import PromptBudget
from host.server.openai_errors import OpenAIError
from host.server.openai_images import ImageFetcher, ImageLimits
from host.server.openai_responses import ResponseStore
from host.server.tenants import TenantLimits

__all__ = ["MIB", "ModelFacts", "OpenAIHandler", "error_response", "tenant_of"]

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the routes check requests against (None: not known, not checked; a test's fake host)."""

    image_tokens: int | None = None  # vectors per image; 0: no vision tower
    hidden_size: int | None = None  # an embedding's width; 0: the backend gives no hidden states
    vocab_size: int | None = None
    embed_tokens: int | None = None  # the most tokens one embedding input may have (context, KV pages)
    count: Callable[[str], int] | None = None  # a string's tokens, as the embedding handler tokenizes it
    matryoshka: tuple[int, ...] | None = None  # widths an embedding may be cut to: None none, () any

    @classmethod
    def of(cls, host: Any, budget: PromptBudget | None) -> ModelFacts:
        backend = getattr(host, "backend", None)
        info = getattr(backend, "info", None)
        if backend is None or info is None:
            return cls()
        tok = backend.tokenizer
        limits = [x for x in (info.max_position, budget.kv_tokens if budget is not None else 0) if x]
        dims = getattr(info, "matryoshka", None)
        return cls(int(getattr(info, "image_tokens", 0) or 0), int(getattr(info, "hidden_size", 0) or 0),
                   info.vocab_size, min(limits) if limits else None, lambda text: len(tok.encode_prompt(text)),
                   None if dims is None else tuple(dims))


@dataclasses.dataclass
class OpenAIHandler:
    """What the routes need: the host, the handler program, the model, auth, metrics, limits.

    With `auth_token` or `tenants` ((name, token) pairs, as `ServerConfig.tenants`) set, a request
    needs one of the tokens as its Bearer key; its instance then acts for that token's tenant
    ("default" for `auth_token`), as over the WebSocket protocol. `limits` (shared with the
    WebSocket side) caps a tenant's requests in progress and running instances.
    """

    host: Any
    program_hash: str
    model: str
    metrics: ServerMetrics
    auth_token: str | None = None
    max_tokens: int = 4096
    tenants: tuple[tuple[str, str], ...] = ()
    running: set[str] = dataclasses.field(default_factory=set)  # instances of requests in progress
    limits: TenantLimits = dataclasses.field(default_factory=lambda: TenantLimits(None, 1 << 30))
    max_body_bytes: int = 8 * MIB
    read_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_queued_bytes: int = 16 * MIB  # messages of one request's instance not yet sent to its client
    budget: PromptBudget | None = None  # None: PromptBudget.of(host)
    stopping: bool = False  # the server is shutting down: new requests get 503
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # for previous_response_id
    embedding_program: str | None = None  # the /v1/embeddings handler (inferlets/openai_embed); None: not served
    images: ImageLimits = dataclasses.field(default_factory=ImageLimits)  # chat's image parts
    facts: ModelFacts | None = None  # None: ModelFacts.of(host)
    # the operator's word that the model was trained for Matryoshka embeddings (pie-serve --matryoshka):
    # () any width, else those widths; None: what the model's config.json says (ModelFacts.matryoshka)
    matryoshka: tuple[int, ...] | None = None
    image_fetcher: ImageFetcher | None = None  # None: made when images.allow_remote is set

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = PromptBudget.of(self.host)
        if self.facts is None:
            self.facts = ModelFacts.of(self.host, self.budget)
        if self.matryoshka is not None:
            self.facts = dataclasses.replace(self.facts, matryoshka=self.matryoshka)
        if self.image_fetcher is None and self.images.allow_remote:
            self.image_fetcher = ImageFetcher(self.images)

    def terminate_all(self, reason: str) -> None:
        """Terminate the instances of every request in progress (the server is stopping)."""
        self.stopping = True
        for iid in list(self.running):
            try:
                self.host.terminate(iid, reason)
            except KeyError:
                pass  # it has just ended


def error_response(e: OpenAIError) -> JSONResponse:
    # A 413 or 408 leaves the body unread: the connection closes after the answer.
    headers = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def tenant_of(h: OpenAIHandler, request: Request) -> str:
    """The tenant the request's Bearer key authenticates ("local" when the server has no token)."""
    if h.auth_token is None and not h.tenants:
        return "local"
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    found = None
    if scheme.lower() == "bearer" and key:
        pairs = ((("default", h.auth_token),) if h.auth_token else ()) + h.tenants
        for name, token in pairs:
            if hmac.compare_digest(key.strip().encode(), token.encode()):
                found = name
    if found is None:
        raise OpenAIError(401, "invalid or missing API key (send it as 'Authorization: Bearer <key>')",
                          type_="authentication_error", code="invalid_api_key")
    return found
