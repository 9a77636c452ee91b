"""A model as loading converted it, kept in the cache dir between starts.

Loading a catalog model reads its float32 checkpoint whole (7.1 GB for Qwen2.5-Coder-1.5B) and
converts it: the GGUF file's Q4_K blocks laid out and interleaved for the kernels, its Q6_K
tensors quantized again, the embedding and LM head to int8 rows. That was most of a server start
once adaptive k's cost table was kept (docs/benchmarks.md, session 86). Here the converted module
is written once (torch.save of the module: its classes, their settings, the tensors with their
sharing, ~1.2 GB for the 1.5B) and a later start reads it back (torch.load): Qwen 1.5B's Engine()
in 3.2 s against 14.8 s converting (session 87); the huge pages move then copies the large tensors out of the heap as before.

The file is a pickle of chatserve's own classes, so it is read only from the cache dir chatserve
writes (where it also builds and loads its C++ kernels), and its name is a digest of everything
the conversion depends on: the model's files (path, size, mtime), the dtype, the quantization,
the context length (the rotary tables), the source of the modules and of the conversion
(chatserve/models, quant, kernels, loading and gguf_convert), torch's version, the kernels' build,
this CPU and the CHATSERVE_* switches. A file that does not load is converted again and replaced.
Of one model's conversions the newest KEEP are kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

CONVERTED_FORMAT = 1
KEEP = 2  # conversions of one model kept (say, int4 and another quantization tried beside it)
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("chatserve/models", "quant", "kernels", "chatserve/loading.py", "chatserve/gguf_convert.py",
           "chatserve/converted.py")


@functools.cache
def sources_digest() -> str:
    """A digest of the code that builds and converts a model (SOURCES: .py, .cpp and .h files)."""
    h = hashlib.blake2b(digest_size=12)
    for name in SOURCES:
        path = ROOT / name
        files = (sorted(p for p in path.rglob("*") if p.suffix in (".py", ".cpp", ".h")) if path.is_dir()
                 else [path] if path.is_file() else [])
        for f in files:
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def converted_key(model_dir: Path, dtype: torch.dtype, quantization: str | None, max_model_len: int) -> str:
    """The digest a conversion of model_dir is kept under (the module docstring lists its parts)."""
    from kernels.cpu_ext import build_environment

    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    parts = {"format": CONVERTED_FORMAT,
             "files": [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files],
             "dtype": str(dtype), "quantization": quantization, "max_model_len": max_model_len,
             "sources": sources_digest(), **build_environment()}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def load_or_convert(cache_dir: str | Path, model_dir: Path, dtype: torch.dtype, quantization: str | None,
                    max_model_len: int, convert: Callable[[], nn.Module]) -> tuple[nn.Module, str]:
    """(the model, where it came from): read back from cache_dir if this conversion is kept there,
    else convert() and keep it (older conversions of the same model beyond KEEP are removed)."""
    from chatserve.head_store import write_atomic

    folder = Path(cache_dir).expanduser()
    name = Path(model_dir).resolve().name
    path = folder / f"{name}-{converted_key(model_dir, dtype, quantization, max_model_len)}.pt"
    if path.is_file():
        try:
            # read, not mapped: torch maps a file as one storage, which every small tensor left in it keeps
            # alive, so the huge pages move's source pages stayed resident (+1.2 GiB on Qwen 1.5B)
            model = torch.load(path, weights_only=False)
            if isinstance(model, nn.Module):
                return model, f"read from {path}"
        except Exception as e:  # a cut or stale file: converted again below
            print(f"chatserve: {path}: {type(e).__name__}: {e}; converting again", file=sys.stderr)
    model = convert()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp: torch.save(model, tmp))
    except OSError as e:  # a full or read-only disk: served all the same, converted at every start
        print(f"chatserve: could not keep the converted model at {path}: {e}", file=sys.stderr)
        return model, "converted"
    older = sorted((p for p in folder.glob(f"{name}-*.pt") if p != path), key=lambda p: p.stat().st_mtime)
    for old in older[: max(len(older) - (KEEP - 1), 0)]:
        old.unlink(missing_ok=True)
    return model, f"converted, kept at {path}"
