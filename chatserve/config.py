"""Frozen configuration dataclasses. Built once; an unknown key is an error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernels.backend import DEVICES, KERNELS

KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2")
DRAFT_CATCH_UPS = ("decode", "prefill", "whole")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. `method` is the default of requests that name none, one of
    chatserve.spec_methods.SPEC_METHODS ("draft": a small model; "ngram": prompt lookup; ...).
    A `draft_model`, when given, is loaded whatever the method, so requests may ask for it."""

    method: str = "draft"
    draft_model: str | None = None
    num_draft_tokens: int = 4  # the maximum k; adaptive speculation picks k in [0, max]
    # The maximum k of proposals that run no model (n-gram, suffix decoding) when adaptive k
    # prices them: their drafts cost verification rows only, so a long match (code returned
    # with an edit) may draft this far while a weak one drafts little. Fixed k: num_draft_tokens.
    num_free_draft_tokens: int = 16
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True
    draft_kv_cache_dtype: str | None = None  # None = the target's kv_cache_dtype
    draft_vocab_size: int = 65536  # draft over the most frequent ids only (spec/draft_vocab.py); 0 = all
    # When a draft model sees tokens it has not seen (a new prompt, a new turn's tail): "decode" =
    # in bounded chunks inside decode steps, while the request drafts by other methods;
    # "prefill" = beside the target's prefill chunks, in the same steps; "whole" = all at once
    # before its first draft (a stall as long as the catch-up). docs/benchmarks.md measures them.
    draft_catch_up: str = "decode"
    # An EAGLE head's file (chatserve train-head writes one); None = the cache's head for the
    # target's weights. Loaded when method is "eagle" or a head is named.
    eagle_head: str | None = None
    # Adaptive EAGLE chains stop where the head's probability of the chain falls below what one
    # more draft costs (SpecState.least_gain); False: each runs to the k adaptive pricing chose.
    confidence_stop: bool = True
    # Greedy chains read the head's P through the power train-head fitted on its held-out replies (the head
    # info's greedy_stop_power: Qwen's head is underconfident at T = 0); False: P as it is. Off: served, the
    # longer chains it drafts were slower (docs/benchmarks.md, session 75).
    calibrated_stop: bool = False
    # Suffix decoding also matches against the most recent replies of all requests, up to this
    # many tokens (a question asked again, code repeated across conversations); 0 = each
    # request's own tokens only (benchmarks of fresh conversations that repeat their files).
    suffix_corpus_tokens: int = 1 << 16
    # Where adaptive k's measured cost table is kept, by machine and loaded models (spec_costs.
    # cached_spec_costs): a later start reads it instead of timing ~200 forwards. None: measured at
    # every start (the library's default; `chatserve serve` keeps it in the cache dir).
    costs_cache_dir: str | None = None

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts any request may take in a step: a fixed k or a free proposal's cap."""
        return max(self.num_draft_tokens, self.num_free_draft_tokens)

    def __post_init__(self) -> None:
        from chatserve.spec_methods import SPEC_METHODS  # the registry's classes import this module

        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec.method: one of {', '.join(map(repr, SPEC_METHODS))}, got {self.method!r}")
        if SPEC_METHODS[self.method].keeps_kv and not self.draft_model:
            raise ValueError(f"spec.draft_model: required when spec.method is {self.method!r}")
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"spec.num_draft_tokens: must be in [1, 16], got {self.num_draft_tokens}")
        if not 1 <= self.num_free_draft_tokens <= 32:
            raise ValueError(f"spec.num_free_draft_tokens: must be in [1, 32], got {self.num_free_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("spec.ngram_min/ngram_max: need 1 <= ngram_min <= ngram_max")
        if self.draft_catch_up not in DRAFT_CATCH_UPS:
            raise ValueError(f"spec.draft_catch_up: one of {DRAFT_CATCH_UPS}, got {self.draft_catch_up!r}")
        if self.suffix_corpus_tokens < 0:
            raise ValueError(f"spec.suffix_corpus_tokens: must be >= 0, got {self.suffix_corpus_tokens}")
        if self.draft_kv_cache_dtype is not None and self.draft_kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"spec.draft_kv_cache_dtype: one of {KV_CACHE_DTYPES}, got {self.draft_kv_cache_dtype!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the whole pool (all models); None = from free memory
    kv_cache_dtype: str = "auto"
    kv_cache_unquantized_layers: int = 0  # with a quantized target cache, its first n layers keep the model dtype
    kv_smooth_keys: bool = True  # quantized caches subtract a calibrated per-channel K mean (chatserve/kv_smooth.py)
    max_model_len: int | None = None  # None = the model's own limit
    max_num_seqs: int = 16
    # Token budget per step (prompt chunks + decodes + drafts). 256, not 512: a prompt arriving while
    # another prefills waits for the running chunk, and chunks of 64-512 prefill equally fast here.
    max_num_batched_tokens: int = 256
    # Beside running decodes, a step's prompt tokens are sized (from measured costs) so that the
    # step takes at most this many decode-only steps; 0 = only the token budget limits them.
    # 2.5 keeps every stream's longest gap within 3x its median at 4 sessions (3.0 gave 3.5x;
    # docs/benchmarks.md, session 24).
    stall_limit: float = 2.5
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch threads; None = leave torch's default
    seed: int = 0
    spec: SpecConfig | None = None
    quantization: str | None = None  # weight quantization: "int4", "int8" (fast on CPU), "bnb-int8", "bnb-nf4"
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template
    # Where the target as loading converted it (int4 / int8) is kept between starts (chatserve/converted.py):
    # a later start reads it back instead of reading the float checkpoint and converting it. None: converted
    # at every start (the library's default; `chatserve serve` keeps it in the cache dir).
    converted_cache_dir: str | None = None
    device: str = "cpu"  # "auto" | "cpu" | "cuda" (kernels/backend.py)
    kernels: str = "auto"  # attention + KV store: "auto" | "torch" | "triton" (kernels/backend.py)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_unquantized_layers < 0:
            raise ValueError(f"kv_cache_unquantized_layers: must be >= 0, got {self.kv_cache_unquantized_layers}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size: one of 8, 16, 32, 64, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 16:
            raise ValueError("max_num_seqs must be >= 1 and max_num_batched_tokens >= 16")
        if self.stall_limit != 0 and self.stall_limit < 1.5:
            raise ValueError(f"stall_limit: 0 (off) or at least 1.5 decode steps, got {self.stall_limit}")
        if self.quantization not in (None, "int4", "int8", "bnb-int8", "bnb-nf4"):
            raise ValueError(f"quantization: one of int4, int8, bnb-int8, bnb-nf4, got {self.quantization!r}")
        if self.device not in DEVICES or self.kernels not in KERNELS:
            raise ValueError(f"device: one of {DEVICES}, kernels: one of {KERNELS}; got {self.device!r}, "
                             f"{self.kernels!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be positive bytes, got {self.kv_cache_memory}")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        """Strict construction: unknown keys raise instead of being dropped."""
        return _strict(cls, values)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # besides the server's own host
    max_message_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None = the model's context limit
    max_tokens_limit: int = 4096  # the largest websocket max_tokens; a chat completion's default (HTTP: up to the context)
    max_connections: int = 64  # open websockets + in-flight HTTP generations
    # Generations (websocket turns + HTTP completions) waiting beyond the engine's max_num_seqs;
    # past it a new one gets 429 + Retry-After instead of an unbounded wait.
    max_queued_requests: int = 48  # with the defaults, 16 + 48 = max_connections
    # Output bytes queued for a websocket that is not reading (beyond the socket's own buffers);
    # past it the connection is dropped with close code 4008 and its turn aborted.
    max_pending_output_bytes: int = 256 << 10
    shutdown_grace: float = 30.0  # seconds running generations get to finish after SIGTERM
    served_model_name: str | None = None
    # Requests (and websocket settings) that leave temperature, top_p, top_k, min_p or
    # repetition_penalty out get the model's generation_config.json values, as in vLLM.
    use_generation_config: bool = True

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_queued_requests < 0:
            raise ValueError("max_connections must be >= 1 and max_queued_requests >= 0")
        if self.max_pending_output_bytes < 1 or self.shutdown_grace < 0:
            raise ValueError("max_pending_output_bytes must be >= 1 and shutdown_grace >= 0")

    @classmethod
    def from_dict(cls, values: dict) -> "ServerConfig":
        return _strict(cls, values)


def _strict(cls, values: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}")
    if cls is EngineConfig and isinstance(values.get("spec"), dict):
        values = {**values, "spec": _strict(SpecConfig, values["spec"])}
    return cls(**values)


__all__ = ["EngineConfig", "SpecConfig", "ServerConfig", "KV_CACHE_DTYPES"]
