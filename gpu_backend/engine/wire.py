"""The wire format between the host and an engine process: the batch format of `types.py` in msgpack.

A message is one msgpack array `[op, payload]`; a reply is `[status, payload]` with status
`ok`, `forward_error` (`[request_index, message]`: that request is invalid, nothing ran) or
`error` (`[exception type, message]`). Requests travel as arrays, not maps, so a decode-step
request of a few ints costs a few bytes and a few microseconds; `checked` travels with them
(the host validated them at its boundary, the engine does not validate them again).

Light on purpose: no torch, so the host side can import it cheaply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from gpu_backend.types import ForwardRequest, OutputResult, OutputSpec, SamplerParams

__all__ = ["decode_requests", "decode_results", "encode_requests", "encode_results", "pack", "unpack"]


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _sampler(s: SamplerParams | None) -> list[Any] | None:
    return None if s is None else [s.temperature, s.top_k, s.top_p, s.min_p, s.seed]


def _output(o: OutputSpec) -> list[Any]:
    return [o.index, _sampler(o.sample), o.dist, o.allowed, o.target, o.hidden]


def request_row(r: ForwardRequest) -> list[Any]:
    return [r.pages, r.last_page_len, r.tokens, r.positions, r.mask, [_output(o) for o in r.outputs],
            r.name, r.checked, None if r.embeds is None else [list(e) for e in r.embeds]]


def encode_requests(reqs: Sequence[ForwardRequest]) -> list[list[Any]]:
    """Requests as msgpack-ready arrays (lists of ints stay lists: msgpack packs them in C)."""
    return [request_row(r) for r in reqs]


def _sampler_from(row: list[Any] | None) -> SamplerParams | None:
    if row is None:
        return None
    t, k, p, m, seed = row
    return SamplerParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed)


def decode_requests(rows: list[list[Any]]) -> list[ForwardRequest]:
    out = []
    for pages, lpl, tokens, positions, mask, outputs, name, checked, embeds in rows:
        specs = [OutputSpec(index=i, sample=_sampler_from(s), dist=d, allowed=a, target=t, hidden=h)
                 for i, s, d, a, t, h in outputs]
        out.append(ForwardRequest(pages=pages, last_page_len=lpl, tokens=tokens, positions=positions, mask=mask,
                                  outputs=specs, name=name, checked=checked,
                                  embeds=None if embeds is None else [(int(i), bytes(d)) for i, d in embeds]))
    return out


def encode_results(results: list[list[OutputResult]]) -> list[list[list[Any]]]:
    return [[[o.token, o.ids, o.probs, o.logprob, o.hidden] for o in r] for r in results]


def decode_results(rows: list[list[list[Any]]]) -> list[list[OutputResult]]:
    return [[OutputResult(token=t, ids=ids, probs=probs, logprob=lp, hidden=h) for t, ids, probs, lp, h in r]
            for r in rows]
