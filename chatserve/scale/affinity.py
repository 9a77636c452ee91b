"""Conversation affinity: which replica a request goes to. Pure Python; knows nothing of Ray.

A request's routing key is its session key (the `x-session-id` header, a `session` query
parameter, or an OpenAI body's `user`) or, without one, a hash of its prompt's first blocks. A
key sticks to the replica that served it first, because that replica holds its prefix in its
KV pool; a new key, or one whose replica is gone, goes to the least loaded replica. Ray's proxy
routes before it reads a body, so the header and the query parameter are read there
(ray_app.AffinityRouter) and `user` and the prompt by the gateway that reads /v1 bodies
(gateway.py, `body_key`; docs/scale-out.md).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from urllib.parse import parse_qs

SESSION_HEADER = "x-session-id"  # Ray Serve's own session header (RAY_SERVE_SESSION_ID_HEADER_KEY)
SESSION_QUERY = "session"  # browsers cannot set headers on a websocket: /ws?session=...
DEFAULT_MAX_SESSIONS = 100_000  # sticky entries kept; the oldest is forgotten first
PROMPT_KEY_PREFIX = "p:"  # keys made from a prompt (prompt_key, body_key), not named by a client
# A prompt key is shared by every request that starts the same way (a short first message, a
# popular question): when its home has this many more requests in flight than the least loaded
# replica, the request goes there instead (its home stays). A session key always sticks.
PROMPT_KEY_SLACK = 2
PROMPT_KEY_CHARS = 256  # characters of a body's first message past the system prompt hashed: ~4 blocks of 16 tokens


class AffinityPolicy:
    """Sticky map from routing key to replica id, least loaded for the rest.

    `choose` mutates the map: the chosen replica becomes the key's home. Replicas that died are
    dropped lazily: a key whose home is not among the live replicas is re-homed.
    """

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS):
        self.max_sessions = max_sessions
        self.homes: OrderedDict[str, str] = OrderedDict()  # routing key -> replica id, oldest first

    def choose(self, key: str | None, loads: dict[str, int]) -> str:
        """The replica for a request. `loads`: live replica id -> requests in flight there."""
        if not loads:
            raise ValueError("no replica to choose from")
        home = self.homes.get(key) if key is not None else None
        if home in loads:
            self.homes.move_to_end(key)
            if key.startswith(PROMPT_KEY_PREFIX) and loads[home] >= min(loads.values()) + PROMPT_KEY_SLACK:
                return least_loaded(key, loads)
            return home
        replica = least_loaded(key, loads)
        if key is not None:
            self.homes[key] = replica
            self.homes.move_to_end(key)
            while len(self.homes) > self.max_sessions:
                self.homes.popitem(last=False)
        return replica

    def ranked(self, key: str | None, loads: dict[str, int]) -> list[str]:
        """`choose`'s replica first, then the others from least to most loaded: where to go when
        the first refuses (full)."""
        first = self.choose(key, loads)
        return [first, *sorted((r for r in loads if r != first), key=loads.__getitem__)]


class RoundRobin:
    """The baseline affinity is measured against: replicas in turn, keys ignored. The turn moves
    on each time the router asks, so requests routed concurrently still alternate."""

    def __init__(self):
        self.num_asked = 0

    def ranked(self, key: str | None, loads: dict[str, int]) -> list[str]:
        replicas = sorted(loads)
        first = self.num_asked % len(replicas)
        self.num_asked += 1
        return replicas[first:] + replicas[:first]


POLICIES = {"affinity": AffinityPolicy, "round_robin": RoundRobin}


def least_loaded(key: str | None, loads: dict[str, int]) -> str:
    """The replica with the fewest requests in flight; ties go by a hash of (key, replica), so
    routers in different processes agree when loads are equal, and keys spread over equals."""
    fewest = min(loads.values())
    tied = [replica for replica, load in loads.items() if load == fewest]
    return tied[0] if len(tied) == 1 else min(tied, key=lambda replica: _rank(key, replica))


def _rank(key: str | None, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()


def prompt_key(token_ids: list[int], block_size: int = 16, num_blocks: int = 4) -> str | None:
    """A key for a request without a session key: a hash of its first `num_blocks` full blocks of
    token ids (the prefix the cache shares: a system prompt, a conversation's first turn). None
    when the prompt holds no full block. Example: block_size 4, num_blocks 2, ids [1..10] -> the
    hash of [1..8]."""
    num_tokens = min(len(token_ids) // block_size, num_blocks) * block_size
    if num_tokens == 0:
        return None
    data = b"".join(t.to_bytes(4, "little") for t in token_ids[:num_tokens])
    return PROMPT_KEY_PREFIX + hashlib.blake2b(data, digest_size=12).hexdigest()


def body_key(body: bytes) -> str | None:
    """The routing key of an OpenAI request body (/v1/chat/completions, /v1/completions): its
    `user`, else a hash of how its prompt starts, else None (not JSON, or no prompt text).

    The gateway has no tokenizer, so the prompt key hashes text, not blocks of token ids: the
    system prompt (shared by many conversations, so it does not pick the replica on its own)
    and the first PROMPT_KEY_CHARS characters of the first message after it, which a
    conversation resends on every turn. A prompt given as token ids is hashed by prompt_key.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    user = data.get("user")
    if isinstance(user, str) and user:
        return "u:" + user
    system, text = [], ""
    if isinstance(data.get("messages"), list):
        for message in data["messages"]:
            if not isinstance(message, dict):
                continue
            content = _text(message.get("content"))
            if message.get("role") in ("system", "developer"):
                system.append(content)
            else:  # the conversation's first message: every later turn resends it
                text = f"{message.get('role')}\n{content}" if content.strip() else ""
                break
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt_key(prompt)
        text = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else prompt
        text = text if isinstance(text, str) else ""
    if not text.strip():
        return None
    hashed = "\0".join(system).encode() + b"\1" + text[:PROMPT_KEY_CHARS].encode()
    return PROMPT_KEY_PREFIX + hashlib.blake2b(hashed, digest_size=12).hexdigest()


def _text(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def session_key(scope: dict) -> str | None:
    """The session key an ASGI scope (HTTP or websocket) carries: the `x-session-id` header, else
    the `session` query parameter. None without either."""
    for name, value in scope.get("headers") or ():
        if name.decode("latin-1").lower().replace("_", "-") == SESSION_HEADER and value:
            return value.decode("latin-1")
    query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
    values = query.get(SESSION_QUERY)
    return values[0] if values and values[0] else None
