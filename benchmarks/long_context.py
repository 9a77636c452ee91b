"""Long conversations over /ws (issue #13): a pasted file of 1-2.8k tokens then three follow-up
questions ("paste"), and an "edit this file" session whose every reply returns the file
("edit"), at several concurrencies, for several server configurations in one run (one
`chatserve serve` per configuration, started and stopped here).

Per turn: TTFT, TPOT, the longest gap between deltas against the turn's median gap, cached
prompt tokens and acceptance; per configuration the issue's goals (second-turn TTFT <= 10% of
the first, longest gap <= 3x the median, first-turn TTFT <= 1.1x speculation off, speedup over
off), and the server's resident memory and free KV blocks after every point (idle, so every
block but the prefix cache's is free). Every run's sessions start with their own first line,
so no run finds another's blocks in the prefix cache. Suffix decoding matches only each
conversation's own tokens (`--suffix-corpus-tokens 0`; `--reuse-replies` lifts it): the files
repeat across points, and a reply seen in an earlier point would be drafted again. Writes JSON
and a PNG.

    python benchmarks/long_context.py --model smollm2-135m-instruct --configs off ngram suffix \
        --concurrency 1 4 --max-tokens 64 --out benchmarks/results/long_context_smollm2.json

With `--interleave SERVE_ARGS`, one server (started with SERVE_ARGS) serves every configuration,
each a method chosen per request (`off`: num_draft_tokens 0; else spec_method NAME), in
`--rounds` rounds whose order rotates: a machine that slows down through the run slows every
method alike, so the speed-ups compare within one run (separate servers run minutes apart).

    python benchmarks/long_context.py --model smollm2-135m-instruct --interleave "--draft suffix" \
        --configs off ngram suffix --rounds 3 --concurrency 1 --sessions 2 --max-tokens 64 --out ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatserve.bench.metrics import RequestRecord, tpot_ms, ttft_ms  # noqa: E402
from chatserve.bench.report import machine, write_json  # noqa: E402
from chatserve.bench.runner import LoadSpec, run_load  # noqa: E402
from chatserve.bench.soak import read_rss  # noqa: E402
from chatserve.bench.sweep import ServerProcess, wait_idle  # noqa: E402
from chatserve.bench.workloads import Conversation, Session  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "long_context.json"
WORKLOADS = ("paste", "edit")
CONFIGS = {"off": "--no-spec", "ngram": "--draft ngram", "suffix": "--draft suffix", "draft": "--draft draft",
           "eagle": "--draft eagle"}


def sessions(workload: str, num_sessions: int, run_tag: str, names: list[str] | None = None) -> tuple[Session, ...]:
    """One session per file (cycled; `names`: only those files, in that order), its first message
    opening with a line unique to this run."""
    data = json.loads(DATA.read_text())
    files = [(name, data["files"][name]) for name in names] if names else list(data["files"].items())
    out = []
    for i in range(num_sessions):
        name, code = files[i % len(files)]
        turns = [t.format(name=name, code=code) for t in data[f"{workload}_turns"]]
        turns[0] = f"({run_tag}, session {i})\n" + turns[0]
        out.append(Session(i, Conversation(tuple(turns), category=workload), len(turns)))
    return tuple(out)


def gaps_ms(r: RequestRecord) -> list[float]:
    """Time between consecutive deltas that carried tokens."""
    return [(b - a) * 1e3 for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def turn_row(r: RequestRecord) -> dict:
    gaps = gaps_ms(r)
    stats = r.server_stats or {}
    return {"session": r.session_idx, "turn": r.turn_idx, "error": r.error, "ttft_ms": ttft_ms(r),
            "tpot_ms": tpot_ms(r), "longest_gap_ms": max(gaps, default=None),
            "median_gap_ms": statistics.median(gaps) if gaps else None,
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "generated_tokens": r.num_generated, "drafted": stats.get("drafted"),
            "accepted": stats.get("accepted"), "spec_method": stats.get("spec_method")}


def _median(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def per_turn(rows: list[dict]) -> list[dict]:
    """Medians over sessions, turn by turn; acceptance pooled."""
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == turn and not r["error"]]
        drafted = sum(r["drafted"] or 0 for r in rs)
        ratios = [r["longest_gap_ms"] / r["median_gap_ms"] for r in rs if r["median_gap_ms"]]
        out.append({"turn": turn, "n": len(rs), **{k: _median(rs, k) for k in (
            "ttft_ms", "tpot_ms", "longest_gap_ms", "median_gap_ms", "prompt_tokens", "cached_tokens")},
            "gap_ratio_max": max(ratios, default=None),
            "acceptance": sum(r["accepted"] or 0 for r in rs) / drafted if drafted else None})
    return out


def goals(points: list[dict]) -> list[dict]:
    """The issue's goals per point, against `off` at the same workload and concurrency."""
    off = {(p["workload"], p["concurrency"]): p for p in points if p["config"] == "off"}
    out = []
    for p in points:
        turns, ref = p["turns"], off.get((p["workload"], p["concurrency"]))
        tpot = statistics.fmean([t["tpot_ms"] for t in turns if t["tpot_ms"]] or [float("nan")])
        ref_tpot = statistics.fmean([t["tpot_ms"] for t in ref["turns"] if t["tpot_ms"]] or [float("nan")]) if ref else None
        out.append({
            "config": p["config"], "workload": p["workload"], "concurrency": p["concurrency"],
            "turn2_over_turn1_ttft": turns[1]["ttft_ms"] / turns[0]["ttft_ms"] if len(turns) > 1 else None,
            "worst_gap_ratio": max((t["gap_ratio_max"] or 0) for t in turns),
            "turn1_ttft_over_off": turns[0]["ttft_ms"] / ref["turns"][0]["ttft_ms"] if ref else None,
            "speedup_vs_off": ref_tpot / tpot if ref_tpot else None,
            "mean_tpot_ms": tpot,
        })
    return out


def format_table(rows: list[dict]) -> str:
    head = f"{'config':<10}{'workload':<8}{'conc':>5}{'T2/T1 TTFT':>12}{'gap/median':>12}{'TTFT/off':>10}{'TPOT ms':>9}{'speedup':>9}"
    lines = [head]
    fmt = lambda x, spec: format(x, spec) if x is not None else "-"  # noqa: E731
    for g in rows:
        lines.append(f"{g['config']:<10}{g['workload']:<8}{g['concurrency']:>5}{fmt(g['turn2_over_turn1_ttft'], '12.3f')}"
                     f"{fmt(g['worst_gap_ratio'], '12.2f')}{fmt(g['turn1_ttft_over_off'], '10.2f')}"
                     f"{fmt(g['mean_tpot_ms'], '9.1f')}{fmt(g['speedup_vs_off'], '9.2f')}")
    return "\n".join(lines)


def plot(points: list[dict], path: Path, memories: list[dict] = ()) -> None:
    """Per workload: TTFT, TPOT and longest gap / median gap by turn (solid: lowest concurrency,
    dashed: highest), and the TPOT speedup over off by concurrency; below, each server's resident
    memory after every point."""
    from chatserve.bench.plots import _colors, _pyplot

    plt = _pyplot()
    workloads = sorted({p["workload"] for p in points}, key=WORKLOADS.index)
    configs = list(dict.fromkeys(p["config"] for p in points))
    concs = sorted({p["concurrency"] for p in points})
    num_rows = len(workloads) + bool(memories)
    fig, axes = plt.subplots(num_rows, 4, figsize=(17, 4 * num_rows), squeeze=False)
    if memories:
        grid = axes[-1, 0].get_gridspec()
        for ax in axes[-1]:
            ax.remove()
        mem_ax = fig.add_subplot(grid[-1, :])
        for m, color in zip(memories, _colors(plt)):
            xs = [s["seconds"] / 60 for s in m["samples"]]
            mem_ax.plot(xs, [s["rss_mib"] for s in m["samples"]], marker="o", color=color, label=m["server"])
        mem_ax.set_title("server resident memory after each point (MiB; every block free after every point: "
                         f"{all(m['pool_all_free_after_every_point'] for m in memories)})", fontsize=10)
        mem_ax.set_xlabel("minutes since the server was up")
        mem_ax.grid(alpha=0.3)
        mem_ax.legend(fontsize=7)
        axes = axes[:-1]
    colors = dict(zip(configs, _colors(plt)))
    for row, workload in zip(axes, workloads):
        for p in (p for p in points if p["workload"] == workload):
            style = "-" if p["concurrency"] == concs[0] else "--"
            turns = [t["turn"] + 1 for t in p["turns"]]
            label = f"{p['config']} c={p['concurrency']}"
            for ax, key in zip(row[:3], ("ttft_ms", "tpot_ms", "gap_ratio_max")):
                ax.plot(turns, [t[key] for t in p["turns"]], style, marker="o", color=colors[p["config"]], label=label)
        for config in configs:
            pts = sorted((g for g in goals(points) if g["workload"] == workload and g["config"] == config),
                         key=lambda g: g["concurrency"])
            row[3].plot([g["concurrency"] for g in pts], [g["speedup_vs_off"] for g in pts], marker="o",
                        color=colors[config], label=config)
        titles = ("TTFT (ms, median)", "TPOT (ms, median)", "longest gap / median gap (worst session)",
                  "speedup over off (mean TPOT)")
        for ax, title in zip(row, titles):
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in row[:3]:
            ax.set_xlabel("turn")
        row[0].set_yscale("log")
        row[2].axhline(3.0, color="red", lw=0.8, ls=":")
        row[3].axhline(1.0, color="gray", lw=0.8)
        row[3].set_xlabel("concurrency")
        row[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def memory_sample(server: ServerProcess, label: str, t0: float) -> dict:
    """The server's VmRSS and pool once it runs nothing: blocks that are neither free nor held by
    the prefix cache's free list after a point would be a leak."""
    wait_idle(server.url)
    health = httpx.get(server.url + "/health", timeout=10).json()
    rss = read_rss(server.proc.pid)
    sample = {"label": label, "seconds": round(time.monotonic() - t0, 1), "rss_mib": rss >> 20 if rss else None,
              "num_free_blocks": health.get("num_free_blocks"), "num_blocks": health.get("num_blocks")}
    print(f"memory after {label}: RSS {sample['rss_mib']} MiB, free blocks {sample['num_free_blocks']} of "
          f"{sample['num_blocks']}", file=sys.stderr)
    return sample


def memory_summary(samples: list[dict]) -> dict:
    """Growth of resident memory from the first point's end to the last's (start-up's warm-up and the
    first point's allocations settle in the first), and whether every block was free after each point."""
    rss = [s["rss_mib"] for s in samples if s["rss_mib"]]
    after_first = rss[1] if len(rss) > 1 else None
    return {"rss_start_mib": rss[0] if rss else None, "rss_after_first_point_mib": after_first,
            "rss_end_mib": rss[-1] if rss else None, "rss_max_mib": max(rss, default=None),
            "rss_growth_after_first_point": rss[-1] / after_first if after_first else None,
            "pool_all_free_after_every_point": all(s["num_free_blocks"] == s["num_blocks"] for s in samples)}


def run_point(url: str, name: str, workload: str, concurrency: int, max_tokens: int, num_sessions: int,
              tag: str, extra: dict | None = None, files: list[str] | None = None):
    """One workload at one concurrency against a running server: (rows per request, the result)."""
    wait_idle(url)
    spec = LoadSpec(url=url, endpoint="ws", settings={"max_tokens": max_tokens, "temperature": 0.0, **(extra or {})},
                    sessions=sessions(workload, num_sessions, tag, files), concurrency=concurrency)
    result = run_load(spec, desc=f"{name} {workload} c={concurrency}")
    return [turn_row(r) for r in result.records], result


def point(name: str, serve_args: list[str], workload: str, concurrency: int, max_tokens: int, rows: list[dict],
          result, loadavg: list) -> dict:
    p = {"config": name, "serve_args": serve_args, "workload": workload, "concurrency": concurrency,
         "max_tokens": max_tokens, "server": result.server, "loadavg": loadavg, "turns": per_turn(rows), "requests": rows}
    print(f"{name} {workload} c={concurrency}: " + ", ".join(
        f"t{t['turn'] + 1} TTFT {t['ttft_ms'] or 0:.0f} TPOT {t['tpot_ms'] or 0:.1f} cached {t['cached_tokens']}"
        for t in p["turns"]), file=sys.stderr)
    return p


def _max_tokens(args, workload: str) -> int:
    return args.edit_max_tokens if workload == "edit" and args.edit_max_tokens else args.max_tokens


def _fresh(args) -> list[str]:
    """Server args that keep every point's conversations fresh: the files repeat across points and
    rounds, and greedy replies are the same for every method, so suffix decoding's corpus of
    recent replies (and a draft-model request mixing its proposals) would draft a reply seen in
    an earlier point: in session 19 the paste summaries went 46 of 46 drafts accepted that way."""
    return [] if args.reuse_replies else ["--suffix-corpus-tokens", "0"]


def run_servers(args, memories: list[dict]) -> list[dict]:
    """One `chatserve serve` per configuration, one after another; each server's memory samples
    are appended to `memories`."""
    points = []
    for item in args.configs:
        name, _, serve = item.partition("=")
        serve = serve or CONFIGS[name]
        serve_args = [*shlex.split(serve), *shlex.split(args.server_args), *_fresh(args)]
        if args.draft_model and "--no-spec" not in serve_args and "--draft-model" not in serve_args:
            serve_args += ["--draft-model", args.draft_model]
        with ServerProcess(args.model, serve_args) as server:
            t0 = time.monotonic()
            memory = [memory_sample(server, "start", t0)]
            for workload in args.workloads:
                for concurrency in args.concurrency:
                    rows, result = run_point(server.url, name, workload, concurrency, _max_tokens(args, workload),
                                             args.sessions, f"{name} {workload} c{concurrency}", files=args.files)
                    points.append(point(name, serve_args, workload, concurrency, _max_tokens(args, workload), rows,
                                        result, [result.loadavg_before, result.loadavg_after]))
                    memory.append(memory_sample(server, f"{workload} c={concurrency}", t0))
            memories.append({"server": name, "samples": memory, **memory_summary(memory)})
    return points


def run_interleaved(args, memories: list[dict]) -> list[dict]:
    """One server; each configuration a per-request method, in rounds whose order rotates; its
    memory samples are appended to `memories`."""
    serve_args = [*shlex.split(args.interleave), *shlex.split(args.server_args), *_fresh(args)]
    if args.draft_model and "--draft-model" not in serve_args:
        serve_args += ["--draft-model", args.draft_model]
    names = [item.partition("=")[0] for item in args.configs]
    extra = {name: {"num_draft_tokens": 0} if name == "off" else {"spec_method": name} for name in names}
    points = []
    with ServerProcess(args.model, serve_args) as server:
        t0 = time.monotonic()
        memory = [memory_sample(server, "start", t0)]
        for workload in args.workloads:
            for concurrency in args.concurrency:
                rows: dict[str, list] = {name: [] for name in names}
                last, loadavg = {}, {name: [] for name in names}
                for r in range(args.rounds):
                    for name in names[r % len(names):] + names[: r % len(names)]:
                        got, result = run_point(server.url, name, workload, concurrency, _max_tokens(args, workload),
                                                args.sessions, f"{name} {workload} c{concurrency} r{r}", extra[name],
                                                files=args.files)
                        for row in got:
                            row["session"] += r * args.sessions
                            row["round"] = r
                        rows[name] += got
                        last[name] = result
                        loadavg[name].append([result.loadavg_before, result.loadavg_after])
                        memory.append(memory_sample(server, f"{name} {workload} c={concurrency} r{r}", t0))
                for name in names:
                    points.append(point(name, serve_args + [f"(per request: {extra[name]})"], workload, concurrency,
                                        _max_tokens(args, workload), rows[name], last[name], loadavg[name]))
        memories.append({"server": "interleaved", "samples": memory, **memory_summary(memory)})
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None, help="passed to every configuration that drafts with a model")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS),
                    help=f"names from {list(CONFIGS)}, or NAME=SERVE_ARGS")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--sessions", type=int, default=4, help="sessions per run (one file each)")
    ap.add_argument("--files", nargs="+", default=None, choices=list(json.loads(DATA.read_text())["files"]),
                    help="only these files of benchmarks/data/long_context.json, cycled (default: all, in order)")
    ap.add_argument("--max-tokens", type=int, default=128, help="per reply in paste sessions")
    ap.add_argument("--edit-max-tokens", type=int, default=None, help="per reply in edit sessions (default: --max-tokens)")
    ap.add_argument("--server-args", default="--threads 2", help="added to every `chatserve serve`")
    ap.add_argument("--interleave", default=None, metavar="SERVE_ARGS",
                    help="one server with these args for all configs, each a per-request method (see above)")
    ap.add_argument("--reuse-replies", action="store_true",
                    help="let suffix decoding match replies of earlier points (off: --suffix-corpus-tokens 0)")
    ap.add_argument("--rounds", type=int, default=1, help="with --interleave: rounds, the order rotating")
    ap.add_argument("--out", type=Path, required=True, help="JSON; the PNG goes next to it")
    args = ap.parse_args()

    memories: list[dict] = []
    points = run_interleaved(args, memories) if args.interleave is not None else run_servers(args, memories)
    table = goals(points)
    print(format_table(table))
    for m in memories:
        print(f"{m['server']}: RSS {m['rss_start_mib']} MiB at start, {m['rss_after_first_point_mib']} after the "
              f"first point, {m['rss_end_mib']} at the end (max {m['rss_max_mib']}); every block free after every "
              f"point: {m['pool_all_free_after_every_point']}")
    png = args.out.with_suffix(".png")
    plot(points, png, memories)
    write_json({"kind": "long-context", "argv": sys.argv[1:], "machine": machine(), "goals": table,
                "memory": memories, "points": points, "plot": str(png)}, args.out)
    print(f"wrote {args.out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
