"""How well a suffix proposal's price predicts its acceptance, offline (no timing: runs beside anything).

The target answers prompts greedily (held-out: chatserve/data/prompts.json as eagle_head.py serves them;
train: the first --train-prompts of each of head_prompts.json's code and chat lists, the prompts a table
of prices is fitted on); at every reply position suffix decoding proposes up to --depth tokens from the
request's own tokens so far (no corpus, as eagle_head.py runs it), walked while the target agrees: a
draft counts as accepted when it and every draft before it are the target's next tokens. Printed per
workload: the first draft's acceptance by its (count, total) (how often its token followed the matched
context) and by the match's length, and every walked draft's acceptance by its depth (the match's length
plus the drafts before it, the context it continues) and against its price in SuffixMethod.offer, and the
price's Brier score at every walked draft and as served (served_brier; --rescore: of saved runs, no model).

    python benchmarks/suffix_calibration.py --model qwen2.5-coder-1.5b-instruct --out /tmp/suffix.json
    python benchmarks/suffix_calibration.py --rescore /tmp/suffix.json
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
from chatserve.head_data import PROMPTS_FILE  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from chatserve.spec_methods.suffix import PRIOR_RATE, position_price  # noqa: E402
from eagle_head import chat_prompts  # noqa: E402
from spec.adaptive import ACCEPT_EMA, AcceptanceEMA  # noqa: E402
from spec.suffix import SuffixProposer  # noqa: E402


def walk_rows(proposer: SuffixProposer, ids: list[int], start: int, depth: int) -> list[tuple]:
    """(position, j, depth, count, total, match_len, accepted) for the drafts walked at every position from
    start: a proposal's draft j counts while drafts 0..j-1 were the target's tokens."""
    rows = []
    for i in range(start, len(ids)):
        draft = proposer.propose(ids[:i], min(depth, len(ids) - i))
        for j, (token, count, total) in enumerate(zip(draft.token_ids, draft.counts, draft.totals)):
            hit = int(token == ids[i + j])
            rows.append((i, j, draft.match_len + j, count, total, draft.match_len, hit))
            if not hit:
                break
    return rows


# position_price's settings that give the price before session 50, (count + rate) / (total + 1), where count = total
FLAT = {"depth_prices": (1.0,), "rate_weight": 0.5}


def brier(rows: list[tuple], **price) -> float:
    """Mean squared error of position_price (at the method's prior rate; `price`: its depth_prices and
    rate_weight, e.g. FLAT) against the walked drafts' outcomes."""
    return sum((position_price(r[3], r[4], r[5], PRIOR_RATE, **price) - r[-1]) ** 2 for r in rows) / max(len(rows), 1)


def served_brier(rows: list[tuple], **price) -> float:
    """Brier score of the price as a request would be served its proposals: each reply's positions in order,
    the next proposal after the accepted drafts and the token after them, priced at the request's measured
    rate (AcceptanceEMA at ACCEPT_EMA from the method's prior, as SpecRunner's controller keeps it)."""
    replies = collections.defaultdict(lambda: collections.defaultdict(list))  # reply -> position -> its drafts
    for n, i, j, depth, count, total, _, hit in rows:
        replies[n][i].append((j, depth, count, total, hit))
    error, num = 0.0, 0
    for proposals in replies.values():
        rate = AcceptanceEMA(ACCEPT_EMA, PRIOR_RATE)
        i, last = min(proposals), max(proposals)
        while i <= last:
            drafts = sorted(proposals.get(i, []))
            for _, depth, count, total, hit in drafts:
                error += (position_price(depth, count, total, rate.rate, **price) - hit) ** 2
                num += 1
            held = sum(d[-1] for d in drafts)
            rate.update(len(drafts), held)
            i += held + 1
    return error / max(num, 1)


def served_scores(rows: list[tuple]) -> dict[str, float]:
    """served_brier of the price and of the flat one."""
    return {"served": served_brier(rows), "served_flat": served_brier(rows, **FLAT)}


def print_scores(scores: dict[str, float]) -> None:
    print(f"  served Brier: {scores['served']:.4f} (flat {scores['served_flat']:.4f})")


def rescore(paths: list[Path]) -> None:
    """The served scores of saved runs' rows (their --out JSON), with no model."""
    for path in paths:
        saved = json.loads(path.read_text())
        for kind, run in saved["workloads"].items():
            print(f"{path.name} {kind} ({len(run['rows'])} drafts walked to {saved['depth']}):")
            print_scores(served_scores([tuple(r) for r in run["rows"]]))


def table_line(name: str, table: dict) -> str:
    cells = sorted(table.items(), key=lambda kv: (len(str(kv[0])), str(kv[0])))
    return f"  by {name}: " + ", ".join(f"{k} {h / n:.2f} ({n})" for k, (n, h) in cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=["code", "chat", "edit", "paste"])
    ap.add_argument("--prompts", default="held-out", choices=["held-out", "train"])
    ap.add_argument("--train-prompts", type=int, default=20, help="with --prompts train: prompts per workload")
    ap.add_argument("--depth", type=int, default=4, help="drafts walked per proposal")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rescore", type=Path, nargs="+", help="score saved --out JSONs' rows (no model) and exit")
    args = ap.parse_args()
    if args.rescore:
        return rescore(args.rescore)
    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model=args.model, quantization="int4", kv_cache_memory=1 << 30))
    tok, proposer, results = engine.tokenizer, SuffixProposer(), {}
    for kind in args.workloads:
        if args.prompts == "train" and kind not in ("code", "chat"):
            raise SystemExit("--prompts train: head_prompts.json holds code and chat prompts")
        train = json.loads(PROMPTS_FILE.read_text())[kind][: args.train_prompts] if args.prompts == "train" else None
        prompts = chat_prompts(tok, kind, train)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        replies = [o["token_ids"] for i in range(0, len(prompts), 2)
                   for o in engine.generate(prompts[i : i + 2], params)]
        rows = []  # (reply, position, j, depth, count, total, match_len, accepted)
        for n, (prompt, reply) in enumerate(zip(prompts, replies)):
            rows += [(n, *row) for row in walk_rows(proposer, list(prompt) + list(reply), len(prompt) + 1, args.depth)]
        by_counts, by_length, by_depth, by_price = (collections.defaultdict(lambda: [0, 0]) for _ in range(4))
        for _, _, j, depth, count, total, length, hit in rows:
            cells = [(by_depth, min(depth, 12)), (by_price, round(position_price(depth, count, total, PRIOR_RATE), 1))]
            if j == 0:
                key = f"{min(count, 4)}/{min(total, 4)}" if count < total else f"all/{min(total, 4)}"
                cells += [(by_counts, key), (by_length, min(length, 8))]
            for table, key in cells:
                table[key][0] += 1
                table[key][1] += hit
        positions = sum(len(r) - 1 for r in replies)
        first = [r[-1] for r in rows if r[2] == 0]
        rate = sum(first) / max(len(first), 1)
        walked = sum(r[-1] for r in rows)
        print(f"{kind}: proposals at {len(first)} of {positions} reply positions, the first draft accepted "
              f"{rate:.3f}, {walked / max(len(first), 1):.2f} drafts accepted a proposal (walked to {args.depth})")
        scores = {"brier": brier(rows), "brier_flat": brier(rows, **FLAT)}
        print(f"  Brier score of the price: {scores['brier']:.4f} (flat, the price before: {scores['brier_flat']:.4f})")
        scores |= served_scores(rows)
        print_scores(scores)
        for name, table in (("count/total (first draft)", by_counts), ("match length (first draft)", by_length),
                            ("depth (every draft)", by_depth), ("price (every draft)", by_price)):
            print(table_line(name, table))
        results[kind] = {"positions": positions, "proposals": len(first), "accepted": rate, **scores,
                         "by_count_total": {k: {"n": n, "accepted": h / n} for k, (n, h) in by_counts.items()},
                         "by_match_length": {str(k): {"n": n, "accepted": h / n} for k, (n, h) in by_length.items()},
                         "by_depth": {str(k): {"n": n, "accepted": h / n} for k, (n, h) in by_depth.items()},
                         "by_price": {str(k): {"n": n, "accepted": h / n} for k, (n, h) in by_price.items()},
                         "rows": rows}
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "depth": args.depth,
                                        "max_tokens": args.max_tokens, "workloads": results}))


if __name__ == "__main__":
    main()
