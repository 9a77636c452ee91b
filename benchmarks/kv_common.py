"""Helpers shared by the KV-cache benchmarks (kv_speed.py, kv_quality.py): engines that share
one copy of the loaded weights but each own a fresh KV pool in a given format, and the eval text."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatserve.block_manager import BlockManager  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.kv_cache import plan_num_blocks  # noqa: E402
from chatserve.kv_smooth import smoothed_kv_caches  # noqa: E402
from chatserve.loading import DTYPES, LoadedModels, cache_shape  # noqa: E402
from chatserve.model_runner import ModelRunner  # noqa: E402

EVAL_TEXT = Path(__file__).resolve().parents[1] / "chatserve" / "data" / "eval_text.txt"


def engine_with_kv(models: LoadedModels, config: EngineConfig, kv_format: str, budget_bytes: int,
                   spec: SpecConfig | None = None, draft_kv_format: str | None = None,
                   num_unquantized_layers: int = 0, smooth_keys: bool = True) -> Engine:
    """An Engine over `models`' weights (not copied) with new pools: the target's in `kv_format`,
    the draft's (if spec uses the draft model) in `draft_kv_format` (default: the target's).
    Quantized pools get K smoothing unless smooth_keys is False, as the engine's own loader does
    (the means are calibrated once per model and shared by all engines on it)."""
    dtype = DTYPES[config.dtype]
    use_draft = spec is not None and spec.method == "draft"
    shapes = [cache_shape(models.target, dtype, kv_format, num_unquantized_layers)]
    if use_draft:
        shapes.append(cache_shape(models.draft, dtype, draft_kv_format or kv_format))
    num_blocks = plan_num_blocks(budget_bytes, shapes, config.block_size)
    caches = smoothed_kv_caches((models.target, models.draft), shapes, num_blocks, config.block_size, smooth_keys,
                                models.tokenizer)
    runners = [ModelRunner(m, cache) for m, cache in zip((models.target, models.draft), caches)]
    fresh = dataclasses.replace(
        models,
        target_runner=runners[0],
        draft_runner=runners[1] if use_draft else None,
        block_manager=BlockManager(num_blocks, config.block_size, config.enable_prefix_caching),
    )
    if spec is not None and draft_kv_format is not None:
        spec = dataclasses.replace(spec, draft_kv_cache_dtype=draft_kv_format)
    config = dataclasses.replace(config, kv_cache_dtype=kv_format, kv_cache_unquantized_layers=num_unquantized_layers,
                                 kv_smooth_keys=smooth_keys)
    return Engine(dataclasses.replace(config, spec=spec), fresh)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_report(report: dict, out: Path | None, default_name: str) -> None:
    """Write a benchmark's JSON to `out`, or to benchmarks/results/<default_name>."""
    import json

    out = out or Path(__file__).parent / "results" / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
