"""Replay greedy replies against n-gram drafting policies, offline: what could a better
controller or proposer win on a workload?

Generates each prompt's greedy reply once (spec off; greedy speculation emits the same tokens),
measures the target's forward time over 1..16 rows (`measure_spec_costs`), then for every policy
walks each reply step by step: propose from the context so far, accept the longest matching
prefix, emit it plus one token, pay the measured cost of a forward over k + 1 rows. Prints
emitted tokens per unit of plain-decode cost (1.0 = no gain) per policy and per prompt.

    python benchmarks/ngram_replay.py --model smollm2-135m-instruct --workload edit --threads 1
    python benchmarks/ngram_replay.py --model qwen2.5-coder-1.5b-instruct --workload edit --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from chatserve.spec_costs import SpecCosts, measure_spec_costs  # noqa: E402
from spec.adaptive import AcceptanceEMA, AdaptiveDraftLength, allocate_drafts, geometric_gains  # noqa: E402
from spec.ngram import NgramProposer  # noqa: E402

PROMPTS = json.loads((Path(__file__).resolve().parent.parent / "chatserve/data/prompts.json").read_text())
MAX_K = 15


class Controlled:
    """What the engine does (SpecRunner.plan at batch 1): the request offers its acceptance
    estimate, the proposal is made with that cap, allocate_drafts prices it with the measured
    costs. `engine_wide` plays the engine's per-method estimate (the prior of new requests and
    probes), shared by the prompts of one replay."""

    def __init__(self, costs: SpecCosts, max_k: int, min_n: int, engine_wide: AcceptanceEMA):
        self.costs, self.engine_wide = costs, engine_wide
        self.ctl = AdaptiveDraftLength(max_k, initial_accept_rate=engine_wide.rate)
        self.proposer = NgramProposer(min_n, 4, max_k)

    def propose(self, context: list[int]) -> list[int]:
        cap, accept_rate = self.ctl.offer(probe_accept_rate=self.engine_wide.rate)
        tokens = self.proposer.propose_one(context, cap)
        k = allocate_drafts([geometric_gains(accept_rate, len(tokens))], self.costs.target)[0] if tokens else 0
        self.ctl.allocated(k)
        return tokens[:k]

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.ctl.update(num_drafted, num_accepted)
            self.engine_wide.update(num_drafted, num_accepted)


def controlled(costs: SpecCosts, max_k: int, min_n: int):
    """A make_policy for replay(): Controlled requests sharing one engine-wide estimate (n-gram prior 0.5)."""
    engine_wide = AcceptanceEMA(ema=0.05, prior=0.5)
    return lambda: Controlled(costs, max_k, min_n, engine_wide)


class PerMatchLength:
    """Propose first, then pick k with an acceptance estimate kept per matched n-gram length."""

    def __init__(self, costs: SpecCosts, max_k: int, min_n: int):
        self.costs = costs
        self.ctls = {n: AdaptiveDraftLength(max_k, initial_accept_rate=0.5) for n in range(min_n, 5)}
        self.proposers = {n: NgramProposer(n, n, max_k) for n in self.ctls}
        self.max_k, self.last_n = max_k, None

    def propose(self, context: list[int]) -> list[int]:
        for n in sorted(self.proposers, reverse=True):
            tokens = self.proposers[n].propose_one(context, self.max_k)
            if tokens:
                self.last_n = n
                cap, accept_rate = self.ctls[n].offer()
                k = allocate_drafts([geometric_gains(accept_rate, min(cap, len(tokens)))], self.costs.target)[0]
                self.ctls[n].allocated(k)
                return tokens[:k]
        return []

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.ctls[self.last_n].update(num_drafted, num_accepted)


class Oracle:
    """Upper bound: the longest n-gram proposal (min n 1, k <= 15), verified for free."""

    def __init__(self, costs: SpecCosts):
        self.proposer = NgramProposer(1, 4, MAX_K)

    def propose(self, context: list[int]) -> list[int]:
        return self.proposer.propose_one(context, MAX_K)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        pass


def replay(make_policy, prompts: list[list[int]], replies: list[list[int]], verify_cost, free: bool = False) -> float:
    """Emitted tokens per unit of cost (one plain decode step = 1)."""
    tokens = cost = 0.0
    for prompt, reply in zip(prompts, replies):
        policy, context, i = make_policy(), list(prompt), 0
        while i < len(reply):
            draft = policy.propose(context)
            accepted = 0
            while accepted < len(draft) and i + accepted < len(reply) and draft[accepted] == reply[i + accepted]:
                accepted += 1
            policy.update(len(draft), accepted)
            emitted = min(accepted + 1, len(reply) - i)
            cost += 1.0 if free else verify_cost(len(draft))
            tokens += emitted
            context += reply[i : i + emitted]
            i += emitted
    return tokens / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workload", default="edit", choices=sorted(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 30))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[args.workload]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    replies = [engine.generate([p], params)[0]["token_ids"] for p in prompts]
    costs = measure_spec_costs(engine.models, MAX_K, 1)
    verify = [costs.target(k + 1) / costs.target(1) for k in range(MAX_K + 1)]
    verify_cost = lambda k: verify[k] if k else 1.0  # noqa: E731
    print(f"{args.model}, {args.workload} x {len(prompts)}, {sum(map(len, replies))} reply tokens")
    print("verify cost of k drafts (plain steps):", [round(c, 2) for c in verify])
    policies = {f"controller k<={k} min_n={n}": controlled(costs, k, n) for k in (4, 7) for n in (1, 2)}
    policies |= {f"per-match-length k<={k}": (lambda k=k: PerMatchLength(costs, k, 1)) for k in (4, 7, 15)}
    report = {"model": args.model, "workload": args.workload, "reply_tokens": [len(r) for r in replies],
              "verify_costs": verify, "tokens_per_cost": {}, "per_prompt": {}}
    for name, make in policies.items():
        report["tokens_per_cost"][name] = rate = replay(make, prompts, replies, verify_cost)
        print(f"  {name:28s} {rate:.3f}")
    report["tokens_per_cost"]["oracle (free verification)"] = rate = replay(lambda: Oracle(costs), prompts, replies, verify_cost, free=True)
    print(f"  {'oracle (free verification)':28s} {rate:.3f}")
    for i, (p, r) in enumerate(zip(prompts, replies)):
        report["per_prompt"][i] = rate = replay(controlled(costs, 4, 1), [p], [r], verify_cost)
        print(f"  prompt {i}: {len(r)} tokens, controller {rate:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
