"""Hugging Face safetensors directory -> DecoderLM parameters. Name mapping in one table."""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from chatserve.models.llama import DecoderLM

# checkpoint name fragment -> (our parameter fragment, shard index in the fused weight)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(model_dir: str | Path, cfg, dtype: torch.dtype, max_positions: int,
               transform: Callable[[str, nn.Module], nn.Module] | None = None,
               streamed: frozenset[str] = frozenset()) -> DecoderLM:
    """Read the checkpoint into a DecoderLM in `dtype`, one layer (leaf module) at a time.

    `transform(name, module)` (e.g. quantization) replaces each leaf module as soon as its
    parameters are read, so a quantized model never holds all of its float weights at once: the
    peak is the quantized model plus one float layer. Files are opened per layer and closed
    after it: safetensors maps them, and mapped pages count as resident until unmapped (a 6 GB
    fp32 file held open would be the peak). A tied LM head is read with the embedding and
    transformed right after it, from the float table, which is then freed: held until the last
    layer, Qwen2.5-1.5B's fp32 table (933 MB) was the peak of an int4 load.

    A leaf named in `streamed` (an untied, bias-free LM head) is not read: `transform` gets a
    StreamedLinear, whose rows it reads a chunk at a time (quant/int8.Int8Linear.from_streamed).
    Read whole in fp32, the two Qwen heads of the default pair (933 + 544 MB) made the peak of
    loading it."""
    with torch.device("meta"):
        model = DecoderLM(cfg, max_positions).to(dtype)
    _init_rotary(model, cfg, max_positions, dtype)
    tied = model.tie_word_embeddings
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    sources = _checkpoint_index(Path(model_dir))  # our parameter name -> [(file, key, shard)]
    names = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    leaves = [name for name, module in model.named_modules()
              if not list(module.children()) and list(module.parameters(recurse=False))]
    if tied:  # the head right after the table: both transformed, the float table can go before the layers load
        leaves.remove("lm_head")
        leaves.insert(leaves.index("embed_tokens") + 1, "lm_head")
    for name in leaves:
        module = model.get_submodule(name)
        if name in streamed and not tied and transform is not None:
            stream = StreamedLinear.of(module, name, sources)
            if stream is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, transform(name, stream))
                loaded.add(f"{name}.weight")
                continue
        if not (tied and name == "lm_head"):  # a tied head already holds the table
            # allocated in the target dtype: copy_ converts as it reads, so a bf16 model never
            # holds an fp32 copy of a layer
            module.to_empty(device="cpu")
            if tied and name == "embed_tokens":
                model.lm_head.weight = module.weight  # to_empty made a new tensor: tie it again
            with _open_files(sources) as files:
                for pname, param in module.named_parameters():
                    _read(param, f"{name}.{pname}", sources, files, model, loaded)
        if transform is not None:
            replacement = transform(name, module)
            if replacement is not module:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, replacement)
    _check_complete(names, loaded, tied)
    return model


def read_tensor(model_dir: str | Path, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One unfused checkpoint tensor by our parameter name (e.g. "embed_tokens.weight"), as `dtype`."""
    sources = _checkpoint_index(Path(model_dir))
    if name not in sources or sources[name][0][2] is not None:
        raise KeyError(f"{model_dir}: no unfused tensor {name!r}")
    path, key, _ = sources[name][0]
    reader = SafetensorsReader(path)
    try:
        out = torch.empty(reader.shape(key), dtype=dtype)
        reader.read_into(key, out)
    finally:
        reader.close()
    return out


class StreamedLinear(nn.Module):
    """A bias-free linear layer whose weight stays in its checkpoint file until read, a chunk of
    rows at a time (`read_rows`), optionally through a subset of its rows (`select`). Not callable:
    a loader's transform turns it into a real layer."""

    def __init__(self, path: Path, key: str, in_features: int, row_ids: torch.Tensor):
        super().__init__()
        self.path, self.key, self.in_features = path, key, in_features
        self.row_ids = row_ids  # [out_features] int64, ascending: rows of the file's tensor
        self.out_features = len(row_ids)
        self.bias = None

    @classmethod
    def of(cls, module: nn.Module, name: str, sources: dict) -> "StreamedLinear | None":
        """`module`'s weight as one, when it is one unfused 2-D tensor and there is no bias."""
        entries = sources.get(f"{name}.weight", [])
        if getattr(module, "bias", None) is not None or len(entries) != 1 or entries[0][2] is not None:
            return None
        path, key, _ = entries[0]
        reader = SafetensorsReader(path)
        try:
            shape = reader.shape(key)
        finally:
            reader.close()
        if len(shape) != 2 or tuple(shape) != tuple(module.weight.shape):
            return None
        return cls(path, key, shape[1], torch.arange(shape[0]))

    def select(self, ids: torch.Tensor) -> "StreamedLinear":
        """The layer of rows `ids` (ascending) of this one."""
        return StreamedLinear(self.path, self.key, self.in_features, self.row_ids[ids])

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as float32 [stop - start, in_features]: each run of consecutive file
        rows is one read."""
        ids = self.row_ids[start:stop]
        out = torch.empty(len(ids), self.in_features)
        breaks = (torch.nonzero(ids[1:] - ids[:-1] != 1).flatten() + 1).tolist()
        reader = SafetensorsReader(self.path)
        try:
            for lo, hi in zip([0, *breaks], [*breaks, len(ids)]):
                reader.read_rows_into(self.key, int(ids[lo]), out[lo:hi])
        finally:
            reader.close()
        return out

    def forward(self, x):
        raise RuntimeError("StreamedLinear is read by a loader's transform, never called")


@contextlib.contextmanager
def _open_files(sources: dict):
    paths = {path for entries in sources.values() for path, _, _ in entries}
    readers = {path: SafetensorsReader(path) for path in paths}
    try:
        yield readers
    finally:
        for reader in readers.values():
            reader.close()


def _checkpoint_index(model_dir: Path) -> dict[str, list[tuple[Path, str, int | None]]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    sources: dict[str, list] = {}
    for path in files:
        reader = SafetensorsReader(path)
        for key in reader.keys():
            target, shard = _map_name(key)
            if target is not None:
                sources.setdefault(target, []).append((path, key, shard))
        reader.close()
    return sources


def _read(param, name, sources, files, model, loaded: set[str]) -> None:
    """Fill one parameter from its checkpoint tensor(s); a fused one (qkv, gate_up) from its shards."""
    for path, key, shard in sources.get(name, ()):
        rows = _shard_rows(param, shard, model, name, files[path].shape(key))
        files[path].read_into(key, rows)
        loaded.add(name if shard is None else f"{name}#{shard}")


class SafetensorsReader:
    """Reads tensors of a safetensors file with plain reads, in chunks, straight into their
    destination (converting the dtype): no mapping, so nothing but the destination stays resident."""

    DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    CHUNK_BYTES = 32 << 20

    def __init__(self, path: Path):
        self.file = open(path, "rb")
        (length,) = struct.unpack("<Q", self.file.read(8))
        self.header = json.loads(self.file.read(length))
        self.data_start = 8 + length

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def read_into(self, key: str, out: torch.Tensor) -> None:
        entry = self.header[key]
        dtype = self.DTYPES[entry["dtype"]]
        assert tuple(out.shape) == tuple(entry["shape"]), (key, out.shape, entry["shape"])
        begin, end = entry["data_offsets"]
        flat = out.view(-1)
        row_bytes = dtype.itemsize
        step = max(self.CHUNK_BYTES // row_bytes, 1)
        self.file.seek(self.data_start + begin)
        with torch.no_grad():
            for start in range(0, (end - begin) // row_bytes, step):
                count = min(step, flat.numel() - start)
                buffer = torch.empty(count, dtype=dtype)
                self.file.readinto(memoryview(buffer.view(torch.uint8).numpy()))
                flat[start : start + count].copy_(buffer)

    def read_rows_into(self, key: str, first_row: int, out: torch.Tensor) -> None:
        """Rows [first_row, first_row + len(out)) of 2-D tensor `key` into `out`, converted."""
        entry = self.header[key]
        dtype = self.DTYPES[entry["dtype"]]
        rows, cols = entry["shape"]
        assert out.dim() == 2 and out.shape[1] == cols and first_row + out.shape[0] <= rows, (key, out.shape, first_row)
        buffer = torch.empty(out.shape, dtype=dtype)
        self.file.seek(self.data_start + entry["data_offsets"][0] + first_row * cols * dtype.itemsize)
        self.file.readinto(memoryview(buffer.view(-1).view(torch.uint8).numpy()))
        out.copy_(buffer)

    def close(self) -> None:
        self.file.close()


def _map_name(name: str) -> tuple[str | None, int | None]:
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None, None
    for src, (dst, shard) in FUSED.items():
        if f".{src}." in name:
            return name.replace(src, dst), shard
    return name, None


def _shard_rows(param: torch.Tensor, shard: int | None, model: DecoderLM, target: str, shape) -> torch.Tensor:
    """The part of `param` a checkpoint tensor of `shape` fills: all of it, or a fused shard's rows."""
    if shard is None:
        assert tuple(param.shape) == tuple(shape), (target, param.shape, shape)
        return param.data
    sizes = _shard_sizes(model, target)
    start = sum(sizes[:shard])
    assert shape[0] == sizes[shard], (target, shard, shape)
    return param.data[start : start + sizes[shard]]


def _shard_sizes(model: DecoderLM, target: str) -> list[int]:
    if "qkv_proj" in target:
        attn = model.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
    inter = model.layers[0].mlp.intermediate
    return [inter, inter]


def _check_complete(params, loaded: set[str], tie_word_embeddings: bool) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        if "qkv_proj" in name:
            need = [f"{name}#{i}" for i in range(3)]
        elif "gate_up_proj" in name:
            need = [f"{name}#0", f"{name}#1"]
        else:
            need = [name]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")


def _init_rotary(model: DecoderLM, cfg, max_positions: int, dtype: torch.dtype) -> None:
    """Tables computed in fp32, stored in the model dtype (as HF's rotary hands them over)."""
    from chatserve.models.layers import Rotary
    from chatserve.models.llama import rope_inv_freq

    rotary = Rotary(*rope_inv_freq(cfg, model.head_dim), max_positions).to(dtype)
    for layer in model.layers:
        layer.self_attn.rotary = rotary
