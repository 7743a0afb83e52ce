"""BRLE attention masks: run lengths alternating attend / masked, starting with attend."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["brle", "masked_full_pages", "pass_rows"]


def brle(masked: Sequence[bool]) -> list[int]:
    """Encode per-token flags (True = masked) as BRLE runs; the first run is attend (maybe 0)."""
    runs: list[int] = []
    state, n = False, 0
    for m in masked:
        if m == state:
            n += 1
        else:
            runs.append(n)
            state, n = m, 1
    runs.append(n)
    return runs


def _push(runs: list[int], masked: bool) -> None:
    # len(runs) odd <=> the last run is an attend run.
    if (len(runs) % 2 == 1) != masked:
        runs[-1] += 1
    else:
        runs.append(1)


def pass_rows(context: Sequence[bool], new: Sequence[bool]) -> list[list[int]]:
    """One BRLE row per new token: row i covers the context plus new tokens 0..=i.

    A token always attends to itself (its own flag only hides it from later tokens), so no row
    is fully masked.
    """
    base = brle(context)
    rows: list[list[int]] = []
    for i in range(len(new)):
        row = base.copy()
        _push(row, False)
        rows.append(row)
        _push(base, new[i])
    return rows


def masked_full_pages(masked: Sequence[bool], page_size: int) -> set[int]:
    """Indices of the full pages (of `page_size` flags each) whose tokens are all masked."""
    full = len(masked) // page_size
    return {j for j in range(full) if all(masked[j * page_size : (j + 1) * page_size])}
