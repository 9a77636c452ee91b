"""Engine speed in the main thread vs a worker thread (the server runs the engine in a worker
thread). Qwen 1.5B, int8, 2 threads, 3 code prompts x 32 tokens, spec off; prints TPOT per prompt.

    python benchmarks/thread_probe.py            # and with OMP_WAIT_POLICY=PASSIVE
"""
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
torch.set_num_threads(2)
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
P = json.loads((ROOT / "chatserve/data/prompts.json").read_text())["code"][:3]
engine = Engine(EngineConfig(model="qwen2.5-coder-1.5b-instruct", dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 30, max_num_seqs=8))
tok = engine.tokenizer
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
def direct(tag):
    t = []
    for p in P:
        ids = tok.apply_chat_template([{"role": "user", "content": p}])
        t.append(engine.generate([ids], params)[0]["stats"].tpot_ms)
    print(tag, [round(x, 1) for x in t], flush=True)
direct("main")
th = threading.Thread(target=direct, args=("worker thread",)); th.start(); th.join()
def with_threads(tag):
    torch.set_num_threads(2)
    direct(tag)
th = threading.Thread(target=with_threads, args=("worker, set_num_threads(2) inside",)); th.start(); th.join()
direct("main again")
