"""One prompt's prefill through ModelRunner in chunks (as the scheduler feeds it), seconds for the
whole prompt, and torch.profiler's top operators for its last chunk (where attention over the
longest context costs most).

    .venv/bin/python benchmarks/prefill_chunks.py --model smollm2-135m-instruct --tokens 2048 --chunk 512 \
        --json benchmarks/results/prefill_chunks_smollm2.json

`--amx-int8 both` alternates the Q4_K matmul's AMX-INT8 path and the VNNI tiles round by round,
reports each, the ratio, and whether the last chunk's logits are equal bit for bit (they must be):

    .venv/bin/python benchmarks/prefill_chunks.py --model qwen2.5-coder-1.5b-instruct --tokens 2048 \
        --chunk 256 --amx-int8 both --json benchmarks/results/prefill_amx_int8_qwen.json
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

from chatserve.batch import BatchItem  # noqa: E402
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="as EngineConfig.kv_cache_dtype (bf16: the AMX attention)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--amx-int8", choices=["on", "off", "both"], default="on",
                   help="the Q4_K matmul's AMX-INT8 path for chunks of 64+ rows; both: alternate, check the "
                        "logits are equal bit for bit, report each and the ratio")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    engine = Engine(EngineConfig(model=args.model, quantization=None if args.quantization == "none" else args.quantization,
                                 dtype=args.dtype, num_threads=args.threads, kv_cache_memory=512 << 20,
                                 kv_cache_dtype=args.kv_cache_dtype))
    runner = engine.models.target_runner
    blocks = list(range(args.tokens // runner.block_size + 4))
    tokens = list(range(100, 100 + args.tokens))

    from kernels import cpu_ext

    ext = cpu_ext.extension()

    def prefill() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        for s in range(0, args.tokens, args.chunk):
            out = runner.run([BatchItem(tokens[s : s + args.chunk], s, blocks, 1)])
        return time.perf_counter() - start, out

    modes = {"on": [True], "off": [False], "both": [True, False]}[args.amx_int8]
    seconds: dict[bool, list[float]] = {m: [] for m in modes}
    last: dict[bool, torch.Tensor] = {}
    prefill()  # warm-up
    for _ in range(args.repeats):
        for mode in modes:
            if ext is not None:
                ext.set_amx_int8(mode)
            t, last[mode] = prefill()
            seconds[mode].append(t)
    if ext is not None:
        ext.set_amx_int8(True)
    best = {m: min(v) for m, v in seconds.items()}
    result = {"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "best_s": best[modes[0]],
              "tokens_per_s": args.tokens / best[modes[0]], "amx_int8_available": bool(ext and ext.amx_int8_enabled()),
              "kv_cache_dtype": args.kv_cache_dtype, "amx_attention": bool(ext and ext.amx_enabled()),
              "load": os.getloadavg()[0]}
    if len(modes) == 2:
        result.update(off_best_s=best[False], off_tokens_per_s=args.tokens / best[False],
                      speedup=best[False] / best[True], seconds=seconds,
                      logits_equal=bool(torch.equal(last[True][0], last[False][0])))
    print(json.dumps(result))
    if args.profile:
        last = args.tokens - args.chunk
        with torch.profiler.profile() as prof:
            runner.run([BatchItem(tokens[last:], last, blocks, 1)])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
