"""How an EAGLE head's chains would serve under a drafting policy, replayed on held-out replies at batch 1.

A served run (benchmarks/eagle_head.py) measures a policy on a dozen turns, with a few percent of
noise between two variants of one run, and takes ~10 minutes a pair. This replays serving's own
decisions instead, with serving's own code (spec.adaptive: the acceptance estimates, the probe,
allocate_drafts and chain_stop_gains; EagleMethod's stop rule) over a head's chains on
train-head's held-out replies (head_calibration.py --save-chains: per reply and anchor, whether
each of a chain of 4 drafts holds and the head's probability of it), priced with the forward
costs a served run measured (its JSON's served_costs_ms). A reply is walked as serving walks it
(train_head.walked_length): from anchor p the step is allocated k drafts, the chain stops where
its probability falls below the step's price, and the next step starts past the accepted ones.

What it leaves out: batches (b = 1 only), a step's costs other than the target's forward over
1 + drafts rows, the head's draft steps and a constant overhead a step (the off step's median less
its forward), and timing noise. So it ranks policies; a served run decides.

    .venv/bin/python benchmarks/head_calibration.py --model qwen2.5-coder-1.5b-instruct \\
        --heads H --save-chains /tmp/chains.pt
    .venv/bin/python benchmarks/spec_policy_sim.py --chains /tmp/chains.pt \\
        --costs benchmarks/results/eagle_qwen_mlp3072_amx_session75.json --out sim.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.spec_runner import MIN_MADE_DRAFTS  # noqa: E402
from spec.adaptive import (PROBE_EVERY, AcceptanceEMA, AdaptiveDraftLength, allocate_drafts,  # noqa: E402
                           chain_drafts, chain_stop_gains, geometric_gains, stop_probability)

MAX_K = 4  # SpecConfig.num_draft_tokens, and the depth of the saved chains


@dataclasses.dataclass(frozen=True)
class Policy:
    """A drafting policy: serving's (the defaults) or a variant of it.
    power: a greedy chain's probability P is read as P ** power by the stop (spec.adaptive.stop_probability).
    full_cap: every step is offered MAX_K drafts whatever the estimate prices (the stop alone ends chains).
    two_prices: keep a computed draft at a row's price, go on at a row and a step over the made
        drafts' acceptance (SpecRunner.keeps_computed_drafts); else one price for both.
    count_made: the acceptance estimates count the drafts made, not the positions priced (a chain
        the stop ended early is not a rejection where it stopped)."""
    name: str
    power: float = 1.0
    full_cap: bool = False
    two_prices: bool = False
    count_made: bool = False


@dataclasses.dataclass
class Outcome:
    steps: int = 0
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    head_steps: int = 0
    ms: float = 0.0

    def add(self, drafted: int, accepted: int, head_steps: int, costs: Costs) -> None:
        """One verification step of `drafted` drafts (`accepted` held) after `head_steps` head steps, priced."""
        self.steps += 1
        self.tokens += accepted + 1
        self.drafts += drafted
        self.accepted += accepted
        self.head_steps += head_steps
        self.ms += costs.target_seconds(1 + drafted) + head_steps * costs.head + costs.overhead

    def row(self, off_ms: float) -> dict:
        per_token = self.ms / self.tokens
        return {"steps": self.steps, "mean_accepted_length": self.tokens / self.steps,
                "drafts_per_step": self.drafts / self.steps, "acceptance": self.accepted / max(self.drafts, 1),
                "head_steps_per_step": self.head_steps / self.steps, "ms_per_step": self.ms / self.steps,
                "ms_per_token": per_token, "speedup_vs_off": off_ms / per_token}


class Costs:
    """Milliseconds of a served run's step parts: target[rows] (a forward over that many rows with its
    verification), one head draft step, and what a step costs besides (off's median step less its
    forward over one row)."""

    def __init__(self, target: dict[int, float], head: float, overhead: float):
        self.target, self.head, self.overhead = target, head, overhead

    @classmethod
    def from_run(cls, path: Path, variant: str, case: str) -> Costs:
        run = json.loads(Path(path).read_text())
        served = run["served_costs_ms"][variant]
        target = {int(rows): ms for rows, ms in served["target"].items()}
        off = run["runs"][case]["off"]["median_step_ms"]
        return cls(target, served["head_1"], max(off - target[1], 0.0))

    def target_seconds(self, rows: int) -> float:  # allocate_drafts' units are its own: ms here
        top = max(self.target)
        if rows <= top:
            return self.target[rows]
        return self.target[top] + (rows - top) * (self.target[top] - self.target[top - 1])

    def head_seconds(self, rows: int) -> float:
        return self.head * rows  # b = 1: one row

    @property
    def off_ms(self) -> float:
        return self.target[1] + self.overhead


def replay(chains: list[tuple[torch.Tensor, torch.Tensor]], policy: Policy, costs: Costs) -> Outcome:
    """Serving's decisions at batch 1 over each reply's (hits [anchors, depth] bool, sure [anchors,
    depth]) in order, one request a reply; the engine-wide estimates carry from reply to reply."""
    method_rate = AcceptanceEMA(ema=0.05, prior=0.7)  # EagleMethod.accept_rate
    made = [0, 0]  # drafts made, accepted: SpecRunner's stats_by_method
    out = Outcome()
    for hits, sure in chains:
        controller = AdaptiveDraftLength(MAX_K, 0.05, probe_every=PROBE_EVERY, initial_accept_rate=method_rate.rate)
        p = 0
        while p < len(hits):
            cap, alpha = controller.offer(probe_accept_rate=method_rate.rate)
            cap = min(cap, len(hits) - p)
            k = 0
            if cap:
                k = allocate_drafts([geometric_gains(alpha, cap)], costs.target_seconds, costs.head_seconds, [True])[0]
                if k == 0 and controller.probing:
                    k = 1  # SpecRunner._probe_k
                if k and policy.full_cap:
                    k = cap
            controller.allocated(k)
            drafted = head_steps = 0
            if k:
                made_rate = made[1] / made[0] if made[0] >= MIN_MADE_DRAFTS else 1.0
                keep, go_on = chain_stop_gains(costs.target_seconds, costs.head_seconds, 1, k,
                                               made_rate if policy.two_prices else 1.0)
                if not policy.two_prices:
                    keep = go_on
                drafted, head_steps = chain_drafts(sure[p], k, stop_probability(keep, policy.power),
                                                   stop_probability(go_on, policy.power))
            accepted = int(hits[p, :drafted].sum())
            offered = drafted if policy.count_made else max(k, drafted)
            if k:
                made[0] += drafted
                made[1] += accepted
                if drafted or offered:
                    method_rate.update(offered, accepted)
                    controller.update(offered, accepted)
            out.add(drafted, accepted, head_steps, costs)
            p += accepted + 1
    return out


def fixed_chain(chains: list[tuple[torch.Tensor, torch.Tensor]], k: int, costs: Costs) -> Outcome:
    """Always k drafts, no stop: train_head.walked_length's walk, priced."""
    out = Outcome()
    for hits, _ in chains:
        p = 0
        while p < len(hits):
            drafted = min(k, len(hits) - p)
            accepted = int(hits[p, :drafted].sum())
            out.add(drafted, accepted, drafted, costs)
            p += accepted + 1
    return out


def policies(fitted: float) -> list[Policy]:
    return [Policy("serving"), Policy("calibrated stop", power=fitted),
            Policy("count made", count_made=True), Policy("calibrated, count made", power=fitted, count_made=True),
            Policy("full cap", full_cap=True), Policy("full cap, calibrated", power=fitted, full_cap=True),
            Policy("two prices", two_prices=True), Policy("two prices, calibrated", power=fitted, two_prices=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=Path, required=True, help="head_calibration.py --save-chains output")
    ap.add_argument("--costs", type=Path, required=True, help="an eagle_head.py run's JSON (served_costs_ms)")
    ap.add_argument("--variant", default="eagle", help="whose served costs (a key of served_costs_ms)")
    ap.add_argument("--case", default="code/b1", help="whose off step gives the per-step overhead")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    saved = torch.load(args.chains, weights_only=True)
    costs = Costs.from_run(args.costs, args.variant, args.case)
    results = {"chains": str(args.chains), "costs": str(args.costs), "variant": args.variant,
               "target_ms": costs.target, "head_ms": costs.head, "overhead_ms": costs.overhead, "heads": {}}
    for path, head in saved["heads"].items():
        chains = list(zip(head["hits"], head["sure"]))
        rows = {f"fixed k={k}": fixed_chain(chains, k, costs).row(costs.off_ms) for k in range(1, MAX_K + 1)}
        rows.update({pol.name: replay(chains, pol, costs).row(costs.off_ms) for pol in policies(head["power"])})
        results["heads"][path] = {"power": head["power"], "policies": rows}
        print(f"{path}: {len(chains)} replies, fitted power {head['power']:.2f}; off {costs.off_ms:.1f} ms a token")
        print(f"  {'policy':26s} tokens/step drafts/step accepted  head steps  ms/step  speed-up")
        for name, r in rows.items():
            print(f"  {name:26s} {r['mean_accepted_length']:10.3f} {r['drafts_per_step']:11.2f} "
                  f"{r['acceptance']:8.2f} {r['head_steps_per_step']:11.2f} {r['ms_per_step']:8.1f} "
                  f"{r['speedup_vs_off']:9.3f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
