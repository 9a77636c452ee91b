"""Resident memory and the KV pool over long conversations, in-process: conversations of ~1.5k
tokens of pasted source, then two follow-ups each (n-gram drafts). After each conversation it
checks that every block is free again (Engine.check_no_leaks raises otherwise) and prints the
pool and resident memory; --out writes them as JSON.

    .venv/bin/python benchmarks/long_conversation_memory.py --model smollm2-135m-instruct \
        --out benchmarks/results/long_conversation_memory_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine, process_memory  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engine = Engine(EngineConfig.from_dict({"model": args.model, "num_threads": 2, "quantization": "int4",
                                            "spec": {"method": "ngram"}}))
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=48, temperature=0.0)
    files = sorted((ROOT / "chatserve").glob("*.py"))
    rows = []
    for c in range(args.conversations):
        code = files[c % len(files)].read_text()[:5000]
        messages = [{"role": "user", "content": f"Here is my code:\n```python\n{code}\n```\nWhat does it do?"}]
        for _ in range(3):
            ids = tok.apply_chat_template(messages)
            out = engine.generate([ids], params)[0]
            messages += [{"role": "assistant", "content": tok.decode(out["token_ids"])},
                         {"role": "user", "content": "And the next part?"}]
        engine.check_no_leaks()
        pool = engine.pool_stats()
        rows.append({"conversation": c, "last_prompt_tokens": len(ids), "num_free_blocks": pool["num_free_blocks"],
                     "num_blocks": pool["num_blocks"], "num_cached_blocks": pool["num_cached_blocks"],
                     "rss_mib": process_memory()["rss_bytes"] >> 20})
        print(rows[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
