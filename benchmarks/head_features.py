"""Which target features an EAGLE head should read, measured offline before serving is built for
them: EAGLE-1's (the final norm's output, what chatserve's head reads today) against EAGLE-3's
(Li et al. 2025, arXiv:2503.01840: a low, a middle and a high layer's hidden states, fused by a
learned linear map into the head's input). Same collected replies, same held-out set, same
vocabulary, init seed, windows, noise and number of steps; scored as train-head chooses heads
(train_head.validate_chain: the mean accepted length of a chain of 4 drafts at T = 0 from every
held-out reply position) and by the first draft's acceptance (the same, a chain of 1).

Data is collected as train-head collects it (head_data.collect: the target's own greedy replies and
standard-library source), with each position's features widened to [layer a; layer b; layer c;
final]: the residual stream after each chosen layer, RMS-normalized without weights (so the three
enter the fuse at one scale), then the final norm's output: the target runner's features with
its feature_layers set, as `train-head` collects them for an EAGLE-3 head since session 36
(session 35's run captured them with forward hooks on the modules, the same numbers). The data
is saved beside --out's JSON (head_data.save_collected) and reused when the
script runs again with the same model and layers.

    .venv/bin/python benchmarks/head_features.py --model smollm2-135m-instruct --data-tokens 400000 \\
        --data-minutes 18 --steps 0 --out benchmarks/results/head_features_smollm2.json       # data only
    .venv/bin/python benchmarks/head_features.py --model smollm2-135m-instruct --data-tokens 200000 \\
        --steps 500 --head-vocab-size 4096 --out benchmarks/results/head_features_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.cli import _dtype, _kv_cache_dtype, _quantization  # noqa: E402
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.head_data import Collected, Sequence, choose_vocab, collect, load_collected, save_collected  # noqa: E402
from chatserve.head_store import weights_hash  # noqa: E402
from chatserve.loading import resolve  # noqa: E402
from chatserve.models.layers import Linear  # noqa: E402
from chatserve.train_head import (TrainConfig, batch_windows, loss_fn, lr_scale, new_head,  # noqa: E402
                                  retain_freed_memory, split_validation, validate_chain)


class FusedFeatures(nn.Module):
    """An EagleHead reading EAGLE-3's fused features: fuse([f_a; f_b; f_c]) stands where the final
    feature stood (pass 0 of a chain); later passes read the head's own norm(y), as they do today."""

    def __init__(self, head, num_layers: int, seed: int):
        super().__init__()
        self.head = head
        torch.manual_seed(seed + 1)
        self.fuse = Linear(num_layers * head.hidden_size, head.hidden_size, bias=False)
        nn.init.normal_(self.fuse.weight, std=1.0 / math.sqrt(num_layers * head.hidden_size))
        self.norm, self.lm_head, self.head_token_ids = head.norm, head.lm_head, head.head_token_ids

    def forward_dense(self, features, embeds):
        return self.head.forward_dense(self.fuse(features), embeds)

    def forward_unrolled(self, features, embeds, depth):
        return self.head.forward_unrolled(self.fuse(features), embeds, depth)


def train_variant(name, head, sequences, val, embed, cols_in, cols_target, cfg: TrainConfig, steps: int, log):
    """Optimize as train_head.train does (AdamW fused, the same lr schedule, clip 0.5, EAGLE's noise),
    for exactly `steps`, feeding features[..., cols_in] and predicting features[..., cols_target]."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    num_windows = max(cfg.batch_tokens // cfg.window, 1)
    val_in = [Sequence(s.token_ids, s.features[:, cols_in], s.num_prompt_tokens) for s in val]
    curve, start = [], time.perf_counter()
    head.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_scale(cfg, step, step / steps)
        features, ids, targets, mask = batch_windows(sequences, num_windows, cfg.window, gen)
        loss, metrics = loss_fn(head, embed, features[..., cols_in], ids, targets[..., cols_target], mask,
                                noise_gen=gen, unroll=cfg.unroll, feature_weight=cfg.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if (step + 1) % max(steps // 6, 1) == 0 or step + 1 == steps:
            point = {"step": step + 1, "seconds": round(time.perf_counter() - start, 1),
                     # the first draft's acceptance at T = 0 (validate() reads the target's feature from
                     # the data, which the fused variant's columns are not)
                     "val_first": round(validate_chain(head, embed, val_in, depth=1) - 1.0, 4),
                     "val_accepted": round(validate_chain(head, embed, val_in), 4),
                     **{k: round(v, 4) for k, v in metrics.items()}}
            head.train()
            curve.append(point)
            log(f"{name}: step {point['step']} ({point['seconds']} s) loss {point['loss']:.3f} "
                f"val first draft {point['val_first']:.3f} chain of 4 accepts {point['val_accepted']:.3f}")
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layers", type=int, nargs=3, default=None,
                    help="the three layers fused (default EAGLE-3's: 2, L // 2, L - 3)")
    ap.add_argument("--data-tokens", type=int, default=300_000)
    ap.add_argument("--data-minutes", type=float, default=25.0)
    ap.add_argument("--data-batch", type=int, default=32)
    ap.add_argument("--reply-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps per variant")
    ap.add_argument("--head-vocab-size", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--feature-weight", type=float, default=0.0, help="0: EAGLE-3's loss (tokens alone)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--variants", nargs="+", default=["final", "fused"], choices=["final", "fused"])
    ap.add_argument("--out", type=Path, required=True, help="result JSON; the data goes beside it")
    args = ap.parse_args()
    retain_freed_memory()
    torch.manual_seed(0)

    quantization = _quantization("auto")  # as `chatserve train-head` builds its engine
    dtype = _dtype("auto", "cpu", quantization)
    engine = Engine(EngineConfig(model=args.model, dtype=dtype, quantization=quantization,
                                 kv_cache_dtype=_kv_cache_dtype("auto", "cpu", dtype), max_num_seqs=args.data_batch,
                                 max_num_batched_tokens=512, stall_limit=0.0, enable_prefix_caching=False))
    target = engine.models.target
    num_layers, hidden = target.config.num_hidden_layers, target.config.hidden_size
    layers = args.layers or [2, num_layers // 2, num_layers - 3]
    target_hash = weights_hash(resolve(args.model))
    data_path = args.out.with_name(f"{args.out.stem}-data-{'-'.join(map(str, layers))}.pt")
    data = load_collected(data_path, target_hash) or Collected([])
    data.feature_layers = tuple(layers)  # the file is named by them (session 35's did not record them)
    if data.num_tokens < args.data_tokens and not data.exhausted:
        engine.models.target_runner.feature_layers = tuple(layers)  # [layers a, b, c; final] a row, as train-head's
        start = time.perf_counter()
        data = collect(engine, max_tokens=args.data_tokens, seconds=args.data_minutes * 60,
                       reply_tokens=args.reply_tokens, batch=args.data_batch, resume=data,
                       checkpoint=lambda state: save_collected(data_path, state, target_hash),
                       progress=lambda n: print(f"\rdata: {n} tokens", end="", file=sys.stderr))
        print(f"\ndata: {data.num_tokens} tokens in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.steps == 0:
        return  # --steps 0: collect only
    train_seqs, val = split_validation(data.sequences)
    ids = choose_vocab(train_seqs, target.vocab_size, args.head_vocab_size, engine.tokenizer.special_token_ids)
    cfg = TrainConfig(window=args.window, batch_tokens=args.batch_tokens, unroll=args.unroll,
                      feature_weight=args.feature_weight, lr=args.lr)
    embed = target.embed_tokens
    final = slice(3 * hidden, 4 * hidden)
    results = {"benchmark": "head_features", "argv": sys.argv, "model": args.model, "layers": layers,
               "num_tokens": data.num_tokens, "num_sequences": len(data.sequences), "num_val_sequences": len(val),
               "val_reply_positions": sum(len(s.token_ids) - s.num_prompt_tokens for s in val),
               "num_kept": len(ids), "config": vars(args) | {"out": str(args.out)}, "variants": {}}
    if args.out.is_file():  # variants run before on the same data and vocabulary are kept
        before = json.loads(args.out.read_text())
        same = (before.get("num_tokens"), before.get("layers"), before.get("num_kept"))
        if same == (data.num_tokens, layers, len(ids)):
            results["variants"] = before["variants"]
    for variant in args.variants:
        head = new_head(target, resolve(args.model), 4096, ids, cfg.seed)
        if variant == "fused":
            head, cols_in = FusedFeatures(head, 3, cfg.seed), slice(0, 3 * hidden)
        else:
            cols_in = final
        curve = train_variant(variant, head, train_seqs, val, embed, cols_in, final, cfg, args.steps,
                              lambda line: print(line, file=sys.stderr, flush=True))
        results["variants"][variant] = {"curve": curve, "val_first": curve[-1]["val_first"],
                                        "val_accepted": curve[-1]["val_accepted"],
                                        "params": sum(p.numel() for p in head.parameters() if p.requires_grad)}
        args.out.write_text(json.dumps(results, indent=1))
    for variant, r in results["variants"].items():
        print(f"{variant:6s} val first draft {r.get('val_first', float('nan')):.3f}  "
              f"chain of 4 accepts {r['val_accepted']:.3f}  "
              f"({r['params'] / 1e6:.1f}M trained parameters)")


if __name__ == "__main__":
    main()
