"""A real model converted at load against the same conversion kept and read back (chatserve/converted.py):
the seconds of load_models each way, resident memory after it, and whether they are the same model
(every parameter and buffer equal, greedy replies to prompts.json's code and chat prompts equal).
Each variant in its own process, in turn, `--rounds` times (a fresh process reads the files as a
server start does; the page cache is not dropped, so both read from memory when it holds the files).

    .venv/bin/python benchmarks/converted_weights.py --model qwen2.5-coder-1.5b-instruct --rounds 1 \\
        --json benchmarks/results/converted_weights_qwen_zen5_session87.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(model: str, cache: str | None, max_tokens: int) -> dict:
    """One load in this process: seconds, RSS, a digest of every tensor, greedy replies."""
    import torch

    from chatserve.config import EngineConfig
    from chatserve.engine import Engine
    from chatserve.sampling_params import SamplingParams

    prompts = json.loads((ROOT / "chatserve/data/prompts.json").read_text())
    start = time.perf_counter()
    engine = Engine(EngineConfig(model=model, quantization="int4", kv_cache_memory=256 << 20,
                                 converted_cache_dir=cache))
    seconds = time.perf_counter() - start
    target = engine.models.target
    h = hashlib.blake2b(digest_size=16)
    named = {**dict(target.named_parameters(remove_duplicate=False)), **dict(target.named_buffers(remove_duplicate=False))}
    for name in sorted(named):
        t = named[name].detach().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    rss = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS:"))) * 1024
    mapped = mapped_file_bytes(".pt")
    asks = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
            for p in prompts["code"][:2] + prompts["chat"][:2]]
    outs = engine.generate(asks, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {"load_seconds": seconds, "source": engine.models.converted_source, "rss_bytes": rss,
            "kept_file_resident_bytes": mapped,
            "tensors": h.hexdigest(), "replies": [o["token_ids"] for o in outs]}


def mapped_file_bytes(suffix: str) -> int:
    """Resident bytes of this process's mappings of files ending in `suffix` (/proc/self/smaps): what
    of a kept conversion's mapping is still in use after the load (the huge pages move copies the
    large tensors out of it)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
            inside = len(head) >= 6 and head[5].endswith(suffix)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, cache = args.child
        print(json.dumps(child(model, None if cache == "-" else cache, args.max_tokens)))
        return
    runs: dict[str, list[dict]] = {"converted": [], "read back": []}
    with tempfile.TemporaryDirectory(dir=ROOT.parent / "scratch" if (ROOT.parent / "scratch").is_dir() else None) as tmp:
        def run(cache: str) -> dict:
            out = subprocess.run([sys.executable, __file__, "--max-tokens", str(args.max_tokens), "--child",
                                  args.model, cache], capture_output=True, text=True, check=True)
            return json.loads(out.stdout.strip().splitlines()[-1])

        first = run(tmp)  # converts and keeps the file: not timed against the others
        print(f"first start: {first['load_seconds']:.1f} s ({first['source']})", flush=True)
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                result = run("-" if name == "converted" else tmp)
                runs[name].append(result)
                print(f"round {r + 1} {name}: load {result['load_seconds']:.1f} s, RSS "
                      f"{result['rss_bytes'] / 2**30:.2f} GiB, of it the kept file's mapping "
                      f"{result['kept_file_resident_bytes'] / 2**20:.0f} MiB ({result['source']})", flush=True)
    every = [first] + [x for v in runs.values() for x in v]
    same_tensors = len({x["tensors"] for x in every}) == 1
    # greedy replies of a batch of four: across processes a near tie can go either way with the same weights
    # (seen on a tiny random model: converted twice, two replies), so each variant's distinct sets are counted
    distinct = {name: len({json.dumps(x["replies"]) for x in v}) for name, v in runs.items()}
    same_replies = len({json.dumps(x["replies"]) for x in every}) == 1
    summary = {name: {"load_seconds_median": statistics.median(x["load_seconds"] for x in v),
                      "rss_gib_median": statistics.median(x["rss_bytes"] for x in v) / 2**30} for name, v in runs.items()}
    print(f"same tensors: {same_tensors}; same greedy replies: {same_replies} (distinct sets by variant: {distinct})")
    for name, s in summary.items():
        print(f"{name}: load {s['load_seconds_median']:.1f} s (median), RSS {s['rss_gib_median']:.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rounds": args.rounds, "first": first, "runs": runs,
                                         "summary": summary, "same_tensors": same_tensors,
                                         "same_replies": same_replies, "distinct_replies": distinct}, indent=1))


if __name__ == "__main__":
    main()
