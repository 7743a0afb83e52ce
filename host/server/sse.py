"""Server-sent-event framing of OpenAI streaming chunks (issue 14).

Invariant: every chunk is one `data: <json>\\n\\n` event and a stream ends with exactly one
`data: [DONE]\\n\\n`, as OpenAI's clients expect.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DONE", "chat_chunk", "completion_chunk", "sse_event", "sse_typed"]

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_typed(payload: dict[str, Any]) -> bytes:
    """One Responses stream event: `event: <its type>` then its data (no [DONE] ends that stream)."""
    return b"event: " + payload["type"].encode() + b"\n" + sse_event(payload)


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `chat.completion.chunk` object for choice `index`."""
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A streamed `text_completion` object for choice `index`."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason}]}
