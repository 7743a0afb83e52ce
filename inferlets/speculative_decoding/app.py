"""speculative_decoding: greedy decoding sped up by a prompt-lookup (n-gram) drafter.

The drafter looks for the latest earlier occurrence of the sequence's last n tokens (n = 3, 2, 1)
and proposes the up to --draft tokens that followed it. One forward pass verifies them all: its
tokens are [last token, draft...] with a greedy output row at every position. Drafted tokens are
accepted while they equal the model's own greedy choice, and the model's token at the first
mismatch comes for free, so the output is exactly greedy decoding's and each pass yields at least
one token. The K/V of rejected draft tokens is simply overwritten by the next pass (the sequence
length is rolled back; pages past it are released).

Returns the text; with --json {"text", "tokens", "passes", "drafted", "accepted"}.
"""

from __future__ import annotations

import json

from inferlet import PAGES, ArgumentParser, InferletError, Sampler, _host, get_model, send

DEFAULT_PROMPT = (
    "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons, oranges, peaches."
)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="speculative_decoding", description="Greedy decoding with an n-gram drafter verified in one pass.")  # fmt: skip
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="the user prompt")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="most tokens to generate (64)")
    p.add_argument("-d", "--draft", type=int, default=6, help="most drafted tokens per pass (6)")
    p.add_argument("--ngram", type=int, default=3, help="longest n-gram the drafter matches (3)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--json", action="store_true", help="return a JSON object with pass counts")
    return p


PARSER = parser()


def draft_tokens(seq: list[int], max_n: int, k: int) -> list[int]:
    """Tokens that followed the latest earlier occurrence of seq's last n tokens (longest n first)."""
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        key = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == key:
                return seq[start + n : start + n + k]
    return []


class Sequence:
    """Pages and length of one sequence, with roll-back (what `Context` does not offer)."""

    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pages: list[int] = []
        self.kv = 0

    def run(self, tokens: list[int], outputs: list) -> list:
        end = self.kv + len(tokens)
        need = -(-end // self.ps) - len(self.pages)
        if need > 0:
            self.pages.extend(PAGES.allocate(need))
        res = _host.forward.run(
            self.pages, end - (len(self.pages) - 1) * self.ps, tokens, list(range(self.kv, end)), [], outputs
        )
        self.kv = end
        return list(res)

    def truncate(self, length: int) -> None:
        self.kv = length
        keep = -(-length // self.ps)
        if len(self.pages) > keep:
            PAGES.release(self.pages[keep:])
            del self.pages[keep:]

    def release(self) -> None:
        PAGES.release(self.pages)
        self.pages, self.kv = [], 0


def prompt_tokens(model, prompt: str, raw: bool) -> list[int]:
    """The prompt's token ids (chat-templated unless `raw`)."""
    text = prompt if raw else model.apply_chat_template([{"role": "user", "content": prompt}], True)
    return model.encode(text)


def accepted_tokens(outs: list, draft: list[int], stops: set[int]) -> list[int]:
    """The model's greedy tokens up to and including the first that differs from the draft (or stops)."""
    got: list[int] = []
    for i, out in enumerate(outs):
        got.append(out.token)
        if out.token in stops or i >= len(draft) or draft[i] != out.token:
            break
    return got


def verify(s: Sequence, seq: list[int], draft: list[int], greedy, stops: set[int]) -> list[int]:
    """One pass over [last token, draft...]; the accepted tokens. Rejected drafts' K/V is rolled back."""
    tokens = [seq[-1]] + draft
    before = s.kv
    outs = s.run(tokens, [_host.forward.OutputSpec(index=i, sample=greedy, dist=0) for i in range(len(tokens))])
    got = accepted_tokens(outs, draft, stops)
    s.truncate(before + len(got))  # inputs up to the last accepted draft are valid K/V
    return got


def speculate(model, seq: list[int], opts, stops: set[int]) -> tuple[list[int], int, int, int]:
    """Greedy decoding of `seq` with drafts: (generated tokens, passes, drafted, accepted drafts)."""
    greedy = Sampler.greedy().to_wit()
    s = Sequence(model.page_size)
    generated: list[int] = []
    passes = drafted = accepted_drafts = 0
    try:
        if len(seq) > 1:
            s.run(seq[:-1], [])
        while len(generated) < opts.max_tokens:
            room = opts.max_tokens - len(generated) - 1
            draft = draft_tokens(seq, opts.ngram, min(opts.draft, room))
            got = verify(s, seq, draft, greedy, stops)
            passes += 1
            drafted += len(draft)
            accepted_drafts += len(got) - 1
            seq.extend(got)
            generated.extend(got)
            if got[-1] in stops:
                break
    finally:
        s.release()
    return generated[: opts.max_tokens], passes, drafted, accepted_drafts


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    if opts.max_tokens < 1 or opts.draft < 0 or opts.ngram < 1:
        raise InferletError("--max-tokens and --ngram must be >= 1, --draft >= 0")
    model = get_model()
    stops = set(model.stop_tokens)
    seq = prompt_tokens(model, opts.prompt, opts.raw)
    generated, passes, drafted, accepted_drafts = speculate(model, seq, opts, stops)
    out_text = model.decode([t for t in generated if t not in stops])
    if opts.json:
        return json.dumps(
            {
                "text": out_text,
                "tokens": generated,
                "passes": passes,
                "drafted": drafted,
                "accepted": accepted_drafts,
            }
        )
    send(
        f"[{len(generated)} tokens in {passes} forward passes; {accepted_drafts}/{drafted} drafted accepted]"
    )
    return out_text
