"""`chatserve bench` arguments and entry point: build the workload, run it against a server (or a
sweep of servers it starts), add the transformers baseline, print tables, write JSON and plots."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path

BASELINES = ("transformers",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="running server (ignored with --sweep)")
    p.add_argument("--endpoint", choices=["ws", "openai"], default="ws",
                   help="websocket /ws or OpenAI /v1/chat/completions with SSE")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", default="chat,code,edit",
                   help="built-in prompt sets, comma-separated: chat, code, edit, long, multiturn, "
                        "chat_wide, code_wide (40 / 24 more single turns)")
    w.add_argument("--dataset", default=None, help="JSONL of conversations ({'messages': [...]} or {'prompt': ...})")
    w.add_argument("--num-requests", type=int, default=16, help="requests (chat turns) per run")
    w.add_argument("--turns", type=int, default=1, help="max turns per session (multi-turn conversations)")
    w.add_argument("--think-time", type=float, default=0.0, help="mean seconds between turns (exponential)")
    w.add_argument("--concurrency", default="1", help="sessions at a time; a list '1,2,4,8' sweeps it")
    w.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson session arrivals per second")
    w.add_argument("--max-concurrency", type=int, default=None, help="cap on sessions in flight (open loop)")
    w.add_argument("--max-tokens", type=int, default=64)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--param", action="append", default=[], metavar="KEY=JSON",
                   help="extra per-turn setting, e.g. speculation=false or num_draft_tokens=4 (repeatable)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests per run")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    w.add_argument("--api-key", default=None)
    o = p.add_argument_group("output")
    o.add_argument("--slo-ttft-ms", type=float, default=None)
    o.add_argument("--slo-tpot-ms", type=float, default=None)
    o.add_argument("--out", default=None, help="write the results as JSON here")
    o.add_argument("--plots", default=None, help="directory for PNG plots (default: next to --out)")
    o.add_argument("--markdown", default=None, help="write the tables as Markdown here (for docs)")
    o.add_argument("--no-progress", action="store_true")
    k = p.add_argument_group("soak (chatserve/bench/soak.py): --num-requests requests from --concurrency clients")
    k.add_argument("--soak", action="store_true",
                   help="misbehaving clients (cancels, drops, bad frames), then end checks: pool free, resident "
                        "memory bounded, all answered, still serving; starts a server for --model, else --url")
    k.add_argument("--cancel-rate", type=float, default=0.15)
    k.add_argument("--drop-rate", type=float, default=0.07)
    k.add_argument("--bad-rate", type=float, default=0.15)
    k.add_argument("--openai-rate", type=float, default=0.3, help="share of soak conversations over /v1")
    k.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, to read its resident memory")
    k.add_argument("--rss-baseline-requests", type=int, default=500, help="resident memory baseline after this many")
    k.add_argument("--max-rss-ratio", type=float, default=1.2)
    s = p.add_argument_group("sweep: start a server per configuration")
    s.add_argument("--sweep", action="store_true", help="start/stop `chatserve serve` per --config")
    s.add_argument("--model", default=None, help="served model (sweep) / baseline model (default: the server's)")
    s.add_argument("--draft-model", default=None, help="draft model: adds the 'draft' config and assisted baseline")
    s.add_argument("--config", action="append", default=[], metavar="NAME=SERVE_ARGS",
                   help="e.g. 'off=--no-spec' 'ngram=--draft ngram' 'int8kv=--no-spec --kv-cache-dtype int8'; "
                        "default: off, ngram, suffix, and draft when --draft-model is given")
    s.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole sweep, configurations interleaved; points pool their rounds")
    s.add_argument("--server-args", default="", help="arguments added to every `chatserve serve`")
    s.add_argument("--reuse-replies", action="store_true",
                   help="let suffix decoding draft replies it saw earlier in the sweep (off: every server runs "
                        "with --suffix-corpus-tokens 0, since the workload repeats its prompts at every point and "
                        "greedy replies repeat with them)")
    s.add_argument("--dtype", default="float32", help="model dtype for sweep servers and the baseline")
    s.add_argument("--threads", type=int, default=None, help="torch threads for sweep servers and the baseline")
    b = p.add_argument_group("baseline")
    b.add_argument("--baseline", choices=BASELINES, default=None,
                   help="also run the prompts through transformers generate in-process (batch 1)")
    b.add_argument("--baseline-requests", type=int, default=None, help="prompts for the baseline (default: 4)")


def settings_from_args(args) -> dict:
    settings = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param {item!r}: expected KEY=JSON")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def conversations_from_args(args):
    from chatserve.bench.workloads import builtin_conversations, load_dataset

    if args.dataset:
        return load_dataset(args.dataset)
    return builtin_conversations(tuple(x.strip() for x in args.prompts.split(",") if x.strip()))


def configs_from_args(args) -> list[tuple[str, list[str]]]:
    """(name, extra `serve` args) per server configuration of a sweep."""
    if args.config:
        out = []
        for item in args.config:
            name, sep, rest = item.partition("=")
            if not sep or not name:
                raise ValueError(f"--config {item!r}: expected NAME=SERVE_ARGS")
            out.append((name, shlex.split(rest)))
        return out
    out = [("off", ["--no-spec"]), ("ngram", ["--draft", "ngram"]), ("suffix", ["--draft", "suffix"])]
    if args.draft_model:
        out.append(("draft", ["--draft-model", args.draft_model]))
    return out


def cmd_bench(args) -> int:
    if args.soak:
        from chatserve.bench.soak import main as soak_main

        return soak_main(argparse.Namespace(
            url=None if args.model else args.url, pid=args.pid, model=args.model, server_args=args.server_args,
            clients=int(args.concurrency), requests=args.num_requests, cancel_rate=args.cancel_rate,
            drop_rate=args.drop_rate, bad_rate=args.bad_rate, openai_rate=args.openai_rate, max_turns=args.turns,
            max_tokens=args.max_tokens, baseline_requests=args.rss_baseline_requests, max_rss_ratio=args.max_rss_ratio,
            timeout=args.timeout, seed=args.seed, out=args.out))
    from chatserve.bench.report import format_summary, format_sweep_table, machine
    from chatserve.bench.sweep import SweepPlan, run_points

    concurrencies = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    plan = SweepPlan(
        url=args.url, endpoint=args.endpoint, conversations=conversations_from_args(args),
        num_requests=args.num_requests, max_turns=args.turns, think_time_s=args.think_time,
        concurrencies=[None] if args.request_rate else concurrencies, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, settings=settings_from_args(args), seed=args.seed,
        num_warmup=args.warmup, timeout_s=args.timeout, api_key=args.api_key,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, progress=not args.no_progress)
    if args.sweep:
        if not args.model:
            raise ValueError("--sweep needs --model")
        # a `kill` of the benchmark unwinds the `with ServerProcess` blocks, stopping the server
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        threads = ["--threads", str(args.threads)] if args.threads else []
        # Before --server-args, which may set it again (argparse keeps the last).
        corpus = [] if args.reuse_replies else ["--suffix-corpus-tokens", "0"]
        serve_args = ["--dtype", args.dtype, *threads, *corpus, *shlex.split(args.server_args)]
        points = run_points(plan, args.model, configs_from_args(args), serve_args, args.rounds)
    else:
        points = run_points(plan, rounds=args.rounds)
    result = {"kind": "chatserve-bench", "argv": sys.argv[1:], "args": _jsonable(args), "machine": machine(),
              "points": points, "baseline": None, "ratios": None, "plots": []}
    for p in points if len(points) == 1 else []:
        print(format_summary(p["report"]), file=sys.stderr)
    if len(points) > 1:
        print(format_sweep_table(points), file=sys.stderr)
    if args.baseline:
        from chatserve.bench.baseline import add_baseline

        add_baseline(result, plan, args)
    _write_outputs(result, args)
    failed = sum(p["report"]["summary"]["num_failed"] for p in points)
    return 1 if failed and failed == sum(p["report"]["summary"]["num_requests"] for p in points) else 0


def _jsonable(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _write_outputs(result: dict, args) -> None:
    """JSON (--out), plots (--plots, or next to --out for a sweep), Markdown tables (--markdown)."""
    from chatserve.bench.plots import plot_outputs
    from chatserve.bench.report import format_markdown, write_json

    points = result["points"]
    plots_dir = args.plots or (str(Path(args.out).with_suffix("")) + "_plots" if args.out and len(points) > 1 else None)
    if plots_dir:
        result["plots"] = plot_outputs(points, plots_dir)
        print(f"plots: {', '.join(result['plots'])}", file=sys.stderr)
    if args.out:
        write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(result) + "\n")
