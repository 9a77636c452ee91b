"""Weight-quantization quality: perplexity of each weight path against the GGUF dequantized to fp32.

The text (chatserve/data/eval_text.txt, never used for calibration) is teacher-forced through the
engine in chunks of --chunk tokens. Chunks of at most quant.int4.SMALL_M rows go through the
decode kernels (int4: activations quantized to int8 per group, as at decode time), so this is the
quality of what decoding computes. Also: greedy agreement with the fp32 path over a few prompts.

    .venv/bin/python benchmarks/weight_quality.py --model qwen2.5-coder-1.5b-instruct \
        --modes none:float32 int8:bfloat16 int4:float32 --json benchmarks/results/weight_quality_qwen1.5b.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_quality import greedy, teacher_forced  # noqa: E402

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402

GOALS = {"int4": 0.01, "int8": 0.003}  # allowed relative perplexity increase over the fp32 GGUF weights
PROMPTS = [
    "Write a Python function that merges two sorted lists, with a docstring.",
    "Explain what a mutex is in two sentences.",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--modes", nargs="+", default=["none:float32", "int8:bfloat16", "int4:float32"],
                    help="quantization:dtype pairs; the first is the reference")
    ap.add_argument("--max-text-tokens", type=int, default=None,
                    help="default: the whole text (~2.3k tokens; over 1k tokens, summation order alone moved int4 by ~0.3%%)")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    text = (Path(__file__).resolve().parents[1] / "chatserve/data/eval_text.txt").read_text()
    rows, reference = [], None
    for mode in args.modes:
        quant, dtype = mode.split(":")
        engine = Engine(EngineConfig(model=args.model, dtype=dtype, quantization=None if quant == "none" else quant,
                                     kv_cache_memory=256 << 20, num_threads=args.threads))
        ids = engine.tokenizer.encode(text)[: args.max_text_tokens]
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        start = time.perf_counter()
        nll, _ = teacher_forced(engine, ids, args.chunk)
        seconds = time.perf_counter() - start
        outs = greedy(engine, prompts, args.greedy_tokens)
        row = {"mode": mode, "nll": nll, "perplexity": math.exp(nll), "tokens": len(ids), "seconds": seconds}
        if reference is None:
            reference = (nll, outs)
        else:
            row["ppl_change"] = math.exp(nll - reference[0]) - 1
            same = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o)) for o, r in zip(outs, reference[1])]
            row["greedy_common_prefix"] = same
            goal = GOALS.get(quant)
            row["goal"] = goal
            row["meets_goal"] = None if goal is None else row["ppl_change"] <= goal
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        gc.collect()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "chunk": args.chunk, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
