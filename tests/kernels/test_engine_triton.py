"""The GPU path's wiring without a GPU: the whole engine with kernels="triton" (Triton's paged
attention and quantizing KV store, run by Triton's interpreter on CPU tensors) gives the same
greedy tokens as the torch CPU path: float, int8 and fp8 pools, speculation (a draft model in
the same pool), and a second turn over the prefix cache."""

import pytest

from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from kernels.backend import resolve_device, resolve_kernels
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TURN_1 = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
TURN_2 = " and then"


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory):
    """A target and a draft with head_dim 64 (the Triton kernel takes 64 or 128)."""
    target = make_tiny_model(tmp_path_factory.mktemp("wide_target"), "qwen2", seed=3, hidden_size=256,
                             intermediate_size=256)
    draft = make_tiny_model(tmp_path_factory.mktemp("wide_draft"), "qwen2", seed=4, num_layers=1, hidden_size=256,
                            intermediate_size=256)
    return target, draft


def two_turns(engine: Engine) -> tuple[list[int], list[int], int]:
    """Greedy tokens of a first turn and of a second one that extends it; the second's cached tokens."""
    prompt = engine.tokenizer.encode(TURN_1)
    first = engine.generate([prompt], GREEDY)[0]["token_ids"]
    second = engine.generate([prompt + first + engine.tokenizer.encode(TURN_2)], GREEDY)[0]
    return first, second["token_ids"], second["stats"].cached_tokens


@pytest.mark.parametrize("kv_cache_dtype, method", [("auto", None), ("auto", "draft"), ("int8", "draft"),
                                                    ("fp8_e5m2", None)])
def test_the_engine_on_the_triton_kernels_equals_the_torch_path(wide_dirs, triton_device, kv_cache_dtype, method):
    if triton_device != "cpu":
        pytest.skip("this test drives the interpreter; on a GPU benchmarks/gpu_smoke.py checks the real thing")
    target, draft = wide_dirs
    spec = SpecConfig(method="draft", draft_model=str(draft), num_draft_tokens=3, adaptive=False) if method else None
    runs = {}
    for kernels in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(target), kernels=kernels, kv_cache_dtype=kv_cache_dtype, spec=spec,
                                     kv_cache_memory=4 << 20, max_model_len=512))
        assert engine.models.target_runner.kernels == kernels
        runs[kernels] = two_turns(engine)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert runs["triton"] == runs["torch"]
    first, second, cached = runs["triton"]
    assert len(first) == len(second) == GREEDY.max_tokens and cached >= 16  # the second turn hit the cache


def test_kernels_triton_is_what_ran(wide_dirs, triton_device, monkeypatch):
    """The switch reaches the kernels: with kernels="triton" every attention call goes to Triton."""
    import kernels.triton_attention as ta

    calls = []
    real = ta.paged_attention_triton
    monkeypatch.setattr(ta, "paged_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = Engine(EngineConfig(model=str(wide_dirs[0]), kernels="triton", kv_cache_memory=4 << 20, max_model_len=512))
    engine.generate([engine.tokenizer.encode("x = 1")], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(calls) == 3 * engine.models.target.num_layers  # the prompt and two decodes, every layer


def test_device_and_kernel_choices():
    import torch

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_kernels("auto", "cpu") == "torch" and resolve_kernels("auto", "cuda") == "triton"
    with pytest.raises(ValueError, match="CPU path"):
        resolve_kernels("torch", "cuda")
    with pytest.raises(ValueError, match="device"):
        EngineConfig(model="m", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device.*--device cpu"):
            resolve_device("cuda")


def test_kernels_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_kernels("triton", "cpu")


def test_gpu_smoke_runs_through_the_interpreter(wide_dirs, tmp_path):
    """benchmarks/gpu_smoke.py end to end on the tiny pair, Triton kernels on CPU tensors: it
    measures both methods at each batch and finds greedy output equal."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_smoke.py"), "--model", str(wide_dirs[0]), "--draft-model",
         str(wide_dirs[1]), "--device", "cpu", "--kernels", "triton", "--dtype", "float32", "--kv-cache-dtype", "int8",
         "--kv-cache-memory", str(4 << 20), "--batches", "1", "2", "--max-tokens", "6", "--out", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["greedy_equal"] is True
    assert [(r["method"], r["batch"]) for r in result["runs"]] == [("off", 1), ("off", 2), ("draft", 1), ("draft", 2)]
    assert all(len(ids) == 6 for r in result["runs"] for ids in r["token_ids"])
