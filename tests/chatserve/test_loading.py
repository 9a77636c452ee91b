"""What loading reads besides weights: the model's generation_config.json sampling defaults, and
--chat-template, on a real engine over a tiny model."""

from __future__ import annotations

import json

from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.loading import read_sampling_defaults
from chatserve.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

QWEN_LIKE = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "eos_token_id": [258, 257], "max_new_tokens": 2048}


def test_read_sampling_defaults(tmp_path):
    assert read_sampling_defaults(tmp_path) == {}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": None, "top_p": 0.0, "min_p": 0.1}))
    assert read_sampling_defaults(tmp_path) == {"min_p": 0.1}  # null skipped; top_p 0 is not a valid value


def test_engine_with_generation_config_and_chat_template(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", "llama", seed=3, num_layers=1)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_k": 5}))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    engine = Engine(EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, chat_template=str(template)))
    assert engine.sampling_defaults == {"temperature": 0.6, "top_k": 5}
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert engine.tokenizer.decode(ids) == "user: hi\nassistant:"
    out = engine.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out["token_ids"]) == 3
