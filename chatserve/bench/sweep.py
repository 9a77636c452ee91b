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
from chatserve.bench.runner import LoadResult, LoadSpec, run_load
from chatserve.bench.workloads import Conversation, plan_sessions


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, up to grace_s seconds to exit (a server drains its turns), then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
        if self.proc:
            stop_process(self.proc, grace_s=30)
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


def _run_on(plan: SweepPlan, url: str, config: str, results: dict) -> None:
    """Every concurrency against one server; appends (spec, LoadResult) to results[(config, c)]."""
    for concurrency in plan.concurrencies:
        wait_idle(url)
        spec = plan.load_spec(url, concurrency)
        desc = f"{config} c={concurrency}" if concurrency else f"{config} rate={plan.request_rate}"
        result = run_load(spec, plan.progress, desc)
        results.setdefault((config, concurrency), []).append((spec, result))
        if plan.progress:
            print(format_summary(run_report(result, spec, plan.slo_ttft_ms, plan.slo_tpot_ms)), file=sys.stderr)


def merge_results(results: list[LoadResult]) -> LoadResult:
    """Rounds of one point as one run: records pooled, durations and counters added."""
    first, last = results[0], results[-1]
    counters: dict[str, float] = {}
    for r in results:
        for k, v in r.server_counters.items():
            counters[k] = counters.get(k, 0.0) + v
    return LoadResult([rec for r in results for rec in r.records], sum(r.duration_s for r in results),
                      first.started_at, first.loadavg_before, last.loadavg_after, first.server, counters)


def run_points(plan: SweepPlan, model: str | None = None, configs: list[tuple[str, list[str]]] | None = None,
               common_args: list[str] = (), rounds: int = 1) -> list[dict]:
    """Without `model`: every concurrency against `plan.url`. With `model` and `configs`: for each
    configuration start a server, run every concurrency, stop it. With rounds > 1 all of that is
    repeated (configurations interleaved in time, so a burst of load from elsewhere hits all of
    them; round i uses seed + i) and each point pools its rounds' requests. Each point is
    {"config", "serve_args", "concurrency", "rounds", "report", "speedup_vs_off"}."""
    results: dict[tuple[str, int | None], list] = {}
    serve_args = {"server": None}
    for i in range(rounds):
        round_plan = replace(plan, seed=plan.seed + i)
        if model is None:
            _run_on(round_plan, plan.url, "server", results)
            continue
        for name, args in configs:
            serve_args[name] = [*common_args, *args]
            with ServerProcess(model, serve_args[name]) as server:
                _run_on(replace(round_plan, url=server.url), server.url, name, results)
    points = []
    for (config, concurrency), runs in results.items():
        spec = runs[-1][0]
        report = run_report(merge_results([r for _, r in runs]), spec, plan.slo_ttft_ms, plan.slo_tpot_ms)
        report["meta"]["num_requests"] = sum(s.num_requests for s, _ in runs)
        points.append({"config": config, "serve_args": serve_args[config], "concurrency": concurrency,
                       "rounds": len(runs), "report": report})
    add_speedups(points)
    return points


def add_speedups(points: list[dict], reference: str = "off") -> None:
    """speedup_vs_off = mean TPOT of the `reference` config / this config's, at the same concurrency."""
    ref = {p["concurrency"]: p["report"]["summary"]["tpot_ms"]["mean"] for p in points if p["config"] == reference}
    for p in points:
        ours, base = p["report"]["summary"]["tpot_ms"]["mean"], ref.get(p["concurrency"])
        p["speedup_vs_off"] = base / ours if base and ours else None
