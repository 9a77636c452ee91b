"""Soak a chatserve server (issue #15): N clients for M requests over /ws and /v1 (streamed), with
random cancels, drops, bad frames and oversized prompts; then checks that the KV pool is all free,
resident memory stayed within --max-rss-ratio of its value after the first 500 requests, every
turn that should have been answered was, and the server still serves. The code is
chatserve/bench/soak.py (also `chatserve bench --soak`).

    .venv/bin/python benchmarks/soak.py --model smollm2-135m-instruct --requests 10000 --clients 64 \\
        --out benchmarks/results/soak_smollm2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.bench.soak import add_arguments, main  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
