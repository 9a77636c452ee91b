"""Resident memory and the pool over long conversations, in-process: six conversations of ~1.5k
tokens of pasted source then two follow-ups (SmolLM2, n-gram drafts); prints pool stats and RSS
after each and fails if a block leaked.  .venv/bin/python benchmarks/long_conversation_memory.py"""
import sys, glob, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from chatserve.engine import Engine, process_memory
from chatserve.config import EngineConfig, SpecConfig
from chatserve.sampling_params import SamplingParams
e = Engine(EngineConfig.from_dict({"model": "smollm2-135m-instruct", "num_threads": 2, "quantization": "int4", "spec": {"method": "ngram"}}))
tok = e.tokenizer
files = sorted(glob.glob(str(__import__("pathlib").Path(__file__).resolve().parent.parent / "chatserve" / "*.py")))
p = SamplingParams(max_tokens=48, temperature=0.0)
rss = []
for r in range(6):
    code = open(files[r]).read()[:5000]
    msgs = [{"role": "user", "content": "Here is my code:\n```python\n" + code + "\n```\nWhat does it do?"}]
    for turn in range(3):
        ids = tok.apply_chat_template(msgs)
        out = e.generate([ids], p)[0]
        msgs += [{"role": "assistant", "content": tok.decode(out["token_ids"])}, {"role": "user", "content": "And the next part?"}]
    e.check_no_leaks()
    rss.append(process_memory()["rss_bytes"] >> 20)
    print(f"conversation {r}: prompt {len(ids)} tokens, pool {e.pool_stats()}, rss {rss[-1]} MiB", flush=True)
