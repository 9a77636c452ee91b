"""PNG plots of a sweep with matplotlib (Agg, no display): latency percentiles against
concurrency per configuration, speedup over speculation-off, ITL CDF, acceptance histogram."""

from __future__ import annotations

from pathlib import Path

from chatserve.bench.metrics import RequestRecord, itl_ms, tokens_per_chunk

_STYLES = {"p50": "-", "p90": "--", "p99": ":"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(plt) -> list[str]:
    return plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4


def _concurrency_axis(ax, points: list[dict]) -> None:
    xs = sorted({p["concurrency"] for p in points if p["concurrency"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel("concurrency")


def _by_config(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["config"], []).append(p)
    return out


def _records(point: dict) -> list[RequestRecord]:
    fields = RequestRecord.__dataclass_fields__
    return [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in point["report"]["requests"]]


def plot_latency(points: list[dict], path: Path) -> None:
    """TTFT and TPOT p50/p90/p99 against concurrency, one colour per configuration."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (config, pts), color in zip(_by_config(points).items(), _colors(plt)):
        pts = sorted(pts, key=lambda p: p["concurrency"] or 0)
        xs = [p["concurrency"] or 0 for p in pts]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            for q, style in _STYLES.items():
                ys = [p["report"]["summary"][key][q] for p in pts]
                ax.plot(xs, ys, style, color=color, marker="o", markersize=3, label=f"{config} {q}")
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_title(title)
        _concurrency_axis(ax, points)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(points: list[dict], path: Path) -> None:
    """Mean-TPOT speedup of each configuration over speculation-off, against concurrency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for config, pts in _by_config(points).items():
        pts = sorted((p for p in pts if p.get("speedup_vs_off")), key=lambda p: p["concurrency"] or 0)
        if pts:
            ax.plot([p["concurrency"] for p in pts], [p["speedup_vs_off"] for p in pts], marker="o", label=config)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="red", lw=0.8, ls=":", label="0.95x")
    _concurrency_axis(ax, points)
    ax.set_ylabel("speedup over speculation off (mean TPOT)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_itl_cdf(points: list[dict], path: Path) -> None:
    """Empirical CDF of per-token ITL per configuration, at the lowest and highest concurrency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (config, pts), color in zip(_by_config(points).items(), _colors(plt)):
        pts = sorted(pts, key=lambda p: p["concurrency"] or 0)
        for p, style in zip((pts[0], pts[-1]) if len(pts) > 1 else pts[:1], ("-", "--")):
            itls = sorted(x for r in _records(p) if r.is_ok for x in itl_ms(r.chunk_times, tokens_per_chunk(r)))
            if itls:
                ys = [(i + 1) / len(itls) for i in range(len(itls))]
                ax.step(itls, ys, style, color=color, where="post", label=f"{config} c={p['concurrency']}")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms, per token)")
    ax.set_ylabel("fraction of tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(points: list[dict], path: Path) -> None:
    """Histogram of per-request acceptance rates per configuration (all concurrencies pooled)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = [i / 20 for i in range(21)]
    for config, pts in _by_config(points).items():
        rates = [x for p in pts for x in p["report"]["summary"]["speculation"]["per_request_acceptance"]]
        if rates:
            ax.hist(rates, bins=bins, alpha=0.5, label=f"{config} (n={len(rates)})")
    ax.set_xlabel("acceptance rate per request (accepted / drafted)")
    ax.set_ylabel("requests")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative requests", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_outputs(points: list[dict], out_dir: str | Path) -> list[str]:
    """Write every plot into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, plot in (("latency_vs_concurrency", plot_latency), ("speedup_vs_off", plot_speedup),
                       ("itl_cdf", plot_itl_cdf), ("acceptance_hist", plot_acceptance)):
        path = out / f"{name}.png"
        plot(points, path)
        paths.append(str(path))
    return paths
