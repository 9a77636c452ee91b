"""An int4 model's untied LM head is quantized from its file a chunk of rows at a time
(chatserve/models/loader.StreamedLinear): the same int8 rows and scales as quantizing the head
read whole, for the full head and for a draft's subset of rows."""

import torch

from chatserve.config import EngineConfig
from chatserve.loading import _load, read_config
from chatserve.models.loader import StreamedLinear, _checkpoint_index, load_model
from quant.int8 import Int8Linear
from spec.draft_vocab import SubsetHead, subset_head


def float_head(model_dir) -> torch.nn.Linear:
    return load_model(model_dir, read_config(model_dir), torch.float32, 64).lm_head


def test_streamed_rows_are_the_files_rows(tiny_qwen_dir):
    head = float_head(tiny_qwen_dir)
    stream = StreamedLinear.of(head, "lm_head", _checkpoint_index(tiny_qwen_dir))
    assert stream is not None and stream.out_features == head.out_features
    ids = torch.tensor([0, 1, 2, 7, 8, 100, 271])  # three runs of consecutive rows
    part = stream.select(ids)
    assert torch.equal(part.read_rows(0, len(ids)), head.weight[ids])
    assert torch.equal(part.read_rows(2, 6), head.weight[ids[2:6]])


def test_int4_load_streams_the_head_to_the_same_int8_rows(tiny_qwen_dir):
    config = EngineConfig(model=str(tiny_qwen_dir), quantization="int4")
    model = _load(tiny_qwen_dir, read_config(tiny_qwen_dir), torch.float32, 64, config)
    want = Int8Linear.from_linear(float_head(tiny_qwen_dir), keep_dense=False)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.dense_weight is None
    assert torch.equal(model.lm_head.qweight, want.qweight) and torch.equal(model.lm_head.scales, want.scales)


def test_a_drafts_subset_head_reads_only_its_rows(tiny_qwen_dir):
    keep = lambda head: subset_head(head, num_kept=100, always=[270, 271])  # noqa: E731
    config = EngineConfig(model=str(tiny_qwen_dir), quantization="int4")
    model = _load(tiny_qwen_dir, read_config(tiny_qwen_dir), torch.float32, 64, config, keep)
    want = keep(float_head(tiny_qwen_dir))
    assert isinstance(model.lm_head, SubsetHead) and torch.equal(model.lm_head.keep_ids, want.keep_ids)
    quantized = Int8Linear.from_linear(want.linear, keep_dense=False)
    assert torch.equal(model.lm_head.linear.qweight, quantized.qweight)
    assert torch.equal(model.lm_head.linear.scales, quantized.scales)
    hidden = torch.randn(3, model.lm_head.linear.in_features)
    assert torch.equal(model.lm_head(hidden).isinf(), want(hidden).isinf())  # -inf outside the kept ids
