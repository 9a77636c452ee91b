"""Per-round speedups of a `chatserve bench --sweep --rounds N` result: how much do rounds agree?

The sweep pools its rounds into one point per (config, concurrency). Rounds run the configs
interleaved, so round r of a config and round r of `off` ran minutes apart; their ratio is the
fairest comparison this noisy machine allows. Prints, per point, mean TPOT per round, the
per-round speedup over off, and off's own round-to-round spread (max / min of its round means).

    python benchmarks/sweep_rounds.py benchmarks/results/bench_qwen_sweep_s4b.json [--json out.json]
"""
import argparse
import json
import statistics
from pathlib import Path


def round_means(point: dict) -> list[float]:
    """Mean TPOT (ms) of each round: requests in start order, split into `rounds` equal parts."""
    reqs = sorted(point["report"]["requests"], key=lambda r: r["start"])
    n = point["rounds"]
    size = len(reqs) // n
    means = []
    for i in range(n):
        tpots = [r["tpot_ms"] for r in reqs[i * size : (i + 1) * size] if r.get("tpot_ms") is not None]
        means.append(statistics.fmean(tpots) if tpots else float("nan"))
    return means


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    points = json.loads(args.result.read_text())["points"]
    means = {(p["config"], p["concurrency"]): round_means(p) for p in points}
    rows = []
    print(f"{'config':<8} {'conc':>4}  {'TPOT per round (ms)':<26} {'speedup per round':<24} pooled  off spread")
    for (config, conc), ms in means.items():
        off = means.get(("off", conc))
        ratios = [o / m for o, m in zip(off, ms)] if off else []
        spread = max(off) / min(off) if off else float("nan")
        pooled = next(p["speedup_vs_off"] for p in points if p["config"] == config and p["concurrency"] == conc)
        rows.append({"config": config, "concurrency": conc, "tpot_ms_per_round": ms,
                     "speedup_per_round": ratios, "pooled_speedup": pooled, "off_spread": spread})
        print(f"{config:<8} {conc:>4}  {' '.join(f'{m:6.1f}' for m in ms):<26} "
              f"{' '.join(f'{r:5.2f}x' for r in ratios):<24} {pooled or 0:5.2f}x  {spread:5.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
