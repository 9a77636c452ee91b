"""Speculation on vs off at several batch sizes, one process, one run: does adaptive drafting
ever lose to plain decoding? Greedy, all requests of a batch at once, for each prompt set
(`--workloads`; chat is where drafts are accepted least) and each method (draft model, n-gram).

Reports the thread's CPU ms per generated token (with --threads 1 the robust number on a
shared machine) and wall tokens/s, and checks that every output equals spec off.

    python benchmarks/bench_spec_batch.py --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --batch-sizes 1 2 4 8 --workloads chat code edit --threads 1
    python benchmarks/bench_spec_batch.py --target smollm2-135m-instruct --draft none --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((Path(__file__).resolve().parent.parent / "chatserve/data/prompts.json").read_text())


def best_of(repeats: int, engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """The run with the least decode time (TPOT) of `repeats` (other load only ever adds time)."""
    return min((run(engine, prompts, params) for _ in range(repeats)), key=lambda r: r["tpot_ms"])


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine.block_manager.reset_prefix_cache()  # every run prefills its prompts
    start, cpu_start = time.perf_counter(), time.thread_time()
    outs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    tokens = sum(len(o["token_ids"]) for o in outs)
    # Decode only (first token to last, per request; the batch's prefill left out): the steps
    # where speculation can differ from plain decoding.
    tpot_ms = sum(o["stats"].tpot_ms for o in outs) / len(outs)
    drafted = sum(o["stats"].num_drafted for o in outs)
    accepted = sum(o["stats"].num_accepted for o in outs)
    return {"tokens": tokens, "tokens_per_s": tokens / wall, "cpu_ms_per_token": cpu * 1e3 / tokens, "tpot_ms": tpot_ms,
            "drafted": drafted, "accepted": accepted, "outputs": [o["token_ids"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a draft model, or none (n-gram only)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--workloads", nargs="+", default=["chat", "code", "edit"], choices=sorted(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="run each point this many times, keep the least TPOT")
    ap.add_argument("--methods", nargs="+", default=["draft", "ngram"], choices=["draft", "ngram", "off"],
                    help="compared with spec off; 'off' runs spec off a second time (an A/A control: the noise)")
    ap.add_argument("--out", default="benchmarks/results/spec_batch.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = None if args.draft == "none" else args.draft
    available = {"ngram": SpecConfig(method="ngram"), "off": None}
    if draft:
        available["draft"] = SpecConfig(method="draft", draft_model=draft)
    specs = {name: available[name] for name in args.methods if name in available}
    engine = Engine(EngineConfig(model=args.target, dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 30,
                                 max_num_seqs=max(args.batch_sizes), spec=available.get("draft")))
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(f"{args.target} + {draft or 'n-gram only'}; load {os.getloadavg()[0]:.2f}", flush=True)
    results: dict = {}
    for workload in args.workloads:
        texts = PROMPTS[workload]
        for b in args.batch_sizes:
            prompts = [tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(b)]
            engine.set_speculation(None)
            off = best_of(args.repeats, engine, prompts, params)
            row = results.setdefault(workload, {})[b] = {"off": off}
            for name, spec in specs.items():
                engine.set_speculation(spec)
                on = row[name if name != "off" else "off again"] = best_of(args.repeats, engine, prompts, params)
                on["cpu_speedup"] = off["cpu_ms_per_token"] / on["cpu_ms_per_token"]
                on["wall_speedup"] = on["tokens_per_s"] / off["tokens_per_s"]
                on["tpot_speedup"] = off["tpot_ms"] / on["tpot_ms"]
                on["same_output"] = on["outputs"] == off["outputs"]
                print(f"  {workload} batch {b}: off {off['cpu_ms_per_token']:.1f} CPU ms/token, {name} "
                      f"{on['cpu_ms_per_token']:.1f} (drafted {on['drafted']}, accepted {on['accepted']}) -> "
                      f"{on['cpu_speedup']:.2f}x CPU, {on['wall_speedup']:.2f}x wall, {on['tpot_speedup']:.2f}x TPOT, "
                      f"same output: {on['same_output']}",
                      flush=True)
            for r in row.values():
                r.pop("outputs")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "loadavg": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
