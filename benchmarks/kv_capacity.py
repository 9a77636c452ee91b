"""KV-cache capacity per format for a fixed byte budget: pure arithmetic from model shapes.

For each KV format (scales included, via quant.kv.kv_bytes_per_token), prints how many tokens
a budget holds and how many 4k-token conversations fit, for SmolLM2-135M alone and for the
Qwen2.5-Coder-1.5B target + 0.5B draft pair, whose caches share one block table (so a block
costs target + draft bytes). Writes the same numbers as JSON.

    python benchmarks/kv_capacity.py [--budget-gib 1] [--block-size 16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant.kv import kv_bytes_per_token  # noqa: E402

# name -> (num_layers, num_kv_heads, head_dim), from the models' config.json
MODEL_SHAPES = {
    "smollm2-135m": (30, 3, 64),
    "qwen2.5-coder-1.5b": (28, 2, 128),
    "qwen2.5-coder-0.5b": (24, 2, 64),
}
SETUPS = {
    "SmolLM2-135M": ["smollm2-135m"],
    "Qwen2.5-Coder-1.5B + 0.5B draft": ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"],
}
# label -> (KV format, model dtype): "auto" stores the model dtype
FORMATS = {
    "fp32": ("auto", torch.float32),
    "bf16": ("auto", torch.bfloat16),
    "int8": ("int8", torch.bfloat16),
    "fp8": ("fp8_e4m3", torch.bfloat16),  # e5m2 takes the same bytes
}
CONVERSATION_TOKENS = 4096
GOAL_X_BF16, GOAL_X_FP32 = 1.9, 3.8  # what int8 / fp8 should reach, scales included


def bytes_per_token(models: list[str], fmt: str, model_dtype: torch.dtype) -> int:
    """All layers of all models sharing the block table (one cache entry per token each)."""
    total = 0
    for name in models:
        num_layers, num_kv_heads, head_dim = MODEL_SHAPES[name]
        total += num_layers * kv_bytes_per_token(fmt, num_kv_heads, head_dim, model_dtype)
    return total


def capacity(models: list[str], budget_bytes: int, block_size: int) -> dict:
    rows = {}
    for label, (fmt, dtype) in FORMATS.items():
        per_token = bytes_per_token(models, fmt, dtype)
        num_blocks = budget_bytes // (per_token * block_size)
        blocks_per_conversation = -(-CONVERSATION_TOKENS // block_size)
        rows[label] = {
            "bytes_per_token": per_token,
            "tokens": num_blocks * block_size,
            "conversations_4k": num_blocks // blocks_per_conversation,
        }
    for label, row in rows.items():
        row["x_bf16"] = round(row["tokens"] / rows["bf16"]["tokens"], 3)
        row["x_fp32"] = round(row["tokens"] / rows["fp32"]["tokens"], 3)
        if label in ("int8", "fp8"):
            row["meets_goal"] = row["x_bf16"] >= GOAL_X_BF16 and row["x_fp32"] >= GOAL_X_FP32
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_capacity.json")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    report = {"budget_bytes": budget, "block_size": args.block_size,
              "conversation_tokens": CONVERSATION_TOKENS, "setups": {}}
    for setup, models in SETUPS.items():
        rows = capacity(models, budget, args.block_size)
        report["setups"][setup] = {"models": models, "formats": rows}
        print(f"\n{setup}: {args.budget_gib:g} GiB, block {args.block_size}")
        print(f"  {'format':<6} {'B/token':>8} {'tokens':>10} {'4k convs':>9} {'x bf16':>7} {'x fp32':>7}"
              f"  goal >= {GOAL_X_BF16}x bf16, >= {GOAL_X_FP32}x fp32")
        for label, row in rows.items():
            goal = {True: "  met", False: "  missed"}.get(row.get("meets_goal"), "")
            print(f"  {label:<6} {row['bytes_per_token']:>8} {row['tokens']:>10} "
                  f"{row['conversations_4k']:>9} {row['x_bf16']:>7.3f} {row['x_fp32']:>7.3f}{goal}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
