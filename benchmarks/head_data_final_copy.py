"""For an A/B of EAGLE-3's fused features against EAGLE-1's final feature on the same tokens: copy
train-head's data (collected with feature layers, [layers; final] per position) to OUT_DIR holding
only the final feature's columns, where `chatserve train-head --feature-layers final --data-share 0
--out OUT_DIR/eagle-head.pt` finds it. Token ids, replies and rounds are the same; the features are
the last `hidden` columns, byte for byte.

    .venv/bin/python benchmarks/head_data_final_copy.py ~/.cache/chatserve/heads/<hash> \\
        ~/.cache/chatserve/heads/<hash>/final
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.head_data import Sequence, load_collected, save_collected  # noqa: E402

DATA = "eagle-head-data.pt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("head_dir", type=Path, help="the directory of the fused head's data (eagle-head-data.*)")
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    source = args.head_dir / DATA
    data = load_collected(source, None)
    if data is None or not data.sequences:
        sys.exit(f"no data at {source}")
    if not data.feature_layers:
        sys.exit(f"{source} holds the final feature alone already")
    target_hash = torch.load(source, weights_only=True)["target_hash"]
    width = data.sequences[0].features.shape[1]
    hidden = width // (len(data.feature_layers) + 1)
    final = [Sequence(s.token_ids, s.features[:, -hidden:], s.num_prompt_tokens) for s in data.sequences]
    copy = dataclasses.replace(data, sequences=final, saved=0, feature_layers=())
    save_collected(args.out_dir / DATA, copy, target_hash)
    print(f"{len(final)} sequences, {data.num_tokens} tokens: layers {list(data.feature_layers)} + final "
          f"({width} columns) -> final ({hidden}) in {args.out_dir}")


if __name__ == "__main__":
    main()
