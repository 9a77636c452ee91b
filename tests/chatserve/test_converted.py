"""The converted model kept between starts (chatserve/converted.py): read back, it is the model a
conversion makes, tensor for tensor, and serves the same tokens; what it depends on changes its key."""

import os

import pytest
import torch

from chatserve import converted
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from tests.chatserve.test_engine import assert_pool_empty

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


def start(model_dir, cache=None, **kw) -> Engine:
    kw = {"max_model_len": 256, **kw}
    return Engine(EngineConfig(model=str(model_dir), quantization="int4", kv_cache_memory=8 << 20,
                               converted_cache_dir=None if cache is None else str(cache), **kw))


def tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_a_kept_conversion_is_read_back_the_same_and_serves_the_same_tokens(fixture, request, tmp_path):
    """Converted at every start, then kept (first start), then read back (second): every parameter and
    buffer of the target equal (names, dtypes, values, the tied rows still one tensor), and greedy
    replies and their logprobs equal; the pool all free after."""
    model_dir = request.getfixturevalue(fixture)
    cache = tmp_path / "converted"
    engines = [start(model_dir), start(model_dir, cache), start(model_dir, cache)]
    assert [e.models.converted_source.split(" ")[0] for e in engines] == ["converted", "converted,", "read"]
    assert len(list(cache.glob("*.pt"))) == 1
    ref = tensors(engines[0].models.target)
    for e in engines[1:]:
        got = tensors(e.models.target)
        assert got.keys() == ref.keys()
        for name, t in ref.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    target = engines[2].models.target
    if hasattr(target.embed_tokens, "share_rows") and target.embed_tokens.packed:  # a tied head's rows, shared
        assert target.embed_tokens.qweight.data_ptr() == target.lm_head.qweight.data_ptr()
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    outs = [e.generate(PROMPTS, params) for e in engines]
    for out in outs[1:]:
        assert [o["token_ids"] for o in out] == [o["token_ids"] for o in outs[0]]
        assert [o["logprobs"] for o in out] == [o["logprobs"] for o in outs[0]]
    for e in engines:
        assert_pool_empty(e)


def test_what_a_conversion_depends_on_gives_it_another_key_and_old_ones_are_dropped(tiny_llama_dir, tmp_path):
    """A touched model file, another context length or another switch: converted again under a new
    name; of one model's files the newest KEEP stay."""
    cache = tmp_path / "converted"
    key = lambda: converted.converted_key(tiny_llama_dir, torch.float32, "int4", 256)
    first = key()
    assert converted.converted_key(tiny_llama_dir, torch.float32, "int4", 128) != first
    assert converted.converted_key(tiny_llama_dir, torch.float32, "int8", 256) != first
    os.environ["CHATSERVE_TEST_SWITCH"] = "1"
    try:
        assert key() != first
    finally:
        del os.environ["CHATSERVE_TEST_SWITCH"]
    start(tiny_llama_dir, cache)
    config = tiny_llama_dir / "config.json"
    stat = config.stat()
    try:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert key() != first
        assert start(tiny_llama_dir, cache).models.converted_source.startswith("converted, kept")
        assert len(list(cache.glob("*.pt"))) == converted.KEEP
        start(tiny_llama_dir, cache, max_model_len=128)  # a third conversion: the oldest goes
        assert len(list(cache.glob("*.pt"))) == converted.KEEP
        assert not (cache / f"{tiny_llama_dir.name}-{first}.pt").exists()
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_cut_file_is_converted_again_and_replaced(tiny_llama_dir, tmp_path, capsys):
    cache = tmp_path / "converted"
    start(tiny_llama_dir, cache)
    (path,) = cache.glob("*.pt")
    path.write_bytes(path.read_bytes()[:1000])
    engine = start(tiny_llama_dir, cache)
    assert engine.models.converted_source == f"converted, kept at {path}"
    assert "converting again" in capsys.readouterr().err
    assert start(tiny_llama_dir, cache).models.converted_source == f"read from {path}"
    assert not list(cache.glob("*.tmp-*"))


def test_only_a_cpu_scheme_that_converts_while_loading_is_kept(tiny_llama_dir, tmp_path):
    """float32 weights (no quantization) are the checkpoint itself: nothing to keep."""
    cache = tmp_path / "converted"
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), max_model_len=256, kv_cache_memory=8 << 20,
                                 converted_cache_dir=str(cache)))
    assert engine.models.converted_source == "converted" and not cache.exists()
