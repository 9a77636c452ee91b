"""Measure what speculation costs on this machine, once, when a draft model is set up.

The adaptive draft length (spec/adaptive.py) needs two prices in units of one plain target
decode step: a draft step, and a target forward over k + 1 rows for each k. Neither is a
constant: with int8 weights on this CPU, 4 rows cost about what 1 row does and 5 rows about
twice that; with a 1.5B target and a 0.5B draft a draft step costs ~0.3. So we time them
(min of a few runs, in scratch blocks taken from the pool and given back) instead of guessing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from chatserve.batch import BatchItem
from chatserve.block_manager import BlockTable

CONTEXT = 48  # tokens already in the cache when the timed rows arrive: a short chat


NGRAM_STEP_COST = 0.02  # a prompt lookup in Python next to a forward: nearly free


@dataclass(frozen=True)
class SpecCosts:
    draft_step_cost: float  # one draft forward (1 row) / one target decode step
    verify_costs: list[float]  # [k] = target forward over k + 1 rows / one target decode step


@torch.inference_mode()
def measure_spec_costs(models, max_k: int, use_draft_model: bool, reps: int = 3) -> SpecCosts | None:
    """None when the pool cannot spare the scratch blocks (then defaults apply). Without a
    draft model (n-gram proposals) only the verification table is timed."""
    bm = models.block_manager
    table = BlockTable()
    if not bm.allocate(table, CONTEXT + max_k + 1):
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

        target = [best_time(models.target_runner, k + 1) for k in range(max_k + 1)]
        draft = best_time(models.draft_runner, 1) / target[0] if use_draft_model else NGRAM_STEP_COST
    finally:
        bm.free(table)
    return SpecCosts(draft, [t / target[0] for t in target])
