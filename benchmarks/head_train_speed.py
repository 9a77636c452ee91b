"""Seconds per `chatserve train-head` step, float32 against bfloat16 autocast, for the EAGLE head
of a real target's shape (default Qwen2.5-Coder-1.5B: hidden 1536, its decoder layer, a 16,384-row
LM head, 2,048 tokens a step in 8 windows of 256).

The head is built from the target's config.json alone, with random weights, and trained by
train_head.train on random features and token ids of the right shapes: a step's time depends on
the shapes, not the values (dense matmuls, softmax over the whole head vocabulary). Dtypes run in
alternating rounds (one warm-up step each, then --steps timed), so a neighbour's load spreads
over both.

    .venv/bin/python benchmarks/head_train_speed.py --out benchmarks/results/head_train_speed.json

The process keeps freed memory as train-head's does (train_head.retain_freed_memory);
--glibc-defaults leaves glibc's allocator alone, to measure what that buys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.head_data import FEATURE_DTYPE, Sequence  # noqa: E402
from chatserve.loading import resolve  # noqa: E402
from chatserve.models.eagle_head import EagleHead  # noqa: E402
from chatserve.train_head import TrainConfig, choose_train_dtype, retain_freed_memory, train  # noqa: E402
from kernels.cpu_features import cpu_flags, cpu_name  # noqa: E402

NUM_SEQUENCES = 32
SEQUENCE_TOKENS = 512


def random_head(cfg, head_vocab_size: int, seed: int,
                intermediate_size: int | None = None) -> tuple[EagleHead, torch.nn.Embedding]:
    """(head, embed): a float32 head initialized as train_head.new_head does (normal, std 0.02)
    with a random frozen LM head, and a frozen embedding over the head's ids only; its MLP
    `intermediate_size` wide (None: the target's)."""
    torch.manual_seed(seed)
    head = EagleHead(cfg, 4096, torch.arange(head_vocab_size), intermediate_size=intermediate_size).float()
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    head.lm_head.weight.requires_grad_(False)
    embed = torch.nn.Embedding(head_vocab_size, cfg.hidden_size).requires_grad_(False)
    return head, embed


def random_sequences(hidden: int, head_vocab_size: int, seed: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    return [Sequence(torch.randint(head_vocab_size, (SEQUENCE_TOKENS,), generator=gen),
                     torch.randn(SEQUENCE_TOKENS, hidden, generator=gen).to(FEATURE_DTYPE), 0)  # [T, hidden]
            for _ in range(NUM_SEQUENCES)]


def time_steps(cfg, head_vocab_size: int, sequences: list[Sequence], train_cfg: TrainConfig,
               num_steps: int, intermediate_size: int | None = None) -> list[float]:
    """Seconds of each of num_steps steps after one warm-up step, from a fresh head."""
    head, embed = random_head(cfg, head_vocab_size, train_cfg.seed, intermediate_size)
    stamps = []
    train(head, embed, sequences, dataclasses.replace(train_cfg, max_steps=num_steps + 1), 3600.0, {},
          progress=lambda metrics: stamps.append(time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="target whose config gives the shapes")
    ap.add_argument("--head-vocab-size", type=int, default=16384)
    ap.add_argument("--head-intermediate-size", type=int, default=None,
                    help="the head's MLP width (train-head's flag); default the target's")
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--unroll", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per dtype and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's allocator as it is (train-head calls retain_freed_memory first)")
    ap.add_argument("--out", default=None, help="result JSON")
    args = ap.parse_args()
    retained = False if args.glibc_defaults else retain_freed_memory()
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    from transformers import AutoConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = AutoConfig.from_pretrained(str(resolve(args.model)))
    sequences = random_sequences(cfg.hidden_size, args.head_vocab_size, seed=0)
    load_before = os.getloadavg()
    steps: dict[str, list[float]] = {dtype: [] for dtype in args.dtypes}
    for round_idx in range(args.rounds):
        for dtype in args.dtypes:
            train_cfg = TrainConfig(batch_tokens=args.batch_tokens, window=args.window, unroll=args.unroll,
                                    train_dtype=dtype, checkpoint_seconds=1e9)
            times = time_steps(cfg, args.head_vocab_size, sequences, train_cfg, args.steps,
                               args.head_intermediate_size)
            steps[dtype] += times
            print(f"round {round_idx + 1} {dtype:>8}: " + " ".join(f"{t:.2f}" for t in times) + " s/step", flush=True)
    results = {dtype: {"median_seconds_per_step": statistics.median(times), "min_seconds_per_step": min(times),
                       "tokens_per_second": args.batch_tokens / statistics.median(times),
                       "seconds_per_step": [round(t, 4) for t in times]} for dtype, times in steps.items()}
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    print(f"freed memory retained: {retained}; page faults {faults:,} ({faults / sum(map(len, steps.values())):,.0f} "
          "a step, warm-ups and set-up included)")
    for dtype, r in results.items():
        print(f"{dtype:>8}: {r['median_seconds_per_step']:.2f} s/step median (min {r['min_seconds_per_step']:.2f}), "
              f"{r['tokens_per_second']:.0f} tokens/s")
    if {"float32", "bfloat16"} <= results.keys():
        speedup = results["float32"]["median_seconds_per_step"] / results["bfloat16"]["median_seconds_per_step"]
        print(f"bf16 speed-up: {speedup:.2f}x")
    record = {
        "benchmark": "head_train_speed", "model": args.model, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "head_intermediate_size": args.head_intermediate_size or cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_vocab_size": args.head_vocab_size,
        "batch_tokens": args.batch_tokens, "window": args.window, "unroll": args.unroll,
        "data": f"random: {NUM_SEQUENCES} sequences of {SEQUENCE_TOKENS} tokens, features N(0, 1) in {FEATURE_DTYPE}",
        "steps_per_round": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "cpu": cpu_name(), "platform": platform.platform(),
        "has_amx_bf16": "amx_bf16" in cpu_flags(), "has_avx512_bf16": "avx512_bf16" in cpu_flags(),
        "auto_dtype": str(choose_train_dtype("auto", cpu_flags())).removeprefix("torch."),
        "retain_freed_memory": retained, "page_faults": faults,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "results": results,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
