"""What an EAGLE head costs while it does not draft: speculation off against the head's engine with
k = 0 for every request (num_draft_tokens=0), so the only difference is the head's upkeep: the
features kept per request, the deferred head rows written FLUSH_ROWS at a time, the blocks' last
features. Times EagleMethod.observe() and the head's forwards inside it; decode speed of both,
rounds alternated, T = 0 on the held-out chat prompts of chatserve/data/prompts.json.

    python benchmarks/eagle_upkeep.py --model qwen2.5-coder-1.5b-instruct --out benchmarks/results/eagle_upkeep_qwen.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from chatserve.spec_methods import eagle as eagle_method  # noqa: E402


def timed(fn, timers: dict, key: str, rows=None):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timers[key] += time.perf_counter() - start
        if rows:
            timers["head_rows"] += rows(*args)
        return out
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--kind", default="chat", choices=["chat", "code", "edit"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype="float32", quantization="int4", kv_cache_memory=1 << 30)
    timers = {"observe_s": 0.0, "head_forward_s": 0.0, "head_rows": 0}
    eagle_method.EagleMethod.observe = timed(eagle_method.EagleMethod.observe, timers, "observe_s")
    engines = {"off": Engine(EngineConfig(**common)), "eagle": Engine(EngineConfig(**common, spec=SpecConfig(method="eagle")))}
    runner = engines["eagle"].models.eagle_runner
    runner.run = timed(runner.run, timers, "head_forward_s", rows=lambda items, *a: sum(len(i.token_ids) for i in items))
    tok = engines["off"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}])
               for p in json.loads((ROOT / "chatserve/data/prompts.json").read_text())[args.kind]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, num_draft_tokens=0)
    for engine in engines.values():
        engine.generate([tok.encode("warm-up")], SamplingParams(max_tokens=8, temperature=0.0))
    runs = []
    for r in range(args.rounds):
        for name in ["off", "eagle"] if r % 2 == 0 else ["eagle", "off"]:
            timers.update(observe_s=0.0, head_forward_s=0.0, head_rows=0)
            start = time.perf_counter()
            outs = [engines[name].generate([p], params)[0] for p in prompts]
            seconds = time.perf_counter() - start
            tokens = sum(len(o["token_ids"]) for o in outs)
            run = {"config": name, "round": r, "seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
                   "drafted": sum(o["stats"].num_drafted for o in outs), **dict(timers),
                   "observe_share": timers["observe_s"] / seconds, "token_ids": [o["token_ids"] for o in outs]}
            runs.append(run)
            print(f"{name:5s} round {r}: {run['tok_per_s']:.2f} tok/s, observe {run['observe_s']:.3f} s "
                  f"({run['observe_share']:.1%}), head forwards {run['head_forward_s']:.3f} s over {run['head_rows']} rows",
                  file=sys.stderr)
    best = {name: max(r["tok_per_s"] for r in runs if r["config"] == name) for name in engines}
    equal = all(r["token_ids"] == runs[0]["token_ids"] for r in runs)
    result = {"model": args.model, "kind": args.kind, "best_tok_per_s": best, "ratio": best["eagle"] / best["off"],
              "greedy_equal": equal, "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs]}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
