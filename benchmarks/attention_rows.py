"""The C++ paged attention of decode and verification rows (kernels/decode_ops.paged_attention_rows)
over float32 or 16-bit (--kv-dtype) caches: ms per step for all layers, at several contexts, for 1 row (a decode) and
k + 1 rows of one sequence (a verification). Each layer has its own cache, so the caches do
not sit in L3 as one layer's would.

    .venv/bin/python benchmarks/attention_rows.py --heads 9 --kv-heads 3 --head-dim 64 --layers 30 \
        --json benchmarks/results/attention_rows_smollm2.json
    .venv/bin/python benchmarks/attention_rows.py --heads 12 --kv-heads 2 --head-dim 128 --layers 28 \
        --kv-dtype float32 bfloat16 float16 --json benchmarks/results/attention_rows_qwen15_kv16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import decode_ops  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 2000, 4000])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-dtype", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"],
                   help="cache dtypes, measured in turn at each context and row count")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    block_size, out = 16, []
    for context in args.contexts:
        num_blocks = context // block_size + 2
        shape = (num_blocks, block_size, args.kv_heads, args.head_dim)
        tables = torch.arange(num_blocks, dtype=torch.int32)[None]
        for rows, kv_dtype in [(r, d) for r in args.rows for d in args.kv_dtype]:
            dtype = getattr(torch, kv_dtype)
            caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
            query = torch.randn(rows, args.heads, args.head_dim)
            contexts = list(range(context - rows + 1, context + 1))

            def step():
                for k_cache, v_cache in caches:
                    decode_ops.paged_attention_rows(query, k_cache, v_cache, tables, [0] * rows, contexts, 0.125)

            step()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
            kv_gb = args.layers * 2 * context * args.kv_heads * args.head_dim * dtype.itemsize / 1e9
            row = {"context": context, "rows": rows, "kv_dtype": kv_dtype, "best_ms": min(times),
                   "median_ms": sorted(times)[len(times) // 2], "kv_gb_per_s": kv_gb / min(times) * 1e3}
            out.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
