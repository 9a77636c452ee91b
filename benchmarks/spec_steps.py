"""Where a speculating engine's time goes, step by step: one engine decodes the held-out prompts of
chatserve/data/prompts.json (or long_context.py's pasted files) at batch B, T = 0, and each decode step of
B requests is filed under the batch's ks (each request's drafts that step, sorted): how many steps took
each, their median wall time and tokens, and what the served cost table prices (the target over 1..N rows,
a draft step, a catch-up); each request's drafts are named by the method that offered them (a draft
model's, or a free proposal of suffix decoding mixed in); the steps with a prefill and those with fewer
requests (a batch's tail) are summed apart. Not a speed comparison (one engine, no lockstep): the shape of
the decisions, e.g. whether the steps that draft pay per token against the steps that do not.

    python benchmarks/spec_steps.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \
        --workload code --batch 2 --out /tmp/steps.json
"""
import argparse
import collections
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chatserve.cli import _kv_cache_dtype  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from eagle_head import chat_prompts  # noqa: E402


def _drafted(req) -> str:
    """A request's drafts this step and the method that offered them, e.g. "1 suffix" ("0": none)."""
    offer = req.spec.offer if req.spec is not None else None
    return f"{req.num_lookahead_tokens} {offer.method.name}" if req.num_lookahead_tokens and offer else "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft-model", default=None, help="speculate with this draft model (default: the EAGLE head)")
    ap.add_argument("--workload", default="code", choices=["code", "chat", "edit", "paste"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--fixed-k", type=int, default=None, help="no adaptive k: every request drafts this many (1-16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = (SpecConfig(method="draft", draft_model=args.draft_model, suffix_corpus_tokens=0) if args.draft_model
            else SpecConfig(method="eagle", suffix_corpus_tokens=0))
    if args.fixed_k is not None:
        spec = dataclasses.replace(spec, adaptive=False, num_draft_tokens=args.fixed_k)
    engine = Engine(EngineConfig(model=args.model, quantization="int4", kv_cache_memory=1 << 30,
                                 kv_cache_dtype=_kv_cache_dtype("auto", "cpu", "float32"), spec=spec))
    prompts = chat_prompts(engine.tokenizer, args.workload)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)  # as eagle_head.py runs them
    steps: dict[tuple, list[tuple[float, int]]] = collections.defaultdict(list)  # ks -> [(seconds, tokens)]
    other = {"prefill": [0, 0.0, 0], "fewer": [0, 0.0, 0]}  # steps, seconds, tokens: a prefill; fewer than --batch
    for i in range(0, len(prompts), args.batch):
        for p in prompts[i : i + args.batch]:
            engine.add_request(p, params)
        while engine.has_unfinished():
            reqs = list(engine.scheduler.running)
            prefill = any(r.is_prefilling or r.num_output_tokens == 0 for r in reqs) or engine.scheduler.waiting
            before = sum(r.num_output_tokens for r in reqs)
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            tokens = sum(r.num_output_tokens for r in reqs) - before
            if not prefill and len(reqs) == args.batch:
                steps[tuple(sorted(_drafted(r) for r in reqs))].append((seconds, tokens))
            else:
                kind = other["prefill" if prefill else "fewer"]
                kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + seconds, kind[2] + tokens
    rows = {}
    for ks, taken in sorted(steps.items()):
        ms = statistics.median(s for s, _ in taken) * 1e3
        tokens = sum(t for _, t in taken) / len(taken)
        rows[str(ks)] = {"steps": len(taken), "median_ms": ms, "tokens": tokens, "ms_per_token": ms / tokens}
        print(f"ks {str(ks):24s} {len(taken):5d} steps, median {ms:7.2f} ms, {tokens:.2f} tokens a step, "
              f"{ms / tokens:6.2f} ms a token")
    full = sum(s for taken in steps.values() for s, _ in taken), sum(t for taken in steps.values() for _, t in taken)
    print(f"full-batch steps: {full[0]:.2f} s, {full[1]} tokens; steps with a prefill: {other['prefill'][0]}, "
          f"{other['prefill'][1]:.2f} s, {other['prefill'][2]} tokens; with fewer than {args.batch} requests: "
          f"{other['fewer'][0]}, {other['fewer'][1]:.2f} s, {other['fewer'][2]} tokens")
    costs = engine.spec.costs
    table = None
    if costs is not None:
        table = {"target_ms": {r: costs.target(r) * 1e3 for r in range(1, 2 * (args.batch + 4) + 1)},
                 "draft_ms": {r: costs.draft(r) * 1e3 for r in range(1, args.batch + 1)},
                 "head_ms": {r: costs.head(r) * 1e3 for r in range(1, args.batch + 1)},
                 "catch_up_ms": {r: costs.catch_up(r) * 1e3 for r in (2, 4, 8, 16)}}
        print("served table:", json.dumps({k: {r: round(v, 2) for r, v in t.items()} for k, t in table.items()}))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "by_ks": rows,
                                        "full_batch": full, "other_steps": other, "served_table": table}, indent=1))


if __name__ == "__main__":
    main()
