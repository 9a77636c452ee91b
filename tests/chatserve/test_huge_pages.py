"""A loaded model's large weights move into 2 MiB pages (chatserve/huge_pages.py): the same
values, shapes, strides and sharing, the same outputs, and, where the kernel gives transparent
huge pages, memory the kernel backs with them; an engine decodes the same tokens either way."""

import pytest
import torch
from torch import nn

from chatserve import huge_pages
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model


def huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process holding `address`."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= address < hi:
                for field in lines[i + 1 :]:
                    if field.startswith("AnonHugePages:"):
                        return int(field.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512), nn.Linear(4, 4), nn.Linear(512, 2048))
    m[2].weight = nn.Parameter(m[0].weight.t())  # a transposed view of another's storage
    m[4].weight = m[0].weight  # one parameter in two modules (a tied LM head)
    m.register_buffer("strided", torch.arange(1 << 18, dtype=torch.int32)[1::2])  # a view at an offset
    return m


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages on this kernel")
def test_moved_weights_are_the_same_tensors_in_huge_pages():
    m = model()
    before = {k: (v.clone(), v.shape, v.stride()) for k, v in m.state_dict().items()}
    small = m[3].weight.data_ptr()
    x = torch.randn(5, 512)
    y = m[:3](x)
    moved = huge_pages.move_to_huge_pages(m)
    assert moved >= 512 * 2048 * 4 + (1 << 17) * 4  # the shared storage once, the strided view's span
    for k, v in m.state_dict().items():
        value, shape, stride = before[k]
        assert torch.equal(v, value) and v.shape == shape and v.stride() == stride, k
    assert m[2].weight.untyped_storage().data_ptr() == m[0].weight.untyped_storage().data_ptr()  # still shared
    assert m[4].weight is m[0].weight
    assert isinstance(m[0].weight, nn.Parameter)
    assert m[3].weight.data_ptr() == small  # under MIN_BYTES: stays
    assert torch.equal(m[:3](x), y)
    assert m[0].weight.data_ptr() % huge_pages.ALIGN == 0
    assert huge_kib(m[0].weight.data_ptr()) >= 2048  # the kernel backed it with at least one 2 MiB page


def test_nothing_moves_when_turned_off(monkeypatch):
    monkeypatch.setenv("CHATSERVE_NO_HUGE_PAGES", "1")
    m = model()
    where = m[0].weight.data_ptr()
    assert not huge_pages.available() and huge_pages.move_to_huge_pages(m) == 0
    assert m[0].weight.data_ptr() == where


@pytest.mark.parametrize("quantization", ["int4", None])
def test_an_engine_decodes_the_same_tokens_from_huge_pages(tmp_path, monkeypatch, quantization):
    """The loaded target's weights move before its decode stack is built (a stack built from the
    old addresses would read freed memory): greedy tokens equal with the move turned off."""
    path = make_tiny_model(tmp_path / "m", "qwen2", seed=3, hidden_size=256, intermediate_size=1024)
    prompts = [[5, 17, 42, 99, 3], list(range(40, 90))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(path), quantization=quantization, dtype="float32", kv_cache_memory=16 << 20)

    def tokens() -> list[list[int]]:
        return [r["token_ids"] for r in Engine(config).generate(prompts, params)]

    moved = Engine(config)
    if huge_pages.available():
        target = moved.models.target
        large = [t for t in [*target.parameters(), *target.buffers()] if t.nbytes >= huge_pages.MIN_BYTES]
        assert large and all(huge_kib(t.data_ptr()) >= 2048 for t in large)
    want = [r["token_ids"] for r in moved.generate(prompts, params)]
    monkeypatch.setenv("CHATSERVE_NO_HUGE_PAGES", "1")
    assert tokens() == want
