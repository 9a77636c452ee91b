"""The forward times speculation is priced by, and the ones it extrapolates: the target over the
engine's measured row grid and over prompt-sized chunks, the draft over its grid and over prompt
catch-ups (one logit row), and what SpecRunner.plan costs a step at batch 8 with n-gram.

    python benchmarks/spec_cost_grid.py --threads 2 --out benchmarks/results/spec_cost_grid.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.batch import BatchItem  # noqa: E402
from chatserve.block_manager import BlockTable  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())


def forward_ms(runner, table: BlockTable, rows: int, num_logits: int) -> float:
    item = BatchItem([0] * rows, 0, table.block_ids, num_logits)
    runner.run([item])  # warm-up
    start = time.perf_counter()
    runner.run([item])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.target, dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 30,
                          spec=SpecConfig(method="draft", draft_model=args.draft))
    engine = Engine(config)
    costs, models = engine.spec.costs, engine.models
    out = {"target_grid_ms": {r: s * 1e3 for r, s in costs.target_seconds.items()},
           "draft_grid_ms": {r: s * 1e3 for r, s in costs.draft_seconds.items()}}
    table = BlockTable()
    assert engine.block_manager.allocate(table, 520)
    out["target_prompt_chunk_ms"] = {r: forward_ms(models.target_runner, table, r, 1) for r in (128, 200, 256)}
    out["draft_catch_up_ms"] = {r: forward_ms(models.draft_runner, table, r, 1) for r in (32, 64, 128, 256, 512)}
    engine.block_manager.free(table)
    tok = engine.tokenizer
    out["prompt_tokens"] = {w: [len(tok.apply_chat_template([{"role": "user", "content": p}])) for p in ps]
                            for w, ps in PROMPTS.items()}
    for name, values in out.items():
        print(f"{name:24s}", {k: round(v, 1) for k, v in values.items()} if name != "prompt_tokens" else values, flush=True)

    # plan()'s own cost per step: 8 n-gram requests decoding together.
    engine.set_speculation(SpecConfig(method="ngram"))
    spent = {"plan": 0.0, "steps": 0}
    plan = engine.spec.plan

    def timed_plan(*a, **k):
        start = time.perf_counter()
        plan(*a, **k)
        spent["plan"] += time.perf_counter() - start
        spent["steps"] += 1

    engine.spec.plan = timed_plan
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}])
               for p in PROMPTS["chat"][:3] + PROMPTS["code"][:3] + PROMPTS["edit"][:2]]
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    total = time.perf_counter() - start
    out["plan_ms_per_step_batch8"] = spent["plan"] * 1e3 / spent["steps"]
    out["step_ms_batch8"] = total * 1e3 / spent["steps"]
    print(f"plan() {out['plan_ms_per_step_batch8']:.2f} ms of a {out['step_ms_batch8']:.1f} ms step (batch 8, n-gram)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
