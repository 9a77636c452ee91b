"""Trained EAGLE heads on disk: where they live (the cache dir, keyed by a hash of the target's
weights), how they are written and read back, and the refusal of a head made for other weights.

A head file holds the trained parameters (fc, the decoder layer, its norm; an EAGLE-3 head's fuse
and the target layers it reads, `feature_layers`), the trimmed LM head
(the target's rows for the kept ids: a quantized target has no float rows to take at load time),
the kept ids, the target's weight hash and how it was trained. The target's embedding is shared,
never stored. Files are written to a temporary name and renamed, so a killed run leaves none half
written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from chatserve.models.eagle_head import EagleHead

HEAD_FORMAT = 1
HEAD_FILE = "eagle-head.pt"


def heads_dir() -> Path:
    from chatserve.catalog import cache_dir

    return cache_dir() / "heads"


def weights_hash(model_dir: Path) -> str:
    """blake2b over the model's *.safetensors files (names and bytes), hex. Memoized by path, size
    and mtime in heads_dir()/weight_hashes.json: hashing a 7 GB checkpoint takes seconds."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    key = ";".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    memo_path = heads_dir() / "weight_hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    digest = hashlib.blake2b(digest_size=16)
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    # entries of files gone (a test's temporary model, a model removed) are dropped as it grows
    memo = {k: v for k, v in memo.items() if all(Path(f.rsplit(":", 2)[0]).exists() for f in k.split(";"))}
    memo[key] = digest.hexdigest()
    write_atomic(memo_path, lambda tmp: tmp.write_text(json.dumps(memo, indent=1)))
    return memo[key]


def default_head_path(target_hash: str) -> Path:
    return heads_dir() / target_hash[:16] / HEAD_FILE


def head_data_path(head_path: Path) -> Path:
    """The train-head data beside a head file (<head>-data.pt)."""
    return head_path.with_name(head_path.stem + "-data.pt")


def trained_head(model: str) -> Path | None:
    """The cache's head for `model`'s weights when one was trained here and the model is on this
    machine (catalog.local_model_dir); None otherwise. Hashes nothing while no head exists at all."""
    from chatserve.catalog import local_model_dir

    if not any(heads_dir().glob(f"*/{HEAD_FILE}")):
        return None
    model_dir = local_model_dir(model)
    if model_dir is None or not any(model_dir.glob("*.safetensors")):
        return None
    path = default_head_path(weights_hash(model_dir))
    return path if path.is_file() else None


def save_head(path: Path, head: EagleHead, target_hash: str, info: dict) -> None:
    """Write the servable head (no optimizer state; see train_head for checkpoints)."""
    record = {"format": HEAD_FORMAT, "target_hash": target_hash, "info": info,
              "feature_layers": list(head.feature_layers),
              "state_dict": {k: v.detach().clone() for k, v in head.state_dict().items()}}
    write_atomic(Path(path), lambda tmp: torch.save(record, tmp))


def train_hint(model: str) -> str:
    return f"train one with: chatserve train-head --model {model}"


def load_head(path: Path | None, model: str, target_dir: Path, cfg, max_positions: int, dtype: torch.dtype,
              rotary=None) -> EagleHead:
    """The head at `path` (None: the cache's head for this target's weights), checked against the
    target: a missing head, or one trained for other weights, is a ValueError saying how to train one."""
    target_hash = weights_hash(target_dir)
    path = Path(path) if path else default_head_path(target_hash)
    if not path.is_file():
        raise ValueError(f"no EAGLE head for {model} (weights {target_hash[:12]}) at {path}; {train_hint(model)}")
    record = torch.load(path, map_location="cpu", weights_only=True)
    if record.get("format") != HEAD_FORMAT:
        raise ValueError(f"{path}: EAGLE head format {record.get('format')!r}, expected {HEAD_FORMAT}; "
                         f"{train_hint(model)}")
    if record["target_hash"] != target_hash:
        raise ValueError(f"the EAGLE head at {path} was trained for other weights ({record['target_hash'][:12]}; "
                         f"{model} has {target_hash[:12]}); {train_hint(model)}")
    try:  # a head from before EAGLE-3's features has no feature_layers: it reads the final feature
        head = EagleHead.from_state(cfg, max_positions, record["state_dict"], record.get("feature_layers", ()), rotary)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; {train_hint(model)}") from None
    head.info = record["info"]
    return head.to(dtype).eval()


def write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)
