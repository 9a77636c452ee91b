"""What a verification costs on this machine, and the speed-up speculation can reach from it.

Times one target forward over 1..max_k + 1 rows (a batch-1 verification of k drafts) and one
draft-model forward over 1 row, at several context lengths (tokens already in the cache: the
rows attend over them), best of --reps. Then, per context and acceptance rate alpha, the best
k and its expected speed-up over plain decoding, from these times only (the standard model:
a step of k drafts emits 1 + alpha + ... + alpha^k tokens on average):
  free proposer (n-gram, suffix):  (1 + ... + alpha^k) * T(1) / T(k + 1)
  draft model:                     (1 + ... + alpha^k) * T(1) / (T(k + 1) + k * D(1))
No scheduling, sampling or catch-up cost is counted: this is the ceiling the engine works under.

    .venv/bin/python benchmarks/verify_rows.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --out benchmarks/results/verify_rows_qwen.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatserve.block_manager import BlockTable  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.spec_costs import time_forward  # noqa: E402

ALPHAS = (0.5, 0.7, 0.8, 0.9, 0.95)


def best_ms(runner, table: BlockTable, context: int, rows: int, reps: int) -> float:
    return time_forward(runner, table, context, rows, reps=reps) * 1e3


def ceiling(target_ms: list[float], draft_ms: float | None, alpha: float) -> tuple[int, float]:
    """(best k, expected speed-up) at acceptance alpha; target_ms[r - 1] = T(r)."""
    best = (0, 1.0)
    for k in range(1, len(target_ms)):
        tokens = sum(alpha ** j for j in range(k + 1))
        seconds = target_ms[k] + (k * draft_ms if draft_ms is not None else 0.0)
        speedup = tokens * target_ms[0] / seconds
        if speedup > best[1]:
            best = (k, speedup)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--contexts", type=int, nargs="+", default=[48, 1024, 2048])
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="auto", help="as for serve (auto, fp16, bf16, int8, ...)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    spec = SpecConfig(method="draft", draft_model=args.draft_model, adaptive=False) if args.draft_model else None
    engine = Engine(EngineConfig(model=args.model, quantization=args.quantization, spec=spec,
                                 kv_cache_dtype=args.kv_cache_dtype))
    models = engine.models
    table = BlockTable()
    assert models.block_manager.allocate(table, max(args.contexts) + args.max_k + 1), "pool too small"
    points = []
    with torch.inference_mode():
        for context in args.contexts:
            target = [best_ms(models.target_runner, table, context, rows, args.reps) for rows in range(1, args.max_k + 2)]
            draft = best_ms(models.draft_runner, table, context, 1, args.reps) if models.draft_runner else None
            point = {"context": context, "target_ms_by_rows": [round(t, 2) for t in target],
                     "draft_ms": round(draft, 2) if draft is not None else None, "ceilings": {}}
            for alpha in ALPHAS:
                free_k, free = ceiling(target, None, alpha)
                row = {"free_k": free_k, "free_speedup": round(free, 3)}
                if draft is not None:
                    draft_k, with_draft = ceiling(target, draft, alpha)
                    row.update(draft_k=draft_k, draft_speedup=round(with_draft, 3))
                point["ceilings"][str(alpha)] = row
            points.append(point)
            print(f"context {context:5d}: target ms by rows 1..{args.max_k + 1} "
                  + " ".join(f"{t:6.1f}" for t in target) + (f"   draft 1 row {draft:5.1f}" if draft else ""), flush=True)
            for alpha, row in point["ceilings"].items():
                print(f"    alpha {alpha:4s}: free proposer k={row['free_k']} {row['free_speedup']:.2f}x"
                      + (f"   draft model k={row['draft_k']} {row['draft_speedup']:.2f}x" if draft else ""))
    models.block_manager.free(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "kind": "verify-rows", "argv": sys.argv, "model": args.model, "draft_model": args.draft_model,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                                           "torch": torch.__version__, "loadavg": os.getloadavg()},
            "points": points}, indent=1))


if __name__ == "__main__":
    main()
