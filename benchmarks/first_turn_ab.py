"""First-turn TTFT with speculation on and off, in one process, alternated: does a method tax the
prefill of a long prompt? (Servers started one after another each see a different machine here;
this compares the methods on the same weights, prompt and minute.)

Each round runs every method once on the same long prompt (a new last token per round, and the
prefix cache dropped by set_speculation, so every run prefills in full), the order reversed every
other round.

    .venv/bin/python benchmarks/first_turn_ab.py --model qwen2.5-coder-1.5b-instruct \
        --methods off ngram suffix --rounds 4 --json benchmarks/results/first_turn_ab_qwen.json
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

DATA = Path(__file__).resolve().parent / "data" / "long_context.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--methods", nargs="+", default=["off", "ngram", "suffix"])
    p.add_argument("--tokens", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    engine = Engine(EngineConfig(model=args.model, quantization=args.quantization, num_threads=args.threads))
    text = next(iter(json.loads(DATA.read_text())["files"].values()))
    prompt = engine.tokenizer.encode(text)[: args.tokens]
    seconds: dict[str, list[float]] = {m: [] for m in args.methods}
    for rnd in range(args.rounds):
        for method in args.methods if rnd % 2 == 0 else reversed(args.methods):
            engine.set_speculation(None if method == "off" else SpecConfig(method=method))
            start = time.perf_counter()
            engine.generate([prompt + [rnd]], SamplingParams(max_tokens=1, temperature=0.0))
            seconds[method].append(time.perf_counter() - start)
            print(f"round {rnd} {method:8s} {seconds[method][-1]:7.2f} s", flush=True)
    ref = sum(seconds[args.methods[0]])
    summary = {m: {"seconds": s, "median_s": statistics.median(s), "sum_over_first": sum(s) / ref}
               for m, s in seconds.items()}
    for m, row in summary.items():
        print(f"{m:8s} median {row['median_s']:6.2f} s  sum / {args.methods[0]} {row['sum_over_first']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "prompt_tokens": len(prompt) + 1, "methods": summary},
                                        indent=1))


if __name__ == "__main__":
    main()
