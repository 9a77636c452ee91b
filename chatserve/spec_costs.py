"""Measure what speculation costs on this machine, once, when speculation is set up.

The adaptive draft length (spec/adaptive.py) prices a step with k drafts in units of one plain
decode step *at the current batch size*: k draft forwards over the batch plus one target
forward over batch * (k + 1) rows, against one target forward over batch rows. None of these
is a constant: with int8 weights on this CPU 4 rows cost about what 1 row does and 5 rows about
twice that, and at 4 sequences a 4-draft verification is 20 rows where plain decoding is 4. So
we time target forwards over a grid of row counts (and the draft's) once, in scratch blocks
taken from the pool and given back, and interpolate in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from chatserve.batch import BatchItem
from chatserve.block_manager import BlockTable

CONTEXT = 48  # tokens already in the cache when the timed rows arrive: a short chat
MAX_ROWS = 64  # beyond this, cost is extrapolated in proportion to rows
NGRAM_STEP_COST = 0.02  # a prompt lookup in Python next to a forward: nearly free


@dataclass(frozen=True)
class SpecCosts:
    target_seconds: dict[int, float]  # rows -> one target forward over that many rows
    draft_seconds: dict[int, float]  # rows -> one draft forward; empty without a draft model

    def target(self, rows: int) -> float:
        """Seconds of one target forward over `rows` rows (interpolated)."""
        return _interpolate(self.target_seconds, rows)

    def draft(self, rows: int) -> float:
        """Seconds of one draft forward over `rows` rows (interpolated); 0 without a draft model."""
        return _interpolate(self.draft_seconds, rows) if self.draft_seconds else 0.0

    def batch_costs(self, batch_size: int, max_k: int, use_draft_model: bool) -> tuple[float, list[float]]:
        """(draft step cost, [verify cost for k = 0..max_k]) in plain steps at batch_size."""
        plain = _interpolate(self.target_seconds, batch_size)
        verify = [_interpolate(self.target_seconds, batch_size * (k + 1)) / plain for k in range(max_k + 1)]
        if use_draft_model and self.draft_seconds:
            return _interpolate(self.draft_seconds, batch_size) / plain, verify
        return NGRAM_STEP_COST, verify

    def table(self, max_batch: int, max_k: int, use_draft_model: bool) -> list[tuple[float, list[float]]]:
        """batch_costs for batch sizes 1..max_batch (index batch_size - 1)."""
        return [self.batch_costs(b, max_k, use_draft_model) for b in range(1, max_batch + 1)]


def _interpolate(seconds: dict[int, float], rows: int) -> float:
    """The time of the nearest measured row count at or above `rows`; proportional to rows past
    the largest. Rounding up, not a line between points: kernels cost in steps (int8 GEMV
    tiles rows in fours, so 9 rows cost what 12 do, not a quarter of the way from 8 to 12), and
    the grid below has a point at the top of each step up to 32 rows."""
    points = sorted(seconds)
    if rows > points[-1]:
        return seconds[points[-1]] * rows / points[-1]
    return seconds[next(p for p in points if p >= rows)]


def row_grid(max_rows: int, max_k: int) -> list[int]:
    """Every row count up to max_k + 1, then every multiple of 4 to 32 (the int8 GEMV's steps),
    then a coarser grid."""
    grid = set(range(1, max_k + 2)) | set(range(8, 33, 4)) | {48, 64}
    return sorted(r for r in grid if r <= max(max_rows, 1))


@torch.inference_mode()
def measure_spec_costs(models, max_k: int, max_num_seqs: int, use_draft_model: bool,
                       reps: int = 2) -> SpecCosts | None:
    """None when the pool cannot spare the scratch blocks (then defaults apply). Without a
    draft model (n-gram proposals) only the target is timed."""
    max_rows = min(MAX_ROWS, max_num_seqs * (max_k + 1))
    bm = models.block_manager
    table = BlockTable()
    if not bm.allocate(table, CONTEXT + max_rows):
        return None
    try:
        def best_time(runner, num_rows: int) -> float:
            item = BatchItem([0] * num_rows, CONTEXT, table.block_ids, num_rows)
            runner.run([item])  # warm-up
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                runner.run([item])
                times.append(time.perf_counter() - start)
            return min(times)

        target = {rows: best_time(models.target_runner, rows) for rows in row_grid(max_rows, max_k)}
        draft = {}
        if use_draft_model:
            draft = {rows: best_time(models.draft_runner, rows) for rows in row_grid(max_num_seqs, 3)}
    finally:
        bm.free(table)
    return SpecCosts(target, draft)
