"""Start-up cost of K smoothing: seconds to calibrate a model's K means (chatserve/kv_smooth.py),
i.e. one prefill of the calibration tokens into a scratch pool, as an engine with a quantized
KV cache does once per model at start. The first run in a fresh process is what `chatserve
serve` pays (cold: first forward of the process); later runs show the steady cost.

    python benchmarks/kv_calibration_time.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_common import load_avg, write_report  # noqa: E402

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.kv_smooth import calibration_ids, compute_key_means  # noqa: E402
from chatserve.loading import DTYPES, load_models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--quantization", default=None, choices=["int8"], help="weight quantization, as the CLI's -q")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=32 << 20, max_num_seqs=1,
                          quantization=args.quantization)
    start = time.perf_counter()
    models = load_models(config)  # "auto" pool: no calibration here
    load_seconds = time.perf_counter() - start
    ids = calibration_ids(models.tokenizer)
    seconds, means = [], None
    for _ in range(args.reps):
        start = time.perf_counter()
        out = compute_key_means(models.target, ids, DTYPES[args.dtype])
        seconds.append(time.perf_counter() - start)
        assert means is None or torch.equal(means, out), "calibration is not deterministic"
        means = out
    print(f"{args.model} {args.dtype} weights {args.quantization or args.dtype}, {args.threads} thread(s): "
          f"load {load_seconds:.1f} s; calibration over {len(ids)} tokens: "
          + ", ".join(f"{s:.2f}" for s in seconds) + " s (first = cold)")
    write_report({"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                  "threads": args.threads, "calibration_tokens": len(ids), "load_seconds": load_seconds,
                  "calibration_seconds": seconds, "loadavg": load_avg()},
                 args.out, f"kv_calibration_time_{args.model}_{args.dtype}.json")


if __name__ == "__main__":
    main()
