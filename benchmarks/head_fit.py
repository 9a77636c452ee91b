"""How far an EAGLE head overfits its data, without timing anything: its pass-0 agreement with the
target (the first draft's acceptance at T = 0) on the reply positions of its own training data,
next to the held-out replies train-head keeps out (every 20th). Compare with
benchmarks/head_acceptance.py on the held-out prompts of chatserve/data/prompts.json.

    python benchmarks/head_fit.py --model smollm2-135m-instruct [--head PATH] [--out RESULT.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.head_data import load_collected  # noqa: E402
from chatserve.head_store import default_head_path, head_data_path, weights_hash  # noqa: E402
from chatserve.loading import resolve  # noqa: E402
from chatserve.models.eagle_head import EagleHead  # noqa: E402
from chatserve.models.loader import read_tensor  # noqa: E402
from chatserve.train_head import split_validation, validate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default=None, help="head file (default: the cache's for the model's weights)")
    ap.add_argument("--positions", type=int, default=20000, help="reply positions scored per set at most")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoConfig

    model_dir = resolve(args.model)
    head_path = Path(args.head) if args.head else default_head_path(weights_hash(model_dir))
    record = torch.load(head_path, weights_only=True)
    sequences = load_collected(head_data_path(head_path), record["target_hash"]).sequences
    head = EagleHead.from_state(AutoConfig.from_pretrained(str(model_dir)), 8192, record["state_dict"],
                                record.get("feature_layers", ())).float()
    name = "embed_tokens.weight"
    embed = torch.nn.Embedding.from_pretrained(read_tensor(model_dir, name))
    train, held_out = split_validation(sequences)
    replies = [s for s in train if s.num_prompt_tokens < len(s.token_ids)]
    result = {"model": args.model, "head": str(head_path), "info": {k: v for k, v in record["info"].items()
                                                                     if k in ("steps", "num_tokens", "val_top1")},
              "train_replies_top1": validate(head, embed, replies, args.positions),
              "held_out_replies_top1": validate(head, embed, held_out, args.positions),
              "num_train_replies": len(replies), "num_held_out": len(held_out)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
