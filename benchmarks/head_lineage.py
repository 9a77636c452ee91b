"""What each session's fine-tuning of a head gained on its own held-out replies: no model, no timing.

Every session that went on from an imported head scored both heads with benchmarks/head_heldout.py
on that session's held-out replies (every reply, a chain of 4, every anchor and walked as serving
walks a reply). This reads those JSONs, takes the head whose path names "imported" as the one the
session started from and the other as the one it trained, and prints and draws, session by session,
both heads' walked length and the gain against the tokens of data the steps ran on. The held-out
replies differ by session (each seed asks other prompts), so a session's two heads compare with
each other, not with another session's. Name one JSON a session: a session's rerun on a prefix
(head_heldout.py --first N, e.g. session 79's _first80) would be a second row for it.

    .venv/bin/python benchmarks/head_lineage.py \\
        benchmarks/results/head_heldout_qwen_session{70_first49,71_first49,73,74,75,76,77,78,79,80,81,82}.json \\
        --png benchmarks/results/head_lineage_qwen.png --out benchmarks/results/head_lineage_qwen.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPLIT = "every held-out reply"


def session_row(path: Path) -> dict:
    """One session's JSON -> its number, tokens, replies and both heads' (every anchor, walked)."""
    record = json.loads(path.read_text())
    heads = record["heads"]
    started = [name for name in heads if "imported" in Path(name).name]
    trained = [name for name in heads if name not in started]
    if len(started) != 1 or len(trained) != 1:
        raise SystemExit(f"{path}: want one imported head and one trained, got {list(heads)}")
    before, after = heads[started[0]][SPLIT], heads[trained[0]][SPLIT]
    match = re.search(r"session(\d+)", path.name)
    return {"session": int(match.group(1)) if match else None, "file": path.name,
            "tokens": record["num_tokens"], "replies": after["replies"], "anchors": after["anchors"],
            "before": {"every_anchor": before["every_anchor"], "walked": before["walked"]},
            "after": {"every_anchor": after["every_anchor"], "walked": after["walked"]},
            "gain": {"every_anchor": round(after["every_anchor"] - before["every_anchor"], 4),
                     "walked": round(after["walked"] - before["walked"], 4)}}


def draw(rows: list[dict], png: Path) -> None:
    from chatserve.bench.plots import _pyplot

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(rows))
    labels = [str(r["session"]) for r in rows]
    for x, r in zip(xs, rows):
        b, a = r["before"]["walked"], r["after"]["walked"]
        left.annotate("", xy=(x, a), xytext=(x, b),
                      arrowprops={"arrowstyle": "->", "color": "tab:green" if a > b else "tab:red", "lw": 2})
        left.plot([x], [b], "o", color="0.5")
    left.set_xticks(list(xs), labels)
    left.set_xlabel("session (its own held-out replies)")
    left.set_ylabel("walked accepted tokens a verification")
    left.set_title("imported head (grey) -> after the session's steps")
    left.set_xlim(-0.6, len(rows) - 0.4)
    lo = min(min(r["before"]["walked"], r["after"]["walked"]) for r in rows)
    hi = max(max(r["before"]["walked"], r["after"]["walked"]) for r in rows)
    left.set_ylim(lo - 0.05, hi + 0.05)
    for key, marker in (("every_anchor", "s"), ("walked", "o")):
        right.plot(list(xs), [r["gain"][key] for r in rows], marker, ls="-", label=key.replace("_", " "))
    for x, r in zip(xs, rows):
        right.annotate(f"{r['tokens'] / 1e3:.0f}k", (x, max(r["gain"].values())), textcoords="offset points",
                       xytext=(0, 6), ha="center", fontsize=8)
    right.axhline(0.0, color="0.3", lw=0.8)
    right.axhline(0.04, color="0.6", lw=0.8, ls="--", label="ship bar (+0.04)")
    right.set_xticks(list(xs), labels)
    right.set_xlabel("session (label: tokens the steps ran on)")
    right.set_ylabel("gain over the imported head")
    right.set_title("what a session's fine-tuning gained, held out")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="benchmarks/head_heldout.py JSONs")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = sorted((session_row(p) for p in args.files), key=lambda r: (r["session"] is None, r["session"]))
    print(f"{'session':>7} {'tokens':>9} {'replies':>7}  {'before':>13}  {'after':>13}  gain (every anchor / walked)")
    for r in rows:
        b, a, g = r["before"], r["after"], r["gain"]
        print(f"{r['session']!s:>7} {r['tokens']:>9,} {r['replies']:>7}  {b['every_anchor']:.3f} / {b['walked']:.3f}"
              f"  {a['every_anchor']:.3f} / {a['walked']:.3f}  {g['every_anchor']:+.3f} / {g['walked']:+.3f}")
    if args.png:
        draw(rows, args.png)
        print(f"wrote {args.png}")
    if args.out:
        args.out.write_text(json.dumps({"split": SPLIT, "sessions": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
