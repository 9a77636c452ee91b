"""How well an EAGLE head's confidence predicts its chain being accepted, on train-head's held-out replies.

A served chain stops on the head's probability of the chain so far, P = the product of its drafts'
probabilities (spec.adaptive.chain_stop_gains: a draft is kept while P >= keep, the next computed while
P >= go_on). That rule is only as good as P is calibrated: an overconfident head drafts past where its
chains fail, an underconfident one stops short. This bins P at every draft position of a fixed chain from
every held-out reply anchor (train_head.chain_hits, T = 0, float32 head; served, the head's weights are
quantized like the target's) against whether the chain up to that draft equals the target's greedy tokens,
and prints each bin's mean P beside its accepted fraction and the expected calibration error (the
count-weighted mean of |mean P - accepted|), then the power a that train-head fits and saves with a head
(train_head.fit_stop_power: accepted ~ P ** a) and the error of P ** a. No generation, no timing.
--save-chains keeps every reply's chains (hits and probabilities) for spec_policy_sim.py.

    .venv/bin/python benchmarks/head_calibration.py --model qwen2.5-coder-1.5b-instruct \\
        --heads <head.pt> ... --out benchmarks/results/head_calibration_qwen_session74.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import chatserve.train_head as th  # noqa: E402
from head_heldout import HeldOut, add_arguments  # noqa: E402

EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def calibration(probs: torch.Tensor, right: torch.Tensor, edges=EDGES) -> dict:
    """probs, right: flat tensors of the chain probability P and whether the chain was accepted ->
    {"bins": [{lo, hi, count, mean_p, accepted}], "ece"}."""
    bins, ece, total = [], 0.0, len(probs)
    index = torch.bucketize(probs, torch.tensor(edges[1:-1]), right=True)  # bin i holds [edges[i], edges[i+1])
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        sel = index == i
        n = int(sel.sum())
        if not n:
            bins.append({"lo": lo, "hi": hi, "count": 0, "mean_p": None, "accepted": None})
            continue
        mean_p, acc = float(probs[sel].mean()), float(right[sel].float().mean())
        ece += n / total * abs(mean_p - acc)
        bins.append({"lo": lo, "hi": hi, "count": n, "mean_p": round(mean_p, 4), "accepted": round(acc, 4)})
    return {"bins": bins, "ece": round(ece, 4), "count": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--save-chains", type=Path, default=None,
                    help="torch.save each head's per-reply chains here (spec_policy_sim.py reads them)")
    args = ap.parse_args()
    held = HeldOut(args)
    results = {"model": args.model, "depth": th.VAL_DEPTH, "num_val_sequences": len(held.val), "first": args.first,
               "edges": EDGES, "heads": {}}
    saved_chains = {}
    for path, head in held.heads():
        chains, sures = [], []
        for seq in held.val:
            if len(seq.token_ids) - 1 > seq.num_prompt_tokens:
                right, _, sure = th.chain_hits(head, held.embed, seq.token_ids, seq.features, seq.num_prompt_tokens,
                                               th.VAL_DEPTH)
                chains.append(right)
                sures.append(sure)
        right, sure = torch.cat(chains), torch.cat(sures)
        chain_p = sure.cumprod(dim=1)  # P of the chain up to each draft, what a served chain stops on
        valid = sure > 0  # rows past a reply's end have sure 0
        by_depth = {}
        for s in range(th.VAL_DEPTH):
            v = valid[:, s]
            by_depth[s + 1] = calibration(chain_p[v, s], right[v, s])
        every = calibration(chain_p[valid], right[valid])
        power = th.fit_stop_power(list(zip(chains, sures)))  # what train-head saves with a head
        fitted = calibration(chain_p[valid] ** power, right[valid])
        saved_chains[path] = {"hits": chains, "sure": sures, "power": power}
        results["heads"][path] = {"all_depths": every, "by_depth": by_depth, "greedy_stop_power": power,
                                  "all_depths_powered": fitted,
                                  "saved_power": head.info.get("greedy_stop_power")}
        depths = ", ".join(f"{d['ece']:.3f}" for d in by_depth.values())
        print(f"{path}: {every['count']} chain positions, expected calibration error {every['ece']:.3f} "
              f"(by depth {depths})")
        print("  P bin       count  mean P  accepted")
        for b in every["bins"]:
            if b["count"]:
                print(f"  {b['lo']:.2f}-{b['hi']:.2f}  {b['count']:7d}  {b['mean_p']:.3f}   {b['accepted']:.3f}")
        print(f"  fitted power {power:.2f} (accepted ~ P ** {power:.2f}): expected calibration error of P ** power "
              f"{fitted['ece']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.save_chains:
        torch.save({"model": args.model, "heads": saved_chains}, args.save_chains)


if __name__ == "__main__":
    main()
