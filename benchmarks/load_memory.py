"""Resident memory after loading a target (and draft) per weight mode, each in a fresh process.

    .venv/bin/python benchmarks/load_memory.py --modes int4:float32 int8:bfloat16 none:bfloat16 \
        --json benchmarks/results/load_memory_qwen_pair.json

Prints, per mode: weights (parameters + buffers), resident set after loading and its peak while
loading, with a 64 MiB KV pool (counted apart: reserved, resident as it is written); and the two
GGUF files' size for the issue's goal (int4: weights and runtime <= 1.5x the files, peak <= 1.3x).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, time
from chatserve.config import EngineConfig, SpecConfig
from chatserve.engine import Engine
target, draft, quant, dtype = sys.argv[1:5]
spec = SpecConfig(method="draft", draft_model=draft, adaptive=False) if draft != "none" else None
start = time.perf_counter()
engine = Engine(EngineConfig(model=target, dtype=dtype, quantization=None if quant == "none" else quant,
                             kv_cache_memory=64 << 20, spec=spec, num_threads=2))
print(json.dumps({**engine.memory_stats(), "load_s": time.perf_counter() - start}))
"""


def gguf_bytes(model: str) -> int:
    from chatserve.loading import resolve

    directory = resolve(model)
    return sum(p.stat().st_size for p in directory.glob("*.gguf"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--modes", nargs="+", default=["int4:float32", "int8:bfloat16", "none:bfloat16"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    files = gguf_bytes(args.target) + (gguf_bytes(args.draft) if args.draft != "none" else 0)
    print(f"GGUF files: {files / 2**30:.2f} GiB", flush=True)
    rows = []
    for mode in args.modes:
        quant, dtype = mode.split(":")
        out = subprocess.run([sys.executable, "-c", CHILD, args.target, args.draft, quant, dtype],
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        row = {"mode": mode, **json.loads(out.stdout.strip().splitlines()[-1])}
        row["rss_over_files"] = row["rss_bytes"] / files
        row["peak_over_rss"] = row["peak_rss_bytes"] / row["rss_bytes"]
        rows.append(row)
        print(f"{mode:16s} weights {row['weights_bytes'] / 2**30:5.2f} GiB  resident {row['rss_bytes'] / 2**30:5.2f} GiB "
              f"({row['rss_over_files']:.2f}x the files)  peak {row['peak_rss_bytes'] / 2**30:5.2f} GiB "
              f"({row['peak_over_rss']:.2f}x resident)  KV pool {row['kv_pool_bytes'] / 2**20:.0f} MiB  "
              f"load {row['load_s']:.1f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": args.target, "draft": args.draft, "gguf_bytes": files, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
