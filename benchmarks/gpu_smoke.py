"""The default pair on a GPU: greedy equality with speculation on and off, then TTFT, TPOT and
tokens/s at batch 1, 8 and 32. Written before any GPU was at hand; on this CPU-only machine the
same script runs a tiny model through Triton's interpreter (tests/kernels/test_gpu_smoke.py), so
its wiring is proven and it is ready for the day a GPU is.

    .venv/bin/python benchmarks/gpu_smoke.py --out benchmarks/results/gpu_smoke.json
    # defaults: --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct
    #           --device cuda --dtype bfloat16 --batches 1 8 32 --max-tokens 128

Exits with the loader's message on a machine without CUDA (--device cuda).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash map is, in three sentences.",
    "def quicksort(xs):\n    # complete this function\n",
    "List five prime numbers and say why each is prime.",
]


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = [o["stats"] for o in outs]
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {
        "batch": len(prompts),
        "ttft_ms": statistics.median(s.ttft_ms for s in stats),
        "tpot_ms": statistics.median(s.tpot_ms for s in stats if s.tpot_ms is not None),
        "tokens_per_s": tokens / seconds,
        "token_ids": [o["token_ids"] for o in outs],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="pool bytes (default: a quarter of free memory)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    common = dict(model=args.model, device=args.device, kernels=args.kernels, dtype=args.dtype,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=max(args.batches), max_model_len=2048)
    spec = SpecConfig(method="draft", draft_model=args.draft_model, adaptive=False)
    try:
        engine = Engine(EngineConfig(**common, spec=spec))
    except ValueError as e:
        print(f"gpu_smoke: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in PROMPTS]
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up (kernels compile)
    results = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "runs": []}
    for method in ("off", "draft"):
        engine.set_speculation(spec if method == "draft" else None)
        for batch in args.batches:
            row = run_batch(engine, [prompts[i % len(prompts)] for i in range(batch)], args.max_tokens)
            results["runs"].append({"method": method, **row})
            print(f"{method:5s} batch {batch:3d}: TTFT {row['ttft_ms']:8.1f} ms  TPOT {row['tpot_ms']:7.2f} ms  "
                  f"{row['tokens_per_s']:8.1f} tok/s", flush=True)
    by = {(r["method"], r["batch"]): r["token_ids"] for r in results["runs"]}
    equal = all(by[("off", b)] == by[("draft", b)] for b in args.batches)
    results["greedy_equal"] = equal
    print(f"greedy output with speculation on == off: {equal}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
