"""Hugging Face safetensors directory -> DecoderLM parameters. Name mapping in one table."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from chatserve.models.llama import DecoderLM

# checkpoint name fragment -> (our parameter fragment, shard index in the fused weight)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(model_dir: str | Path, cfg, dtype: torch.dtype, max_positions: int) -> DecoderLM:
    with torch.device("meta"):
        model = DecoderLM(cfg, max_positions)
    # Allocate in the target dtype at once (copy_ converts each tensor as it is read), so a
    # 1.5B model in bf16 never holds a 6 GB fp32 copy on the way.
    model = model.to_empty(device="cpu").to(dtype)
    # to_empty leaves buffers uninitialised and may untie shared weights: redo both.
    _init_rotary(model, cfg, max_positions, dtype)
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target, shard = _map_name(name)
                if target is None or target not in params:
                    continue
                _copy_into(params[target], f.get_tensor(name), shard, model, target)
                loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(model, params, loaded)
    return model


def _map_name(name: str) -> tuple[str | None, int | None]:
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None, None
    for src, (dst, shard) in FUSED.items():
        if f".{src}." in name:
            return name.replace(src, dst), shard
    return name, None


def _copy_into(param: torch.nn.Parameter, tensor: torch.Tensor, shard: int | None, model: DecoderLM, target: str):
    with torch.no_grad():
        if shard is None:
            assert param.shape == tensor.shape, (target, param.shape, tensor.shape)
            param.copy_(tensor)
            return
        sizes = _shard_sizes(model, target)
        start = sum(sizes[:shard])
        assert tensor.shape[0] == sizes[shard], (target, shard, tensor.shape)
        param[start : start + sizes[shard]].copy_(tensor)


def _shard_sizes(model: DecoderLM, target: str) -> list[int]:
    if "qkv_proj" in target:
        attn = model.layers[0].self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
    inter = model.layers[0].mlp.intermediate
    return [inter, inter]


def _check_complete(model: DecoderLM, params: dict, loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.tie_word_embeddings:
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
