"""Where an EAGLE engine's decode step goes beside speculation off's, phase by phase: off and an EAGLE
engine that never drafts (no method offers: the head is kept up as always) decode the held-out prompts
in lockstep (eagle_head.lockstep_runs: steps interleaved, so a burst of this host's noise hits both),
and each decode step of a full batch is split into the target's forward, the scheduler, and the
speculation runner's plan / propose / observe_forward / observe (the head's rows and their glue);
"rest" is the remainder of Engine.step (verification, sampling, appending). Mean ms a step per batch
size; what the EAGLE engine's step adds over off's is its upkeep (eagle_head.py's `upkeep` variant
measures the same as a speed ratio). One process, models loaded once.

    python benchmarks/eagle_upkeep_phases.py --model smollm2-135m-instruct --out /tmp/phases.json
"""
import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chatserve.cli import _kv_cache_dtype  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from eagle_head import chat_prompts, lockstep_runs  # noqa: E402

RUNNER_PHASES = ("plan", "propose", "observe_forward", "observe")


def instrument(engine: Engine, name: str, times: dict) -> None:
    """Time each decode step of a full batch of `engine` and its phases into times[(batch, phase)]."""
    current: dict[str, float] = {}

    def timed(obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            current[phase] = current.get(phase, 0.0) + time.perf_counter() - start
            return out

        setattr(obj, attr, wrapper)

    timed(engine.models.target_runner, "run", "forward")
    timed(engine.models.target_runner, "run_with_features", "forward")
    timed(engine.scheduler, "schedule", "schedule")
    for phase in RUNNER_PHASES if engine.spec is not None else ():
        timed(engine.spec, phase, phase)
    step = engine.step

    def timed_step():
        reqs = list(engine.scheduler.running)
        is_decode = bool(reqs) and not engine.scheduler.waiting and not any(
            r.is_prefilling or r.num_output_tokens == 0 for r in reqs)
        current.clear()
        start = time.perf_counter()
        deltas = step()
        total = time.perf_counter() - start
        if is_decode:
            times[name][len(reqs), "step"].append(total)
            for phase, seconds in current.items():
                times[name][len(reqs), phase].append(seconds)
            times[name][len(reqs), "rest"].append(total - sum(current.values()))
        return deltas

    engine.step = timed_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=["code", "chat", "edit"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(model=args.model, quantization="int4", kv_cache_memory=1 << 30,
                  kv_cache_dtype=_kv_cache_dtype("auto", "cpu", "float32"))
    engines = {"off": Engine(EngineConfig(**common)),
               "upkeep": Engine(EngineConfig(**common, spec=SpecConfig(method="eagle", suffix_corpus_tokens=0)))}
    for method in engines["upkeep"].spec.methods.values():
        method.offer = lambda *a: None  # kept up, never drafts
    times = {name: collections.defaultdict(list) for name in engines}
    for name, engine in engines.items():
        engine.generate([engine.tokenizer.encode("warm-up")], SamplingParams(max_tokens=8, temperature=0.0))
        instrument(engine, name, times)
    for kind in args.workloads:
        prompts = chat_prompts(engines["off"].tokenizer, kind)
        for batch in args.batches:
            for r in range(args.rounds):
                lockstep_runs(engines, prompts, batch, args.max_tokens, first=r)
    results = {"model": args.model, "workloads": args.workloads, "rounds": args.rounds, "mean_ms": {}}
    for batch in args.batches:
        for name in engines:
            phases = {phase: statistics.mean(t) * 1e3 for (b, phase), t in times[name].items() if b == batch}
            results["mean_ms"][f"b{batch}/{name}"] = {**phases, "steps": len(times[name][batch, "step"])}
            print(f"b{batch} {name:7s} " + "  ".join(f"{p} {ms:.3f}" for p, ms in phases.items())
                  + f"  ({len(times[name][batch, 'step'])} steps, mean ms)")
        extra = results["mean_ms"][f"b{batch}/upkeep"]["step"] - results["mean_ms"][f"b{batch}/off"]["step"]
        print(f"b{batch} upkeep over off: +{extra:.3f} ms a step "
              f"({extra / results['mean_ms'][f'b{batch}/off']['step']:.1%})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
