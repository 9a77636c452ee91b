"""Choosing k, the number of draft tokens, from acceptance and measured costs.

AdaptiveDraftLength keeps one request's acceptance estimate (and pauses / probes it);
allocate_drafts splits a step's drafts over the batch from those estimates and the forward
times (spec_costs.py measures them at start-up). Integers and floats only; the engine
measures costs and reports outcomes.

With per-position acceptance rate alpha, a step with k drafts emits on average
    1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)
tokens (the accepted ones and one recovered or bonus token; Leviathan et al.,
arXiv:2211.17192, eq. 1): the j-th draft position adds alpha^j.
"""

from __future__ import annotations


class AcceptanceEMA:
    """alpha, the probability that a draft position is accepted: accepted / attempted positions,
    both as exponential moving averages over steps; the prior weighs one position."""

    def __init__(self, ema: float, prior: float):
        self.ema = ema
        self._accepted = prior
        self._attempted = 1.0

    @property
    def rate(self) -> float:
        return self._accepted / self._attempted

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A step's outcome: the first num_accepted of num_drafted drafts were accepted."""
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"need 0 <= num_accepted <= num_drafted, got {num_accepted}, {num_drafted}")
        if num_drafted == 0:
            return
        # Positions actually tested: the accepted ones plus the rejected one, if any.
        num_attempted = num_accepted + (num_accepted < num_drafted)
        self._accepted += self.ema * (num_accepted - self._accepted)
        self._attempted += self.ema * (num_attempted - self._attempted)


PROBE_EVERY = 16  # AdaptiveDraftLength's default probe_every (a speculation method may set its own)
ACCEPT_EMA = 0.2  # and its default ema (likewise)


class AdaptiveDraftLength:
    """One request's side of choosing k: its acceptance estimate, the pause and the probe.

    alpha, the per-position acceptance rate, is an EMA (AcceptanceEMA). Each step the request
    offers (cap, alpha) and allocate_drafts, which sees the whole batch and the measured
    forward times, decides how many drafts it actually gets (allocated(k)). While alpha is below
    min_accept_rate the request offers nothing; once probe_every steps in a row got no drafts
    (paused, or priced out by the batch) it offers max_k at a probe rate, so that a stale
    estimate can recover.
    """

    def __init__(
        self,
        max_k: int,
        ema: float = ACCEPT_EMA,
        min_accept_rate: float = 0.1,
        probe_every: int = PROBE_EVERY,
        initial_accept_rate: float = 0.8,
    ):
        if max_k < 0 or not 0.0 < ema <= 1.0 or probe_every < 1 or not 0.0 <= initial_accept_rate <= 1.0:
            raise ValueError("need max_k >= 0, 0 < ema <= 1, probe_every >= 1, 0 <= initial_accept_rate <= 1")
        self.max_k = max_k
        self.min_accept_rate = min_accept_rate
        self.probe_every = probe_every
        self.initial_accept_rate = initial_accept_rate
        self._alpha = AcceptanceEMA(ema, initial_accept_rate)
        self._num_steps_at_zero = 0

    @property
    def accept_rate(self) -> float:
        """Current estimate of alpha, the probability that a draft position is accepted."""
        return self._alpha.rate

    def offer(self, probe_accept_rate: float | None = None) -> tuple[int, float]:
        """(the most drafts this request may take this step, the acceptance rate to price them
        at): (0, alpha) while alpha is below min_accept_rate; once probe_every steps in a row
        got no drafts, max_k at probe_accept_rate (default: the initial rate). Report the
        outcome with allocated(k)."""
        if self.probing:
            return self.max_k, self.initial_accept_rate if probe_accept_rate is None else probe_accept_rate
        if self.accept_rate < self.min_accept_rate:
            return 0, self.accept_rate
        return self.max_k, self.accept_rate

    @property
    def probing(self) -> bool:
        """Whether this step's offer is a probe (probe_every steps in a row got no drafts)."""
        return self._num_steps_at_zero + 1 >= self.probe_every

    def allocated(self, k: int) -> None:
        """The k this request got for the step its offer() was for."""
        self._num_steps_at_zero = 0 if k > 0 else self._num_steps_at_zero + 1

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record a step's outcome: the first num_accepted of num_drafted drafts were accepted."""
        self._alpha.update(num_drafted, num_accepted)


def geometric_gains(accept_rate: float, cap: int) -> list[float]:
    """Expected tokens of each draft position at one acceptance rate per position: [alpha, alpha^2, ...]."""
    return [accept_rate ** j for j in range(1, cap + 1)]


def step_seconds(
    ks: list[int],
    target_seconds,
    draft_seconds=None,
    runs_model: list[bool] | None = None,
    setup_seconds: list[float] | None = None,
) -> float:
    """What allocate_drafts prices a step at whose sequences draft ks (same arguments)."""
    seconds = target_seconds(len(ks) + sum(ks))
    if setup_seconds is not None:
        seconds += sum(setup for setup, k in zip(setup_seconds, ks) if k)
    if draft_seconds is not None:
        model_ks = [k for i, k in enumerate(ks) if runs_model is None or runs_model[i]]
        seconds += sum(draft_seconds(n) for s in range(1, max(model_ks, default=0) + 1)
                       if (n := sum(k >= s for k in model_ks)))
    return seconds


def stop_probability(gain: float, power: float = 1.0) -> float:
    """The chain probability P below which a greedy chain stops, for a stop priced at `gain` tokens
    (chain_stop_gains' keep or go_on) where the head's P ** power is what its chains are accepted at:
    gain ** (1 / power) (a price above 1 read as 1: P never exceeds it); the gain itself at power 1;
    a gain <= 0 never stops."""
    if gain <= 0.0 or power == 1.0:
        return gain
    return min(gain, 1.0) ** (1.0 / power)


def chain_drafts(probs, k: int, keep_below: float, go_on_below: float) -> tuple[int, int]:
    """A greedy chain over known probabilities, as EagleMethod.propose and DecodeStack.draft_chain
    stop it: probs[s] is the head's probability of its argmax at draft position s; the chain's
    probability P is their running product. Position s is computed (a head step), its draft kept
    while P >= keep_below, and the chain goes on while it has fewer than k drafts and P >=
    go_on_below. -> (drafts kept, head steps run)."""
    chain, drafted = 1.0, 0
    for s in range(k):
        chain *= float(probs[s])
        if chain < keep_below:
            return drafted, s + 1
        drafted += 1
        if chain < go_on_below:
            return drafted, s + 1
    return drafted, k


def chain_stop_gains(target_seconds, draft_seconds, num_seqs: int, num_drafts: int,
                     made_accept_rate: float) -> tuple[float, float]:
    """Where a proposer that knows how sure it is (an EAGLE head's probability of its chain so
    far, the product of its drafts' probabilities) stops a chain in a step of num_seqs sequences
    allocated num_drafts drafts (same arguments as allocate_drafts): (keep, go_on), in tokens of
    plain decoding (num_seqs tokens per target_seconds(num_seqs); a drafting step beats that rate,
    so this errs towards one draft too many). A verification row costs the drafts' rows' cost
    shared evenly (row by row the table steps at tile edges). A draft already computed costs only
    its row: it is kept while the chain's probability P >= keep. The next draft costs a row and a
    draft step, and is computed only while P x made_accept_rate >= that, i.e. P >= go_on: the
    next draft's chance is the chain's times a draft's (the engine's acceptance of the drafts it
    made, not of the positions it priced, which counts stops as rejections and would fall as the
    chains stop). Offline on SmolLM2's head and code (docs/benchmarks.md session 45), keeping what
    was computed at P >= 0.15 and going on at P >= 0.58 kept 1.43 drafts a verification for 1.59
    head steps (1.76 tokens) where stopping below one price, 0.45, kept 0.81 for 1.77 (1.55); served,
    the extra rows cost more than they brought (code 3-5% slower), so SpecRunner uses go_on at
    made_accept_rate 1.0 as one price for both unless told otherwise."""
    plain = target_seconds(num_seqs)
    row = max(target_seconds(num_seqs + num_drafts) - plain, 0.0) / max(num_drafts, 1)
    step = draft_seconds(1) if draft_seconds is not None else 0.0
    keep = row * num_seqs / plain
    return keep, (keep + step * num_seqs / plain) / max(made_accept_rate, 0.05)


def allocate_drafts(
    gains: list[list[float]],
    target_seconds,
    draft_seconds=None,
    runs_model: list[bool] | None = None,
    setup_seconds: list[float] | None = None,
    max_seconds: float | None = None,
) -> list[int]:
    """Batch-level draft lengths: k_i <= len(gains[i]) for each decoding sequence of one step,
    chosen to maximize expected emitted tokens per second of the whole step.

    gains[i][j - 1] is what sequence i's j-th draft position adds in expected tokens: the
    probability that its first j drafts are all accepted (so the list does not increase;
    geometric_gains for one acceptance rate per position, a proposer's own confidence otherwise).
    A step with n drafts in all runs one target forward over b + n rows (`target_seconds(rows)`),
    and with a draft model (`draft_seconds(rows)`, None when every proposal is free, as n-gram
    and suffix proposals are) max(k) draft steps, step s over the sequences with k_i >= s (only
    those with runs_model[i], when given; the others' proposals are free).
    For a given n the best drafts are the n largest gains (each sequence's gains shrink with j,
    so these form a prefix per sequence): scanning every n is exact without a draft model. With
    one, draft steps cost by count more than by rows, so the scan is repeated for every limit
    K on the steps (positions j <= K only): a close heuristic (tested against enumeration).
    Unlike pricing each sequence as if every other one drafted the same k, this sees that at 3
    sequences one more row is free (int8 GEMV tiles rows in fours) while at 8 sequences a
    single extra row starts a third tile.
    setup_seconds[i], when given, is paid once if sequence i drafts at all (a draft model
    catching up on tokens it has not seen); the scan is repeated without the sequences that
    have one, so a dear setup cannot keep the others from drafting.
    max_seconds, when given, bounds a step that drafts (a stream's gap between deltas); plain
    decoding is always allowed.
    Returns all zeros when no allocation beats plain decoding (b tokens for target_seconds(b)).
    """
    b = len(gains)
    caps = [len(g) for g in gains]
    if b == 0 or not any(caps):
        return [0] * b
    best_rate, best = b / target_seconds(b), []
    candidates = [caps]
    if setup_seconds is not None and any(setup_seconds):  # also try without the sequences that need one
        candidates.append([0 if setup_seconds[i] else c for i, c in enumerate(caps)])
    target_at: dict[int, float] = {}  # rows -> target_seconds(rows): the scans below ask again and again
    draft_at = [0.0] * (b + 1)  # draft_at[a]: one draft step over a sequences (draft_at[0] = 0)
    if draft_seconds is not None:
        draft_at[1:] = [draft_seconds(a) for a in range(1, b + 1)]
    for caps_tried in candidates:
        if not any(caps_tried):
            continue
        # (gain, -j, i): largest gain first; equal gains keep each sequence's positions in order.
        chosen_all = sorted(((gains[i][j - 1], -j, i) for i in range(b) for j in range(1, caps_tried[i] + 1)),
                            reverse=True)
        top = max(caps_tried)
        limits = [top]
        if draft_seconds is not None:
            # A limit past every model-run sequence's cap cuts free proposals alone, which cost no draft
            # step: the scan without a limit (top) sees every such set's drafts or better ones.
            model_top = max((c for i, c in enumerate(caps_tried) if runs_model is None or runs_model[i]), default=0)
            limits = [*range(1, min(model_top, top - 1) + 1), top]
        for max_steps in limits:
            chosen = [g for g in chosen_all if -g[1] <= max_steps]
            tokens, setup = float(b), 0.0
            active_per_step = [0] * (max_steps + 1)  # active_per_step[s]: model-run sequences drafting >= s tokens
            for n, (gain, neg_j, i) in enumerate(chosen, start=1):
                tokens += gain
                if runs_model is None or runs_model[i]:
                    active_per_step[-neg_j] += 1
                if setup_seconds is not None and neg_j == -1:
                    setup += setup_seconds[i]
                rows = b + n
                seconds = target_at.get(rows)
                if seconds is None:
                    seconds = target_at[rows] = target_seconds(rows)
                seconds += setup
                if draft_seconds is not None:
                    seconds += sum(draft_at[a] for a in active_per_step[1:])
                if max_seconds is not None and seconds > max_seconds:
                    break  # a step's seconds only grow with n
                if tokens / seconds > best_rate:
                    best_rate, best = tokens / seconds, chosen[:n]
    ks = [0] * b
    for _, _, i in best:
        ks[i] += 1
    return ks
