"""A real `chatserve serve` subprocess on the tiny models, and what tests read from it (/health,
/metrics). Shared by test_real_server.py, test_backpressure.py and test_shutdown.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from chatserve.bench.sweep import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealServer:
    """`python -m chatserve.cli serve --model <dir> <args>` on a free port, up once /health answers.

    Its output goes to a file, not a pipe: uvicorn logs a line per request, and a pipe nobody
    reads fills after ~64 KB and then blocks the server's event loop on its next log line."""

    def __init__(self, model_dir, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--kv-cache-memory", "8M", "--threads", "1", "--served-model-name", "tiny", *args]
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for _ in range(600):
            if self.proc.poll() is not None:
                pytest.fail("server exited:\n" + self.output())
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        pytest.fail("server did not come up")

    @property
    def ws_url(self) -> str:
        return self.base.replace("http", "ws") + "/ws"

    def health(self) -> dict:
        return httpx.get(self.base + "/health").json()

    def metric(self, name: str) -> float:
        """One sample of /metrics, e.g. 'chatserve:request_success_total{finished_reason="abort",model_name="tiny"}'
        (0 if absent)."""
        text = httpx.get(self.base + "/metrics").text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024

    def stop(self) -> None:
        stop_process(self.proc, grace_s=60)


def wait_pool_free(base: str, timeout: float = 10.0) -> dict:
    health = {}
    for _ in range(int(timeout / 0.05)):
        health = httpx.get(base + "/health").json()
        if health["num_free_blocks"] == health["num_blocks"] and health["num_running"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"pool not back to free: {health}")


def wait_health(base: str, condition, timeout: float = 60.0) -> dict:
    """Poll /health until condition(health) holds."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(base + "/health").json()
        if condition(health):
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"/health never met the condition: {health}")
        time.sleep(0.02)


@contextlib.contextmanager
def ws_connect(base: str, **kwargs):
    from websockets.sync.client import connect

    with connect(base.replace("http", "ws") + "/ws", **kwargs) as ws:
        assert json.loads(ws.recv())["type"] == "ready"
        yield ws
