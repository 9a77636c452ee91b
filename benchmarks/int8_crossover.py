"""Where does torch's packed int8 GEMV (quant/int8.py, used up to SMALL_M rows) stop beating a
bf16 GEMM? Times both per layer shape (Qwen2.5-1.5B MLP and attention, SmolLM2-135M MLP) over
row counts; prints "rows: int8 ms / bf16 ms" and writes JSON.

    python benchmarks/int8_crossover.py --threads 2 --out benchmarks/results/int8_crossover.json
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qwen1.5b mlp up (8960x1536)": (8960, 1536), "qwen1.5b mlp down (1536x8960)": (1536, 8960),
          "qwen1.5b qkv (2048x1536)": (2048, 1536), "smollm2 mlp up (1536x576)": (1536, 576)}
ROWS = (1, 4, 5, 8, 12, 16, 20, 24, 32, 48)


def best_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"threads": args.threads, "shapes": {}}
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
        scales = torch.rand(out_f, dtype=torch.bfloat16)
        row = {}
        for m in ROWS:
            x = torch.randn(m, in_f, dtype=torch.bfloat16)
            row[m] = (best_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scales)), best_ms(lambda: F.linear(x, w)))
        result["shapes"][name] = row
        print(f"{name:30s}", " ".join(f"{m}:{a:.2f}/{b:.2f}" for m, (a, b) in row.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
