"""What sampling costs a decode step: the engine's Sampler.sample and Sampler.verify timed in-process
(wall clock a call) beside the time per output token, at the sampling settings people chat with
(temperature, top-p, top-k), on held-out chat prompts of chatserve/data/prompts.json, one request
at a time, unseeded as most are (--seed: seeded, which also fixes a speculative request's k, as
adaptive k would make a seed's text depend on timings). Prints a line a prompt and the summary;
--out writes JSON.

    .venv/bin/python benchmarks/sampling_cost.py --model qwen2.5-coder-1.5b-instruct \\
        --temperature 0.7 --top-p 0.9 --out benchmarks/results/sampling_cost_qwen_session39.json

Run it from two checkouts (old and new code) alternately to compare: the script reads the package
beside it.
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.cli import _kv_cache_dtype  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())


def timed_sampler(engine: Engine, spent: collections.Counter, calls: collections.Counter) -> None:
    for name in ("sample", "verify"):
        inner = getattr(engine.sampler, name)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start
                calls[_name] += 1

        setattr(engine.sampler, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--spec", default="off", help="off, or a speculation method (eagle, ngram, suffix, draft)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--eagle-head", default=None)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--kind", default="chat", choices=["code", "chat"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", action="store_true", help="seed request i with i (a fixed k when speculating)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = None
    if args.spec != "off":
        spec = SpecConfig(method=args.spec, draft_model=args.draft_model, eagle_head=args.eagle_head,
                          suffix_corpus_tokens=0)
    engine = Engine(EngineConfig(model=args.model, dtype="float32", quantization="int4", kv_cache_memory=1 << 30,
                                 kv_cache_dtype=_kv_cache_dtype("auto", "cpu", "float32"), spec=spec))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[args.kind][: args.prompts]]
    engine.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))  # warm
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    timed_sampler(engine, spent, calls)
    settings = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    tpot = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i if args.seed else None, **settings)
        out = engine.generate([prompt], params)
        stats = out[0]["stats"]
        tpot.append((stats.finish_time - stats.first_token_time) / (args.max_tokens - 1) * 1e3)
        print(f"prompt {i}: {tpot[-1]:.2f} ms/token", file=sys.stderr)
    result = {"model": args.model, "spec": args.spec, "sampling": settings, "seeded": args.seed,
              "max_tokens": args.max_tokens,
              "tpot_ms": [round(t, 3) for t in tpot], "mean_tpot_ms": round(sum(tpot) / len(tpot), 3),
              "sampler_ms_per_call": {k: round(spent[k] / calls[k] * 1e3, 3) for k in spent},
              "sampler_calls": dict(calls),
              "sampler_ms_per_token": round(sum(spent.values()) * 1e3 / (len(prompts) * (args.max_tokens - 1)), 3)}
    print(json.dumps(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
