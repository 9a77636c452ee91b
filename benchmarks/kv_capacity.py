"""KV-cache capacity per format for a fixed byte budget, as the engine plans and allocates it.

For each KV format, sizes the pool with the engine's own planner (chatserve.kv_cache:
CacheShape.bytes_per_block counts K, V and the bf16 scales; plan_num_blocks), allocates it
(torch.empty, so no page is touched) to check the real tensors fit the budget, and prints how
many tokens it holds and how many 4k-token conversations fit, for SmolLM2-135M, the
Qwen2.5-Coder-1.5B alone and the 1.5B target + 0.5B draft pair, whose caches share one block
table (so a block costs target + draft bytes). Model shapes come from config.json in the model
cache when present, else from the known configs below. Writes the same numbers as JSON.

    python benchmarks/kv_capacity.py [--budget-gib 1] [--block-size 16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chatserve.kv_cache import CacheShape, KVCache, plan_num_blocks  # noqa: E402

MODEL_CACHE = Path("~/.cache/chatserve/models").expanduser()
# name -> (num_layers, num_kv_heads, head_dim), the models' config.json (fallback when not cached)
KNOWN_SHAPES = {
    "smollm2-135m-instruct": (30, 3, 64),
    "qwen2.5-coder-1.5b-instruct": (28, 2, 128),
    "qwen2.5-coder-0.5b-instruct": (24, 2, 64),
}
SETUPS = {
    "SmolLM2-135M": ["smollm2-135m-instruct"],
    "Qwen2.5-Coder-1.5B": ["qwen2.5-coder-1.5b-instruct"],
    "Qwen2.5-Coder-1.5B + 0.5B draft": ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"],
}
# label -> (KV format, model dtype, the target's unquantized first layers): "auto" stores the
# model dtype; "+L0" is --kv-cache-unquantized-layers 1 (what Qwen2.5 needed before K smoothing)
FORMATS = {
    "fp32": ("auto", torch.float32, 0),
    "bf16": ("auto", torch.bfloat16, 0),
    "int8": ("int8", torch.bfloat16, 0),
    "fp8_e4m3": ("fp8_e4m3", torch.bfloat16, 0),
    "fp8_e5m2": ("fp8_e5m2", torch.bfloat16, 0),
    "int8+L0": ("int8", torch.bfloat16, 1),
}
CONVERSATION_TOKENS = 4096
GOAL_X_BF16, GOAL_X_FP32 = 1.9, 3.8  # what int8 / fp8 should reach, scales included


def model_shape(name: str) -> tuple[tuple[int, int, int], str]:
    """(num_layers, num_kv_heads, head_dim) and where it came from."""
    config_path = MODEL_CACHE / name / "config.json"
    if not config_path.exists():
        return KNOWN_SHAPES[name], "known config"
    cfg = json.loads(config_path.read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim), str(config_path)


def capacity(models: list[str], budget_bytes: int, block_size: int) -> dict:
    rows = {}
    for label, (fmt, dtype, num_unquantized) in FORMATS.items():
        shapes = [CacheShape(*model_shape(name)[0], dtype, fmt, num_unquantized if i == 0 else 0)
                  for i, name in enumerate(models)]
        num_blocks = plan_num_blocks(budget_bytes, shapes, block_size)
        allocated = sum(KVCache(s, num_blocks, block_size).num_bytes for s in shapes)
        assert allocated <= budget_bytes, (label, allocated, budget_bytes)
        rows[label] = {
            "bytes_per_token": sum(s.bytes_per_block(block_size) for s in shapes) // block_size,
            "num_blocks": num_blocks,
            "allocated_bytes": allocated,
            "tokens": num_blocks * block_size,
            "conversations_4k": num_blocks // -(-CONVERSATION_TOKENS // block_size),
        }
    for label, row in rows.items():
        row["x_bf16"] = round(row["tokens"] / rows["bf16"]["tokens"], 3)
        row["x_fp32"] = round(row["tokens"] / rows["fp32"]["tokens"], 3)
        if FORMATS[label][0] != "auto":
            row["meets_goal"] = row["x_bf16"] >= GOAL_X_BF16 and row["x_fp32"] >= GOAL_X_FP32
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-gib", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_capacity.json")
    args = parser.parse_args()
    budget = int(args.budget_gib * 2**30)
    report = {"budget_bytes": budget, "block_size": args.block_size, "conversation_tokens": CONVERSATION_TOKENS,
              "scale_dtype": "bfloat16", "shapes": {}, "setups": {}}
    for setup, models in SETUPS.items():
        for name in models:
            shape, source = model_shape(name)
            report["shapes"][name] = {"num_layers": shape[0], "num_kv_heads": shape[1], "head_dim": shape[2],
                                      "source": source}
        rows = capacity(models, budget, args.block_size)
        report["setups"][setup] = {"models": models, "formats": rows}
        print(f"\n{setup}: {args.budget_gib:g} GiB, block {args.block_size}")
        print(f"  {'format':<9} {'B/token':>8} {'tokens':>10} {'4k convs':>9} {'x bf16':>7} {'x fp32':>7}"
              f"  goal >= {GOAL_X_BF16}x bf16, >= {GOAL_X_FP32}x fp32")
        for label, row in rows.items():
            goal = {True: "  met", False: "  missed"}.get(row.get("meets_goal"), "")
            print(f"  {label:<9} {row['bytes_per_token']:>8} {row['tokens']:>10} "
                  f"{row['conversations_4k']:>9} {row['x_bf16']:>7.3f} {row['x_fp32']:>7.3f}{goal}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
