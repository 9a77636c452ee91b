"""Decode TPOT at long context with a quantized KV pool against the unquantized one.

One process, one copy of the weights; one engine per KV format, each with its own pool. For
each context length the prompt is the eval text (chatserve/data/eval_text.txt) repeated to
that many tokens; it is prefilled once per engine (untimed), later rounds reuse it through
the prefix cache, and each round then decodes --decode-tokens tokens at batch 1. Rounds
interleave the formats (alternating who goes first). Per round we keep the median and the
fastest step; reported are the median over rounds of (format / auto in the same round), and
the ratio of the fastest steps (the least disturbed by other processes on a shared machine).

A second table times only the attention of one decode step (KV store of the new token +
paged attention, all layers, the model's head shapes) over a pool filled to the context,
interleaved the same way, min and median over --attention-reps. Writes JSON with loadavg.
Quantized pools use K smoothing (chatserve/kv_smooth.py) as the engine does by default; a
format written "int8/unsmoothed" is the same pool without it (its cost is one subtraction per
layer in the model, so its attention-only row equals the smoothed one's by construction).

    python benchmarks/kv_speed.py --model smollm2-135m-instruct --dtype float32 \
        --contexts 2048 4096 --formats auto int8 --rounds 9 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_common import EVAL_TEXT, engine_with_kv, load_avg, write_report  # noqa: E402

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.kv_cache import KVCache  # noqa: E402
from chatserve.loading import DTYPES, cache_shape, load_models  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from kernels.attention import paged_attention  # noqa: E402
from kernels.kv_store import kv_store  # noqa: E402


def kv_format(label: str) -> tuple[str, bool]:
    """"int8" -> ("int8", smoothing on); "int8/unsmoothed" -> ("int8", off)."""
    fmt, _, variant = label.partition("/")
    assert variant in ("", "unsmoothed"), label
    return fmt, variant != "unsmoothed"


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(EVAL_TEXT.read_text())
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def decode_step_ms(engine, prompt: list[int], num_tokens: int) -> list[float]:
    """Times of the decode steps (after the first token) of one batch-1 request."""
    params = SamplingParams(max_tokens=num_tokens + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    times, last = [], None
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        if any(d.token_ids for d in deltas):
            if last is not None:
                times.append((now - last) * 1e3)
            last = now
    engine.check_no_leaks()
    return times


def engine_decode(models, config, args) -> dict:
    max_context = max(args.contexts) + args.decode_tokens + 64
    per_token = 2 * models.target.num_layers * models.target.num_kv_heads * models.target.head_dim * 4
    budget = 2 * per_token * max_context * len(args.contexts)  # every prompt stays prefix-cached
    engines = {}
    for label in args.formats:
        fmt, smooth = kv_format(label)
        engines[label] = engine_with_kv(models, config, fmt, budget, smooth_keys=smooth)
    prompts = {n: long_prompt(models.tokenizer, n) for n in args.contexts}
    for prompt in prompts.values():  # warm-up: prefill every prompt into every pool
        for engine in engines.values():
            decode_step_ms(engine, prompt, 2)
    medians = {n: {fmt: [] for fmt in args.formats} for n in args.contexts}
    fastest = {n: {fmt: [] for fmt in args.formats} for n in args.contexts}
    for r in range(args.rounds):
        for n, prompt in prompts.items():
            for fmt in args.formats[r % 2:] + args.formats[: r % 2]:
                steps = decode_step_ms(engines[fmt], prompt, args.decode_tokens)
                medians[n][fmt].append(statistics.median(steps))
                fastest[n][fmt].append(min(steps))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n}: " + " ".join(f"{fmt} {medians[n][fmt][-1]:.1f}" for fmt in args.formats) for n in args.contexts),
            flush=True)
    results = {}
    for n in args.contexts:
        rows = {}
        for fmt in args.formats:
            ratios = [a / b for a, b in zip(medians[n][fmt], medians[n]["auto"])]
            rows[fmt] = {"tpot_ms_median": statistics.median(medians[n][fmt]),
                         "x_auto_median": statistics.median(ratios),
                         "fastest_step_ms": min(fastest[n][fmt]),
                         "x_auto_fastest": min(fastest[n][fmt]) / min(fastest[n]["auto"]),
                         "round_medians_ms": medians[n][fmt], "round_fastest_ms": fastest[n][fmt]}
        results[str(n)] = rows
    return results


def attention_only(models, config, args) -> dict:
    """ms for one decode step's attention (store + paged attention, all layers) per format."""
    model = models.target
    dtype = DTYPES[config.dtype]
    results = {}
    for n in args.contexts:
        num_blocks = -(-(n + 1) // config.block_size)
        block_table = torch.randperm(num_blocks).to(torch.int32)[None]  # scattered blocks
        slots = block_table[0].long().repeat_interleave(config.block_size) * config.block_size
        slots = (slots + torch.arange(config.block_size).repeat(num_blocks))[: n + 1]
        cases = {}
        for fmt in args.formats:
            cache = KVCache(cache_shape(model, dtype, kv_format(fmt)[0]), num_blocks, config.block_size)
            kv = torch.randn(2, n, model.num_kv_heads, model.head_dim, dtype=dtype)
            for layer in cache.layers:
                kv_store(kv[0], kv[1], layer.k_cache, layer.v_cache, slots[:n], k_scale=layer.k_scale,
                         v_scale=layer.v_scale)
            cases[fmt] = cache
        num_heads = model.layers[0].self_attn.num_heads
        query = torch.randn(1, num_heads, model.head_dim, dtype=dtype)
        new_kv = torch.randn(2, 1, model.num_kv_heads, model.head_dim, dtype=dtype)

        def step(cache):
            for layer in cache.layers:
                kv_store(new_kv[0], new_kv[1], layer.k_cache, layer.v_cache, slots[n:], k_scale=layer.k_scale,
                         v_scale=layer.v_scale)
                paged_attention(query, layer.k_cache, layer.v_cache, block_table, [n + 1], [0, 1],
                                model.head_dim**-0.5, k_scale=layer.k_scale, v_scale=layer.v_scale)

        times = {fmt: [] for fmt in args.formats}
        for r in range(args.attention_reps + 1):
            for fmt in args.formats[r % 2:] + args.formats[: r % 2]:
                start = time.perf_counter()
                step(cases[fmt])
                if r:  # the first rep warms up
                    times[fmt].append((time.perf_counter() - start) * 1e3)
        results[str(n)] = {fmt: {"ms_min": min(ts), "ms_median": statistics.median(ts),
                                 "x_auto_min": min(ts) / min(times["auto"]),
                                 "x_auto_median": statistics.median(ts) / statistics.median(times["auto"])}
                           for fmt, ts in times.items()}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--formats", nargs="+", default=["auto", "int8"])
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--attention-reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert args.formats[0] == "auto", "the first format is the reference: auto"
    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=32 << 20, max_num_seqs=1,
                          num_threads=args.threads)
    models = load_models(config)
    load_before = load_avg()
    attention = attention_only(models, config, args)
    decode = engine_decode(models, config, args)
    report = {"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "decode_tokens": args.decode_tokens, "rounds": args.rounds, "attention_reps": args.attention_reps,
              "loadavg_before": load_before, "loadavg_after": load_avg(),
              "engine_decode": decode, "attention_only": attention}
    print(f"\n{args.model} {args.dtype}, {args.threads} thread(s), load {load_before} -> {report['loadavg_after']}")
    print(f"  {'context':>7} {'format':<16} {'TPOT ms':>8} {'x auto':>7} | {'attn ms':>8} {'x auto':>7}"
          f" {'attn min':>8} {'x auto':>7}")
    for n in args.contexts:
        for fmt in args.formats:
            d, a = decode[str(n)][fmt], attention[str(n)][fmt]
            print(f"  {n:>7} {fmt:<16} {d['tpot_ms_median']:>8.1f} {d['x_auto_median']:>7.3f} | "
                  f"{a['ms_median']:>8.2f} {a['x_auto_median']:>7.3f} {a['ms_min']:>8.2f} {a['x_auto_min']:>7.3f}")
    write_report(report, args.out, f"kv_speed_{args.model}_{args.dtype}.json")


if __name__ == "__main__":
    main()
