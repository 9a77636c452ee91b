"""Engine speed on the loading (main) thread vs a worker thread, with and without the main
thread's OpenMP team alive (chatserve/openmp.py). The server's AsyncEngine steps the engine on
a worker thread after freeing the loading thread's team.
Qwen 1.5B, int8, 2 threads, 3 code prompts x 32 tokens, spec off; each round runs
main -> worker (main's team alive) -> worker (main's team freed); prints TPOT per prompt and
the median per phase over all rounds.

    python benchmarks/thread_probe.py [--rounds 3]
"""
import argparse
import json
import statistics
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.openmp import release_thread_team  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
torch.set_num_threads(2)
P = json.loads((ROOT / "chatserve/data/prompts.json").read_text())["code"][:3]
engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", dtype="bfloat16", quantization="int8",
                             kv_cache_memory=1 << 30, max_num_seqs=8))
tok = engine.tokenizer
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
results: dict[str, list[float]] = {}


def direct(tag):
    t = []
    for p in P:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        t.append(engine.generate([ids], params)[0]["stats"].tpot_ms)
    results.setdefault(tag, []).extend(t)
    print(f"{tag:34s}", [round(x, 1) for x in t], flush=True)


def in_worker(tag):
    th = threading.Thread(target=direct, args=(tag,))
    th.start()
    th.join()


for r in range(args.rounds):
    direct("main")
    in_worker("worker, main's team alive")
    assert release_thread_team()
    in_worker("worker, main's team freed")
print("median TPOT ms:", {k: round(statistics.median(v), 1) for k, v in results.items()})
