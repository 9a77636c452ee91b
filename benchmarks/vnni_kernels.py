"""The weight matmuls' AVX-512 VNNI tiles against their AVX2 tiles, on the 1.5B's layer shapes, per
row count: milliseconds and GMAC/s with cold weights (distinct copies, more bytes than the L3
cache), 2 threads, both paths in one process, alternated in rounds (median of the rounds' best
quarter). Rows 1 are decode; 2-17 a verification's rows; the outputs are the same bit for bit.

    .venv/bin/python benchmarks/vnni_kernels.py --json benchmarks/results/vnni_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.q4k_kernels import best_quarter  # noqa: E402
from kernels import cpu_ext  # noqa: E402
from kernels import quant_matmul as qm  # noqa: E402
from quant.int8 import quantize_int8  # noqa: E402
from quant.q4k import interleave, quantize_q4k  # noqa: E402

# (kind, in_features, out_features): Qwen2.5-Coder-1.5B's layers as chatserve runs them
SHAPES = {"q4k gate_up": ("q4k", 1536, 17920), "q4k down": ("q4k", 8960, 1536), "q4k qkv": ("q4k", 1536, 2048),
          "int8 lm_head": ("int8", 1536, 151936)}


def layers_of(kind: str, k: int, n: int, copies: int) -> list:
    out = []
    for _ in range(copies):
        w = torch.randn(n, k) * 0.02
        if kind == "q4k":
            out.append(interleave(*quantize_q4k(w)))
        else:
            q, scales = quantize_int8(w)
            out.append((qm.pack_int8(q), scales))
    return out


def run(kind: str, x: torch.Tensor, layers: list) -> None:
    for layer in layers:
        if kind == "q4k":
            qm.q4k_linear(x, *layer)
        else:
            qm.int8x8_matmul(x, *layer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--cold-bytes", type=float, default=600e6, help="weight bytes per shape (beyond the L3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_ext.extension()
    assert ext is not None and ext.set_vnni(True) is not None
    if not ext.vnni_enabled():
        sys.exit("this CPU has no AVX-512 VNNI: nothing to compare")
    results = []
    for name in args.shapes:
        kind, k, n = SHAPES[name]
        bytes_per_copy = k * n * (0.5625 if kind == "q4k" else 1.0)
        copies = max(2, int(args.cold_bytes / bytes_per_copy))
        layers = layers_of(kind, k, n, copies)
        for m in args.rows:
            x = torch.randn(m, k)
            ext.set_vnni(True)
            same = None
            times = {"avx2": [], "vnni": []}
            for rnd in range(args.rounds):
                for isa in (("avx2", "vnni") if rnd % 2 == 0 else ("vnni", "avx2")):
                    ext.set_vnni(isa == "vnni")
                    times[isa].append(best_quarter(lambda: run(kind, x, layers), 5) / copies)
            ext.set_vnni(True)
            y_vnni = qm.q4k_linear(x, *layers[0]) if kind == "q4k" else qm.int8x8_matmul(x, *layers[0])
            ext.set_vnni(False)
            y_avx2 = qm.q4k_linear(x, *layers[0]) if kind == "q4k" else qm.int8x8_matmul(x, *layers[0])
            ext.set_vnni(True)
            same = bool(torch.equal(y_vnni, y_avx2))
            t = {isa: statistics.median(v) for isa, v in times.items()}
            gmac = m * k * n / 1e9
            row = {"shape": name, "k": k, "n": n, "rows": m, "copies": copies,
                   "avx2_ms": round(t["avx2"] * 1e3, 3), "vnni_ms": round(t["vnni"] * 1e3, 3),
                   "avx2_gmacs": round(gmac / t["avx2"], 1), "vnni_gmacs": round(gmac / t["vnni"], 1),
                   "speedup": round(t["avx2"] / t["vnni"], 2), "same_output": same,
                   "loadavg": round(os.getloadavg()[0], 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
        del layers
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
