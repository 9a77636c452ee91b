"""Trained EAGLE heads on disk: where they live (the cache dir, keyed by a hash of the target's
weights), how they are written and read back, and the refusal of a head made for other weights.

A head file holds the trained parameters (fc, the decoder layer, its norm; an EAGLE-3 head's fuse
and the target layers it reads, `feature_layers`), the trimmed LM head
(the target's rows for the kept ids: a quantized target has no float rows to take at load time),
the kept ids, the target's weight hash and how it was trained. The target's embedding is shared,
never stored. Files are written to a temporary name and renamed, so a killed run leaves none half
written.

A head also travels as a portable file (export_portable / import_portable): its trained weights in
int8 with a bfloat16 scale for every PORTABLE_GROUP columns, without the LM head (the target's own
rows, read back from the target on import): a Qwen 1.5B head is 31 MiB this way against 227 MB as
trained, small enough to carry to another machine, where `train-head` goes on from it.
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
PORTABLE_FORMAT = "chatserve-eagle-head-portable/1"
PORTABLE_GROUP = 64  # columns sharing an int8 scale


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


def head_checkpoint_path(head_path: Path) -> Path:
    """The train-head checkpoint beside a head file (<head>-checkpoint.pt): train-head goes on from it first."""
    return head_path.with_name(head_path.stem + "-checkpoint.pt")


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


# a source checkout's heads/: portable heads (export-head files) named <model>.eagle.pt
SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "heads"


def shipped_head(model: str) -> Path | None:
    path = SHIPPED_HEADS / f"{Path(model).name}.eagle.pt"
    return path if path.is_file() else None


def train_hint(model: str) -> str:
    hint = f"train one with: chatserve train-head --model {model}"
    shipped = shipped_head(model)
    return hint + (f", or import the one shipped: chatserve import-head --model {model} {shipped}" if shipped else "")


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
    head.path = path  # the file it came from (what the engine measured on it is keyed by it)
    return head.to(dtype).eval()


def quantize_groups(weight: torch.Tensor, group: int = PORTABLE_GROUP) -> dict:
    """A 2-D float weight as int8 with a bfloat16 scale for every `group` columns (absmax / 127)."""
    rows, cols = weight.shape
    w = weight.float().reshape(rows, cols // group, group)
    scale = (w.abs().amax(-1, keepdim=True) / 127).to(torch.bfloat16)
    q = torch.round(w / scale.float().clamp_min(torch.finfo(torch.float32).tiny)).clamp(-127, 127).to(torch.int8)
    return {"q": q.reshape(rows, cols), "scale": scale.squeeze(-1)}


def dequantize_groups(packed: dict) -> torch.Tensor:
    q, scale = packed["q"], packed["scale"]
    rows, cols = q.shape
    return (q.float().reshape(rows, scale.shape[1], -1) * scale.float()[..., None]).reshape(rows, cols)


def export_portable(head_path: Path, out: Path) -> dict:
    """Write the head at head_path as a portable file (see the module's doc) -> its record. 2-D
    weights whose columns split into groups go in int8 (quantize_groups), the rest (norms, biases,
    the kept ids) as they are."""
    record = torch.load(head_path, map_location="cpu", weights_only=True)
    if record.get("format") != HEAD_FORMAT:
        raise ValueError(f"{head_path}: not an EAGLE head file (format {record.get('format')!r})")
    weights = {}
    for name, t in record["state_dict"].items():
        if name == "lm_head.weight":
            continue  # the target's rows for head_token_ids: read back from the target on import
        grouped = t.is_floating_point() and t.dim() == 2 and t.shape[1] % PORTABLE_GROUP == 0
        weights[name] = quantize_groups(t) if grouped else t.clone()
    portable = {"format": PORTABLE_FORMAT, "target_hash": record["target_hash"], "info": record["info"],
                "feature_layers": record.get("feature_layers", []), "weights": weights}
    write_atomic(Path(out), lambda tmp: torch.save(portable, tmp))
    return portable


def import_portable(path: Path, model: str, target_dir: Path, out: Path | None = None) -> Path:
    """The head in a portable file made servable for the target at target_dir: its weights back in
    float32, its LM head the target's rows for its kept ids; written to `out` (default: the cache's
    head for these weights) -> that path. A file for other weights is a ValueError."""
    record = torch.load(path, map_location="cpu", weights_only=True)
    if record.get("format") != PORTABLE_FORMAT:
        raise ValueError(f"{path}: not a portable EAGLE head (format {record.get('format')!r}, expected "
                         f"{PORTABLE_FORMAT!r})")
    target_hash = weights_hash(target_dir)
    if record["target_hash"] != target_hash:
        raise ValueError(f"the EAGLE head in {path} was trained for other weights ({record['target_hash'][:12]}; "
                         f"{model} has {target_hash[:12]}); {train_hint(model)}")
    state = {name: dequantize_groups(t) if isinstance(t, dict) else t for name, t in record["weights"].items()}
    state["lm_head.weight"] = target_rows(target_dir, state["head_token_ids"])
    out = Path(out) if out else default_head_path(target_hash)
    info = {**record["info"], "imported_from": Path(path).name}
    write_atomic(out, lambda tmp: torch.save({"format": HEAD_FORMAT, "target_hash": target_hash, "info": info,
                                              "feature_layers": record["feature_layers"], "state_dict": state}, tmp))
    return out


def target_rows(target_dir: Path, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's output rows for token_ids, float32, read from its checkpoint as
    train_head.set_vocab reads them: the embedding's where the two are tied, else lm_head's."""
    from chatserve.loading import read_config
    from chatserve.models.loader import read_tensor

    tied = getattr(read_config(target_dir), "tie_word_embeddings", False)
    weight = read_tensor(target_dir, "embed_tokens.weight" if tied else "lm_head.weight")
    return weight[token_ids.long()].contiguous()


def write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:  # a full disk or an interrupt: no partial file left behind
        tmp.unlink(missing_ok=True)
        raise
