"""An EAGLE head's chains on `chatserve train-head`'s own held-out replies: no generation, no timing.

train-head validates a head on a budget of held-out positions (train_head.VAL_CHAIN_POSITIONS
chain anchors, in train_head.spread_order) and chooses it by the mean accepted length of a fixed
chain of VAL_DEPTH drafts from every anchor. This scores head files on the cache's data split
(train_head.split_validation of the data the head was trained on) both ways, on that budget and
on every held-out reply, and beside each the same chains walked as serving walks a reply
(train_head.walked_length: the number serving measures, session 31: 1.86 walked, 1.88 served).
The heads run in float32; served, their weights are quantized like the target's. Every held-out
reply is also split by what was asked (from the same chains, no second pass): the requests to write
code (the target's own, head_data.model_questions kind "code", and the shipped code prompts), chat
(the shipped chat prompts and the messages the target wrote on its chat topics) and the rest
(head_data.sequence_kinds).

    .venv/bin/python benchmarks/head_heldout.py --model qwen2.5-coder-1.5b-instruct \\
        --out benchmarks/results/head_heldout_qwen_session66.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import chatserve.train_head as th  # noqa: E402
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.head_data import load_collected, sequence_kinds  # noqa: E402
from chatserve.head_store import default_head_path, head_data_path, weights_hash  # noqa: E402
from chatserve.loading import resolve  # noqa: E402


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a script that scores head files on train-head's held-out replies (HeldOut)."""
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--heads", nargs="*", default=None, help="head files (default: the cache's head for the model)")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--first", type=int, default=None, metavar="N",
                    help="only the first N held-out replies: the split of an earlier, smaller cache (data grows by "
                         "appending, so its held-out replies stay a prefix)")
    ap.add_argument("--out", type=Path, default=None)


class HeldOut:
    """The cache's train-head data for args.model, its held-out replies (val, the first args.first),
    and a float32 engine whose target reads the data's feature layers, to load args.heads on."""

    def __init__(self, args: argparse.Namespace):
        self.target_hash = weights_hash(resolve(args.model))
        self.head_path = default_head_path(self.target_hash)
        data_path = head_data_path(self.head_path)
        self.data = load_collected(data_path, self.target_hash)
        if self.data is None:
            raise SystemExit(f"no train-head data for {args.model} at {data_path}")
        self.engine = Engine(EngineConfig(model=args.model, dtype="float32", quantization=args.quantization,
                                          num_threads=args.threads, enable_prefix_caching=False))
        # what a head must read to compare
        self.engine.models.target_runner.feature_layers = tuple(self.data.feature_layers)
        self.val = th.split_validation(self.data.sequences)[1][: args.first]
        self.embed = self.engine.models.target.embed_tokens
        self.paths = args.heads or [str(self.head_path)]

    def heads(self):
        """(path, head in eval mode) for each head file asked for."""
        for path in self.paths:
            head = th._load_servable(Path(path), self.engine, self.target_hash)
            if head is None:
                raise SystemExit(f"{path}: not a head for these weights and the data's feature layers")
            yield path, head.eval()


def reply_kinds(held: HeldOut) -> list[str]:
    """Per held-out reply, in the order th.held_out_chains scores them (th.chained_replies), what it
    answered (head_data.sequence_kinds): "chat", "code requests" (the requests to write code the
    target wrote, and head_prompts.json's code prompts) or "other" (tasks on given source)."""
    return sequence_kinds(list(th.chained_replies(held.val)), held.data.questions, held.engine.tokenizer)


def scores(hits: list) -> dict:
    return {"replies": len(hits), "anchors": sum(len(h) for h in hits),
            "every_anchor": round(th.every_anchor_length(hits), 4),
            "walked": round(th.walked_length(hits, th.VAL_DEPTH), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args()
    held = HeldOut(args)
    embed, val = held.embed, held.val
    results = {"model": args.model, "depth": th.VAL_DEPTH, "num_tokens": held.data.num_tokens,
               "num_val_sequences": len(val), "first": args.first, "heads": {}}
    kinds = reply_kinds(held)
    for path, head in held.heads():
        rows = {}
        for name, budget in (("validation budget", th.VAL_CHAIN_POSITIONS), ("every held-out reply", math.inf)):
            hits = th.held_out_hits(head, embed, val, th.VAL_DEPTH, budget)
            rows[name] = scores(hits)
            if budget == math.inf:  # split by what was asked
                for kind in sorted(set(kinds)):
                    rows[f"held-out replies: {kind}"] = scores([h for h, k in zip(hits, kinds) if k == kind])
        for name, r in rows.items():
            print(f"{path} ({name}): {r['replies']} replies, {r['anchors']} anchors: a chain of {th.VAL_DEPTH} "
                  f"accepts {r['every_anchor']:.3f} tokens a verification over every anchor, {r['walked']:.3f} "
                  f"walked", flush=True)
        results["heads"][path] = rows
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
