"""One check shared by the fast-format tests: greedy speculation (n-gram, or the model drafting for
itself) gives token for token what plain greedy decoding gives on the same weights and dtype."""

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams


def check_greedy_speculation_equals_plain(model_dir, method: str, dtype: str, quantization: str | None,
                                          prompts: list[str]) -> Engine:
    """Asserts the equality, that something was drafted (all of it accepted when self-drafting)
    and that the pool is whole afterwards; returns the plain engine for further checks."""
    fast = dict(dtype=dtype, quantization=quantization, kv_cache_memory=8 << 20)
    plain = Engine(EngineConfig(model=str(model_dir), **fast))
    if method == "ngram":
        spec = SpecConfig(method="ngram", num_draft_tokens=4, adaptive=False)
    else:
        spec = SpecConfig(method="draft", draft_model=str(model_dir), num_draft_tokens=4, adaptive=False)
    engine = Engine(EngineConfig(model=str(model_dir), spec=spec, **fast))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    token_ids = [plain.tokenizer.encode(p) for p in prompts]
    expected = [plain.generate([p], params)[0]["token_ids"] for p in token_ids]
    got = [engine.generate([p], params)[0] for p in token_ids]
    assert [g["token_ids"] for g in got] == expected
    assert sum(g["stats"].num_drafted for g in got) > 0
    if method == "self-draft":
        assert all(g["stats"].num_accepted == g["stats"].num_drafted for g in got)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return plain
