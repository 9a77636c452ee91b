"""How long `chatserve serve` takes to answer /health, start after start, by variant of its flags.

Each run is a fresh server process on loopback; the clock runs from launch to the first 200 from
/health, and the start-up line `loaded ... in N s` is kept (N: the engine's build alone). Variants
run interleaved, round after round, so a slow minute of the machine falls on every variant; the
first round also warms the page cache and, for a variant that keeps adaptive k's cost table, may
be the run that measures and saves it (the line says which: "measured, saved to" / "read from").

    .venv/bin/python benchmarks/server_start.py --rounds 3 \\
        --variants cached= uncached=--no-costs-cache --json benchmarks/results/server_start_qwen_session86.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_llamacpp import free_port, wait_ready  # noqa: E402
from chatserve.bench.sweep import stop_process  # noqa: E402

LOADED = re.compile(r"^loaded .* in (?P<seconds>[0-9.]+) s;", re.MULTILINE)


def one_start(flags: list[str], log: Path) -> dict:
    port = free_port()
    cmd = [str(ROOT / ".venv/bin/chatserve"), "serve", "--port", str(port), *flags]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(port, proc, poll=0.1)
            ready = time.perf_counter() - start
        finally:
            stop_process(proc, grace_s=10)
    text = log.read_text()
    loaded = LOADED.search(text)
    line = text[loaded.start():text.index("\n", loaded.start())] if loaded else ""
    costs = re.search(r"adaptive k's costs (.*)\) in [0-9.]+ s;", line)
    return {"ready_s": round(ready, 2), "engine_s": float(loaded["seconds"]) if loaded else None,
            "costs": costs.group(1) if costs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", default="", help="serve flags every variant shares (one string)")
    ap.add_argument("--variants", nargs="+", default=["cached=", "uncached=--no-costs-cache"], metavar="NAME=FLAGS",
                    help="each variant's name and serve flags (one string each; NAME= runs the defaults)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    variants = dict(v.partition("=")[::2] for v in args.variants)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for i, (name, flags) in enumerate(variants.items()):
            run = one_start([*shlex.split(args.flags), *shlex.split(flags)], logs / f"server_start_{i}.log")
            runs[name].append(run)
            print(f"round {r + 1} [{name}]: ready {run['ready_s']:.1f} s, engine {run['engine_s']} s, "
                  f"costs {run['costs']}", flush=True)
    summary = {}
    for name, rs in runs.items():
        ready = [x["ready_s"] for x in rs]
        later = statistics.median(ready[1:]) if len(ready) > 1 else None
        summary[name] = {"median_ready_s": statistics.median(ready), "median_ready_s_after_first": later}
        print(f"{name}: median ready {statistics.median(ready):.1f} s (after round 1: {later})")
    if args.json:
        args.json.write_text(json.dumps({"kind": "server-start", "argv": sys.argv, "flags": args.flags,
                                         "machine": {"cpu_count": os.cpu_count(), "loadavg": os.getloadavg()},
                                         "variants": variants, "runs": runs,
                                         "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
