"""The draft model's vocabulary chosen by the target's own replies (issue #13 item 5,
spec/draft_vocab.py).

Reads the replies `chatserve train-head --model M` collected (the target's greedy answers to the
shipped prompts, in the cache beside M's head), and:
- measures, on half of them held out, how often the draft's top token over N kept ids is the
  target's next token (the first draft's acceptance at T = 0), the ids chosen by counts over the
  other half or lowest ids first, for several N; counted, not timed;
- times the draft's LM head (int8, the serving kernel) at N rows, one row in;
- with --write-counts, writes the counts over every reply for serving (spec/data/).

    .venv/bin/python benchmarks/draft_vocab.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --write-counts spec/data/qwen2.5.json \\
        --out benchmarks/results/draft_vocab_qwen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.batch import BatchItem  # noqa: E402
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.head_data import load_collected  # noqa: E402
from chatserve.head_store import default_head_path, head_data_path, weights_hash  # noqa: E402
from chatserve.loading import resolve  # noqa: E402
from quant.int8 import Int8Linear  # noqa: E402
from spec.draft_vocab import frequent_token_ids, vocab_fingerprint  # noqa: E402

SIZES = (8192, 16384, 24576, 32768, 49152, 65536)


def replies(data_path: Path) -> list[tuple[list[int], int]]:
    """(token ids, where the reply starts) of every sequence that holds a target's reply."""
    sequences = load_collected(data_path, None).sequences
    return [(s.token_ids.tolist(), s.num_prompt_tokens) for s in sequences if s.num_prompt_tokens < len(s.token_ids)]


def count(seqs: list[tuple[list[int], int]]) -> Counter:
    counts: Counter = Counter()
    for ids, start in seqs:
        counts.update(ids[start:])
    return counts


def agreement(engine: Engine, seqs, keeps: dict[str, torch.Tensor]) -> tuple[dict[str, float], int]:
    """Per kept set: the share of reply positions where the draft's top kept token is the next one."""
    runner = engine.models.target_runner
    hits, total = Counter(), 0
    for ids, start in seqs:
        blocks = list(range(len(ids) // runner.block_size + 2))
        logits, _ = runner.run([BatchItem(ids[:-1], 0, blocks, len(ids) - start)])
        logits = logits.float()
        truth = torch.tensor(ids[start:])
        total += len(truth)
        for name, keep in keeps.items():
            hits[name] += int((keep[logits[:, keep].argmax(1)] == truth).sum())
    return {name: hits[name] / total for name in keeps}, total


def head_ms(hidden: int, rows: int, rounds: int = 30) -> float:
    """Median ms of an int8 LM head of `rows` x `hidden` (random weights) on one row."""
    layer = Int8Linear.from_linear(torch.nn.Linear(hidden, rows, bias=False), keep_dense=False)
    x = torch.randn(1, hidden)
    for _ in range(3):
        layer(x)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the target whose replies are counted")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--data", type=Path, default=None, help="default: the cache's head data for --model")
    p.add_argument("--eval-replies", type=int, default=60, help="held-out replies scored (of the odd half)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-counts", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data_path = args.data or head_data_path(default_head_path(weights_hash(resolve(args.model))))
    if not data_path.is_file():
        sys.exit(f"no head data at {data_path}: run `chatserve train-head --model {args.model}` first")
    seqs = replies(data_path)
    engine = Engine(EngineConfig(model=args.draft_model, quantization="int4", num_threads=args.threads,
                                 kv_cache_memory=256 << 20))
    vocab = engine.models.target.config.vocab_size
    hidden = engine.models.target.config.hidden_size
    special = engine.tokenizer.special_token_ids
    fingerprint = vocab_fingerprint(engine.tokenizer.hf.get_vocab())
    all_counts = count(seqs)
    print(f"{len(seqs)} replies, {sum(all_counts.values())} tokens, {len(all_counts)} distinct ({data_path})")

    if args.write_counts:
        record = {"tokenizer": fingerprint, "model": args.model, "source": "greedy replies of chatserve train-head's data",
                  "reply_tokens": sum(all_counts.values()),
                  "counts": [[t, c] for t, c in sorted(all_counts.items(), key=lambda tc: (-tc[1], tc[0]))]}
        args.write_counts.parent.mkdir(parents=True, exist_ok=True)
        args.write_counts.write_text(json.dumps(record, separators=(",", ":")) + "\n")
        print(f"wrote {args.write_counts} (tokenizer {fingerprint})")

    fit = count(seqs[0::2])
    held_out = seqs[1::2][: args.eval_replies]
    keeps = {"all": torch.arange(vocab)}
    for n in SIZES:
        keeps[f"counts {n}"] = frequent_token_ids(vocab, n, special, dict(fit))
        keeps[f"lowest {n}"] = frequent_token_ids(vocab, n, special)
    start = time.time()
    rates, total = agreement(engine, held_out, keeps)
    print(f"{total} held-out reply positions in {len(held_out)} replies, {time.time() - start:.0f} s")
    rows = []
    full_ms = head_ms(hidden, vocab)
    print(f"{'N':>8}{'by counts':>11}{'lowest ids':>12}{'head ms':>9}")
    for n in (*SIZES, vocab):
        by_counts = rates["all"] if n == vocab else rates[f"counts {n}"]
        lowest = rates["all"] if n == vocab else rates[f"lowest {n}"]
        ms = full_ms if n == vocab else head_ms(hidden, n)
        rows.append({"kept": n, "by_counts": by_counts, "lowest_ids": lowest, "head_ms": ms})
        print(f"{n:>8}{by_counts:>11.4f}{lowest:>12.4f}{ms:>9.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": sys.argv, "data": str(data_path), "tokenizer": fingerprint,
                                        "replies": len(seqs), "reply_tokens": sum(all_counts.values()),
                                        "held_out_positions": total, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
