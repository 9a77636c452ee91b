"""Perplexity with every layer's KV quantized except layer 0's (kept in the model dtype).

Tests the explanation for Qwen2.5's KV-quantization loss (benchmarks/kv_outliers.py: layer 0's
K has outlier channels) through the engine option --kv-cache-unquantized-layers 1 (layer 0 in a
second pool in the model dtype), teacher-forcing chatserve/data/eval_text.txt as kv_quality.py does.
The quantized layers use K smoothing (chatserve/kv_smooth.py, the engine's default) unless
--smooth-keys off; layer 0, kept in the model dtype, is never smoothed.

    python benchmarks/kv_keep_layer0.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_common import EVAL_TEXT, engine_with_kv, load_avg  # noqa: E402
from kv_quality import teacher_forced  # noqa: E402

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.loading import load_models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--formats", nargs="+", default=["int8", "fp8_e4m3"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smooth-keys", default="on", choices=["on", "off"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=32 << 20, max_num_seqs=1)
    models = load_models(config)
    ids = models.tokenizer.encode(EVAL_TEXT.read_text())
    report = {"model": args.model, "dtype": args.dtype, "loadavg_before": load_avg(),
              "smooth_keys": args.smooth_keys, "ppl_layer0_unquantized": {}}
    for fmt in args.formats:
        engine = engine_with_kv(models, config, fmt, 256 << 20, num_unquantized_layers=1,
                                smooth_keys=args.smooth_keys == "on")
        assert engine.models.target_runner.kv_cache.layers[0].k_scale is None
        nll, _ = teacher_forced(engine, ids, 64)
        report["ppl_layer0_unquantized"][fmt] = math.exp(nll)
        print(f"{fmt}, layer 0 in {args.dtype}: perplexity {math.exp(nll):.4f}", flush=True)
    report["loadavg_after"] = load_avg()
    out = args.out or Path(__file__).parent / "results" / f"kv_keep_layer0_{args.model}_{args.dtype}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
