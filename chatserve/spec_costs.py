"""Measure what speculation costs on this machine, once, when speculation is set up.

allocate_drafts (spec/adaptive.py) prices a step by its forwards: one target forward over
batch + drafts rows, and with a draft model one draft forward per draft position over the
sequences still drafting. None of these is a constant: with int8 weights on this CPU 4 rows
cost about what 1 row does and 5 rows about twice that, and at 4 sequences a 4-draft
verification is 20 rows where plain decoding is 4. So we time target forwards over a grid of
row counts (and the draft's) once, in scratch blocks taken from the pool and given back, and
look up in between. When the pool cannot spare the blocks, assumed_spec_costs stands in.

Timed at start-up, a forward is not what the same rows cost in service (another tenant's steal,
caches the other models left cold, contexts that grow): on this VM two sequences' steps of 2, 3
and 4 rows took 55, 72 and 90 ms in the engine where a table of best timings said +7-10 ms a row
(the typical forward of 3-5 rows is 20-40% above the best one), and speculation at batch 2 lost
10-27% buying rows at half their price. So the table takes the median of its rounds, and
ObservedForwards keeps the engine's own decode forwards and rescales the table: by default
(SpecRunner.reshapes_table) its shape stays and one ratio, service's latest forwards over it, sets
its level; each row count priced by its own forwards kept a count the allocation seldom buys at an
old, dear price (session 54), while the counts bought among the latest forwards cost their own
median (the start-up shape is noise at ±0.5-1 ms a row; session 55). The same goes for an EAGLE
head's draft positions: propose times each (the head's step with its drafting glue, beside a
target forward that left the caches cold) and
a second ObservedForwards rescales the head's table: on SmolLM2 a position cost 1.2-1.6 ms served
where the start-up table said 1.0-1.6 (and 0.6 ms in a loop; docs/benchmarks.md session 45).

Measuring the table took about half of a server's start (Qwen 1.5B with its head on 2 cores), so
cached_spec_costs keeps it on disk, keyed by the machine and what was loaded, and a later start on the
same machine and models reads it back: ObservedForwards rescales a table from service anyway, so one
measured at an earlier start does what one measured now would.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chatserve.batch import BatchItem
from chatserve.block_manager import BlockTable
from chatserve.head_store import write_atomic
from spec.sampling import argmax_rows

CONTEXT = 48  # tokens already in the cache when the timed rows arrive: a short chat
MAX_ROWS = 64  # beyond this, cost is extrapolated in proportion to rows
ROUNDS = 5  # timings of each forward of up to FEW_ROWS rows (median_of_rounds); 2 for longer ones
FEW_ROWS = 16
# A draft that has not seen a request's tokens catches up on them in forwards with no logit
# rows to speak of (one): priced from these points, not from decode rows (Qwen 0.5B, 2 threads:
# 64 rows ~84 ms, 256 ~311 ms; extrapolating from 16 decode rows would say 160 and 960).
CATCH_UP_ROWS = (16, 32, 64, 128, 256)
# Assumed when nothing can be measured, in units of a one-row target forward: each extra row
# adds 5% (the weights are read once per forward), a draft forward costs 35% (a 0.5B draft
# next to a 1.5B target) plus 1% per row.
ASSUMED_ROW_COST = 0.05
ASSUMED_DRAFT_COST = 0.35
ASSUMED_DRAFT_ROW_COST = 0.01
ASSUMED_HEAD_COST = 0.07  # an EAGLE head step: 5-7% of a one-row target step on Qwen 1.5B (measured)


@dataclass(frozen=True)
class SpecCosts:
    target_seconds: dict[int, float]  # rows -> one target forward over that many rows
    draft_seconds: dict[int, float]  # rows -> one draft forward (a logit row each); empty without a draft model
    catch_up_seconds: dict[int, float] = field(default_factory=dict)  # rows -> a draft forward with one logit row
    head_seconds: dict[int, float] = field(default_factory=dict)  # rows -> one EAGLE head draft step; empty without

    def __post_init__(self):  # the row counts in order, once (allocate_drafts looks up ~100 a step)
        object.__setattr__(self, "_target_rows", sorted(self.target_seconds))
        object.__setattr__(self, "_draft_rows", sorted(self.draft_seconds))
        object.__setattr__(self, "_catch_up_rows", sorted(self.catch_up_seconds))
        object.__setattr__(self, "_head_rows", sorted(self.head_seconds))

    def target(self, rows: int) -> float:
        """Seconds of one target forward over `rows` rows (looked up)."""
        return _lookup(self.target_seconds, self._target_rows, rows)

    def step_target(self, num_decodes: int, prefill_rows: int = 0):
        """rows -> seconds, as allocate_drafts should price a step that also feeds prefill_rows
        prompt tokens: a decode-only step's time for the decodes (the rate drafts must beat is
        what those sequences get without drafts), plus what rows past them add next to the
        prompt chunk. That chunk makes the forward compute-bound, with no int8 tile steps: on
        Qwen 1.5B, 4 -> 5 rows alone cost +48 ms, next to 200 prompt rows ~+4 ms."""
        if not prefill_rows:
            return self.target
        plain = self.target(num_decodes) - self.target(prefill_rows + num_decodes)
        return lambda rows: plain + self.target(prefill_rows + rows)

    def draft(self, rows: int) -> float:
        """Seconds of one draft forward over `rows` rows (looked up); 0 without a draft model."""
        return _lookup(self.draft_seconds, self._draft_rows, rows) if self.draft_seconds else 0.0

    def head(self, rows: int) -> float:
        """Seconds of one EAGLE head draft step over `rows` rows (its layer, norm and trimmed LM
        head; looked up); 0 without a head."""
        return _lookup(self.head_seconds, self._head_rows, rows) if self.head_seconds else 0.0

    def draft_step(self, kind: str, rows: int) -> float:
        """One draft position's forward for `rows` sequences: "draft" (the draft model) or "head"."""
        return self.draft(rows) if kind == "draft" else self.head(rows)

    def catch_up(self, rows: int) -> float:
        """Seconds of a draft forward feeding `rows` tokens it has not seen (one logit row);
        from the decode grid when no catch-up was measured."""
        if not self.catch_up_seconds:
            return self.draft(rows)
        return _lookup(self.catch_up_seconds, self._catch_up_rows, rows)

    def max_catch_up_rows(self, seconds: float) -> int:
        """The largest measured catch-up that fits in `seconds` with every smaller one (0 if
        the smallest does not): a noisy point above a slow one must not widen the chunk."""
        fits = 0
        for rows in self._catch_up_rows or self._draft_rows:
            if self.catch_up(rows) > seconds:
                break
            fits = rows
        return fits


def _lookup(seconds: dict[int, float], points: list[int], rows: int) -> float:
    """The time of the nearest measured row count at or above `rows` (points: the sorted keys);
    proportional to rows past the largest. Rounding up, not a line between points: kernels cost
    in steps (int8 GEMV tiles rows in fours, so 9 rows cost what 12 do, not a quarter of the way
    from 8 to 12), and the grid below has a point at the top of each step up to 32 rows."""
    if rows > points[-1]:
        return seconds[points[-1]] * rows / points[-1]
    return seconds[points[bisect.bisect_left(points, rows)]]


def row_grid(max_rows: int, max_k: int) -> list[int]:
    """Every row count up to max_k + 1 and at least up to 8, then every multiple of 4 to 32 (the
    int8 GEMV's steps), then a coarser grid. At least to 8: batches of a few sequences step one
    row at a time there, each row dearer (SmolLM2 served: 2 rows 6.1 ms, 3 ~8, 4 ~10.5, 5 ~13,
    8 ~18; docs/benchmarks.md session 47), and a table with max_k = 1 (points 1, 2, 8) priced 3
    or 4 rows, two sequences drafting one each, as 8: adaptive k <= 1 on code at batch 2 ran at
    0.88-0.89x of drafting one always, 0.94x with these points."""
    grid = set(range(1, max(max_k + 2, 9))) | set(range(8, 33, 4)) | {48, 64}
    return sorted(r for r in grid if r <= max(max_rows, 1))


def assumed_spec_costs(max_rows: int, has_draft_model: bool, has_head: bool = False) -> SpecCosts:
    """A linear model (the ASSUMED_* constants) on every row count up to max_rows."""
    rows = range(1, max(max_rows, 1) + 1)
    target = {r: 1.0 + ASSUMED_ROW_COST * (r - 1) for r in rows}
    head = {r: ASSUMED_HEAD_COST * (1.0 + ASSUMED_ROW_COST * (r - 1)) for r in rows} if has_head else {}
    if not has_draft_model:
        return SpecCosts(target, {}, head_seconds=head)
    draft = {r: ASSUMED_DRAFT_COST + ASSUMED_DRAFT_ROW_COST * (r - 1) for r in rows}
    catch_up = {r: ASSUMED_DRAFT_COST + ASSUMED_DRAFT_ROW_COST * (r - 1) for r in CATCH_UP_ROWS}
    return SpecCosts(target, draft, catch_up, head)


def time_forward(runner, table: BlockTable, context: int, num_rows: int, num_logits: int | None = None,
                 reps: int = 2) -> float:
    """Seconds of one forward of `runner` over `num_rows` rows placed after `context` tokens of
    `table` (scratch blocks: the rows' KV is written and left there), best of `reps` after a warm-up."""
    run = _forward(runner, table, context, num_rows, num_logits)
    run()  # warm-up
    return min(_timed(run) for _ in range(reps))


def _forward(runner, table: BlockTable, context: int, num_rows: int, num_logits: int | None = None):
    item = BatchItem([0] * num_rows, context, table.block_ids, num_logits or num_rows)
    return lambda: runner.run([item])


def _head_step(head_runner, table: BlockTable, context: int, num_rows: int):
    """One EAGLE draft step over `num_rows` sequences, as EagleMethod.propose runs it: the head's
    layer over one row each, its norm, its LM head over the kept ids and their argmax (the rows
    stand for different requests at the same position of the table; only the time is used).
    Not compute_logits' [vocab] rows, which propose no longer builds. (On SmolLM2 this times
    ~1 ms a row, where the step takes ~0.6 ms in a loop: the rounds run it after target forwards,
    its weights out of cache; served positions take more, and correct it: ObservedForwards.)"""
    items = [BatchItem([0], context, table.block_ids, 1) for _ in range(num_rows)]
    features = head_runner.block_features.new_zeros(num_rows, head_runner.head.hidden_size)
    head = head_runner.head
    return lambda: argmax_rows(head.kept_logits(head.norm(head_runner.run(items, features))).cpu())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_of_rounds(forwards: dict, rounds: dict) -> dict:
    """{key: median seconds} over `rounds[key]` timings of each forward, taken in rounds that visit
    every key once (after one warm-up each) rather than key by key. A slow spell of the machine
    (another tenant's steal: on this 2-core VM one measured 5 rows at 76 ms and, a minute later,
    118 ms) then slows one round of many keys, not every timing of a few, and the median keeps
    the table's shape, which is all allocate_drafts compares. The median, not the best: a step
    costs what it typically costs (two sequences' 3 rows: best of 8 53 ms, median 74), and the
    best of rounds priced rows past one at half what they cost in service."""
    for fn in forwards.values():
        fn()
    seen = {key: [] for key in forwards}
    for r in range(max(rounds.values(), default=0)):
        for key, fn in forwards.items():
            if r < rounds[key]:
                seen[key].append(_timed(fn))
    return {key: statistics.median(times) for key, times in seen.items()}


class ObservedForwards:
    """The target's decode-only forwards as the engine times them (with their rows' verification and
    sampling, which the start-up table leaves out: at T > 0 a row's sampling is a real share of a
    step), or with table="head_seconds" / "draft_seconds" an EAGLE head's or a draft model's draft
    steps as propose times them (with their drafting glue), keyed by the sequences drafting: the
    latest `window` per row count. corrected(costs) rescales that start-up table by what service
    says: a row count seen at least MIN_SEEN times costs the median of its forwards; one not seen
    takes the ratio (seen / table) of the nearest row count seen, so the table's shape stands where
    nothing says otherwise; and the result never falls as rows grow (a cheap-looking 6 rows beside
    dear 5 would buy a row for nothing). A median of a window, not a running mean: one slow forward
    moves nothing, a slow minute moves the price while it lasts. Rows that service never buys are
    never measured again, but the rows that are bought are: a batch that stops drafting because
    drafts looked dear measures its plain steps, and the probes of free proposals keep one more row
    measured. A count bought seldom is measured seldom, though, and its window stays as old as its
    forwards: with reshape=False, what SpecRunner uses for the target's table, corrected() keeps the
    start-up shape instead and takes only its level from service. That shape is noise at ±0.5-1 ms a
    row on a 2-core VM (tables of one engine measured again: the 4th row +0.50 to +2.43 ms), so with
    recent=True (SpecRunner's) a row count seen MIN_SEEN times among the latest 3 x window forwards
    costs their median: what the steps being bought cost now, and nothing older than the ratio's
    own window (docs/benchmarks.md session 55)."""

    WINDOW = 9
    MIN_SEEN = 3
    # Without reshape, a table is rebuilt only once the one ratio has moved this share from the one
    # it was built at: the engine asks after every decode forward, and a rebuild (a table, the
    # costs around it) ran ~60 us of Python on the caches a forward left cold, ~1% of a SmolLM2 step.
    RATIO_STEP = 0.01

    def __init__(self, window: int = WINDOW, table: str = "target_seconds", reshape: bool = True,
                 recent: bool = False):
        self.window, self.table = window, table  # table: the SpecCosts field corrected
        self.recent = recent  # without reshape: counts seen MIN_SEEN times among the latest at their median
        self._seen: dict[int, deque[float]] = {}
        self._latest: deque[tuple[int, float]] = deque(maxlen=3 * window)  # (rows, seconds), any row count
        self._medians: dict[int, float] = {}  # rows -> its window's median, once MIN_SEEN are in (kept as they come)
        self._reshape = reshape  # False: one ratio over the start-up shape (corrected_table)
        self._nearest: tuple[tuple, list[tuple[int, int]]] = ((), [])  # ((seen, table rows), [(rows, nearest)])
        # without reshape: the latest forwards' ratios over a start-up table (the one passed last) and how
        # many of the latest are still to price; with recent, each row count's times among the latest,
        # their medians (MIN_SEEN of them or more) and the counts whose median is to be taken again (a
        # forward came or left); the table last returned with the ratio and medians it was built at
        self._ratios: deque[float] = deque(maxlen=3 * window)
        self._unpriced = 0
        self._recent: dict[int, deque[float]] = {}
        self._own: dict[int, float] = {}
        self._stale: set[int] = set()
        self._scaled: tuple[dict | None, float, dict, dict] = (None, 0.0, {}, {})  # (start-up, ratio, medians, table)

    @property
    def reshape(self) -> bool:
        return self._reshape

    @reshape.setter
    def reshape(self, reshape: bool) -> None:
        """Switch modes; the per-count medians only reshape reads are taken again for it."""
        if reshape and not self._reshape:
            self._medians = {rows: statistics.median(times) for rows, times in self._seen.items()
                             if len(times) >= self.MIN_SEEN}
        self._reshape = reshape

    def observe(self, rows: int, seconds: float) -> bool:
        """Whether the observation changed what corrected() returns (its row count's median), or
        without reshape may have (the one ratio: from MIN_SEEN forwards on)."""
        times = self._seen.setdefault(rows, deque(maxlen=self.window))
        times.append(seconds)
        if len(self._latest) == self._latest.maxlen:  # the oldest leaves the latest: its count's recent times too
            oldest = self._latest[0][0]
            self._recent[oldest].popleft()
            self._stale.add(oldest)
        self._latest.append((rows, seconds))
        self._recent.setdefault(rows, deque()).append(seconds)
        self._stale.add(rows)
        self._unpriced = min(self._unpriced + 1, len(self._latest))
        if not self._reshape:  # its count's median is taken when reshape is switched on
            return len(self._latest) >= self.MIN_SEEN
        if len(times) < self.MIN_SEEN:
            return False
        median = statistics.median(times)
        changed = self._medians.get(rows) != median
        self._medians[rows] = median
        return changed

    def corrected(self, costs: SpecCosts) -> SpecCosts:
        table = self.corrected_table(getattr(costs, self.table))
        return costs if table is None else dataclasses.replace(costs, **{self.table: table})

    def corrected_table(self, seconds: dict[int, float]) -> dict[int, float] | None:
        """The start-up table `seconds` (rows -> seconds) as corrected() rescales it; None when it is
        empty or no row count has been seen MIN_SEEN times. The engine asks after each observation
        that moved a median: only that row count's is new then (observe keeps each as it comes).
        Without reshape: the start-up table's shape, scaled by one ratio, the median of the latest
        3 x window forwards' over the table (any row count; None before MIN_SEEN of them), and with
        recent the counts seen MIN_SEEN times among those at their median; while the ratio and
        those medians stay within RATIO_STEP of what the table last returned for the same `seconds`
        was built at, that very table (the caller may keep what it built from it)."""
        if not seconds or not (self._medians if self.reshape else len(self._latest) >= self.MIN_SEEN):
            return None
        points = sorted(seconds)
        if self.reshape:
            ratios = {rows: median / _lookup(seconds, points, rows) for rows, median in self._medians.items()}
            prices = ((rows, seconds[rows] * ratios[nearest])
                      for rows, nearest in self._nearest_seen(tuple(sorted(ratios)), points))
        else:
            ratio = self._ratio(seconds, points)
            own = self._recent_medians() if self.recent else {}
            start_up, built_at, built_own, scaled = self._scaled
            if (start_up is seconds and self._within_step(ratio, built_at) and own.keys() == built_own.keys()
                    and all(self._within_step(own[rows], built_own[rows]) for rows in own)):
                return scaled
            prices = ((rows, own[rows] if rows in own else seconds[rows] * ratio) for rows in points)
        table, floor = {}, 0.0
        for rows, price in prices:
            floor = max(floor, price)
            table[rows] = floor
        if not self.reshape:
            self._scaled = (seconds, ratio, own, table)
        return table

    def _within_step(self, value: float, built_at: float) -> bool:
        return abs(value - built_at) <= self.RATIO_STEP * built_at

    def _recent_medians(self) -> dict[int, float]:
        """rows -> the median of its forwards among the latest 3 x window, for the counts seen MIN_SEEN
        times there (taken again only for the counts a forward came to or left: one or two a step)."""
        for rows in self._stale:
            times = self._recent[rows]
            if len(times) >= self.MIN_SEEN:
                self._own[rows] = statistics.median(times)
            else:
                self._own.pop(rows, None)
        self._stale.clear()
        return dict(self._own)

    def _ratio(self, seconds: dict[int, float], points: list[int]) -> float:
        """The median of the latest forwards' times over `seconds`' price for their rows, each priced
        once as it comes (all again when another table is passed)."""
        if self._scaled[0] is not seconds:
            self._ratios.clear()
            self._unpriced = len(self._latest)
        for i in range(len(self._latest) - self._unpriced, len(self._latest)):
            rows, t = self._latest[i]
            self._ratios.append(t / _lookup(seconds, points, rows))
        self._unpriced = 0
        return statistics.median(self._ratios)

    def _nearest_seen(self, seen: tuple[int, ...], points: list[int]) -> list[tuple[int, int]]:
        """(rows, the nearest seen row count) for each of the table's rows, a tie to the smaller;
        kept while the seen counts stay (they change rarely, the engine asks every step: the
        search took ~0.1 ms of a step on a 2-core VM)."""
        key = (seen, tuple(points))
        if self._nearest[0] != key:
            pairs = [(rows, min(seen, key=lambda r: (abs(r - rows), r))) for rows in points]
            self._nearest = (key, pairs)
        return self._nearest[1]


COSTS_FORMAT = 1  # raise when what measure_spec_costs times changes: older files are measured again
_TABLES = ("target_seconds", "draft_seconds", "catch_up_seconds", "head_seconds")


def costs_key(fingerprint: str, max_k: int, max_num_seqs: int, max_rows_k: int | None) -> str:
    """A digest of what a measured table depends on: the loaded models and their settings
    (LoadedModels.fingerprint), the grid asked for, this machine's CPU and threads, the torch and
    kernel builds, and the CHATSERVE_* switches of the kernels."""
    from kernels.cpu_ext import build_environment

    parts = {"format": COSTS_FORMAT, "models": fingerprint, "max_k": max_k, "max_num_seqs": max_num_seqs,
             "max_rows_k": max_rows_k, "grid": [CONTEXT, MAX_ROWS, ROUNDS, FEW_ROWS, list(CATCH_UP_ROWS)],
             "threads": torch.get_num_threads(), **build_environment()}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def cached_spec_costs(models, max_k: int, max_num_seqs: int, max_rows_k: int | None,
                      cache_dir: str | Path | None) -> tuple[SpecCosts | None, str]:
    """(measure_spec_costs' table, where it came from). With a cache_dir and models that say what
    they are (a fingerprint), a table measured before for the same key is read back, and a new one
    is written there; a file that does not parse is measured again and replaced."""
    if cache_dir is None or not models.fingerprint:
        return measure_spec_costs(models, max_k, max_num_seqs, max_rows_k), "measured"
    path = Path(cache_dir).expanduser() / f"{costs_key(models.fingerprint, max_k, max_num_seqs, max_rows_k)}.json"
    try:
        record = json.loads(path.read_text())
        tables = {name: {int(rows): float(t) for rows, t in record[name].items()} for name in _TABLES}
        return SpecCosts(**tables), f"read from {path} (measured {record['measured_at']})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    costs = measure_spec_costs(models, max_k, max_num_seqs, max_rows_k)
    if costs is None:
        return None, "measured"
    record = {name: getattr(costs, name) for name in _TABLES}
    record["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1)))
    return costs, f"measured, saved to {path}"


@torch.inference_mode()
def measure_spec_costs(models, max_k: int, max_num_seqs: int, max_rows_k: int | None = None,
                       rounds: int = ROUNDS) -> SpecCosts | None:
    """None when the pool cannot spare the scratch blocks (then assumed_spec_costs apply).
    Every row count up to max_k + 1 is timed, then row_grid's steps up to max_num_seqs
    sequences of max_rows_k drafts (default max_k; free proposals may draft further).
    A draft model's forwards are timed only with one (models.draft_runner), an EAGLE head's steps
    only with one (models.eagle_runner). Forwards of up to FEW_ROWS rows (the steps that batch-1
    and batch-2 drafts choose between) take the median of `rounds`, longer ones of 2 (each lasts
    long enough to average a slow spell out)."""
    max_rows = min(MAX_ROWS, max_num_seqs * (max(max_k, max_rows_k or 0) + 1))
    bm = models.block_manager
    table = BlockTable()
    has_draft_model = models.draft_runner is not None
    catch_up_rows = CATCH_UP_ROWS if has_draft_model else ()
    if not bm.allocate(table, CONTEXT + max((max_rows, *catch_up_rows))):
        catch_up_rows = ()  # a small pool: price catch-ups from the decode grid instead
        if not bm.allocate(table, CONTEXT + max_rows):
            return None
    try:
        forwards, num_rounds = {}, {}
        for kind, runner, grid, num_logits in (
                ("target", models.target_runner, row_grid(max_rows, max_k), None),
                ("draft", models.draft_runner, row_grid(max_num_seqs, 3) if has_draft_model else (), None),
                ("catch_up", models.draft_runner, catch_up_rows, 1)):
            for rows in grid:
                forwards[kind, rows] = _forward(runner, table, CONTEXT, rows, num_logits)
                num_rounds[kind, rows] = rounds if rows <= FEW_ROWS and kind != "catch_up" else min(rounds, 2)
        for rows in row_grid(max_num_seqs, 3) if models.eagle_runner is not None else ():
            forwards["head", rows] = _head_step(models.eagle_runner, table, CONTEXT, rows)
            num_rounds["head", rows] = rounds
        typical = median_of_rounds(forwards, num_rounds)
    finally:
        bm.free(table)
    tables = {kind: {rows: t for (k, rows), t in typical.items() if k == kind}
              for kind in ("target", "draft", "catch_up", "head")}
    return SpecCosts(tables["target"], tables["draft"], tables["catch_up"], tables["head"])
