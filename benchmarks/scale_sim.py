"""100 replicas on paper: prefix-cache hit rate with conversation affinity vs round robin as the
number of active conversations grows, and what moving KV between replicas (LMCache-like) adds.

The model, in tokens (no timing, pure Python, seeded): `--replicas` replicas, each with a KV pool
of `--capacity` tokens holding whole conversation prefixes, least recently used evicted first.
`N` conversations are active; each arrival picks one at random for its next turn (user message
and reply drawn uniformly from `--user-tokens` and `--reply-tokens`); after `--turns` turns a
conversation ends and a new one takes its place. A turn's prompt is the conversation so far plus
the new user message; its *hit* tokens are the prefix its replica still holds. The shared system
prompt is left out (every replica holds it, under any router). Routing: affinity (affinity.py's
AffinityPolicy: sticky, least loaded for a new key; load = conversations homed there) or round
robin. With *transfer*, a turn whose replica holds less than another replica fetches the longer
prefix from there instead of recomputing it.

    .venv/bin/python benchmarks/scale_sim.py --out benchmarks/results/scale_sim.json --plot docs/scale-sim.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.scale.affinity import AffinityPolicy  # noqa: E402


class Replica:
    """A KV pool as an LRU of conversation prefixes (tokens), bounded by `capacity` tokens."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # conversation -> cached prefix length

    def cached(self, conv: int) -> int:
        return self.prefixes.get(conv, 0)

    def store(self, conv: int, num_tokens: int) -> list[int]:
        """Cache `conv`'s prefix of `num_tokens`; returns the conversations evicted for it."""
        self.used += num_tokens - self.prefixes.pop(conv, 0)
        self.prefixes[conv] = num_tokens
        evicted = []
        while self.used > self.capacity and self.prefixes:
            victim, num_victim = self.prefixes.popitem(last=False)
            self.used -= num_victim
            evicted.append(victim)
        return evicted

    def drop(self, conv: int) -> None:
        self.used -= self.prefixes.pop(conv, 0)


def simulate(policy: str, num_conversations: int, args, seed: int = 0) -> dict:
    rng = random.Random(seed)
    replicas = [Replica(args.capacity) for _ in range(args.replicas)]
    names = [f"r{i}" for i in range(args.replicas)]
    sticky, homed = AffinityPolicy(max_sessions=10 * num_conversations + 10), {name: 0 for name in names}
    holders: dict[int, set[int]] = {}  # conversation -> replicas holding a prefix of it
    lengths, turns_done, next_id = {}, {}, 0
    for _ in range(num_conversations):
        lengths[next_id], turns_done[next_id] = 0, 0
        next_id += 1
    active = list(lengths)
    num_turns = min(max(args.min_turns, args.turns_per_conversation * num_conversations), args.max_turns)
    warmup = num_turns // 3
    prompt = hit = hit_transfer = 0
    num_rr = 0
    for step in range(num_turns):
        slot = rng.randrange(len(active))
        conv = active[slot]
        if policy == "affinity":
            name = sticky.choose(str(conv), homed)
            if turns_done[conv] == 0:
                homed[name] += 1
        else:
            name, num_rr = names[num_rr % len(names)], num_rr + 1
        idx = int(name[1:])
        replica = replicas[idx]
        num_prompt = lengths[conv] + rng.randint(*args.user_tokens)
        local = replica.cached(conv)
        best = max([local, *(replicas[i].cached(conv) for i in holders.get(conv, ()))]) if args.transfer else local
        if step >= warmup and turns_done[conv] > 0:
            prompt += num_prompt
            hit += local
            hit_transfer += best
        lengths[conv] = num_prompt + rng.randint(*args.reply_tokens)
        for evicted in replica.store(conv, lengths[conv]):
            holders[evicted].discard(idx)
        holders.setdefault(conv, set()).add(idx)
        turns_done[conv] += 1
        if turns_done[conv] == args.turns:  # the conversation ends; a new one takes its slot
            for i in holders.pop(conv):
                replicas[i].drop(conv)
            if policy == "affinity":
                homed[sticky.homes.pop(str(conv))] -= 1
            del lengths[conv], turns_done[conv]
            lengths[next_id], turns_done[next_id] = 0, 0
            active[slot] = next_id
            next_id += 1
    return {"policy": policy, "conversations": num_conversations, "turns": num_turns,
            "hit_rate": hit / max(1, prompt), "hit_rate_with_transfer": hit_transfer / max(1, prompt)}


def plot(rows: list[dict], path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy, color in (("affinity", "tab:blue"), ("round_robin", "tab:orange")):
        mine = [r for r in rows if r["policy"] == policy]
        xs = [r["conversations"] for r in mine]
        ax.plot(xs, [r["hit_rate"] for r in mine], "o-", color=color, label=policy.replace("_", " "))
        ax.plot(xs, [r["hit_rate_with_transfer"] for r in mine], "s--", color=color, alpha=0.6,
                label=f"{policy.replace('_', ' ')} + KV transfer")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("active conversations")
    ax.set_ylabel("prompt tokens served from the prefix cache")
    ax.set_title(f"{args.replicas} replicas, {args.capacity // 1000}k KV tokens each (simulated)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--capacity", type=int, default=300_000, help="KV tokens per replica (an 8B model on an 80 GB GPU)")
    p.add_argument("--turns", type=int, default=8, help="turns per conversation")
    p.add_argument("--user-tokens", type=int, nargs=2, default=(30, 200))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 500))
    p.add_argument("--conversations", type=int, nargs="+",
                   default=[100, 1000, 3000, 10_000, 20_000, 40_000, 70_000, 100_000])
    p.add_argument("--turns-per-conversation", type=int, default=6, help="simulated turns = this x conversations")
    p.add_argument("--min-turns", type=int, default=20_000)
    p.add_argument("--max-turns", type=int, default=800_000)
    p.add_argument("--no-transfer", dest="transfer", action="store_false")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG path (matplotlib)")
    args = p.parse_args()
    rows = []
    for n in args.conversations:
        for policy in ("affinity", "round_robin"):
            row = simulate(policy, n, args)
            rows.append(row)
            print(f"{n:>7} conversations  {policy:<11}  hit {row['hit_rate']:.1%}  "
                  f"with KV transfer {row['hit_rate_with_transfer']:.1%}  ({row['turns']} turns)", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": {k: v for k, v in vars(args).items()}, "rows": rows},
                                             indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
