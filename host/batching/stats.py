"""The scheduler's counters (`Scheduler.stats`, served in the `stats` query and /metrics)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BATCH_SIZE_BUCKETS", "SchedulerStats"]

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # upper bounds of the batch-size histogram


@dataclass
class SchedulerStats:
    batches: int = 0
    forwards: int = 0
    tokens: int = 0
    copies: int = 0
    queue_wait_s: float = 0.0
    backend_s: float = 0.0
    max_batch_size: int = 0
    errors: int = 0
    lookaheads: int = 0  # predicted steps queued before their owner asked (follow-ups, `submit(lookahead=True)`)
    lookaheads_withdrawn: int = 0  # follow-ups taken back before they ran
    chunked_prefills: int = 0  # forwards split into chunks (`--prefill-chunk`, host/batching/chunks.py)
    prefill_chunks: int = 0  # the chunks they ran as, one batch each
    # `--prefill-chunk auto` (host/batching/stepcost.py): the prefill tokens the last batch with running
    # decodes could take, and the fit of a batch's time it came from (fixed ms + us per token)
    prefill_budget: int = 0
    step_fixed_ms: float = 0.0
    step_token_us: float = 0.0
    # batches by size: [i] counts sizes <= BATCH_SIZE_BUCKETS[i] (and > the bound before); the last, larger ones
    batch_size_counts: list[int] = field(default_factory=lambda: [0] * (len(BATCH_SIZE_BUCKETS) + 1))

    def record(self, size: int, tokens: int, waited: float, start: float, end: float) -> None:
        """One batch of `size` forwards and `tokens` tokens ran from `start` to `end`; its forwards had
        waited `waited` seconds in all."""
        self.batches += 1
        self.forwards += size
        self.tokens += tokens
        self.max_batch_size = max(self.max_batch_size, size)
        self.batch_size_counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += 1
        self.queue_wait_s += waited
        self.backend_s += end - start

    def as_dict(self) -> dict[str, Any]:
        b = max(self.batches, 1)
        f = max(self.forwards, 1)
        return {
            "batches": self.batches, "forwards": self.forwards, "tokens": self.tokens, "copies": self.copies,
            "mean_batch_size": self.forwards / b, "mean_batch_tokens": self.tokens / b,
            "max_batch_size": self.max_batch_size, "mean_queue_wait_ms": 1000 * self.queue_wait_s / f,
            "mean_backend_ms": 1000 * self.backend_s / b, "backend_errors": self.errors,
            "lookaheads": self.lookaheads, "lookaheads_withdrawn": self.lookaheads_withdrawn,
            "chunked_prefills": self.chunked_prefills, "prefill_chunks": self.prefill_chunks,
            "prefill_budget": self.prefill_budget, "step_fixed_ms": self.step_fixed_ms,
            "step_token_us": self.step_token_us,
            "batch_size_counts": list(self.batch_size_counts),
        }
