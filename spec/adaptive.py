"""Choosing k, the number of draft tokens, from acceptance and measured costs.

AdaptiveDraftLength keeps one request's acceptance estimate (and pauses / probes it);
allocate_drafts splits a step's drafts over the batch from those estimates and the measured
forward times. (AdaptiveDraftLength.next_k, a per-request choice on relative costs, is what
the engine falls back to when the pool had no room to measure.) Integers and floats only; the
engine measures costs and reports outcomes.
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


class AdaptiveDraftLength:
    """Picks k in [0, max_k] to maximize expected emitted tokens per unit of cost.

    With per-position acceptance rate alpha (an EMA), a step with k drafts emits on average
        expected_tokens(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)
    tokens (accepted + one recovered or bonus; Leviathan et al., arXiv:2211.17192, eq. 1).
    Costs are in units of one plain target decode step at the current batch size, so plain
    decoding (k = 0) emits 1 token per unit. For k >= 1 (a linear model):
        cost(k) = k * draft_step_cost + verify_base_cost + verify_per_token_cost * k * batch_size
    The base term is the weight reads of one target forward; the per-token term is the
    compute for the k extra positions of every sequence, which is what grows with batch.
    `batch_costs[batch_size - 1] = (draft_step_cost, verify_costs)` measured for each batch
    size prices batched steps the same way: at 4 sequences, 4 drafts mean 20 verified rows.
    A measured table `verify_costs[k]` (a forward over k + 1 rows, in plain decode steps)
    replaces the first two terms when given: real kernels are not linear in rows (torch's
    packed int8 GEMV on this CPU handles rows in fours, so 5 rows cost ~2x as much as 4).
    next_k returns 0 when no k beats plain decoding, or when alpha < min_accept_rate. While
    at 0, every probe_every-th call drafts again (with the k a fresh request would get) so
    that the estimate can recover.
    """

    def __init__(
        self,
        max_k: int,
        ema: float = 0.2,
        min_accept_rate: float = 0.1,
        probe_every: int = 16,
        initial_accept_rate: float = 0.8,
        draft_step_cost: float = 0.5,
        verify_base_cost: float = 1.0,
        verify_per_token_cost: float = 0.05,
        verify_costs: list[float] | None = None,
        batch_costs: list[tuple[float, list[float]]] | None = None,
    ):
        if max_k < 0 or not 0.0 < ema <= 1.0 or probe_every < 1 or not 0.0 <= initial_accept_rate <= 1.0:
            raise ValueError("need max_k >= 0, 0 < ema <= 1, probe_every >= 1, 0 <= initial_accept_rate <= 1")
        self.max_k = max_k
        self.ema = ema
        self.min_accept_rate = min_accept_rate
        self.probe_every = probe_every
        self.initial_accept_rate = initial_accept_rate
        self.set_costs(draft_step_cost, verify_base_cost, verify_per_token_cost, verify_costs)
        # Measured (draft step cost, verify costs) per batch size (index batch_size - 1); when
        # given, they price every batch size instead of the linear per-token term.
        self.batch_costs = batch_costs
        self._alpha = AcceptanceEMA(ema, initial_accept_rate)
        self._num_steps_at_zero = 0

    def set_costs(
        self,
        draft_step_cost: float,
        verify_base_cost: float,
        verify_per_token_cost: float,
        verify_costs: list[float] | None = None,
    ) -> None:
        """Relative costs, in units of one target decode step (the engine measures them)."""
        if min(draft_step_cost, verify_base_cost, verify_per_token_cost, *(verify_costs or [0.0])) < 0:
            raise ValueError("costs must be >= 0")
        self.draft_step_cost = draft_step_cost
        self.verify_base_cost = verify_base_cost
        self.verify_per_token_cost = verify_per_token_cost
        self.verify_costs = list(verify_costs) if verify_costs else None

    @property
    def accept_rate(self) -> float:
        """Current estimate of alpha, the probability that a draft position is accepted."""
        return self._alpha.rate

    def next_k(self, batch_size: int = 1) -> int:
        """k for this request's next step; call once per step."""
        if self.accept_rate >= self.min_accept_rate:
            k = self._best_k(self.accept_rate, batch_size)
            if k > 0:
                self._num_steps_at_zero = 0
                return k
        self._num_steps_at_zero += 1
        if self._num_steps_at_zero < self.probe_every:
            return 0
        self._num_steps_at_zero = 0
        return self._best_k(self.initial_accept_rate, batch_size)

    def offer(self, probe_accept_rate: float | None = None) -> tuple[int, float]:
        """For a batch-level choice (allocate_drafts): (the most drafts this request may take
        this step, the acceptance rate to price them at). (0, alpha) while alpha is below
        min_accept_rate; once probe_every steps in a row got no drafts, max_k at
        probe_accept_rate (default: the initial rate), so that a stale estimate can recover.
        Report the outcome with allocated(k)."""
        if self._num_steps_at_zero + 1 >= self.probe_every:
            return self.max_k, self.initial_accept_rate if probe_accept_rate is None else probe_accept_rate
        if self.accept_rate < self.min_accept_rate:
            return 0, self.accept_rate
        return self.max_k, self.accept_rate

    def allocated(self, k: int) -> None:
        """The k this request got for the step its offer() was for."""
        self._num_steps_at_zero = 0 if k > 0 else self._num_steps_at_zero + 1

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """Record a step's outcome: the first num_accepted of num_drafted drafts were accepted."""
        self._alpha.update(num_drafted, num_accepted)

    def expected_tokens(self, k: int, accept_rate: float | None = None) -> float:
        """Mean tokens emitted by a step with k drafts: (1 - alpha^(k+1)) / (1 - alpha)."""
        alpha = self.accept_rate if accept_rate is None else accept_rate
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    def cost(self, k: int, batch_size: int = 1) -> float:
        """Cost of a step with k drafts, in target decode steps at this batch size."""
        if k == 0:
            return 1.0
        if self.batch_costs:
            draft_step_cost, verify_costs = self.batch_costs[min(batch_size, len(self.batch_costs)) - 1]
            if k < len(verify_costs):
                return k * draft_step_cost + verify_costs[k]
        if self.verify_costs is not None and k < len(self.verify_costs):
            verify_cost = self.verify_costs[k] + self.verify_per_token_cost * k * (batch_size - 1)
        else:
            verify_cost = self.verify_base_cost + self.verify_per_token_cost * k * batch_size
        return k * self.draft_step_cost + verify_cost

    def _best_k(self, accept_rate: float, batch_size: int) -> int:
        best_k, best_rate = 0, 1.0  # plain decoding: 1 token per unit of cost
        for k in range(1, self.max_k + 1):
            rate = self.expected_tokens(k, accept_rate) / self.cost(k, batch_size)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k


def allocate_drafts(
    accept_rates: list[float],
    caps: list[int],
    target_seconds,
    draft_seconds=None,
    uses_draft_model: list[bool] | None = None,
) -> list[int]:
    """Batch-level draft lengths: k_i <= caps[i] for each decoding sequence of one step, chosen
    to maximize expected emitted tokens per second of the whole step.

    Sequence i's j-th draft position adds accept_rates[i]**j expected tokens (it counts only if
    the j - 1 before it were accepted). A step with n drafts in all runs one target forward over
    b + n rows (`target_seconds(rows)`), and with a draft model (`draft_seconds(rows)`, None for
    free proposals such as n-gram) max(k) draft steps, step s over the sequences with k_i >= s
    (only those with uses_draft_model[i], when given; the others' proposals are free).
    For a given n the best drafts are the n largest gains (each sequence's gains shrink with j,
    so these form a prefix per sequence): scanning every n is exact without a draft model. With
    one, draft steps cost by count more than by rows, so the scan is repeated for every limit
    K on the steps (positions j <= K only): a close heuristic (tested against enumeration).
    Unlike pricing each sequence as if every other one drafted the same k, this sees that at 3
    sequences one more row is free (int8 GEMV tiles rows in fours) while at 8 sequences a
    single extra row starts a third tile.
    Returns all zeros when no allocation beats plain decoding (b tokens for target_seconds(b)).
    """
    b = len(caps)
    if b == 0 or not any(caps):
        return [0] * b
    # (gain, -j, i): largest gain first; equal gains keep each sequence's positions in order.
    gains = sorted(((accept_rates[i] ** j, -j, i) for i in range(b) for j in range(1, caps[i] + 1)), reverse=True)
    best_rate, best = b / target_seconds(b), []
    for max_steps in range(1, max(caps) + 1) if draft_seconds is not None else [max(caps)]:
        chosen = [g for g in gains if -g[1] <= max_steps]
        tokens = float(b)
        active_per_step = [0] * (max_steps + 1)  # active_per_step[s]: draft-model sequences drafting >= s tokens
        for n, (gain, neg_j, i) in enumerate(chosen, start=1):
            tokens += gain
            if uses_draft_model is None or uses_draft_model[i]:
                active_per_step[-neg_j] += 1
            seconds = target_seconds(b + n)
            if draft_seconds is not None:
                seconds += sum(draft_seconds(a) for a in active_per_step[1:] if a)
            if tokens / seconds > best_rate:
                best_rate, best = tokens / seconds, chosen[:n]
    ks = [0] * b
    for _, _, i in best:
        ks[i] += 1
    return ks
