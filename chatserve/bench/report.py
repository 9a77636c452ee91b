"""Benchmark results as JSON (one dict per run, sweep or baseline) and as terminal tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from chatserve.bench.metrics import aggregate
from chatserve.bench.runner import LoadResult, LoadSpec


def run_report(result: LoadResult, spec: LoadSpec, slo_ttft_ms: float | None = None,
               slo_tpot_ms: float | None = None) -> dict:
    """The JSON of one load run: what was sent, to what, on what machine, and what came back."""
    summary = aggregate(result.records, result.duration_s, slo_ttft_ms, slo_tpot_ms)
    counters = result.server_counters
    if counters.get("spec_decode_num_draft_tokens"):
        # Covers the OpenAI endpoint, whose responses carry no acceptance stats; only exact when
        # this benchmark was the server's only client during the run.
        summary["speculation"]["server_counters_acceptance_rate"] = (
            counters["spec_decode_num_accepted_tokens"] / counters["spec_decode_num_draft_tokens"])
    return {
        "meta": {
            "url": spec.url,
            "endpoint": spec.endpoint,
            "server": result.server,
            "concurrency": spec.concurrency,
            "request_rate": spec.request_rate,
            "max_concurrency": spec.max_concurrency,
            "think_time_s": spec.think_time_s,
            "num_requests": spec.num_requests,
            "num_sessions": len(spec.sessions),
            "settings": spec.settings,
            "token_counts_per_chunk": "exact (delta.num_tokens)" if spec.endpoint == "ws"
                                      else "estimated (usage.completion_tokens spread evenly over chunks)",
            "started_at": result.started_at,
            "loadavg_before": list(result.loadavg_before),
            "loadavg_after": list(result.loadavg_after),
            **machine(),
        },
        "summary": summary,
        "server_counters": counters,
        "requests": [r.to_dict() for r in result.records],
    }


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, **git_state()}


def git_state() -> dict:
    """The checkout the servers ran from: commit, and whether tracked files had local edits."""
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": bool(status.strip())}


def write_json(obj: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def _f(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def format_summary(report: dict) -> str:
    """A readable block for one run."""
    s, m = report["summary"], report["meta"]
    server = m.get("server") or {}
    load = f"concurrency {m['concurrency']}" if m["concurrency"] else f"rate {m['request_rate']}/s"
    lines = [
        f"chatserve bench: {server.get('model', '?')} (draft: {server.get('draft')}) over {m['endpoint']}, {load}",
        f"  requests      {s['num_completed']} ok / {s['num_failed']} failed in {s['duration_s']:.1f} s"
        + (f"  {s['failure_reasons']}" if s["failure_reasons"] else ""),
        f"  tokens        prompt {s['prompt_tokens']} (cached {s['cached_tokens']}), generated {s['generated_tokens']}",
        f"  throughput    {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s"
        + (f", goodput {s['goodput']:.2f} req/s" if any(v is not None for v in s["slo"].values()) else ""),
        f"  {'ms':<12} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
                       ("queue_ms", "queue")):
        d = s[key]
        if d["count"]:
            lines.append(f"  {label:<12} " + " ".join(f"{_f(d[q]):>8}" for q in ("mean", "p50", "p90", "p99")))
    spec = s["speculation"]
    rate = spec["acceptance_rate"] if spec["acceptance_rate"] is not None else spec.get("server_counters_acceptance_rate")
    lines.append(f"  speculation   acceptance {_f(rate, '{:.0%}')}, mean accepted length "
                 f"{_f(spec['mean_accepted_length'], '{:.2f}')}, tokens per chunk {_f(s['tokens_per_chunk'], '{:.2f}')}")
    lines.append(f"  load average  {m['loadavg_before'][0]:.2f} -> {m['loadavg_after'][0]:.2f}")
    return "\n".join(lines)


def format_sweep_table(points: list[dict]) -> str:
    """One row per (configuration, concurrency) point of a sweep; `points` are sweep entries."""
    head = (f"{'config':<10} {'conc':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'ITL p50':>8} {'tok/s':>7} {'accept':>7} {'vs off':>7} {'fail':>4}")
    lines = [head, "-" * len(head)]
    for p in points:
        s = p["report"]["summary"]
        rate = s["speculation"]["acceptance_rate"]
        lines.append(f"{p['config']:<10} {p['concurrency']:>4} {_f(s['ttft_ms']['p50']):>9} {_f(s['ttft_ms']['p99']):>9} "
                     f"{_f(s['tpot_ms']['p50']):>9} {_f(s['tpot_ms']['p99']):>9} {_f(s['itl_ms']['p50']):>8} "
                     f"{s['output_throughput']:>7.1f} {_f(rate, '{:.0%}'):>7} {_f(p.get('speedup_vs_off'), '{:.2f}x'):>7} "
                     f"{s['num_failed']:>4}")
    return "\n".join(lines)


def format_markdown(result: dict) -> str:
    """The sweep table (and the transformers ratios, if any) as Markdown, for docs/benchmarks.md."""
    lines = ["| config | concurrency | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 (ms) | tok/s "
             "| acceptance | tokens/chunk | vs off (mean TPOT) | failed | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        s, m = p["report"]["summary"], p["report"]["meta"]
        lines.append(f"| {p['config']} | {p['concurrency'] or m['request_rate']} "
                     f"| {_f(s['ttft_ms']['p50'], '{:.0f}')} / {_f(s['ttft_ms']['p99'], '{:.0f}')} "
                     f"| {_f(s['tpot_ms']['p50'])} / {_f(s['tpot_ms']['p99'])} | {_f(s['itl_ms']['p50'])} "
                     f"| {s['output_throughput']:.1f} | {_f(s['speculation']['acceptance_rate'], '{:.0%}')} "
                     f"| {_f(s['tokens_per_chunk'], '{:.2f}')} | {_f(p.get('speedup_vs_off'), '{:.2f}x')} "
                     f"| {s['num_failed']} | {m['loadavg_before'][0]:.1f} |")
    if result.get("ratios"):
        lines += ["", "| config (concurrency 1) | vs | TTFT p50 ours / theirs (ms) | TPOT p50 ours / theirs (ms) "
                  "| TPOT ratio | speedup |", "|---|---|---|---|---|---|"]
        for r in result["ratios"]:
            lines.append(f"| {r['config']} | {r['vs']} | {_f(r['ours_ttft_ms'], '{:.0f}')} / "
                         f"{_f(r['baseline_ttft_ms'], '{:.0f}')} | {_f(r['ours_tpot_ms'])} / {_f(r['baseline_tpot_ms'])} "
                         f"| {_f(r['tpot_ratio'], '{:.2f}')} | {_f(1 / r['tpot_ratio'] if r['tpot_ratio'] else None, '{:.2f}x')} |")
    return "\n".join(lines)
