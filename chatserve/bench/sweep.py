"""Run a benchmark at several concurrencies, against a running server or against a
`chatserve serve` subprocess started and stopped per server configuration."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import httpx

from chatserve.bench.report import format_summary, run_report
from chatserve.bench.runner import LoadSpec, run_load
from chatserve.bench.workloads import Conversation, plan_sessions


@dataclass(frozen=True)
class SweepPlan:
    """Everything about a benchmark except the server: `concurrencies` lists the closed-loop
    points ([None] with `request_rate` for one open-loop run)."""

    url: str
    endpoint: str
    conversations: list[Conversation]
    num_requests: int
    max_turns: int
    concurrencies: list[int | None]
    settings: dict
    think_time_s: float = 0.0
    request_rate: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    num_warmup: int = 1
    timeout_s: float = 600.0
    api_key: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    progress: bool = True

    def load_spec(self, url: str, concurrency: int | None) -> LoadSpec:
        sessions = plan_sessions(self.conversations, self.num_requests, self.max_turns, self.seed)
        return LoadSpec(url=url, endpoint=self.endpoint, sessions=tuple(sessions), settings=self.settings,
                        concurrency=concurrency, request_rate=self.request_rate,
                        max_concurrency=self.max_concurrency, think_time_s=self.think_time_s,
                        api_key=self.api_key, seed=self.seed, timeout_s=self.timeout_s,
                        num_warmup=self.num_warmup)


class ServerProcess:
    """`chatserve serve --model M --port P *args` in a subprocess, up (healthy) inside the `with`."""

    def __init__(self, model: str, args: list[str], startup_timeout_s: float = 900.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "chatserve.cli", "serve", "--model", model,
                    "--port", str(self.port), *args]
        self.startup_timeout_s = startup_timeout_s
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {' '.join(self.cmd)}\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s:.0f} s\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def log_tail(self, num_chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-num_chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Wait until the server runs nothing (a previous point's aborted requests have drained)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            health = httpx.get(url + "/health", timeout=5).json()
            if health.get("num_running", 0) == 0 and health.get("num_waiting", 0) == 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)


def _points_on(plan: SweepPlan, url: str, config: str, serve_args: list[str] | None) -> list[dict]:
    points = []
    for concurrency in plan.concurrencies:
        wait_idle(url)
        spec = plan.load_spec(url, concurrency)
        desc = f"{config} c={concurrency}" if concurrency else f"{config} rate={plan.request_rate}"
        result = run_load(spec, plan.progress, desc)
        report = run_report(result, spec, plan.slo_ttft_ms, plan.slo_tpot_ms)
        points.append({"config": config, "serve_args": serve_args, "concurrency": concurrency, "report": report})
        if plan.progress:
            print(format_summary(report), file=sys.stderr)
    return points


def run_points(plan: SweepPlan, model: str | None = None, configs: list[tuple[str, list[str]]] | None = None,
               common_args: list[str] = ()) -> list[dict]:
    """Without `model`: every concurrency against `plan.url`. With `model` and `configs`: for each
    configuration start a server, run every concurrency, stop it. Each point is
    {"config", "serve_args", "concurrency", "report", "speedup_vs_off"}."""
    if model is None:
        points = _points_on(plan, plan.url, "server", None)
    else:
        points = []
        for name, args in configs:
            serve_args = [*common_args, *args]
            with ServerProcess(model, serve_args) as server:
                points += _points_on(replace(plan, url=server.url), server.url, name, serve_args)
    add_speedups(points)
    return points


def add_speedups(points: list[dict], reference: str = "off") -> None:
    """speedup_vs_off = mean TPOT of the `reference` config / this config's, at the same concurrency."""
    ref = {p["concurrency"]: p["report"]["summary"]["tpot_ms"]["mean"] for p in points if p["config"] == reference}
    for p in points:
        ours, base = p["report"]["summary"]["tpot_ms"]["mean"], ref.get(p["concurrency"])
        p["speedup_vs_off"] = base / ours if base and ours else None
