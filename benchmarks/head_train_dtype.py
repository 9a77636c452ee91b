"""Does an EAGLE head trained under bf16 autocast learn as well as a float32 one? Heads from the
same init, on the same collected data (a train-head <head>-data.pt), with the same windows, noise
and learning-rate schedule, --steps steps each, differing only in TrainConfig.train_dtype; held-out
top-1 (train_head.validate, in float32 for every head: pass-0 agreement with the target on the reply
positions of held-out replies) every --val-every steps, and seconds per step.

Replies are held out every --hold-out-every (train-head holds out every 20th; a few minutes of
collected data has too few replies for that).

    .venv/bin/python benchmarks/head_train_dtype.py --model smollm2-135m-instruct \
        --data /tmp/heads/eagle-head-data.pt --steps 150 --out benchmarks/results/head_train_dtype_smollm2.json
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
from chatserve.head_data import Sequence, choose_vocab, load_collected  # noqa: E402
from chatserve.loading import resolve  # noqa: E402
from chatserve.train_head import TrainConfig, new_head, train, validate  # noqa: E402


def hold_out(sequences: list[Sequence], every: int) -> tuple[list[Sequence], list[Sequence]]:
    """-> (train, held out): every `every`-th reply sequence held out, as train_head.split_validation."""
    replies = [i for i, s in enumerate(sequences) if s.num_prompt_tokens < len(s.token_ids)]
    held = set(replies[every - 1 :: every])
    return [s for i, s in enumerate(sequences) if i not in held], [sequences[i] for i in sorted(held)]


def train_one(engine, model_dir: Path, train_seqs, val, head_token_ids, train_dtype: str, args) -> dict:
    target = engine.models.target
    embed = target.embed_tokens
    head = new_head(target, model_dir, engine.max_model_len, head_token_ids, args.seed)
    cfg = TrainConfig(max_steps=args.steps, train_dtype=train_dtype, seed=args.seed, checkpoint_seconds=1e9)
    curve = [{"step": 0, "val_top1": validate(head, embed, val, args.val_positions)}]
    step_seconds, last = [], [time.perf_counter()]

    def progress(metrics: dict) -> None:
        step_seconds.append(time.perf_counter() - last[0])
        if metrics["step"] % args.val_every == 0 or metrics["step"] == args.steps:
            curve.append({"step": metrics["step"], "val_top1": validate(head, embed, val, args.val_positions),
                          "loss": metrics["loss"], "top1": metrics["top1"]})
            print(f"{train_dtype:>8} step {metrics['step']:4d}: loss {metrics['loss']:.3f} top1 {metrics['top1']:.3f} "
                  f"val {curve[-1]['val_top1']:.4f}", flush=True)
        last[0] = time.perf_counter()  # validation is not charged to the next step

    # the steps should end the run: the lr schedule follows the steps only while they come before the time
    state = train(head, embed, train_seqs, cfg, args.max_minutes * 60, {}, progress=progress)
    return {"train_dtype": train_dtype, "steps": state["step"], "val_top1": curve[-1]["val_top1"],
            "final": state["metrics"], "median_seconds_per_step": statistics.median(step_seconds[1:]),
            "seconds_per_step": [round(t, 3) for t in step_seconds], "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", required=True, help="a train-head <head>-data.pt for this model")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--val-positions", type=int, default=20000, help="held-out reply positions scored at most")
    ap.add_argument("--hold-out-every", type=int, default=4)
    ap.add_argument("--head-vocab-size", type=int, default=32768)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--max-minutes", type=float, default=7.5, help="a guard on each run; --steps should end it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result JSON")
    args = ap.parse_args()

    model_dir = resolve(args.model)
    engine = Engine(EngineConfig(model=args.model, kv_cache_memory=64 << 20, max_model_len=4096))
    sequences = load_collected(args.data, None).sequences
    train_seqs, val = hold_out(sequences, args.hold_out_every)
    target = engine.models.target
    ids = choose_vocab(train_seqs, target.vocab_size, args.head_vocab_size, engine.tokenizer.special_token_ids)
    val_positions = min(sum(len(s.token_ids) - s.num_prompt_tokens for s in val), args.val_positions)
    print(f"{sum(len(s.token_ids) for s in sequences)} tokens in {len(sequences)} sequences; {len(val)} replies "
          f"held out ({val_positions} positions scored)", flush=True)
    load_before = os.getloadavg()
    results = [train_one(engine, model_dir, train_seqs, val, ids, dtype, args) for dtype in args.dtypes]
    for r in results:
        print(f"{r['train_dtype']:>8}: val top-1 {r['val_top1']:.4f} after {r['steps']} steps, "
              f"{r['median_seconds_per_step']:.2f} s/step median")
    if args.out:
        out = {"benchmark": "head_train_dtype", "model": args.model, "data": str(args.data),
               "num_tokens": sum(len(s.token_ids) for s in sequences), "num_sequences": len(sequences),
               "num_val_sequences": len(val), "num_val_positions": val_positions, "hold_out_every": args.hold_out_every,
               "num_kept": len(ids), "steps": args.steps, "batch_tokens": TrainConfig.batch_tokens,
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
