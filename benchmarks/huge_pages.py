"""Decode speed with the weights in 4 KiB pages against 2 MiB pages (chatserve/huge_pages.py).

Two engines on the same model in one process: A loaded with CHATSERVE_NO_HUGE_PAGES=1 (torch's
memory, 4 KiB pages), B as served (its large weights moved into huge pages). Each round runs
the same greedy request in both, their steps interleaved one by one (which leads alternates
between rounds), and takes A's time over B's; the speed-up
is the geometric mean of the rounds' ratios, with its standard error (this host's noise moves a
step by 10-30% between runs: only a ratio inside one round says anything). Both engines' greedy
tokens are compared first: the move must change no value. Optionally with a
draft model (the draft's weights move with the target's); --fixed-k then keeps each engine's
adaptive k, priced from its own start-up timings, from drafting differently.

    .venv/bin/python benchmarks/huge_pages.py --model qwen2.5-coder-1.5b-instruct --rounds 8 \\
        --json benchmarks/results/huge_pages_qwen1.5b_session46.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatserve import huge_pages  # noqa: E402
from chatserve.cli import _kv_cache_dtype  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = Path(__file__).resolve().parent.parent / "chatserve" / "data" / "prompts.json"


def huge_kib() -> int:
    """This process's AnonHugePages (KiB)."""
    return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])


def lockstep(engines: dict[str, Engine], prompt: list[int], params: SamplingParams, first: str) -> dict[str, float]:
    """Seconds per token after the first of one request in each engine, the engines' steps
    interleaved one by one (`first`'s step leads): a burst of noise on this host then lands on
    both alike, where timing one whole request after the other left it to one."""
    for engine in engines.values():
        engine.add_request(prompt, params)
        engine.step()  # the prefill and first token
    order = [first, *(name for name in engines if name != first)]
    spent = dict.fromkeys(engines, 0.0)
    while any(engine.has_unfinished() for engine in engines.values()):
        for name in order:
            if engines[name].has_unfinished():
                start = time.perf_counter()
                engines[name].step()
                spent[name] += time.perf_counter() - start
    return {name: t / (params.max_tokens - 1) for name, t in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--fixed-k", type=int, default=None,
                   help="with --draft-model: draft this many tokens every step (adaptive k off), so that both engines "
                        "speculate alike whatever their start-up cost tables say")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-kind", default="code", help="a key of chatserve/data/prompts.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not huge_pages.available():
        sys.exit("no transparent huge pages here (or CHATSERVE_NO_HUGE_PAGES is set): nothing to compare")
    fixed = {} if args.fixed_k is None else {"num_draft_tokens": args.fixed_k, "adaptive": False}
    spec = SpecConfig(draft_model=args.draft_model, **fixed) if args.draft_model else None
    config = EngineConfig(model=args.model, dtype="float32", quantization="int4", kv_cache_memory=1 << 30,
                          kv_cache_dtype=_kv_cache_dtype("auto", "cpu", "float32"), spec=spec)
    before = huge_kib()
    os.environ["CHATSERVE_NO_HUGE_PAGES"] = "1"
    small = Engine(config)
    del os.environ["CHATSERVE_NO_HUGE_PAGES"]
    moved_kib = huge_kib() - before
    huge = Engine(config)
    moved_kib = huge_kib() - before - moved_kib
    print(f"{args.model}: {moved_kib >> 10} MiB of weights in huge pages in the served engine", flush=True)
    text = json.loads(PROMPTS.read_text())[args.prompt_kind][0]
    prompt = small.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    same = [r["token_ids"] for r in small.generate([prompt], params)] == [r["token_ids"] for r in huge.generate([prompt], params)]
    if not same:  # the move must not change a value
        sys.exit("the engines' greedy tokens differ: the weights were not moved faithfully")
    rounds = []
    for r in range(args.rounds):
        t = lockstep({"4k": small, "2m": huge}, prompt, params, first="4k" if r % 2 == 0 else "2m")
        rounds.append({"tpot_4k_ms": round(t["4k"] * 1e3, 2), "tpot_2m_ms": round(t["2m"] * 1e3, 2),
                       "ratio": round(t["4k"] / t["2m"], 4), "loadavg": round(os.getloadavg()[0], 2)})
        print(f"round {r}: 4 KiB pages {t['4k'] * 1e3:.2f} ms/token, 2 MiB pages {t['2m'] * 1e3:.2f}, "
              f"{t['4k'] / t['2m']:.3f}x", flush=True)
    ratios = [r["ratio"] for r in rounds]
    result = {
        "model": args.model, "draft_model": args.draft_model, "fixed_k": args.fixed_k, "max_tokens": args.max_tokens,
        "prompt_kind": args.prompt_kind, "threads": args.threads, "huge_pages_mib": moved_kib >> 10, "greedy_equal": same,
        "median_tpot_4k_ms": statistics.median(r["tpot_4k_ms"] for r in rounds),
        "median_tpot_2m_ms": statistics.median(r["tpot_2m_ms"] for r in rounds),
        "speedup": round(statistics.geometric_mean(ratios), 4),
        "speedup_se": round(statistics.stdev(ratios) / len(ratios) ** 0.5, 4) if len(ratios) > 1 else None,
        "rounds_ahead": sum(x > 1 for x in ratios), "rounds": rounds,
    }
    print(f"speed-up {result['speedup']:.3f}x (se {result['speedup_se']}), huge pages ahead in "
          f"{result['rounds_ahead']} of {len(rounds)} rounds; median TPOT {result['median_tpot_4k_ms']} -> "
          f"{result['median_tpot_2m_ms']} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
