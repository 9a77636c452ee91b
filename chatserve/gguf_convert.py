"""GGUF file -> Hugging Face model directory: config.json, tokenizer files, generation_config.json
and a float32 model.safetensors with transformers' parameter names.

The weights are bit for bit what `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` holds:
the same dequantization (`gguf.dequantize`), tensor-name map and per-architecture fix-ups
(transformers' `TENSOR_PROCESSORS`, e.g. undoing llama.cpp's Q/K row permutation for llama), in
float32. It avoids building the model and parsing the vocabulary twice more, and streams one tensor
at a time to disk, so memory stays near the largest tensor.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

# GGUF metadata value types of fixed width: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64.
_VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


class GgufTensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-moving first)
    ggml_type: gguf.GGMLQuantizationType
    start: int  # absolute byte offset in the file
    num_bytes: int


def read_tensor_table(gguf_path: Path) -> tuple[str, list[GgufTensorInfo]]:
    """(general.architecture, tensor table) without materializing the vocabulary (gguf.GGUFReader
    builds one numpy view per token string: ~12 s for Qwen's 151k tokens and merges)."""
    blob = np.memmap(gguf_path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file (bad magic bytes)")
    version, num_tensors, num_kvs = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{gguf_path}: GGUF version {version} is not supported (2 or 3)")
    pos, metadata = 24, {}
    for _ in range(num_kvs):
        key, pos = _read_string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _read_value(blob, pos + 4, value_type)
    entries = []
    for _ in range(num_tensors):
        name, pos = _read_string(blob, pos)
        (num_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        entries.append((name, tuple(reversed(dims)), gguf.GGMLQuantizationType(ggml_type), offset))
    alignment = metadata.get("general.alignment", 32)
    data_start = (pos + alignment - 1) // alignment * alignment
    infos = []
    for name, shape, ggml_type, offset in entries:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        num_bytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        infos.append(GgufTensorInfo(name, shape, ggml_type, data_start + offset, num_bytes))
    return metadata["general.architecture"], infos


def _read_string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _read_value(blob: np.ndarray, pos: int, value_type: int):
    """One metadata value and the offset after it; arrays of strings are skipped (returned as None)."""
    if value_type in _VALUE_FORMATS:
        fmt = _VALUE_FORMATS[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_string(blob, pos)
    if value_type == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item_type in _VALUE_FORMATS:
            return None, pos + count * struct.calcsize(_VALUE_FORMATS[item_type])
        for _ in range(count):
            _, pos = _read_value(blob, pos, item_type)
        return None, pos
    raise ValueError(f"unknown GGUF metadata value type {value_type}")


def read_tensor(gguf_path: Path, info: GgufTensorInfo) -> np.ndarray:
    """One tensor dequantized to float32 by gguf's own reference code, shape `info.shape`."""
    raw = np.memmap(gguf_path, mode="r", dtype=np.uint8, offset=info.start, shape=(info.num_bytes,))
    if info.ggml_type in _FLOAT_DTYPES:
        data = raw.view(_FLOAT_DTYPES[info.ggml_type]).reshape(info.shape)
    else:
        data = raw.reshape(gguf.quant_shape_to_byte_shape(info.shape, info.ggml_type))
    return gguf.dequantize(data, info.ggml_type)


def iter_hf_tensors(
    gguf_path: Path, skeleton: torch.nn.Module, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every GGUF tensor transformers would load, in file order.

    Mirrors the tensor loop of transformers' `load_gguf_checkpoint(return_tensors=True)`;
    `skeleton` is the model (on the meta device) whose parameter names are the targets."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture, infos = read_tensor_table(gguf_path)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=skeleton.config.to_dict())
    name_map = get_gguf_hf_weights_map(skeleton, processor)  # {gguf name: hf name}
    total_bytes = sum(info.num_bytes for info in infos)
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="dequantize", disable=not progress) as bar:
        for info in infos:
            weights = read_tensor(gguf_path, info)
            merged = {"tensors": {}}  # where MoE processors put tensors they merge across GGUF entries
            result = processor.process(
                weights=weights, name=info.name, tensor_key_mapping=name_map, parsed_parameters=merged
            )
            bar.update(info.num_bytes)
            if result.name != info.name or merged["tensors"]:
                raise NotImplementedError(f"{architecture}: {info.name} is renamed or merged; not supported here")
            if info.name in name_map:
                yield name_map[info.name], torch.from_numpy(np.copy(result.weights)).to(torch.float32)


def meta_model(config) -> torch.nn.Module:
    """The transformers model for `config` on the meta device: names and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def expected_shapes(skeleton: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """{HF parameter name: shape} the checkpoint must hold; a tied lm_head is left out."""
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    if getattr(skeleton.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def write_safetensors(
    path: Path, shapes: dict[str, tuple[int, ...]], tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """Stream float32 tensors into one safetensors file whose header is laid out from `shapes` up front.

    Tensors arrive in any order; each must match its declared shape, and all must arrive."""
    order = list(shapes)
    offsets, cursor = {}, 0
    for name in order:
        size = 4 * int(np.prod(shapes[name], dtype=np.int64))
        offsets[name] = (cursor, cursor + size)
        cursor += size
    header = {"__metadata__": {"format": "pt"}}
    header.update({n: {"dtype": "F32", "shape": list(shapes[n]), "data_offsets": list(offsets[n])} for n in order})
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    data_start = 8 + len(header_bytes)
    written = set()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        f.truncate(data_start + cursor)
        for name, tensor in tensors:
            if name not in shapes:
                continue  # not stored by this model (a tied lm_head)
            if tuple(tensor.shape) != shapes[name] or name in written:
                raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, expected {shapes[name]} once")
            f.seek(data_start + offsets[name][0])
            f.write(tensor.contiguous().numpy().data)
            written.add(name)
    if missing := set(shapes) - written:
        raise ValueError(f"GGUF lacks {len(missing)} parameters the model needs, e.g. {sorted(missing)[:5]}")


def load_config(gguf_path: Path):
    """The transformers config built from the GGUF metadata, cleaned for a plain safetensors dir."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    config.dtype = torch.float32
    return config


def generation_eos_ids(config, tokenizer, extra_eos_tokens: Sequence[str]) -> list[int]:
    """The GGUF's eos id, then each extra token, then `<|im_end|>` if the chat template ends turns with it."""
    eos = config.eos_token_id
    ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    vocab = tokenizer.get_vocab()
    tokens = list(extra_eos_tokens)
    if "<|im_end|>" in (tokenizer.chat_template or ""):
        tokens.append("<|im_end|>")
    for token in tokens:
        if token in vocab and vocab[token] not in ids:
            ids.append(vocab[token])
    return ids


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, extra_eos_tokens: Sequence[str] = (), progress: bool = True
) -> None:
    """Write a Hugging Face model directory for `gguf_path` into `out_dir` (which must exist)."""
    from transformers import AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    _say(progress, f"reading config and tokenizer from {gguf_path.name}")
    config = load_config(gguf_path)
    skeleton = meta_model(config)
    config.architectures = [type(skeleton).__name__]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _say(progress, f"dequantizing {gguf_path.name} to float32 safetensors")
    tensors = iter_hf_tensors(gguf_path, skeleton, progress)
    write_safetensors(out_dir / "model.safetensors", expected_shapes(skeleton), tensors)
    config.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _embed_chat_template(out_dir, tokenizer.chat_template)
    eos_ids = generation_eos_ids(config, tokenizer, extra_eos_tokens)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)


def _embed_chat_template(out_dir: Path, chat_template: str | None) -> None:
    """transformers 5 saves the template as chat_template.jinja; also put it in tokenizer_config.json
    (identical text) for readers that only look there."""
    if not chat_template:
        return
    path = out_dir / "tokenizer_config.json"
    values = json.loads(path.read_text())
    values["chat_template"] = chat_template
    path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"chatserve: {message}", file=sys.stderr, flush=True)


# our fused linear layer -> the GGUF tensors whose rows it stacks, in order
_GGUF_LINEARS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


class GgufBlocks:
    """The raw 4-bit blocks of a converted model's GGUF file, by our layer name, so that
    --quantization int4 keeps the file's own weights instead of re-quantizing the float copy:
    Q4_K layers go to quant/q4k.py, Q4_1 ones to quant/int4.py (the same formula per group of
    32). Only layers whose every part has the same one of those types qualify."""

    TYPES = {gguf.GGMLQuantizationType.Q4_K: "Q4_K", gguf.GGMLQuantizationType.Q4_1: "Q4_1"}

    def __init__(self, gguf_path: Path):
        self.path = gguf_path
        _, infos = read_tensor_table(gguf_path)
        self.infos = {info.name: info for info in infos}

    @classmethod
    def for_model(cls, model_dir: Path) -> GgufBlocks | None:
        """The model directory's GGUF (named in chatserve.json by the catalog's conversion), or None."""
        meta_path = Path(model_dir) / "chatserve.json"
        if not meta_path.exists():
            return None
        name = json.loads(meta_path.read_text()).get("gguf_file")
        path = Path(model_dir) / name if name else None
        return cls(path) if path is not None and path.exists() else None

    def layer_rows(self, layer_name: str) -> tuple[str, np.ndarray] | None:
        """("Q4_K" or "Q4_1", blocks [out_features, bytes per row] uint8) for layers.{i}.<linear>,
        or None when the layer is not entirely one of those types in the file."""
        parts = layer_name.split(".")
        if len(parts) != 4 or parts[0] != "layers":
            return None
        kinds = _GGUF_LINEARS.get(".".join(parts[2:]))
        if kinds is None:
            return None
        infos = [self.infos.get(f"blk.{parts[1]}.{kind}.weight") for kind in kinds]
        if any(info is None for info in infos) or len({info.ggml_type for info in infos}) != 1:
            return None
        kind = self.TYPES.get(infos[0].ggml_type)
        if kind is None:
            return None
        rows = []
        for info in infos:
            raw = np.fromfile(self.path, dtype=np.uint8, count=info.num_bytes, offset=info.start)
            rows.append(raw.reshape(info.shape[0], -1))
        return kind, (np.concatenate(rows) if len(rows) > 1 else rows[0])
