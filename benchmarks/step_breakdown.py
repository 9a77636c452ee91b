"""Where a decode step's time goes, speculation off against an EAGLE head, at batch 1: the target's
forward (with features when the head reads them), the head's forwards and its fuse, and the rest of
Engine.step (scheduling, drafting glue, verification, sampling, detokenizing), per step and per
generated token, on held-out prompts of chatserve/data/prompts.json (greedy unless --temperature,
ignore_eos). Wall
clock of each runner call, wrapped in-process; the best of --rounds.

    .venv/bin/python benchmarks/step_breakdown.py --model smollm2-135m-instruct \\
        --eagle-head ~/.cache/chatserve/heads/<hash>/eagle-head.pt \\
        --fixed-k 1 2 --out benchmarks/results/step_breakdown_smollm2_fused_session37.json
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
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.model_runner import HeadRunner, ModelRunner  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())
TIMED = ((ModelRunner, "run"), (ModelRunner, "run_with_features"), (HeadRunner, "run"),
         (HeadRunner, "greedy_chain"), (HeadRunner, "input_features"))


def wrap_runners(spent: collections.Counter) -> None:
    for cls, name in TIMED:
        inner = getattr(cls, name)

        def timed(self, *args, _inner=inner, _key=f"{cls.__name__}.{name}", **kwargs):
            if _key.startswith("ModelRunner"):  # rows the target is fed: 1 + the drafts it verifies
                spent["target_rows"] += sum(len(item.token_ids) for item in args[0])
            start = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                spent[_key] += time.perf_counter() - start

        setattr(cls, name, timed)


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, spent: collections.Counter,
        temperature: float = 0.0) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
    decode: collections.Counter = collections.Counter()  # runner time in decode steps alone
    steps = tokens = 0
    total = 0.0
    for prompt in prompts:
        engine.add_request(prompt, params)
        first = True
        while engine.has_unfinished():
            spent.clear()
            start = time.perf_counter()
            deltas = engine.step()
            emitted = sum(len(d.token_ids) for d in deltas)
            if not first:  # the prefill's steps (up to the first token) are not decode steps
                total += time.perf_counter() - start
                steps += 1
                tokens += emitted
                decode.update(spent)
            first = first and not emitted
    rows = decode.pop("target_rows", 0)
    parts = {k: round(v / steps * 1e3, 3) for k, v in decode.items()}
    rest = total - sum(decode.values())
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps, 3),
            "target_rows_per_step": round(rows / steps, 3),
            "ms_per_token": round(total / tokens * 1e3, 3), "ms_per_step": round(total / steps * 1e3, 3),
            "ms_per_step_parts": parts, "ms_per_step_rest": round(rest / steps * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--eagle-head", default=None, help="head file (default: the cache's for the model's weights)")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--kind", default="code", choices=["code", "chat"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled replies (unseeded, so each run's text differs; compare rates, not tokens)")
    ap.add_argument("--fixed-k", type=int, nargs="*", default=[],
                    help="also the head with adaptive k off at these chain lengths (eagle-k1, ...)")
    ap.add_argument("--no-stop", action="store_true",
                    help="also the head with its chains run to adaptive k, not stopped on its confidence "
                         "(eagle-nostop: SpecConfig.confidence_stop off)")
    ap.add_argument("--two-prices", action="store_true",
                    help="also the head whose chains keep a computed draft at a row's price and go on at a row "
                         "and a step (eagle-two-prices: SpecRunner.keeps_computed_drafts on)")
    ap.add_argument("--startup-head-costs", action="store_true",
                    help="also the head priced by its start-up table alone, not corrected by its served "
                         "steps (eagle-startup)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from chatserve.cli import _kv_cache_dtype

    spent: collections.Counter = collections.Counter()
    wrap_runners(spent)
    common = dict(model=args.model, dtype="float32", quantization=args.quantization, kv_cache_memory=1 << 30,
                  kv_cache_dtype=_kv_cache_dtype("auto", "cpu", "float32"))
    configs = {"off": None, "eagle": SpecConfig(method="eagle", eagle_head=args.eagle_head, suffix_corpus_tokens=0)}
    if args.no_stop:
        configs["eagle-nostop"] = SpecConfig(method="eagle", eagle_head=args.eagle_head, suffix_corpus_tokens=0,
                                             confidence_stop=False)
    for k in args.fixed_k:
        configs[f"eagle-k{k}"] = SpecConfig(method="eagle", eagle_head=args.eagle_head, suffix_corpus_tokens=0,
                                            adaptive=False, num_draft_tokens=k)
    if args.startup_head_costs:
        configs["eagle-startup"] = configs["eagle"]
    if args.two_prices:
        configs["eagle-two-prices"] = configs["eagle"]
    engines = {name: Engine(EngineConfig(**common, spec=spec)) for name, spec in configs.items()}
    if args.startup_head_costs:
        engines["eagle-startup"].spec.step_observers.clear()  # the head's table stays as timed at start
    if args.two_prices:
        engines["eagle-two-prices"].spec.keeps_computed_drafts = True
    startup = {name: e.spec.costs for name, e in engines.items() if e.spec is not None and e.spec.costs}
    tok = engines["off"].tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[args.kind][: args.prompts]]
    results = {"model": args.model, "kind": args.kind, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "temperature": args.temperature,
               "rounds": args.rounds, "runs": {}}
    for engine in engines.values():
        engine.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=0.0))
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):  # alternated: drift hits both
            got = run(engines[name], prompts, args.max_tokens, spent, args.temperature)
            best = results["runs"].get(name)
            if best is None or got["ms_per_token"] < best["ms_per_token"]:
                results["runs"][name] = got
            print(name, json.dumps(got), file=sys.stderr)
    for name, table in startup.items():  # one row's target forward and head step: timed at start, in service
        now = engines[name].spec.costs
        results["runs"][name]["costs_ms"] = {
            "target_1": [round(table.target(1) * 1e3, 3), round(now.target(1) * 1e3, 3)],
            "head_1": [round(table.head(1) * 1e3, 3), round(now.head(1) * 1e3, 3)]}
    off = results["runs"]["off"]["ms_per_token"]
    for name, got in results["runs"].items():
        got["x_off"] = round(off / got["ms_per_token"], 3)
        print(f"{name:9s} {got['ms_per_token']:6.2f} ms/token  x off {got['x_off']:.3f}  "
              f"{got['ms_per_step']:6.2f} ms/step  "
              f"{got['tokens_per_step']:.2f} tokens/step  {got['target_rows_per_step']:.2f} rows/step  "
              f"parts {got['ms_per_step_parts']}  rest {got['ms_per_step_rest']:.2f}  "
              f"costs (start, served) {got.get('costs_ms')}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
