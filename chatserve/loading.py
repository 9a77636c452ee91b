"""Build what the engine runs on: tokenizer, target (and draft model, EAGLE head), one shared KV pool."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from chatserve.block_manager import BlockManager
from chatserve.config import EngineConfig
from chatserve.huge_pages import move_to_huge_pages
from chatserve.kv_cache import CacheShape, FeatureShape, KVCache, available_memory_bytes, plan_num_blocks
from chatserve.kv_smooth import smoothed_kv_caches
from chatserve.model_runner import HeadRunner, ModelRunner
from chatserve.models.eagle_head import EagleHead
from chatserve.models.llama import DecoderLM
from chatserve.models.loader import load_model
from chatserve.sampling_params import SamplingParams
from chatserve.tokenizer import Tokenizer
from kernels.backend import resolve_device, resolve_kernels
from spec.draft_vocab import SubsetHead, reply_counts, subset_head, vocab_fingerprint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModels:
    tokenizer: Tokenizer
    target: DecoderLM
    target_runner: ModelRunner
    draft: DecoderLM | None
    draft_runner: ModelRunner | None
    block_manager: BlockManager
    max_model_len: int
    vocab_size: int
    eagle_runner: HeadRunner | None = None  # an EAGLE head on the target's features
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json (read_sampling_defaults)
    device: str = "cpu"  # where weights, the pool and the logits live (kernels/backend.py)
    # what was loaded and how (model files by path, size and mtime; the settings that change a forward's
    # cost): a key for what is measured on these models (spec_costs.cached_spec_costs); "" = unknown
    fingerprint: str = ""
    converted_source: str = "converted"  # where the target's converted weights came from (chatserve/converted.py)


def resolve(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    from chatserve.catalog import resolve_model

    return resolve_model(name_or_path)


def read_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def load_models(config: EngineConfig) -> LoadedModels:
    device = resolve_device(config.device)
    kernels = resolve_kernels(config.kernels, device)
    if device == "cuda" and config.quantization in ("int4", "int8"):
        raise ValueError(f"quantization {config.quantization} is the CPU's kernels; on CUDA use none (bf16 "
                         "weights) or bnb-int8 / bnb-nf4")
    dtype = DTYPES[config.dtype]
    target_dir = resolve(config.model)
    target_cfg = read_config(target_dir)
    max_model_len = min(config.max_model_len or 10**9, target_cfg.max_position_embeddings)
    tokenizer = Tokenizer(target_dir, config.chat_template)
    target, converted_source = _load_kept(target_dir, target_cfg, dtype, max_model_len, config, device)
    target = _in_huge_pages(_quantized(target, config).to(device))
    draft, draft_dir = None, None
    if config.spec and config.spec.draft_model:
        draft_dir = resolve(config.spec.draft_model)
        draft_cfg = read_config(draft_dir)
        check_same_vocab(tokenizer, Tokenizer(draft_dir), target_cfg, draft_cfg)
        counts = reply_counts(vocab_fingerprint(tokenizer.hf.get_vocab())) if config.spec.draft_vocab_size else {}
        restrict = functools.partial(subset_head, num_kept=config.spec.draft_vocab_size,
                                     always=tokenizer.special_token_ids, counts=counts)
        draft = _load(draft_dir, draft_cfg, dtype, max_model_len, config, restrict)
        draft = _in_huge_pages(_quantized(draft, config).to(device))
    shapes = [cache_shape(target, dtype, config.kv_cache_dtype, config.kv_cache_unquantized_layers)]
    if draft:
        shapes.append(cache_shape(draft, dtype, config.spec.draft_kv_cache_dtype or config.kv_cache_dtype))
    head = _load_eagle_head(config, target_dir, target_cfg, target, dtype, max_model_len)
    pooled = list(shapes)
    if head:  # its one layer's KV in the model dtype, unsmoothed (1/num_layers of the target's), + a feature
        pooled += [CacheShape(1, head.num_kv_heads, head.head_dim, dtype), FeatureShape(head.hidden_size, dtype)]
    num_blocks = plan_num_blocks(kv_budget(config, pooled, max_model_len, device), pooled, config.block_size)
    if num_blocks < 4:
        raise ValueError(f"kv_cache_memory: room for only {num_blocks} KV blocks; give the pool more memory")
    bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    # K smoothing for quantized caches: calibrated here, once per model (chatserve/kv_smooth.py).
    caches = smoothed_kv_caches((target, draft), shapes, num_blocks, config.block_size, config.kv_smooth_keys,
                                tokenizer, device)
    target_runner = ModelRunner(target, caches[0], kernels)
    draft_runner = ModelRunner(draft, caches[1], kernels) if draft else None
    eagle_runner = None
    if head:
        head_cache = KVCache(pooled[len(shapes)], num_blocks, config.block_size, device)
        eagle_runner = HeadRunner(_in_huge_pages(head.to(device)), target.embed_tokens, head_cache, kernels)
        target_runner.feature_layers = head.feature_layers  # an EAGLE-3 head's layers, captured every step
    vocab = target_cfg.vocab_size
    release_free_memory()
    fingerprint = models_fingerprint(config, target_dir, draft_dir, getattr(head, "path", None), kernels)
    return LoadedModels(tokenizer, target, target_runner, draft, draft_runner, bm, max_model_len, vocab, eagle_runner,
                        read_sampling_defaults(target_dir), device, fingerprint, converted_source)


def models_fingerprint(config: EngineConfig, target_dir: Path, draft_dir: Path | None, head_path: Path | None,
                       kernels: str) -> str:
    """JSON of what load_models built: each model's files (path, size, mtime) and the settings that
    change what a forward costs. Two loads with the same fingerprint run the same forwards."""
    def files(path: Path | None) -> list[str]:
        if path is None:
            return []
        path = Path(path)
        found = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")) if path.is_dir() else [path]
        return [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in found]

    spec = config.spec
    return json.dumps({
        "target": files(target_dir), "draft": files(draft_dir), "head": files(head_path),
        "quantization": config.quantization, "dtype": config.dtype, "device": config.device, "kernels": kernels,
        "kv_cache_dtype": config.kv_cache_dtype, "kv_unquantized_layers": config.kv_cache_unquantized_layers,
        "kv_smooth_keys": config.kv_smooth_keys, "block_size": config.block_size,
        "draft_kv_cache_dtype": spec.draft_kv_cache_dtype if spec else None,
        "draft_vocab_size": spec.draft_vocab_size if spec and draft_dir else None,
    }, sort_keys=True)


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(model_dir: Path) -> dict:
    """The sampling settings a model's generation_config.json recommends (what vLLM applies by
    default): those of SAMPLING_DEFAULT_KEYS it sets, {} without the file. As in vLLM, `do_sample`
    is not read. A value SamplingParams refuses is left out with a warning, not served."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    values = json.loads(path.read_text())
    defaults = {}
    for key in SAMPLING_DEFAULT_KEYS:
        if values.get(key) is None:
            continue
        try:
            SamplingParams(**{key: values[key]})
            defaults[key] = values[key]
        except (ValueError, TypeError) as e:
            print(f"chatserve: {path}: {e}; not used as a default", file=sys.stderr)
    return defaults


def _load_eagle_head(config: EngineConfig, target_dir: Path, target_cfg, target: DecoderLM, dtype: torch.dtype,
                     max_model_len: int) -> EagleHead | None:
    """The EAGLE head when the engine may draft with it (spec.method "eagle", or spec.eagle_head
    named), quantized like the target; else None. A missing head, or one for other weights, is a
    ValueError that says how to train one (chatserve/head_store.py)."""
    spec = config.spec
    if not spec or not (spec.method == "eagle" or spec.eagle_head):
        return None
    from chatserve.head_store import load_head

    rotary = target.layers[0].self_attn.rotary
    head = load_head(spec.eagle_head, config.model, target_dir, target_cfg, max_model_len, dtype, rotary)
    # Its kept LM head in int4 too: read cold in every draft step after the target's forward, it is
    # worth its bits' time (SmolLM2's 4,111 rows: 1.009-1.020x over int8 in lockstep), and a
    # draft's rare different argmax costs acceptance, never output (0-1 point offline; session 49).
    return _quantized(head, config, int8_head=False)


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Loading frees a float copy of every layer it quantizes. glibc keeps most of that in its heap
    (its mmap threshold grows to the size of the largest freed block, so later ones come from
    the heap and are not unmapped): 410 MiB of Qwen2.5-1.5B + 0.5B's int4 load, resident but
    unused, and the floor under the next model's peak."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


M_ARENA_MAX = -8  # glibc's mallopt() parameter number


def limit_malloc_arenas(num_arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas for the threads created from now on (mallopt M_ARENA_MAX; the
    MALLOC_ARENA_MAX variable only works from a process's start, and is left to rule when set).
    By default each thread that allocates gets an arena of its own, up to 8 per core, and each
    keeps the pages it freed: a server's uvicorn, engine and OpenMP threads made its resident
    memory creep under a soak (issue #15, tiny model, 600 requests: +22 MiB default, +7.7 MiB
    with 2 arenas; docs/benchmarks.md). True when glibc took the limit."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, num_arenas))


def _load_kept(model_dir: Path, model_cfg, dtype: torch.dtype, max_model_len: int, config: EngineConfig,
               device: str = "cpu") -> tuple[DecoderLM, str]:
    """(_load's model, where it came from): with config.converted_cache_dir and a CPU scheme that
    converts while loading (int4, int8), the conversion kept there by an earlier start, or made now
    and kept (chatserve/converted.py); else converted now."""
    from quant.apply import NATIVE_SCHEMES

    convert = functools.partial(_load, model_dir, model_cfg, dtype, max_model_len, config)
    if not config.converted_cache_dir or config.quantization not in NATIVE_SCHEMES or device != "cpu":
        return convert(), "converted"
    from chatserve.converted import load_or_convert

    return load_or_convert(config.converted_cache_dir, model_dir, dtype, config.quantization, max_model_len, convert)


def _load(model_dir: Path, model_cfg, dtype: torch.dtype, max_model_len: int, config: EngineConfig,
          head_transform=None) -> DecoderLM:
    """The model, quantized layer by layer as it is read (int4 / int8: peak memory is the
    quantized model plus one float layer). `head_transform` (a draft's subset head) applies to
    the LM head before it is quantized."""
    from chatserve.gguf_convert import GgufBlocks
    from quant.apply import NATIVE_SCHEMES, prepare, quantize_module, share_tied_rows

    scheme = config.quantization
    head_transform = head_transform or (lambda head: head)

    blocks = GgufBlocks.for_model(model_dir) if scheme == "int4" else None  # the file's own 4-bit weights
    table = {}  # the quantized embedding, for a tied head to share

    def transform(name: str, module):
        if name == "lm_head":
            module = head_transform(module)
            if isinstance(module, SubsetHead):
                module.linear = transform("lm_head.linear", module.linear)
                return module
        if scheme not in NATIVE_SCHEMES:
            return module
        rows = blocks.layer_rows(name) if blocks is not None else None
        layer = quantize_module(module, scheme, is_head=name.startswith("lm_head"), file_rows=rows)
        if name == "embed_tokens":
            table["embed_tokens"] = layer
        if name == "lm_head":
            layer = share_tied_rows(table.get("embed_tokens"), layer)
        if layer is not module and sum(p.nbytes for p in module.parameters()) >= 32 << 20:
            release_free_memory()  # what the float layers read before this one left in the heap
        return layer

    if scheme in NATIVE_SCHEMES:
        prepare(scheme)
    # an int4 model's untied LM head is quantized to int8 from its file a chunk of rows at a time
    streamed = frozenset({"lm_head"}) if scheme == "int4" else frozenset()
    model = load_model(model_dir, model_cfg, dtype, max_model_len, transform, streamed).eval()
    release_free_memory()
    return model


def _in_huge_pages(model):
    """model, its large CPU weights moved into 2 MiB pages (chatserve/huge_pages.py: a decode step
    streams them all: decode ~1.05x faster, docs/benchmarks.md session 46)."""
    if move_to_huge_pages(model) and hasattr(model, "reset_decode_stack"):
        model.reset_decode_stack()  # a stack built before would hold the old memory's addresses
    return model


def _quantized(model: DecoderLM, config: EngineConfig, int8_head: bool = True) -> DecoderLM:
    if config.quantization is None:
        return model
    from quant.apply import quantize_weights

    return quantize_weights(model, config.quantization, int8_head)


def cache_shape(model: DecoderLM, dtype: torch.dtype, kv_format: str, num_unquantized_layers: int = 0) -> CacheShape:
    return CacheShape(model.num_layers, model.num_kv_heads, model.head_dim, dtype, kv_format, num_unquantized_layers)


def kv_budget(config: EngineConfig, shapes: list[CacheShape], max_model_len: int, device: str = "cpu") -> int:
    """Bytes for the pool: as given, else enough for max_num_seqs full contexts, capped at a
    quarter of free memory (the GPU's, on CUDA)."""
    if config.kv_cache_memory:
        return config.kv_cache_memory
    per_token = sum(s.bytes_per_block(config.block_size) for s in shapes) // config.block_size
    wanted = per_token * max_model_len * config.max_num_seqs
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else available_memory_bytes()
    return max(min(wanted, free // 4), 64 * per_token * config.block_size)


def check_same_vocab(target_tok: Tokenizer, draft_tok: Tokenizer, target_cfg, draft_cfg) -> None:
    """A draft must tokenize exactly like the target, or its proposals mean nothing."""
    t_vocab, d_vocab = target_tok.hf.get_vocab(), draft_tok.hf.get_vocab()
    if t_vocab != d_vocab:
        diff = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ValueError(
            f"draft model's tokenizer differs from the target's ({len(d_vocab)} vs {len(t_vocab)} tokens, "
            f"{diff} entries differ): speculation needs the same vocabulary"
        )
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        print(
            f"note: draft vocab_size {draft_cfg.vocab_size} != target {target_cfg.vocab_size} (padding rows)",
            file=sys.stderr,
        )
