"""Where one batch-1 decode step's time goes: the weight matmuls of the layers, the LM head, and
everything else (norms, RoPE, KV store, attention, residuals, casts, Python), per model and
weight mode, through ModelRunner at a given context length (issue #12's "lean decode step").

    .venv/bin/python benchmarks/decode_step.py --model qwen2.5-coder-1.5b-instruct \
        --modes int4:float32 --contexts 200 1000 --json benchmarks/results/decode_step_qwen1.5b.json

Each step's matmul time is summed by wrapping the quantized layers' forward with a timer (the
wrappers cost a few microseconds per call, charged to the matmuls). The layers of a step of few
rows run as one C++ call (LayerStack) that no wrapper sees: `--no-stack` runs them as modules
(same kernels, ~0.2 ms of Python a layer more) so the split is seen; with the stack, "linears"
is the LM head's input side only. `--rows 1 2 3 4 5` times a batch-1 verification of that many
rows (each with logits) instead of a decode step: where the time of a k-draft verification goes.
`--profile` also prints torch.profiler's top operators for a few steps.

    .venv/bin/python benchmarks/decode_step.py --contexts 1024 --rows 1 2 3 4 5 --no-stack
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.batch import BatchItem  # noqa: E402
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from quant.int4 import Int4Linear  # noqa: E402
from quant.int8 import Int8Linear  # noqa: E402
from quant.q4k import Q4KLinear  # noqa: E402


def time_steps(engine: Engine, context: int, steps: int, num_rows: int = 1) -> list[dict]:
    runner = engine.models.target_runner
    model = runner.model
    head = model.lm_head
    spent = {"linears": 0.0, "head": 0.0}
    originals = {}

    def wrap(cls):
        original = cls.forward
        originals[cls] = original

        def timed(self, x):
            start = time.perf_counter()
            y = original(self, x)
            spent["head" if self is head else "linears"] += time.perf_counter() - start
            return y
        cls.forward = timed

    blocks = list(range((context + steps * num_rows) // runner.block_size + 2))
    runner.run([BatchItem(list(range(100, 100 + context)), 0, blocks, 1)])  # the context's KV
    for cls in (Int4Linear, Q4KLinear, Int8Linear, torch.nn.Linear):
        wrap(cls)
    rows = []
    try:
        for i in range(steps):
            spent["linears"] = spent["head"] = 0.0
            start = time.perf_counter()
            runner.run([BatchItem([5] * num_rows, context + i * num_rows, blocks, num_rows)])
            step = time.perf_counter() - start
            rows.append({"step_ms": step * 1e3, "linears_ms": spent["linears"] * 1e3, "head_ms": spent["head"] * 1e3,
                         "rest_ms": (step - spent["linears"] - spent["head"]) * 1e3})
    finally:
        for cls, original in originals.items():
            cls.forward = original
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--modes", nargs="+", default=["int4:float32"], help="quantization:dtype, quantization 'none' for dense")
    p.add_argument("--contexts", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows per step, each with logits (a verification)")
    p.add_argument("--no-stack", action="store_true", help="run the layers as modules so their matmuls are timed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    results = []
    for mode in args.modes:
        quant, dtype = mode.split(":")
        engine = Engine(EngineConfig(model=args.model, dtype=dtype, quantization=None if quant == "none" else quant,
                                     kv_cache_memory=512 << 20, num_threads=args.threads))
        engine.models.target_runner.model.stack.enabled = not args.no_stack
        for context, num_rows in itertools.product(args.contexts, args.rows):
            rows = time_steps(engine, context, args.steps, num_rows)
            best = sorted(rows, key=lambda r: r["step_ms"])[: max(3, args.steps // 2)]  # the quieter half
            line = {"mode": mode, "context": context, "rows": num_rows, "stack": not args.no_stack,
                    "threads": args.threads, "loadavg": os.getloadavg()[0]}
            for key in ("step_ms", "linears_ms", "head_ms", "rest_ms"):
                line[key] = round(statistics.median(r[key] for r in best), 2)
            line["rest_share"] = round(line["rest_ms"] / line["step_ms"], 3)
            results.append(line)
            print(json.dumps(line), flush=True)
            if args.profile:
                runner = engine.models.target_runner
                blocks = list(range((context + 40) // runner.block_size + 2))
                with torch.profiler.profile() as prof:
                    for i in range(5):
                        runner.run([BatchItem([5], context + args.steps + i, blocks, 1)])
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        del engine
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "results": results}, indent=1))


if __name__ == "__main__":
    main()
