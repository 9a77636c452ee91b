"""Quantized KV caches end to end: the pool layout and byte budget (scales included), engines
with int8 / fp8 target and draft caches, and speculation staying lossless on any cache dtype."""

import json
import os

import pytest
import torch

from chatserve.cli import build_parser, engine_config
from chatserve.cli import main as cli_main
from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.kv_cache import CacheShape, KVCache, plan_num_blocks
from chatserve.sampling_params import SamplingParams
from quant.kv import SCALE_DTYPE

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Hello there",
    "def add(a, b):",
    "The quick brown fox jumps over",
    "Once upon a time, in a land far away, there lived",
]
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]


def make_engine(model_dir, **kw):
    kw.setdefault("kv_cache_memory", 8 << 20)
    return Engine(EngineConfig(model=str(model_dir), **kw))


def run(engine, prompts=PROMPTS):
    ids = [engine.tokenizer.encode(p) for p in prompts]
    outs = engine.generate(ids, GREEDY)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    return [o["token_ids"] for o in outs], outs


@pytest.fixture(scope="module")
def auto_outputs(tiny_llama_dir):
    return run(make_engine(tiny_llama_dir))[0]


# -- layout and budget --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["auto", "fp16", "bf16", *QUANTIZED])
def test_pool_layout_and_views(fmt):
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, kv_format=fmt)
    cache = KVCache(shape, num_blocks=5, block_size=8)
    assert len(cache.layers) == 3
    layer = cache.layers[1]
    assert layer.k_cache.shape == (5, 8, 2, 16) and layer.v_cache.shape == (5, 8, 2, 16)
    # views into the one pool, not copies
    assert layer.k_cache.data_ptr() == cache.pool[1, 0].data_ptr()
    if fmt in ("auto", "fp16", "bf16"):
        assert layer.k_scale is None and layer.v_scale is None and cache.scales is None
        assert cache.pool.dtype == {"auto": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
    else:
        assert cache.pool.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
        assert layer.k_scale.shape == (5, 8, 2) and layer.k_scale.dtype == SCALE_DTYPE
        assert layer.v_scale.data_ptr() == cache.scales[1, 1].data_ptr()
    assert cache.num_bytes == 5 * shape.bytes_per_block(8)


def resident_fraction(t: torch.Tensor) -> float:
    """The share of t's memory pages that are resident, from /proc/self/pagemap (bit 63 of each
    page's entry: present; readable without privileges)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    present = sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))
    return present / (last - first + 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_pool_is_resident_from_the_start(fmt):
    """Issue #15: a lazily mapped pool became resident block by block under traffic, which read
    as a leak. Made zeroed, all its pages are resident at once. The pool is over glibc's largest
    mmap threshold (32 MiB), so it is a fresh mapping, never reused heap pages: with torch.empty
    none of them would be present."""
    shape = CacheShape(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32, kv_format=fmt)
    cache = KVCache(shape, num_blocks=2048, block_size=16)  # 256 MiB (auto), 64 MiB (int8) + scales
    assert resident_fraction(cache.pool) > 0.99
    assert cache.scales is None or resident_fraction(cache.scales) > 0.99
    assert not cache.pool.any() and (cache.scales is None or not cache.scales.any())


def test_first_layers_can_stay_unquantized():
    shape = CacheShape(3, 2, 16, torch.float32, "int8", num_unquantized_layers=1)
    cache = KVCache(shape, num_blocks=5, block_size=8)
    first, rest = cache.layers[0], cache.layers[1:]
    assert first.k_cache.dtype == torch.float32 and first.k_scale is None
    assert all(layer.k_cache.dtype == torch.int8 and layer.v_scale is not None for layer in rest)
    per_token = 2 * 2 * 16 * 4 + 2 * 2 * (2 * 16 + 2 * SCALE_DTYPE.itemsize)
    assert shape.bytes_per_block(8) == 8 * per_token and cache.num_bytes == 5 * 8 * per_token
    with pytest.raises(ValueError):
        CacheShape(3, 2, 16, torch.float32, "int8", num_unquantized_layers=4)


def test_engine_with_unquantized_first_layer(tiny_llama_dir, auto_outputs):
    engine = make_engine(tiny_llama_dir, kv_cache_dtype="int8", kv_cache_unquantized_layers=1)
    cache = engine.models.target_runner.kv_cache
    assert cache.layers[0].k_scale is None and cache.layers[1].k_scale is not None
    outs, _ = run(engine)
    assert outs[0] == auto_outputs[0]


def test_budget_counts_scales():
    budget = 1 << 20
    fp32 = CacheShape(30, 3, 64, torch.float32, "auto")
    int8 = CacheShape(30, 3, 64, torch.float32, "int8")
    per_token_int8 = 30 * 2 * (3 * 64 + 3 * SCALE_DTYPE.itemsize)
    assert int8.bytes_per_block(16) == 16 * per_token_int8
    assert plan_num_blocks(budget, [int8], 16) == budget // (16 * per_token_int8)
    # a target and a draft with different formats share one block table
    both = plan_num_blocks(budget, [fp32, int8], 16)
    assert both == budget // (fp32.bytes_per_block(16) + int8.bytes_per_block(16))


def test_engine_pool_fits_budget(tiny_llama_dir):
    budget = 4 << 20
    for fmt in ("auto", "int8"):
        engine = make_engine(tiny_llama_dir, kv_cache_memory=budget, kv_cache_dtype=fmt)
        cache = engine.models.target_runner.kv_cache
        assert cache.num_bytes <= budget
        assert cache.num_bytes > budget - cache.shape.bytes_per_block(engine.block_manager.block_size)


def test_a_16_bit_pool_holds_twice_the_tokens_of_a_float32_one():
    shapes = {fmt: CacheShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, kv_format=fmt)
              for fmt in ("auto", "fp16", "bf16")}
    assert shapes["fp16"].bytes_per_block(16) == shapes["bf16"].bytes_per_block(16) == shapes["auto"].bytes_per_block(16) // 2
    for fmt, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        cache = KVCache(shapes[fmt], num_blocks=5, block_size=8)
        assert cache.pool.dtype == dtype and cache.scales is None and cache.layers[0].k_scale is None


# -- engine end to end --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_engine_close_to_auto(tiny_llama_dir, auto_outputs, fmt):
    outs, _ = run(make_engine(tiny_llama_dir, kv_cache_dtype=fmt))
    assert [len(o) for o in outs] == [len(o) for o in auto_outputs]
    same = sum(a == b for out, ref in zip(outs, auto_outputs) for a, b in zip(out, ref))
    total = sum(len(o) for o in auto_outputs)
    # int8 keeps ~2 decimal digits per value; fp8 e4m3 ~1, e5m2 less: greedy paths may fork late
    assert same / total >= {"int8": 0.9, "fp8_e4m3": 0.6, "fp8_e5m2": 0.5}[fmt]
    if fmt == "int8":
        assert outs[0] == auto_outputs[0]


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_a_16_bit_cache_engine_follows_auto(tiny_llama_dir, auto_outputs, fmt):
    outs, _ = run(make_engine(tiny_llama_dir, kv_cache_dtype=fmt))
    same = sum(a == b for out, ref in zip(outs, auto_outputs) for a, b in zip(out, ref))
    assert same / sum(len(o) for o in auto_outputs) >= 0.9 and outs[0] == auto_outputs[0]


def test_quantized_engine_batched_equals_alone(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, kv_cache_dtype="int8", max_num_batched_tokens=32)
    batched, _ = run(engine)
    alone = [run(engine, [p])[0][0] for p in PROMPTS]
    assert batched == alone


@pytest.mark.parametrize("target_fmt,draft_fmt", [("int8", "int8"), ("int8", "fp8_e5m2"), ("auto", "int8"),
                                                  ("fp8_e4m3", None), ("bf16", None), ("fp16", "auto")])
def test_spec_lossless_on_quantized_caches(tiny_llama_dir, tiny_draft_dir, target_fmt, draft_fmt):
    """The target verifies every token, so spec output equals spec off on the same target cache,
    whatever the draft's cache holds."""
    plain, _ = run(make_engine(tiny_llama_dir, kv_cache_dtype=target_fmt))
    for draft in (tiny_llama_dir, tiny_draft_dir):
        spec = SpecConfig(method="draft", draft_model=str(draft), num_draft_tokens=4, adaptive=False,
                          draft_kv_cache_dtype=draft_fmt)
        engine = make_engine(tiny_llama_dir, kv_cache_dtype=target_fmt, spec=spec)
        draft_cache = engine.models.draft_runner.kv_cache
        assert draft_cache.shape.kv_format == (draft_fmt or target_fmt)
        outs, results = run(engine)
        assert outs == plain
        assert sum(r["stats"].num_drafted for r in results) > 0
        if draft == tiny_llama_dir:  # self-draft: nearly every draft is accepted
            drafted = sum(r["stats"].num_drafted for r in results)
            assert sum(r["stats"].num_accepted for r in results) >= 0.8 * drafted


def test_ngram_lossless_on_int8_cache(tiny_llama_dir):
    plain, _ = run(make_engine(tiny_llama_dir, kv_cache_dtype="int8"))
    spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    assert run(make_engine(tiny_llama_dir, kv_cache_dtype="int8", spec=spec))[0] == plain


# -- command line -------------------------------------------------------------------------


def test_cli_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--draft-kv-cache-dtype", "fp8_e4m3"])
    config = engine_config(args)
    assert config.kv_cache_dtype == "int8" and config.spec.draft_kv_cache_dtype == "fp8_e4m3"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert engine_config(args).spec.draft_kv_cache_dtype is None  # = the target's
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int8", "--kv-cache-unquantized-layers", "1"])
    assert engine_config(args).kv_cache_unquantized_layers == 1


@pytest.mark.parametrize("amx", [True, False])
def test_cli_auto_kv_cache_is_16_bit_for_a_float32_model_on_the_cpu(amx):
    """bf16 where the attention takes the AMX tiles (set_amx(True) holds only where the CPU has
    them), else fp16."""
    from kernels import cpu_ext

    parse = build_parser().parse_args
    before = cpu_ext.extension().set_amx(amx)
    try:
        expected = "bf16" if cpu_ext.extension().amx_enabled() else "fp16"
        assert amx or expected == "fp16"
        assert engine_config(parse(["serve"])).kv_cache_dtype == expected  # int4 weights, float32 activations
        assert engine_config(parse(["serve", "--quantization", "none", "--dtype", "float32"])).kv_cache_dtype == expected
    finally:
        cpu_ext.extension().set_amx(before)
    assert engine_config(parse(["serve", "--dtype", "bfloat16"])).kv_cache_dtype == "auto"  # the model dtype
    assert engine_config(parse(["serve", "--kv-cache-dtype", "fp32"])).kv_cache_dtype == "fp32"
    assert engine_config(parse(["serve", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"


def test_an_fp32_format_is_a_float32_pool_whatever_the_model_dtype():
    shape = CacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, kv_format="fp32")
    cache = KVCache(shape, num_blocks=3, block_size=8)
    assert cache.pool.dtype == torch.float32 and cache.scales is None


def test_cli_generate_int8(tiny_llama_dir, capsys):
    code = cli_main(["generate", "Hello there", "--model", str(tiny_llama_dir), "--kv-cache-dtype", "int8",
                     "--kv-cache-memory", "4M", "--max-tokens", "8", "--ignore-eos", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"


def test_serve_with_quantized_target_and_draft_caches(tiny_llama_dir, tiny_draft_dir):
    """`chatserve serve --kv-cache-dtype int8 --draft-kv-cache-dtype fp8_e4m3` as a subprocess:
    a completion through the OpenAI route, then the pool is back to all blocks free."""
    import os
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--model", str(tiny_llama_dir),
           "--draft-model", str(tiny_draft_dir), "--kv-cache-dtype", "int8", "--draft-kv-cache-dtype", "fp8_e4m3",
           "--port", str(port), "--kv-cache-memory", "4M", "--threads", "1", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            assert proc.poll() is None, "server exited:\n" + proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 12, "temperature": 0}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] >= 1, reply
        for _ in range(100):
            health = httpx.get(base + "/health").json()
            if health["num_free_blocks"] == health["num_blocks"]:
                break
            time.sleep(0.05)
        assert health["num_free_blocks"] == health["num_blocks"], health
    finally:
        proc.terminate()
        proc.wait(timeout=10)
