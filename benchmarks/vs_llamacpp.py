"""chatserve against llama.cpp's server on the same GGUF files, one run, batch 1.

Each configuration is a fresh server process on loopback (so no prefix cache carries over), given
an unrecorded warm-up turn, then the same prompts in the same order over the OpenAI chat API
(streamed): a ~170-token chat prompt and a ~1k-token code prompt, each generating --max-tokens
tokens (ignore_eos). The client records TTFT (request sent -> first content chunk) and TPOT
((last chunk - first chunk) / (tokens - 1)); ratios are ours / theirs for the same draft setting.
`--drafts eagle` serves ours with the machine's EAGLE head (llama.cpp has none for these models:
that row is set against llama.cpp without a draft).

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-server /path/to/llama-server \\
        --configs chatserve:int4 chatserve:int8 chatserve:none llama.cpp \\
        --drafts none qwen2.5-coder-0.5b-instruct --json benchmarks/results/vs_llamacpp_qwen1.5b.json

llama.cpp is not a dependency and never runs in CI: build its `llama-server` yourself (see
docs/benchmarks.md). Its draft settings follow CPU-NOTES: --spec-type draft-simple --spec-draft-n-max 8 --spec-draft-p-min 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chatserve.bench.sweep import stop_process  # noqa: E402
CHAT_PROMPT = (
    "I am planning a small command-line tool in Python that keeps a personal reading list. Each book has a "
    "title, an author, the date I added it, an optional date I finished it, a rating from one to five and a "
    "few free-form tags. I want to add books, mark them finished, list what I have not read yet sorted by "
    "the date I added them, and print a short yearly summary with the number of books finished and the "
    "average rating. The data should live in a single JSON file in my home directory. Please suggest how "
    "to structure the code into modules and functions, which standard-library pieces to use, and what the "
    "main data classes should look like. Keep it practical and short."
)


def code_prompt() -> str:
    prompts = json.loads((ROOT / "chatserve/data/bench_prompts.json").read_text())
    return prompts["long"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_of(model: str) -> Path:
    from chatserve.loading import resolve

    meta = json.loads((resolve(model) / "chatserve.json").read_text())
    return resolve(model) / Path(meta["gguf_file"]).name


def start_server(kind: str, quant: str | None, model: str, draft: str | None, port: int, threads: int,
                 llama_server: str | None) -> subprocess.Popen:
    if kind == "llama.cpp":
        cmd = [llama_server, "-m", str(gguf_of(model)), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-c", "4096", "-np", "1", "--no-webui"]
        if draft:
            # --spec-type: a current llama-server loads a draft model but drafts nothing without it
            cmd += ["-md", str(gguf_of(draft)), "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                    "--spec-draft-p-min", "0.5", "-td", str(threads)]
    else:
        cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--model", model, "--port", str(port),
               "--threads", str(threads), "-q", quant, "--max-model-len", "4096"]
        if draft == "eagle":  # the machine's EAGLE head for the model (chatserve import-head / train-head)
            cmd += ["--draft", "eagle"]
        else:
            cmd += ["--draft-model", draft] if draft else ["--no-spec"]
    log = open(f"/tmp/vs_llamacpp_{kind}_{port}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 900, poll: float = 1.0) -> None:
    """Until /health answers 200, asked every `poll` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see its log in /tmp")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise TimeoutError("server did not become ready")


def stream_turn(port: int, prompt: str, max_tokens: int, model: str, kind: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True}
    if kind == "llama.cpp":  # chatserve refuses fields it does not know
        body["cache_prompt"] = False
    times, text = [], []
    start = time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                times.append(time.perf_counter())
                text.append(delta)
    # chunks are tokens for both servers at batch 1 except where speculation emits several at once:
    # TPOT counts tokens, so it is measured from the chunk times and max_tokens
    ttft = times[0] - start
    tpot = (times[-1] - times[0]) / max(max_tokens - 1, 1)
    return {"ttft_s": ttft, "tpot_ms": tpot * 1e3, "chunks": len(times), "text": "".join(text)}


def run_config(kind: str, quant: str | None, args, draft: str | None) -> dict:
    port = free_port()
    proc = start_server(kind, quant, args.model, draft, port, args.threads, args.llama_server)
    try:
        t0 = time.perf_counter()
        wait_ready(port, proc)
        ready_s = time.perf_counter() - t0
        stream_turn(port, "Say hello.", 8, args.model, kind)  # warm-up, unrecorded
        rows = {name: stream_turn(port, prompt, args.max_tokens, args.model, kind)
                for name, prompt in (("chat", CHAT_PROMPT), ("code_1k", code_prompt()))}
        return {"ready_s": ready_s, "turns": rows}
    finally:
        stop_process(proc, grace_s=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--drafts", nargs="+", default=["none", "qwen2.5-coder-0.5b-instruct"])
    ap.add_argument("--configs", nargs="+", default=["chatserve:int4", "chatserve:int8", "chatserve:none", "llama.cpp"])
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results = []
    for draft_name in args.drafts:
        draft = None if draft_name == "none" else draft_name
        for config in args.configs:
            kind, _, quant = config.partition(":")
            if kind == "llama.cpp" and draft == "eagle":
                continue  # llama.cpp has no EAGLE head for these models: ours is set against its other runs
            print(f"== {config} draft={draft_name}", flush=True)
            res = run_config(kind, quant or None, args, draft)
            res.update(config=config, draft=draft_name, loadavg=os.getloadavg()[0])
            for name, turn in res["turns"].items():
                print(f"   {name}: TTFT {turn['ttft_s']:.2f} s  TPOT {turn['tpot_ms']:.1f} ms  ({turn['chunks']} chunks)",
                      flush=True)
            results.append(res)
    print("\nours / llama.cpp (same draft setting; < 1 is better for us):")
    llama = {r["draft"]: r for r in results if r["config"] == "llama.cpp"}
    for draft_name in args.drafts:
        # the same draft setting; our EAGLE head against llama.cpp without a draft
        theirs = llama.get("none") if draft_name == "eagle" else llama.get(draft_name)
        if theirs is None:
            continue
        for r in results:
            if r["draft"] != draft_name or r["config"] == "llama.cpp":
                continue
            for name, turn in r["turns"].items():
                t = theirs["turns"][name]
                print(f"  draft={draft_name:28s} {r['config']:16s} {name:8s} "
                      f"TTFT {turn['ttft_s'] / t['ttft_s']:.2f}x  TPOT {turn['tpot_ms'] / t['tpot_ms']:.2f}x"
                      f"  (llama.cpp draft={theirs['draft']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        for r in results:
            for turn in r["turns"].values():
                turn["text"] = turn["text"][:200]
        args.json.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "threads": args.threads,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
