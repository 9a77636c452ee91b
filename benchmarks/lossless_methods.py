"""Greedy replies per speculation method on real weights, against speculation off (no timing).

One engine like `chatserve serve --draft draft` (the draft model loaded, methods chosen per
request), the first turn of each long-conversation workload (benchmarks/data/long_context.json:
a pasted file and a question; an "edit this file" request), prefix caching off so every request
takes the same numeric path. Prints, per workload and method, whether the reply equals
speculation off's and how many drafts were accepted; writes JSON. Run with the suffix corpus on
(the default) it also shows what session 19 found: a reply the corpus has seen is drafted again.

    python benchmarks/lossless_methods.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --out benchmarks/results/lossless_methods_qwen.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatserve.bench.report import machine, write_json  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "long_context.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None, help="loaded so that requests may ask for method draft")
    ap.add_argument("--methods", nargs="+", default=["draft", "suffix", "ngram"])
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--suffix-corpus-tokens", type=int, default=1 << 16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    data = json.loads(DATA.read_text())
    name, code = next(iter(data["files"].items()))
    methods = [m for m in args.methods if m != "draft" or args.draft_model]
    engine = Engine(EngineConfig(
        model=args.model, quantization=None if args.quantization == "none" else args.quantization,
        enable_prefix_caching=False,
        spec=SpecConfig(method="draft" if args.draft_model else "suffix", draft_model=args.draft_model,
                        suffix_corpus_tokens=args.suffix_corpus_tokens)))
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for workload in ("paste", "edit"):
        content = data[f"{workload}_turns"][0].format(name=name, code=code)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
        reference = None
        for method in ["off", *methods]:
            params = (dataclasses.replace(greedy, num_draft_tokens=0) if method == "off"
                      else dataclasses.replace(greedy, spec_method=method))
            out = engine.generate([prompt], params)[0]
            reference = reference if reference is not None else out["token_ids"]
            stats = out["stats"]
            row = {"workload": workload, "method": method, "prompt_tokens": len(prompt),
                   "equal_to_off": out["token_ids"] == reference, "drafted": stats.num_drafted,
                   "accepted": stats.num_accepted}
            rows.append(row)
            print(f"{workload:6s} {method:7s} {'equal' if row['equal_to_off'] else 'DIFFERENT':9s} "
                  f"drafted {row['drafted']:3d} accepted {row['accepted']:3d}", flush=True)
    write_json({"kind": "lossless_methods", "argv": sys.argv[1:], "machine": machine(), "rows": rows}, args.out)
    print(f"wrote {args.out}")
    return 0 if all(r["equal_to_off"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
