"""Conversation affinity: which replica a request goes to. Pure Python; knows nothing of Ray.

A request's routing key is its session key (the `x-session-id` header, a `session` query
parameter, or an OpenAI body's `user`) or, without one, a hash of its prompt's first blocks. A
key sticks to the replica that served it first, because that replica holds its prefix in its
KV pool; a new key, or one whose replica is gone, goes to the least loaded replica. Ray's proxy
routes before it reads a body, so ray_app.AffinityRouter uses only the header and the query
parameter (docs/scale-out.md); `user` and `prompt_key` are for a router that has the body.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from urllib.parse import parse_qs

SESSION_HEADER = "x-session-id"  # Ray Serve's own session header (RAY_SERVE_SESSION_ID_HEADER_KEY)
SESSION_QUERY = "session"  # browsers cannot set headers on a websocket: /ws?session=...
DEFAULT_MAX_SESSIONS = 100_000  # sticky entries kept; the oldest is forgotten first


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
    return "p:" + hashlib.blake2b(data, digest_size=12).hexdigest()


def session_key(scope: dict) -> str | None:
    """The session key an ASGI scope (HTTP or websocket) carries: the `x-session-id` header, else
    the `session` query parameter. None without either."""
    for name, value in scope.get("headers") or ():
        if name.decode("latin-1").lower().replace("_", "-") == SESSION_HEADER and value:
            return value.decode("latin-1")
    query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
    values = query.get(SESSION_QUERY)
    return values[0] if values and values[0] else None
