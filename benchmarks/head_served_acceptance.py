"""EAGLE heads as served, compared on what they get accepted and nothing else: greedy replies to the
held-out prompts of chatserve/data/prompts.json with a fixed chain of k drafts (adaptive k off, so
every head is asked the same number of drafts a step), the mean accepted length (tokens a
verification, the bonus token included) and the per-draft acceptance. Each head runs quantized as
`serve` quantizes it (like the target), and with --float-heads also in float32, to tell what the
head's own quantization costs. No timing: benchmarks/eagle_head.py times them.

--held-out also serves the prompts of train-head's own held-out replies that answer a request (the
cache's data, train_head.split_validation, head_data.sequence_kinds: "held-out chat", "held-out code
requests"), prompts like those the head was trained on, to tell how much of the gap between
head_heldout.py's walked length and what the benchmark prompts get is the prompts and how much serving.

    .venv/bin/python benchmarks/head_served_acceptance.py --model smollm2-135m-instruct --float-heads \\
        --heads ~/.cache/chatserve/heads/<hash>/eagle-head.pt ~/.cache/chatserve/heads/<hash>/final/eagle-head.pt \\
        --out benchmarks/results/head_served_acceptance_smollm2_session36.json
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import chatserve.loading as loading  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--heads", nargs="+", required=True, help="head files")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--k", type=int, default=4, help="drafts a step")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kinds", nargs="+", default=["code", "chat"], choices=list(PROMPTS),
                    help="prompts.json's sets (chat_wide / code_wide: 40 / 24 more prompts than chat / code's 8)")
    ap.add_argument("--float-heads", action="store_true", help="also run each head unquantized")
    ap.add_argument("--held-out", action="store_true",
                    help="also the prompts of train-head's held-out replies to chat and to requests to write code")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    quantized = loading._quantized
    results = {"model": args.model, "k": args.k, "max_tokens": args.max_tokens, "runs": {}}
    sets = {kind: PROMPTS[kind] for kind in args.kinds}
    if args.held_out:
        sets.update(held_out_prompts(args.model))
    for head_quantization in (["as served", "float32"] if args.float_heads else ["as served"]):
        def head_kept_float(model, config):  # the target still quantized; the head not
            return model if type(model).__name__ == "EagleHead" else quantized(model, config)

        loading._quantized = head_kept_float if head_quantization == "float32" else quantized
        for path in args.heads:
            engine = Engine(EngineConfig(model=args.model, dtype="float32", quantization=args.quantization,
                                         kv_cache_memory=1 << 30,
                                         spec=SpecConfig(method="eagle", eagle_head=path, adaptive=False,
                                                         num_draft_tokens=args.k, suffix_corpus_tokens=0)))
            head = engine.models.eagle_runner.head
            for kind, texts in sets.items():
                prompts = [p if isinstance(p, list) else engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}]) for p in texts]
                outs = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
                accepted, drafted, steps = (sum(getattr(o["stats"], n) for o in outs)
                                            for n in ("num_accepted", "num_drafted", "num_spec_steps"))
                run = {"head": path, "feature_layers": list(head.feature_layers), "head_weights": head_quantization,
                       "kind": kind, "mean_accepted_length": (accepted + steps) / steps, "acceptance": accepted / drafted,
                       "num_drafted": drafted, "tokens": sum(len(o["token_ids"]) for o in outs),
                       "per_prompt": [(o["stats"].num_accepted + o["stats"].num_spec_steps) / max(o["stats"].num_spec_steps, 1)
                                      for o in outs]}
                results["runs"][f"{path}|{head_quantization}|{kind}"] = run
                print(f"{Path(path).parent.name}/{Path(path).name} layers {list(head.feature_layers) or 'final'} "
                      f"({head_quantization}) {kind}: mean accepted length {run['mean_accepted_length']:.3f}, "
                      f"acceptance {run['acceptance']:.3f} of {drafted} drafts", flush=True)
    loading._quantized = quantized
    paired(results["runs"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def held_out_prompts(model: str) -> dict[str, list[list[int]]]:
    """"held-out chat" / "held-out code requests": the prompt token ids of the cache's held-out
    replies of each kind (every one, in the order the data holds them)."""
    import chatserve.train_head as th
    from chatserve.head_data import load_collected, sequence_kinds
    from chatserve.head_store import default_head_path, head_data_path, weights_hash
    from chatserve.tokenizer import Tokenizer

    target_dir = loading.resolve(model)
    target_hash = weights_hash(target_dir)
    data = load_collected(head_data_path(default_head_path(target_hash)), target_hash)
    if data is None:
        raise SystemExit(f"--held-out: no train-head data for {model} in the cache")
    val = th.split_validation(data.sequences)[1]
    kinds = sequence_kinds(val, data.questions, Tokenizer(target_dir))
    return {f"held-out {kind}": [s.token_ids[: s.num_prompt_tokens].tolist() for s, k in zip(val, kinds) if k == kind]
            for kind in ("chat", "code requests")}


def paired(runs: dict) -> None:
    """Each later head against the first on the same kind and weights: the ratio of mean accepted
    lengths and on how many prompts it was longer / shorter (a prompt's own mean accepted length)."""
    first = {}
    for run in runs.values():
        key = (run["kind"], run["head_weights"])
        if key not in first:
            first[key] = run
            continue
        base = first[key]
        better = sum(a > b for a, b in zip(run["per_prompt"], base["per_prompt"]))
        worse = sum(a < b for a, b in zip(run["per_prompt"], base["per_prompt"]))
        run["vs_first"] = {"ratio": run["mean_accepted_length"] / base["mean_accepted_length"],
                           "prompts_longer": better, "prompts_shorter": worse}
        print(f"{run['kind']} ({run['head_weights']}) {Path(run['head']).name} / {Path(base['head']).name}: "
              f"{run['vs_first']['ratio']:.3f}, longer on {better} prompts, shorter on {worse} of {len(run['per_prompt'])}")


if __name__ == "__main__":
    main()
