"""What a benchmark sends: conversations (built-in prompt sets or a JSONL file), cut into sessions
of turns, and when they start (closed loop, or open-loop Poisson arrivals). No networking here."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PROMPT_SETS = ("chat", "code", "edit", "long", "multiturn", "chat_wide", "code_wide")


@dataclass(frozen=True)
class Conversation:
    """User turns sent one after another; the server writes the replies in between."""

    user_turns: tuple[str, ...]
    system: str | None = None
    category: str = "custom"


@dataclass(frozen=True)
class Session:
    """One conversation as a client runs it: `num_turns` requests on one connection."""

    session_idx: int
    conversation: Conversation
    num_turns: int


def builtin_conversations(categories: tuple[str, ...] = ("chat", "code", "edit")) -> list[Conversation]:
    """Prompt sets shipped in chatserve/data: single-turn chat, code, edit and long-context prompts,
    and multi-turn conversations."""
    unknown = set(categories) - set(PROMPT_SETS)
    if unknown:
        raise ValueError(f"unknown prompt set(s) {sorted(unknown)}; choose from {list(PROMPT_SETS)}")
    sets = {**json.loads((DATA_DIR / "prompts.json").read_text()),
            **json.loads((DATA_DIR / "bench_prompts.json").read_text())}
    out = []
    for category in categories:
        for item in sets[category]:
            turns = tuple(item) if isinstance(item, list) else (item,)
            out.append(Conversation(turns, category=category))
    return out


def load_dataset(path: str | Path) -> list[Conversation]:
    """A JSONL file, one conversation per line: {"messages": [{"role", "content"}, ...]} (the user
    turns are replayed, the file's assistant turns are replaced by the server's replies; a leading
    system message is kept) or {"prompt": "..."} for a single turn."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            out.append(_conversation(obj))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no conversations")
    return out


def _conversation(obj: dict) -> Conversation:
    if "prompt" in obj:
        return Conversation((str(obj["prompt"]),), category=obj.get("category", "dataset"))
    messages = obj["messages"]
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    turns = tuple(m["content"] for m in messages if m["role"] == "user")
    if not turns:
        raise ValueError("a conversation needs at least one user message")
    return Conversation(turns, system=system, category=obj.get("category", "dataset"))


def plan_sessions(conversations: list[Conversation], num_requests: int, max_turns: int,
                  seed: int = 0) -> list[Session]:
    """Sessions totalling exactly `num_requests` turns: conversations in a seeded shuffled order
    (cycled when there are fewer than needed), each cut to at most `max_turns` turns."""
    if not conversations:
        raise ValueError("no conversations to send")
    if num_requests < 1 or max_turns < 1:
        raise ValueError("num_requests and max_turns must be >= 1")
    order = list(conversations)
    random.Random(seed).shuffle(order)
    sessions, remaining = [], num_requests
    while remaining > 0:
        conv = order[len(sessions) % len(order)]
        turns = min(len(conv.user_turns), max_turns, remaining)
        sessions.append(Session(len(sessions), conv, turns))
        remaining -= turns
    return sessions


def poisson_arrivals(num: int, rate: float, seed: int = 0) -> list[float]:
    """Start offsets in seconds of `num` arrivals at `rate` per second (exponential gaps; the first
    arrives at 0). rate = inf sends everything at once."""
    if rate <= 0:
        raise ValueError("request rate must be > 0")
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num):
        if i and rate != float("inf"):
            t += rng.expovariate(rate)
        times.append(t)
    return times


def think_time(mean_s: float, rng: random.Random) -> float:
    """Pause between a reply and the user's next turn: exponential with mean `mean_s` (0 = none)."""
    return rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0
