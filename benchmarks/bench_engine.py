"""Our engine against transformers `generate`, same model, same prompts, one process, one run.

Several configurations of ours (weight dtype / weight quantization) and of transformers (fp32,
bf16) run the same prompts in interleaved rounds. Prints TTFT, TPOT (medians) and tokens/s at
batch 1 and with N concurrent streams, each configuration's memory-bandwidth floor (weight
bytes read per decode step / measured read bandwidth), the ratios against transformers, and the
second-turn TTFT over a ~1,000-token history. Writes everything to JSON.

Besides wall time, each batch-1 run records the thread's CPU time (`time.thread_time`). With
`--threads 1` that is the work per token, which other load on a shared machine barely moves:
compare those columns when the load average is high.

    python benchmarks/bench_engine.py --model smollm2-135m-instruct --ours fp32,bf16,int8 \
        --hf fp32,bf16 --out benchmarks/results/engine_smollm2.json
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
    start, cpu_start = time.perf_counter(), time.thread_time()
    ids = [engine.add_request(p, params) for p in prompts]
    first, last, count, tokens = {}, {}, {i: 0 for i in ids}, {i: [] for i in ids}
    cpu_first = None
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids:
                if cpu_first is None:
                    cpu_first = time.thread_time()
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] += len(d.token_ids)
                tokens[d.request_id] += d.token_ids
    wall = time.perf_counter() - start
    cpu = time.thread_time() - cpu_start
    ttft = [(first[i] - start) * 1e3 for i in ids]
    tpot = [(last[i] - first[i]) * 1e3 / (count[i] - 1) for i in ids if count[i] > 1]
    n = sum(count.values())
    return {"ttft_ms": ttft, "tpot_ms": tpot, "tokens": n, "wall_s": wall,
            "cpu_ttft_ms": (cpu_first - cpu_start) * 1e3,
            "cpu_tpot_ms": (cpu - (cpu_first - cpu_start)) * 1e3 / max(n - len(prompts), 1),
            "tokens_per_s": sum(count.values()) / wall, "token_ids": [tokens[i] for i in ids]}


def run_hf(model, prompt: list[int], max_tokens: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times, self.cpu = [], []

        def put(self, value):
            self.times.append(time.perf_counter())
            self.cpu.append(time.thread_time())

        def end(self):
            pass

    clock = Clock()
    start, cpu_start = time.perf_counter(), time.thread_time()
    with torch.inference_mode():
        x = torch.tensor([prompt])  # explicit mask: the pad id may also be the chat end-of-turn token
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             streamer=clock, eos_token_id=None, pad_token_id=0)
    wall = time.perf_counter() - start
    times = clock.times[1:]  # the first put is the prompt
    n = len(times)
    cpu = clock.cpu[1:]
    return {"ttft_ms": (times[0] - start) * 1e3, "tpot_ms": (times[-1] - times[0]) * 1e3 / (n - 1),
            "cpu_ttft_ms": (cpu[0] - cpu_start) * 1e3, "cpu_tpot_ms": (cpu[-1] - cpu[0]) * 1e3 / (n - 1),
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


OURS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("bfloat16", "int8")}
HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decode_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every weight except the embedding table (one row of it)."""
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith("embed_tokens") and "rotary" not in name and "dense_weight" not in name:
            total += t.numel() * t.element_size()
    if getattr(model, "tie_word_embeddings", False) and isinstance(model.lm_head, torch.nn.Linear):
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()  # tied: not listed twice
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ours", default="fp32,bf16,int8", help=f"comma list of {sorted(OURS)}")
    ap.add_argument("--hf", default="fp32,bf16", help="transformers dtypes, comma list (empty: skip)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ours_names = [c for c in args.ours.split(",") if c]
    hf_names = [c for c in args.hf.split(",") if c]

    engines = {}
    for name in ours_names:
        dtype, quant = OURS[name]
        engines[name] = Engine(EngineConfig(model=args.model, dtype=dtype, quantization=quant,
                                            kv_cache_memory=1 << 30, max_num_seqs=args.streams))
    tok = next(iter(engines.values())).tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in (PROMPTS["chat"] + PROMPTS["code"])]
    bandwidth = read_bandwidth_gbs()
    print(f"model {args.model}; read bandwidth {bandwidth:.1f} GB/s; threads {torch.get_num_threads()}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    floors = {}
    for name, engine in engines.items():
        nbytes = decode_bytes(engine.models.target)
        floors[name] = {"decode_mb": nbytes / 1e6, "floor_tpot_ms": nbytes / (bandwidth * 1e9) * 1e3}
        print(f"  ours {name}: {nbytes / 1e6:.0f} MB read per decode step -> floor "
              f"{floors[name]['floor_tpot_ms']:.1f} ms/token", flush=True)

    hf_models = {}
    if hf_names:
        from transformers import AutoModelForCausalLM

        from chatserve.loading import resolve

        for name in hf_names:
            hf_models[name] = AutoModelForCausalLM.from_pretrained(
                str(resolve(args.model)), dtype=HF_DTYPES[name]).eval()

    for engine in engines.values():
        run_ours(engine, prompts[:1], 8)  # warm up
    for model in hf_models.values():
        run_hf(model, prompts[0], 8)
    b1 = {f"ours_{n}": [] for n in engines} | {f"hf_{n}": [] for n in hf_models}
    streams = {n: [] for n in engines}
    for r in range(args.rounds):  # interleaved rounds on this noisy machine
        for p in prompts[r * 2 : r * 2 + 2]:
            for name, engine in engines.items():
                b1[f"ours_{name}"].append(run_ours(engine, [p], args.max_tokens))
            for name, model in hf_models.items():
                b1[f"hf_{name}"].append(run_hf(model, p, args.max_tokens))
            print(f"  round {r}: TPOT " + ", ".join(
                f"{k} {_tpot(v[-1]):.1f} (cpu {v[-1]['cpu_tpot_ms']:.1f})" for k, v in b1.items()) + " ms", flush=True)
        for name, engine in engines.items():
            streams[name].append(run_ours(engine, prompts[: args.streams], args.max_tokens))
        print(f"  round {r}: {args.streams} streams " + ", ".join(
            f"ours_{n} {v[-1]['tokens_per_s']:.1f}" for n, v in streams.items()) + " tok/s", flush=True)

    result = {"model": args.model, "max_tokens": args.max_tokens, "threads": torch.get_num_threads(),
              "loadavg": os.getloadavg(), "read_gbs": bandwidth, "floors": floors, "batch1": {}, "streams": {}}
    for key, runs in b1.items():
        result["batch1"][key] = {"ttft_ms": median([_ttft(r) for r in runs]), "tpot_ms": median([_tpot(r) for r in runs]),
                                 "tokens_per_s": median([_tokens(r) / r["wall_s"] for r in runs]),
                                 "cpu_ttft_ms": median([r["cpu_ttft_ms"] for r in runs]),
                                 "cpu_tpot_ms": median([r["cpu_tpot_ms"] for r in runs])}
    for name, runs in streams.items():
        result["streams"][f"ours_{name}"] = {"streams": args.streams,
                                             "tokens_per_s": median([r["tokens_per_s"] for r in runs]),
                                             "tpot_ms": median([median(r["tpot_ms"]) for r in runs]),
                                             "ttft_ms": median([median(r["ttft_ms"]) for r in runs])}
    result["ratios"] = ratios(result, engines, hf_models)
    result["greedy_agreement"] = agreement(b1, engines, hf_models)
    last = ours_names[-1]  # the fastest configuration comes last by convention
    result["second_turn"] = second_turn(engines[last], tok, 32) | {"config": last}
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


def _tpot(r):
    return r["tpot_ms"][0] if isinstance(r["tpot_ms"], list) else r["tpot_ms"]


def _ttft(r):
    return r["ttft_ms"][0] if isinstance(r["ttft_ms"], list) else r["ttft_ms"]


def _tokens(r):
    return r["tokens"]


def ratios(result, engines, hf_models) -> dict:
    """TPOT ours / transformers at batch 1 (lower is better), and our N-stream aggregate
    tokens/s over transformers' batch-1 tokens/s (higher is better), for every pair."""
    out = {}
    for o in engines:
        for h in hf_models:
            ours, hf = result["batch1"][f"ours_{o}"], result["batch1"][f"hf_{h}"]
            out[f"tpot_ours_{o}_over_hf_{h}"] = ours["tpot_ms"] / hf["tpot_ms"]
            out[f"cpu_tpot_ours_{o}_over_hf_{h}"] = ours["cpu_tpot_ms"] / hf["cpu_tpot_ms"]
            out[f"streams_ours_{o}_over_hf_{h}_b1"] = result["streams"][f"ours_{o}"]["tokens_per_s"] / hf["tokens_per_s"]
    return out


def agreement(b1, engines, hf_models) -> dict:
    """Greedy token agreement of each of ours with transformers at the same dtype."""
    out = {}
    for o in engines:
        h = "fp32" if o == "fp32" else "bf16"
        if f"hf_{h}" not in b1:
            continue
        pairs = list(zip(b1[f"ours_{o}"], b1[f"hf_{h}"]))
        same = sum(a["token_ids"][0] == b["token_ids"] for a, b in pairs)
        out[f"ours_{o}_vs_hf_{h}"] = f"{same}/{len(pairs)} identical"
    return out


def print_table(result) -> None:
    print(f"\n{'config':12} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>7} {'CPU TTFT':>9} {'CPU TPOT':>9}")
    for key, row in result["batch1"].items():
        print(f"{key:12} {row['ttft_ms']:9.1f} {row['tpot_ms']:9.1f} {row['tokens_per_s']:7.1f} "
              f"{row['cpu_ttft_ms']:9.1f} {row['cpu_tpot_ms']:9.1f}")
    for key, row in result["streams"].items():
        print(f"{key + ' x' + str(row['streams']):12} {row['ttft_ms']:9.1f} {row['tpot_ms']:9.1f} {row['tokens_per_s']:7.1f}")
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}")
    print(json.dumps({"greedy_agreement": result["greedy_agreement"], "second_turn": result["second_turn"]}, indent=1))


if __name__ == "__main__":
    main()
