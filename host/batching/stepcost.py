"""`--prefill-chunk auto`: how many prefill tokens a batch with running decodes may take.

The scheduler times every batch it runs (from its launch, or the previous batch's end if that is
later: a device runs its queue in order) and keeps a running fit of

    step time = fixed + per_token * tokens      (tokens: every new token in the batch)

over the batches it actually ran. Points are kept per size class (a power of two of tokens: the
mean tokens and the median time of its last 5 batches), so the many decode-only steps do not drown the few batches
with prefills, and a class seen long ago still anchors the line. The fit is least squares over the
classes' means, once the largest has at least `_SPAN` times the tokens of the smallest (a narrower
range measures the timing noise, not the slope).

A batch whose running decodes bring `d` tokens may then add `P` prefill tokens such that its
predicted time stays within `ratio` times a decode-only step's, `T(d)`:

    T(d) + per_token * P <= ratio * T(d)
    P <= (ratio - 1) * T(d) / per_token

`per_token` is what recent batches with prefill actually cost per prefill token over `T(d)` (the
median of the last 5: on CPU a chunk's cost grows with the context it attends to, and the torch
backend pads a batch's queries and keys to its longest request's, which a line over tokens does
not see: the model on CPU, 16 decodes, ~10 ms a token by the line, 3.8x a decode step observed
for 14-token chunks), the line's slope until such a batch has run.
`T(d)` is the decode-only batches' own running median (moved along the line's slope to `d` tokens)
once one has run, else the line's `fixed + per_token * d`: the line is fitted over every batch,
and the decode-only steps, many and alike, are where the prediction must be right (the model on
CPU: a line through a few prefill batches put the fixed part at 2.7 s, the decode steps took
0.33 s). The very first batch is not counted (its time includes the backend's warm-up: on CPU
several times a later batch's of its size). With `T(d) = fixed + per_token * d`:
`P <= (ratio - 1) * (fixed / per_token + d)`.

The budget is per prefill: the scheduler gives each queued prefill that could join the batch
(host/batching/queue.py, `decode_tokens`) its own `P`, so a batch with `k` of them may take `k * P`
(`max_batch_tokens` still caps it). With one `P` for all of them, the prefills of several owners
queued at once went one `P` a batch, so while any decode ran the prefills had at most
`(ratio - 1) / ratio` of the backend's time: a load whose prefills need more (8 agents on the model on
CPU, whose turns each prefill their observation: about half the model's time) queued them without
bound and ran at that rate (bench/agent_io.md: 2x slower than never splitting, both ways). The
decodes' bound holds per prefill: one long prompt still runs in chunks of `P`.

So on a device where a step is mostly its fixed part (10 ms + 20 us a token: P ~ 250 + d / 2 at
1.5) prefills go in large chunks, and on CPU, where a token costs about what a step's fixed part
does, in a few tokens. A batch with no running decodes is not capped beyond `max_batch_tokens`.
Before there is a fit a batch with decodes takes as many prefill tokens as its decodes have (at
least `PROBE_TOKENS`): twice the decode-only step's tokens, the range a fit needs, at a cost of at
most about twice a decode step's time where tokens cost everything (the model on CPU). The budget
is never more than twice the most prefill tokens a measured batch had: it grows by doubling as
the batches it allows widen the fit's range (a narrow range's slope can be the timing noise's).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["StepCost", "PROBE_TOKENS", "DEFAULT_RATIO"]

PROBE_TOKENS = 8  # prefill tokens per batch with decodes before there is a fit (or as many as its decodes')
DEFAULT_RATIO = 1.5  # a batch with prefill chunks: at most this many decode-only steps' time
_KEEP = 5  # batches kept per size class (and of the decode-only ones): the median of their times
_SPAN = 2  # a fit needs batches of at least this many times the fewest tokens seen


def _point(batches: deque[tuple[int, float]]) -> tuple[float, float]:
    """A class's point: its batches' mean tokens and median time (a loaded machine's delays are
    outliers one way)."""
    return sum(t for t, _s in batches) / len(batches), statistics.median(s for _t, s in batches)


class StepCost:
    """The running fit of a batch's time on its tokens (not thread-safe: the scheduler thread's)."""

    def __init__(self, ratio: float = DEFAULT_RATIO) -> None:
        if not ratio > 1.0:
            raise ValueError(f"the prefill ratio must be > 1 (a batch may take longer than a decode step), got {ratio}")
        self.ratio = ratio
        self._classes: dict[int, deque[tuple[int, float]]] = {}  # size class -> its last batches
        self._fit: tuple[float, float] | None = None  # (fixed s, per-token s), None until two classes
        self._decode: deque[tuple[int, float]] = deque(maxlen=_KEEP)  # the last decode-only batches
        self._warm = False  # the first batch has run (and was not counted)
        self._most = 0  # the most prefill tokens of a batch timed (the fit's evidence)
        self._dirty = False  # batches observed since the last fit
        self._marginal: deque[float] = deque(maxlen=_KEEP)  # recent prefill batches: s per prefill token over T(d)
        self.budget = 0  # the last budget given to a batch with decodes (0: none yet)

    def observe(self, tokens: int, seconds: float, prefill: int = 0) -> None:
        """A batch of `tokens` new tokens, `prefill` of them prefill (the rest decode steps), took `seconds`."""
        if tokens <= 0 or not seconds > 0:
            return
        if not self._warm:
            self._warm = True
            return
        if prefill <= 0:
            self._decode.append((tokens, seconds))
        elif self._decode and tokens > prefill:  # what its prefill tokens added to a decode step's time
            self._marginal.append((seconds - self._decode_time(tokens - prefill)) / prefill)
        self._most = max(self._most, prefill)
        self._classes.setdefault(tokens.bit_length(), deque(maxlen=_KEEP)).append((tokens, seconds))
        self._dirty = True  # (refitted when next asked: most batches need no budget)

    def _refit(self) -> tuple[float, float] | None:
        pts = [_point(c) for c in self._classes.values()]
        if len(pts) < 2 or max(p[0] for p in pts) < _SPAN * min(p[0] for p in pts):
            return None  # too narrow a range of sizes: the slope would be the timing noise's
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        if sxx <= 0:
            return None
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
        slope = max(slope, 0.0)
        return max(my - slope * mx, 0.0), slope

    @property
    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before two size classes were seen."""
        if self._dirty:
            self._dirty = False
            self._fit = self._refit() or self._fit  # (a fit once made is kept until a new one can be)
        return self._fit

    def prefill_budget(self, decode_tokens: int, max_tokens: int) -> int:
        """Prefill tokens a batch whose decodes bring `decode_tokens` may add (at least 1)."""
        room = max(max_tokens - decode_tokens, 1)
        if decode_tokens <= 0:
            return room
        fit = self.fit
        marginal = statistics.median(self._marginal) if self._marginal else 0.0
        if fit is None and marginal <= 0:  # a probe large enough to give the fit its range
            p = max(PROBE_TOKENS, decode_tokens)
        else:
            per_token = marginal if marginal > 0 else fit[1] if fit is not None else 0.0
            if per_token <= 0:
                p = room
            else:
                p = int((self.ratio - 1.0) * self._decode_time(decode_tokens) / per_token)
            # no further than twice the largest prefill measured: a fit over a narrow range can put
            # the slope near 0 (timing noise), and its budget would be the whole prompt (a device's
            # 10 ms + 20 us: 16 decodes and 16 + 32 tokens measured, once 4,096 at once); the
            # budget grows by doubling as the batches it allows widen the range
            p = min(p, max(2 * self._most, PROBE_TOKENS))
        self.budget = p = max(1, min(p, room))
        return p

    def _decode_time(self, decode_tokens: int) -> float:
        """T(d): a decode-only step's time at `decode_tokens` (its batches' median, moved along the
        line's slope; the line alone before one has run)."""
        fixed, slope = self.fit or (0.0, 0.0)
        if not self._decode:
            return fixed + slope * decode_tokens
        tokens, seconds = _point(self._decode)
        return max(seconds + slope * (decode_tokens - tokens), 1e-6)

    def fit_ms_us(self) -> tuple[float, float]:
        """The fit as (fixed ms, us per prefill token: what recent prefill batches cost, else the
        line's slope); zeros before there is one."""
        fixed, per_token = self.fit or (0.0, 0.0)
        marginal = statistics.median(self._marginal) if self._marginal else 0.0
        per_token = marginal if marginal > 0 else per_token
        return round(1000 * fixed, 3), round(1e6 * per_token, 3)
