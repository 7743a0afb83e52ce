"""beam_search: beam search over top-k distributions, beams forked from one shared prompt.

Every beam is a `Context.fork()` of its parent: full KV pages are shared, only the partial last
page is copied. Each step submits one `next_dist` pass per live beam (they run batched, at once),
expands every beam into its `--beam-width` most probable continuations (score += ln p), and keeps
the best `--beam-width` candidates overall (ties: lower beam index, then higher-ranked token).
A candidate ending in a stop token is finished. The search ends when no beam is live, when
`--beam-width` hypotheses are finished, or after `--max-tokens` steps. The result is the
hypothesis (finished or live) with the best `logprob / len ** length_penalty`.

Returns the text; with `--json`, {"text", "tokens", "logprob", "score"}.
"""

from __future__ import annotations

import json
import math

from inferlet import ArgumentParser, Context, InferletError, get_model, wait_any


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="beam_search", description="Beam search; the best hypothesis is the return value.")  # fmt: skip
    p.add_argument("-p", "--prompt", default="Write one sentence about the sea.", help="the user prompt")
    p.add_argument("-w", "--beam-width", type=int, default=3, help="beams kept per step (3)")
    p.add_argument("-n", "--max-tokens", type=int, default=24, help="most tokens to generate (24)")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="final ranking by logprob / len**penalty (1.0; 0 = raw logprob)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="return a JSON object with tokens and scores")
    return p


PARSER = parser()


def normalized(logprob: float, length: int, penalty: float) -> float:
    return logprob / (max(length, 1) ** penalty)


# A beam: (context, logprob, generated tokens); a candidate: (logprob, beam index, rank, token).
Beam = tuple[Context, float, list[int]]
Candidate = tuple[float, int, int, int]


def prompt_context(model, prompt: str, raw: bool) -> Context:
    """A context holding the prompt (chat-templated unless `raw`), prefilled."""
    root = Context(model)
    if raw:
        root.fill(prompt)
    else:
        root.fill_user(prompt)
    root.flush()
    return root


def next_dists(beams: list[Beam], width: int) -> list[tuple[list[int], list[float]]]:
    """The top-`width` next-token distribution of every beam, all passes submitted at once."""
    passes = [ctx.submit_dist(width) for ctx, _, _ in beams]
    pending = list(passes)
    while pending:
        pending.remove(wait_any(pending))
    return [f.result for f in passes]


def best_candidates(beams: list[Beam], dists: list[tuple[list[int], list[float]]], width: int) -> list[Candidate]:
    """The `width` best continuations over all beams (ties: lower beam index, then higher rank)."""
    cands: list[Candidate] = []
    for bi, ((ids, probs), (_ctx, score, _toks)) in enumerate(zip(dists, beams, strict=False)):
        for rank, (tok, prob) in enumerate(zip(ids, probs, strict=False)):
            if prob > 0.0:
                cands.append((score + math.log(prob), bi, rank, tok))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return cands[:width]


def expand(beams: list[Beam], top: list[Candidate], stops: set[int],
           finished: list[tuple[float, list[int]]]) -> list[Beam]:
    """The next beams from the chosen candidates; stopped ones go to `finished`, dropped beams are released."""
    left: dict[int, int] = {}
    for _score, bi, _rank, tok in top:
        if tok not in stops:
            left[bi] = left.get(bi, 0) + 1
    new: list[Beam] = []
    for score, bi, _rank, tok in top:
        parent, _, toks = beams[bi]
        if tok in stops:
            finished.append((score, toks + [tok]))
            continue
        left[bi] -= 1
        # Fork for all children but the last, which continues in the parent's context.
        child = parent if left[bi] == 0 else parent.fork()
        child.fill_tokens([tok])
        new.append((child, score, toks + [tok]))
    for bi, (ctx, _score, _toks) in enumerate(beams):
        if bi not in left:
            ctx.release()
    return new


def search(root: Context, width: int, max_tokens: int, penalty: float, stops: set[int]) -> tuple[float, list[int]]:
    """Beam search from `root`; the best (logprob, tokens) by normalized score. Releases every beam."""
    beams: list[Beam] = [(root, 0.0, [])]
    finished: list[tuple[float, list[int]]] = []
    try:
        for _step in range(max_tokens):
            top = best_candidates(beams, next_dists(beams, width), width)
            beams = expand(beams, top, stops, finished)
            if not beams or len(finished) >= width:
                break
        hyps = finished + [(score, toks) for _ctx, score, toks in beams]
        return max(hyps, key=lambda h: normalized(h[0], len(h[1]), penalty))
    finally:
        for ctx, _, _ in beams:
            ctx.release()


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    if opts.beam_width < 1 or opts.max_tokens < 1:
        raise InferletError("--beam-width and --max-tokens must be >= 1")
    model = get_model()
    stops = set(model.stop_tokens)
    root = prompt_context(model, opts.prompt, opts.raw)
    best_logprob, best = search(root, opts.beam_width, opts.max_tokens, opts.length_penalty, stops)
    text = model.decode([t for t in best if t not in stops])
    if opts.json:
        return json.dumps({"text": text, "tokens": best, "logprob": best_logprob,
                           "score": normalized(best_logprob, len(best), opts.length_penalty)})
    return text
