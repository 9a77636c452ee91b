"""Our engine against transformers `generate`, same model, same prompts, one process, one run.

Prints TTFT, TPOT (medians) and tokens/s at batch 1 and with N concurrent streams, the
memory-bandwidth floor for a decode step, and the second-turn TTFT over a ~1,000-token
history. Writes everything to JSON.

    python benchmarks/bench_engine.py --model smollm2-135m-instruct --out benchmarks/results/engine.json
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

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((Path(__file__).resolve().parent.parent / "chatserve/data/prompts.json").read_text())


def read_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    x = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


def run_ours(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; per-request TTFT/TPOT from step timestamps; aggregate tokens/s."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first, last, count, tokens = {}, {}, {i: 0 for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] += len(d.token_ids)
                tokens[d.request_id] += d.token_ids
    wall = time.perf_counter() - start
    ttft = [(first[i] - start) * 1e3 for i in ids]
    tpot = [(last[i] - first[i]) * 1e3 / (count[i] - 1) for i in ids if count[i] > 1]
    return {"ttft_ms": ttft, "tpot_ms": tpot, "tokens": sum(count.values()), "wall_s": wall,
            "tokens_per_s": sum(count.values()) / wall, "token_ids": [tokens[i] for i in ids]}


def run_hf(model, prompt: list[int], max_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    start = time.perf_counter()
    with torch.inference_mode():
        x = torch.tensor([prompt])  # explicit mask: the pad id may also be the chat end-of-turn token
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             streamer=clock, eos_token_id=None, pad_token_id=0)
    wall = time.perf_counter() - start
    times = clock.times[1:]  # the first put is the prompt
    n = len(times)
    return {"ttft_ms": (times[0] - start) * 1e3, "tpot_ms": (times[-1] - times[0]) * 1e3 / (n - 1),
            "tokens": n, "wall_s": wall, "token_ids": out[0, len(prompt):].tolist()}


def second_turn(engine: Engine, tok, max_tokens: int) -> dict:
    history = [{"role": "system", "content": "You are a helpful assistant. " + "Remember this context. " * 150}]
    history.append({"role": "user", "content": "Say hello."})
    ids1 = tok.apply_chat_template(history)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    r1 = run_ours(engine, [ids1], max_tokens)
    reply = tok.decode(r1["token_ids"][0])
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And now say goodbye."}]
    ids2 = tok.apply_chat_template(history)
    rid = engine.add_request(ids2, params)
    stats = None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                stats = d.stats
    del rid, t0
    return {"turn1_prompt_tokens": len(ids1), "turn1_ttft_ms": r1["ttft_ms"][0],
            "turn2_prompt_tokens": len(ids2), "turn2_cached_tokens": stats.cached_tokens,
            "turn2_ttft_ms": stats.ttft_ms, "ratio": stats.ttft_ms / r1["ttft_ms"][0]}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=1 << 30, max_num_seqs=args.streams))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in (PROMPTS["chat"] + PROMPTS["code"])]
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.models.target.parameters())
    bandwidth = read_bandwidth_gbs()
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    print(f"model {args.model} {args.dtype}: {weight_bytes / 1e6:.0f} MB of weights; read bandwidth "
          f"{bandwidth:.1f} GB/s -> decode floor {floor_ms:.1f} ms/token; load {os.getloadavg()[0]:.2f}", flush=True)

    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from chatserve.loading import resolve

        hf = AutoModelForCausalLM.from_pretrained(str(resolve(args.model)), dtype=getattr(torch, args.dtype)).eval()

    run_ours(engine, prompts[:1], 8)  # warm up
    ours1, hf1, ours_n = [], [], []
    for r in range(args.rounds):  # interleaved rounds on this noisy machine
        for p in prompts[r * 2 : r * 2 + 2]:
            ours1.append(run_ours(engine, [p], args.max_tokens))
            if hf is not None:
                hf1.append(run_hf(hf, p, args.max_tokens))
            print(f"  round {r}: ours TPOT {ours1[-1]['tpot_ms'][0]:.1f} ms"
                  + (f", transformers TPOT {hf1[-1]['tpot_ms']:.1f} ms" if hf1 else ""), flush=True)
        ours_n.append(run_ours(engine, prompts[: args.streams], args.max_tokens))
        print(f"  round {r}: ours {args.streams} streams {ours_n[-1]['tokens_per_s']:.1f} tok/s", flush=True)

    agree = [o["token_ids"][0] == h["token_ids"] for o, h in zip(ours1, hf1)]
    result = {
        "model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
        "loadavg": os.getloadavg(), "weight_mb": weight_bytes / 1e6, "read_gbs": bandwidth, "floor_tpot_ms": floor_ms,
        "ours_b1": {"ttft_ms": median([r["ttft_ms"][0] for r in ours1]), "tpot_ms": median([r["tpot_ms"][0] for r in ours1]),
                    "tokens_per_s": median([r["tokens"] / r["wall_s"] for r in ours1])},
        f"ours_{args.streams}streams": {"tokens_per_s": median([r["tokens_per_s"] for r in ours_n]),
                                        "tpot_ms": median([median(r["tpot_ms"]) for r in ours_n]),
                                        "ttft_ms": median([median(r["ttft_ms"]) for r in ours_n])},
    }
    if hf1:
        result["hf_b1"] = {"ttft_ms": median([r["ttft_ms"] for r in hf1]), "tpot_ms": median([r["tpot_ms"] for r in hf1]),
                           "tokens_per_s": median([r["tokens"] / r["wall_s"] for r in hf1])}
        result["greedy_agreement"] = f"{sum(agree)}/{len(agree)}"
        result["tpot_ratio_ours_over_hf"] = result["ours_b1"]["tpot_ms"] / result["hf_b1"]["tpot_ms"]
        result["throughput_ratio_streams_over_hf_b1"] = result[f"ours_{args.streams}streams"]["tokens_per_s"] / result["hf_b1"]["tokens_per_s"]
    result["second_turn"] = second_turn(engine, tok, 32)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
