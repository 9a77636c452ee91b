"""How well a suffix proposal's price predicts its acceptance, offline (no timing: runs beside anything).

The target answers the held-out prompts of chatserve/data/prompts.json greedily; at every reply position
suffix decoding proposes one token from the request's own tokens so far (no corpus, as eagle_head.py runs
it), and the proposal counts as accepted when it is the target's next token. Printed per workload: the
acceptance by the proposal's (count, total) (how often its token followed the matched context, which
SuffixMethod.offer prices as (count + rate) / (total + 1)) and by the match's length.

    python benchmarks/suffix_calibration.py --model qwen2.5-coder-1.5b-instruct --out /tmp/suffix.json
"""
import argparse
import collections
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from eagle_head import chat_prompts  # noqa: E402
from spec.suffix import SuffixProposer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=["code", "chat", "edit", "paste"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model=args.model, quantization="int4", kv_cache_memory=1 << 30))
    tok, proposer, results = engine.tokenizer, SuffixProposer(), {}
    for kind in args.workloads:
        prompts = chat_prompts(tok, kind)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        replies = [o["token_ids"] for i in range(0, len(prompts), 2)
                   for o in engine.generate(prompts[i : i + 2], params)]
        rows = []  # (count, total, match_len, accepted)
        for prompt, reply in zip(prompts, replies):
            ids = list(prompt) + list(reply)
            for i in range(len(prompt) + 1, len(ids)):
                draft = proposer.propose(ids[:i], 1)
                if draft.token_ids:
                    rows.append((draft.counts[0], draft.totals[0], draft.match_len, int(draft.token_ids[0] == ids[i])))
        by_counts, by_length = collections.defaultdict(lambda: [0, 0]), collections.defaultdict(lambda: [0, 0])
        for count, total, length, hit in rows:
            key = f"{min(count, 4)}/{min(total, 4)}" if count < total else f"all/{min(total, 4)}"
            for table, k in ((by_counts, key), (by_length, min(length, 8))):
                table[k][0] += 1
                table[k][1] += hit
        positions = sum(len(r) - 1 for r in replies)
        rate = sum(r[3] for r in rows) / max(len(rows), 1)
        print(f"{kind}: proposals at {len(rows)} of {positions} reply positions, accepted {rate:.3f}")
        for name, table in (("count/total", by_counts), ("match length", by_length)):
            cells = sorted(table.items(), key=str)
            print(f"  by {name}: " + ", ".join(f"{k} {h / n:.2f} ({n})" for k, (n, h) in cells))
        results[kind] = {"positions": positions, "proposals": len(rows), "accepted": rate,
                         "by_count_total": {k: {"n": n, "accepted": h / n} for k, (n, h) in by_counts.items()},
                         "by_match_length": {str(k): {"n": n, "accepted": h / n} for k, (n, h) in by_length.items()},
                         "rows": rows}
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "workloads": results}))


if __name__ == "__main__":
    main()
