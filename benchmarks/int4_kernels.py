"""Weight-matmul kernels on the 1.5B target's linear shapes, cold weights (one distinct tensor per
layer, so L3 cannot hold them): time for all 112 matmuls of one forward, by activation rows M.

    .venv/bin/python benchmarks/int4_kernels.py --rows 1 4 8 16 64 --json benchmarks/results/int4_kernels.json
    .venv/bin/python benchmarks/int4_kernels.py --shapes head --layers 2 --rows 1 4 9 \
        --kinds chatserve-int8 torch-int8pack chatserve-int4 --json benchmarks/results/head_kernels.json

`--shapes head` times the LM head instead ([151936, 1536], two copies so the second is cold);
`--shapes smollm2 --layers 30 --kinds chatserve-int4x8` SmolLM2-135M's layers in the layout an AVX2 CPU
without VNNI serves them in (what a verification row adds there: docs/benchmarks.md, session 62).

Kernels: chatserve's int4 (kernels/quant_matmul.py) and its dense path (dequantize, then an fp32
GEMM: what Int4Linear does past quant.int4.SMALL_M rows), torch's `_weight_int4pack_mm_for_cpu` (bf16
activations), chatserve's int8 (quant/int8.py's decode path where the C++ kernel builds), torch's
`_weight_int8pack_mm` (its fallback), dense fp32 and bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.quant_matmul import int4_dense_matmul, int4_matmul, int4x8_linear, int8_matmul
from quant.int4 import interleave, make_params, pack_codes

SHAPE_SETS = {
    "layers": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],  # (out, in): qkv, o, gate_up, down
    "head": [(151936, 1536)],  # Qwen2.5's LM head
    "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],  # SmolLM2-135M's qkv, o, gate_up, down
}
SHAPES = SHAPE_SETS["layers"]


def build(num_layers: int, kinds: list[str]) -> dict[str, list]:
    weights = {k: [] for k in kinds}
    for _ in range(num_layers):
        for n, k in SHAPES:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            if {"chatserve-int4", "chatserve-int4-dense", "chatserve-int4x8"} & set(kinds):
                params = make_params(torch.rand(n, k // 32) * 0.01, torch.randn(n, k // 32) * 0.01)
                for kind in ("chatserve-int4", "chatserve-int4-dense"):
                    if kind in kinds:
                        weights[kind].append((pack_codes(codes), params))
                if "chatserve-int4x8" in kinds:
                    weights["chatserve-int4x8"].append(interleave(pack_codes(codes), params))
            if "torch-int4pack" in kinds:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
                weights["torch-int4pack"].append((packed, torch.randn(k // 32, n, 2).to(torch.bfloat16)))
            if "chatserve-int8" in kinds:
                weights["chatserve-int8"].append((codes.to(torch.int8) - 8, torch.rand(n) * 0.01))
            if "torch-int8pack" in kinds:
                weights["torch-int8pack"].append((codes.to(torch.int8), torch.rand(n).to(torch.bfloat16)))
            if "dense-fp32" in kinds:
                weights["dense-fp32"].append(torch.randn(n, k))
            if "dense-bf16" in kinds:
                weights["dense-bf16"].append(torch.randn(n, k, dtype=torch.bfloat16))
    return weights


def run(kind: str, ws: list, rows: int) -> None:
    xs = {k: torch.randn(rows, k) for _, k in SHAPES}
    xb = {k: v.to(torch.bfloat16) for k, v in xs.items()}
    for (n, k), w in zip(SHAPES * (len(ws) // len(SHAPES)), ws):
        if kind == "chatserve-int4":
            int4_matmul(xs[k], *w)
        elif kind == "chatserve-int4x8":  # Int4Linear's layout where the CPU has no VNNI
            int4x8_linear(xs[k], *w)
        elif kind == "chatserve-int4-dense":  # Int4Linear's path past SMALL_M rows
            int4_dense_matmul(xs[k], *w)
        elif kind == "chatserve-int8":
            int8_matmul(xs[k], *w)
        elif kind == "torch-int4pack":
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], w[0], 32, w[1])
        elif kind == "torch-int8pack":
            torch.ops.aten._weight_int8pack_mm(xb[k], *w)
        elif kind == "dense-fp32":
            F.linear(xs[k], w)
        else:
            F.linear(xb[k], w)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    p.add_argument("--kinds", nargs="+", default=["chatserve-int4", "torch-int4pack", "torch-int8pack", "dense-fp32", "dense-bf16"])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="layers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    global SHAPES
    SHAPES = SHAPE_SETS[args.shapes]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = build(args.layers, args.kinds)
    results = []
    for rows in args.rows:
        line = {"rows": rows}
        for kind in args.kinds:  # interleaved per row count: the kinds see the same machine state
            run(kind, weights[kind], rows)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run(kind, weights[kind], rows)
                times.append(time.perf_counter() - start)
            line[kind] = round(min(times) * 1e3, 2)
        line["loadavg"] = os.getloadavg()[0]
        results.append(line)
        print(json.dumps(line), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "layers": args.layers, "shapes": args.shapes, "results": results}, indent=1))


if __name__ == "__main__":
    main()
