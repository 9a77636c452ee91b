"""Where should a draft model's chain stop? Its calibration at T = 0, offline: nothing is timed but
--costs, so without it this runs beside anything.

The target answers the held-out prompts of chatserve/data/prompts.json (chat, code, edit) greedily,
speculation off. The draft model then reads each prompt and reply in one forward (teacher forcing):
at every reply position its argmax and its softmax probability of that argmax (T = 1, over its whole
vocabulary: what DraftModelMethod.propose would read). A chain of drafts from anchor p is exactly
that while its drafts hold (each accepted draft is the target's token), so the draft from anchor p
at depth s counts if the argmax at p..p+s all equal the reply's tokens, and its probability is the
one at p + s. Printed per workload, as benchmarks/head_acceptance.py prints a head's: how well the
probability predicts acceptance (bins, first and second draft), fixed chains of k = 1..depth walked
as serving walks a reply, and chains of up to --depth drafts stopped where the product of the
probabilities falls below each --stop-at (tokens, drafts and draft forwards a verification: a
forward is paid for each draft and for the one cut). With --costs, the machine must be quiet: one
target forward over 1..depth+1 rows and one draft forward of a row are timed (spec_costs, as the
engine times them at start), and each walk's speed-up over plain decoding estimated from them,
tokens x T(1) / sum over verifications of (T(1 + drafts) + forwards x D(1)); beside fixed chains
and the stops above, a marginal rule that keeps a draft already computed while the chain's
probability P pays its own verification row (the forward is spent before P is known) and runs the
next forward only while P x the acceptance rate pays that draft's row and forward (x 1, 1.5, 2).
--reads keeps the replies' reads and the costs in a file for a second look without the models.

    .venv/bin/python benchmarks/draft_acceptance.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --costs --out benchmarks/results/draft_acceptance_qwen_session45.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from head_acceptance import PROMPTS, calibration, walk_rule, walk_summary, walked_length, walked_stopped  # noqa: E402

from chatserve.batch import BatchItem  # noqa: E402
from chatserve.block_manager import BlockTable  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from chatserve.spec_costs import SpecCosts, measure_spec_costs  # noqa: E402
from spec.adaptive import allocate_drafts, chain_stop_gains, geometric_gains  # noqa: E402


def greedy_replies(engine: Engine, kind: str, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + reply token ids, num prompt tokens) of the target's greedy answer to each prompt of
    `kind`, speculation off."""
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[kind]]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, num_draft_tokens=0)
    return [(prompt + out["token_ids"], len(prompt)) for prompt, out in zip(prompts, engine.generate(prompts, params))]


@torch.inference_mode()
def draft_reads(engine: Engine, ids: list[int], num_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft model over ids[:-1] in one forward (scratch blocks of the pool, given back) ->
    (hit, probability) [reply tokens]: whether its argmax after ids[:j] is ids[j], and its softmax
    probability of that argmax, for each reply position j."""
    fed, reply = ids[:-1], torch.tensor(ids[num_prompt:])
    bm = engine.models.block_manager
    table = BlockTable()
    if not bm.allocate(table, len(fed)):
        raise SystemExit("the pool cannot hold a reply: raise kv_cache_memory")
    try:
        logits, _ = engine.models.draft_runner.run([BatchItem(fed, 0, table.block_ids, len(reply))])
    finally:
        bm.free(table)
    probs = logits.float().softmax(-1)
    top, best = probs.max(-1)
    return best == reply, top


def chains(hit: torch.Tensor, prob: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position hits and probabilities [n] -> chain_hits' shapes [n, depth]: hits[p, s] = the
    first s + 1 drafts from anchor p all hold; sure[p, s] = the probability at p + s (0 past the
    reply, where a chain has nothing to draft)."""
    n = len(hit)
    pad_hit = torch.cat((hit, torch.zeros(depth, dtype=torch.bool)))
    pad_prob = torch.cat((prob, torch.zeros(depth)))
    index = torch.arange(n)[:, None] + torch.arange(depth)[None]
    return pad_hit[index].int().cumprod(dim=1).bool(), pad_prob[index]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--kinds", nargs="+", default=["chat", "code", "edit"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--stop-at", type=float, nargs="*", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    ap.add_argument("--costs", action="store_true", help="time the forwards and estimate speed-ups (quiet machine)")
    ap.add_argument("--target-ms", type=float, nargs="*", default=None,
                    help="estimate with these target forward times for 1, 2, ... rows (another machine's)")
    ap.add_argument("--draft-ms", type=float, default=None, help="with --target-ms: one draft forward")
    ap.add_argument("--cap", type=int, default=4, help="the engine's num_draft_tokens, the served rules' cap")
    ap.add_argument("--reads", type=Path, default=None,
                    help="keep the draft's reads (and the timed costs) in this file, or take them from it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    saved = torch.load(args.reads, weights_only=False) if args.reads and args.reads.exists() else None  # our own file
    if saved is None:
        spec = SpecConfig(method="draft", draft_model=args.draft, adaptive=False)
        engine = Engine(EngineConfig(model=args.model, quantization=args.quantization, max_num_seqs=8,
                                     enable_prefix_caching=False, spec=spec))
        saved = {"costs": measure_spec_costs(engine.models, args.depth, 1) if args.costs else None,
                 "reads": {kind: [draft_reads(engine, ids, num_prompt)
                                  for ids, num_prompt in greedy_replies(engine, kind, args.max_tokens)]
                           for kind in args.kinds}}
        if args.reads:
            torch.save(saved, args.reads)
    results = {"model": args.model, "draft": args.draft, "max_tokens": args.max_tokens, "depth": args.depth,
               "workloads": {}}
    costs = saved["costs"]
    if args.target_ms:
        costs = SpecCosts({r: t / 1e3 for r, t in enumerate(args.target_ms, start=1)}, {1: args.draft_ms / 1e3})
    if costs is not None:
        target_ms = [costs.target(r) * 1e3 for r in range(1, args.depth + 2)]
        results["target_ms_by_rows"], results["draft_ms"] = target_ms, costs.draft(1) * 1e3
        print("target ms by rows " + " ".join(f"{t:.1f}" for t in target_ms) + f", draft {costs.draft(1) * 1e3:.1f} ms")

    for kind in args.kinds:
        reads = [chains(hit, prob, args.depth) for hit, prob in saved["reads"][kind]]
        hits, sure = [h for h, _ in reads], [p for _, p in reads]
        walked = [walked_length(hits, k) for k in range(1, args.depth + 1)]
        stopped = {least: [round(x, 3) for x in walked_stopped(hits, sure, args.depth, least)]
                   for least in args.stop_at}
        bins = calibration(torch.cat(hits), torch.cat(sure))
        results["workloads"][kind] = {
            "positions": sum(len(h) for h in hits), "walked_accepted_length": [round(x, 3) for x in walked],
            "stopped_walked": {str(least): dict(zip(("tokens", "drafts", "draft_forwards"), v))
                               for least, v in stopped.items()},
            "calibration": bins}
        print(f"{kind:5s} positions {sum(len(h) for h in hits):5d}  walked fixed k=1..{args.depth} "
              f"{' '.join(f'{x:.2f}' for x in walked)}", flush=True)
        for s, row in enumerate(bins):
            print(f"{kind:5s} draft {s + 1} by the draft's probability: "
                  + "  ".join(f"[{lo:.1f}, {hi:.1f}) {n} at {p:.2f} accepted {a:.2f}" for lo, hi, n, p, a in row))
        for least, (tokens, drafts, forwards) in stopped.items():
            print(f"{kind:5s} walked, up to {args.depth} drafts stopped below {least}: {tokens:.3f} tokens a "
                  f"verification, {drafts:.2f} drafts, {forwards:.2f} draft forwards", flush=True)
        if costs is None:
            continue
        t1, draft = costs.target(1), costs.draft(1)
        row = [(costs.target(s + 2) - costs.target(s + 1)) / t1 for s in range(args.depth + 1)]  # draft s's row
        walks = {f"fixed k={k}": walk_rule(hits, sure, k, 0.0, 0.0) for k in range(1, args.depth + 1)}
        walks.update({f"stop below {least}": walk_rule(hits, sure, args.depth, least, 0.0) for least in args.stop_at})
        rate = float(torch.cat([h[:, 0] for h in hits]).float().mean())
        for scale in (1.0, 1.5, 2.0):  # go on while the next draft's expected gain pays its row and forward
            go_on = [scale * (row[s + 1] + draft / t1) for s in range(args.depth)]
            walks[f"marginal x{scale}: keep >= its row, go on at rate {rate:.2f}"] = walk_rule(
                hits, sure, args.depth, row[: args.depth], go_on, rate)
        # as served: adaptive k prices the cap at this rate (allocate_drafts), then the chain stops
        # below one price (session 44's EagleMethod.propose), or keeps and goes on at two (this session's)
        for cap in sorted({args.cap, args.depth}):
            k = allocate_drafts([geometric_gains(rate, cap)], costs.target, costs.draft, [True])[0]
            least = chain_stop_gains(costs.target, costs.draft, 1, k, 1.0)[1]
            walks[f"served cap {cap}: adaptive k = {k}"] = walk_rule(hits, sure, k, 0.0, 0.0) if k else []
            walks[f"served cap {cap}: k = {k}, stop below {least:.2f}"] = walk_rule(hits, sure, k, least, 0.0)
            keep, go_on = chain_stop_gains(costs.target, costs.draft, 1, k, rate)
            walks[f"served cap {cap}: k = {k}, keep >= {keep:.2f}, go on >= {go_on:.2f}"] = walk_rule(
                hits, sure, k, keep, go_on)
            go_on = [row[s + 1] + draft / t1 for s in range(cap)]
            walks[f"served cap {cap}: marginal to the cap"] = walk_rule(hits, sure, cap, row[:cap], go_on, rate)
            walks[f"served cap {cap}: marginal to the cap, rate 1"] = walk_rule(hits, sure, cap, row[:cap], go_on)
            walks[f"served cap {cap}: keep >= {keep:.2f}, go on >= {least:.2f}"] = walk_rule(
                hits, sure, cap, keep, least)
        estimates = {name: [round(x, 3) for x in walk_summary(steps, costs.target, draft)]
                     for name, steps in walks.items() if steps}
        results["workloads"][kind]["estimates"] = {name: dict(zip(("tokens", "drafts", "forwards", "speedup"), v))
                                                  for name, v in estimates.items()}
        for name, (tokens, drafts, forwards, x) in estimates.items():
            print(f"{kind:5s} {name:45s} {tokens:.2f} tokens {drafts:.2f} drafts {forwards:.2f} forwards: "
                  f"{x:.2f}x plain (estimated)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
