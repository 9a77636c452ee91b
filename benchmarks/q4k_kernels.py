"""The Q4_K kernel (quant/q4k.py) against the int4 kernel in groups of 32 (quant/int4.py) on the
1.5B's layer shapes, per row count: GFLOP/s with cold weights (12 distinct copies per shape, so
L3 cannot hold them), 2 threads. Rows 1-4 are decode and verification, 45+ prefill chunks.

    .venv/bin/python benchmarks/q4k_kernels.py --json benchmarks/results/q4k_kernels.json
    .venv/bin/python benchmarks/q4k_kernels.py --rows 16 32 64 128 256 512 --amx-int8 \
        --json benchmarks/results/q4k_kernels_amx_int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import quant_matmul as qm  # noqa: E402
from quant.int4 import Int4Linear  # noqa: E402
from quant.q4k import Q4KLinear  # noqa: E402

SHAPES = {"gate_up": (1536, 17920), "down": (8960, 1536), "qkv": (1536, 2048)}


def best_quarter(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 45, 128, 512])
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--amx-int8", action="store_true",
                    help="also time the Q4_K kernel with its AMX-INT8 path off (q4k_vnni_*; 64+ rows take the tiles)")
    args = ap.parse_args()
    from kernels import cpu_ext

    ext = cpu_ext.extension()
    torch.set_num_threads(args.threads)
    results = []
    for name, (k, n) in SHAPES.items():
        floats = [torch.nn.Linear(k, n, bias=False) for _ in range(args.copies)]
        g32 = [Int4Linear.from_linear(f) for f in floats]
        q4k = [Q4KLinear.from_linear(f) for f in floats]
        del floats
        for m in args.rows:
            x = torch.randn(m, k)
            runs = 4 if m > 100 else 10
            t_g32 = best_quarter(lambda: [layer(x) for layer in g32], runs) / args.copies  # its layout, as served
            t_q4k = best_quarter(lambda: [qm.q4k_linear(x, layer.codes, layer.subs, layer.dd) for layer in q4k], runs) / args.copies
            gflop = 2 * m * k * n / 1e9
            extra = {}
            if args.amx_int8 and ext is not None:
                ext.set_amx_int8(False)
                t_vnni = best_quarter(lambda: [qm.q4k_linear(x, layer.codes, layer.subs, layer.dd) for layer in q4k], runs) / args.copies
                ext.set_amx_int8(True)
                extra = {"amx_int8": ext.amx_int8_enabled(), "q4k_vnni_ms": round(t_vnni * 1e3, 3),
                         "q4k_vnni_gflops": round(gflop / t_vnni, 1), "amx_speedup": round(t_vnni / t_q4k, 2)}
            row = {"shape": name, "k": k, "n": n, "rows": m, "g32_ms": round(t_g32 * 1e3, 3), "q4k_ms": round(t_q4k * 1e3, 3),
                   "g32_gflops": round(gflop / t_g32, 1), "q4k_gflops": round(gflop / t_q4k, 1),
                   "speedup": round(t_g32 / t_q4k, 2), **extra, "loadavg": round(os.getloadavg()[0], 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "copies": args.copies, "results": results}, indent=1))


if __name__ == "__main__":
    main()
