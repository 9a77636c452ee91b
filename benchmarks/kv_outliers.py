"""Why a model's KV quantizes badly: per layer, how far the K/V rows' largest entry sits above
their typical entry, the largest channels, and the round-trip error of each format.

Prefills the start of chatserve/data/eval_text.txt into an unquantized pool (through the
engine, as kv_quality.py does), then reads the cached post-RoPE K and V back per layer.

    python benchmarks/kv_outliers.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_common import EVAL_TEXT, engine_with_kv  # noqa: E402
from kv_quality import teacher_forced  # noqa: E402

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.loading import load_models  # noqa: E402
from quant.kv import dequantize_kv, quantize_kv  # noqa: E402


def layer_stats(x: torch.Tensor) -> dict:
    """x: [num_tokens, num_kv_heads, head_dim] float32 -> outlier and error numbers."""
    amax = x.abs().amax(-1)
    typical = x.abs().median(-1).values.clamp_min(1e-6)
    row = {"amax_over_median": (amax / typical).median().item(),
           "top_channel_amax": x.abs().amax(0).flatten().topk(4).values.tolist()}
    for fmt in ("int8", "fp8_e4m3"):
        q, scales = quantize_kv(x, fmt)
        row[f"rel_err_{fmt}"] = ((dequantize_kv(q, scales) - x).norm() / x.norm()).item()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=32 << 20, max_num_seqs=1)
    models = load_models(config)
    engine = engine_with_kv(models, config, "auto", 256 << 20)
    ids = models.tokenizer.encode(EVAL_TEXT.read_text())[: args.tokens]
    teacher_forced(engine, ids, 64)  # writes K/V of every token into blocks 0.. of the pool
    pool = engine.models.target_runner.kv_cache.pool  # [L, 2, num_blocks, block_size, Hkv, D]
    report = {"model": args.model, "dtype": args.dtype, "tokens": len(ids), "layers": []}
    for layer in range(pool.shape[0]):
        entry = {"layer": layer}
        for kv, name in ((0, "k"), (1, "v")):
            x = pool[layer, kv].reshape(-1, *pool.shape[-2:])[: len(ids)].float()
            entry[name] = layer_stats(x)
        report["layers"].append(entry)
        k = entry["k"]
        print(f"layer {layer:>2} K: amax/median {k['amax_over_median']:>6.0f}  top channels "
              f"{[round(c, 1) for c in k['top_channel_amax'][:3]]}  rel err int8 {k['rel_err_int8']:.4f} "
              f"fp8_e4m3 {k['rel_err_fp8_e4m3']:.4f} | V amax/median {entry['v']['amax_over_median']:.0f}",
              flush=True)
    out = args.out or Path(__file__).parent / "results" / f"kv_outliers_{args.model}_{args.dtype}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
