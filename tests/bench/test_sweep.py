"""A short sweep: 2 server configurations (speculation off / draft model) x concurrency 1, 2 on the
tiny model; `chatserve bench --sweep` starts and stops each server, writes the JSON and the PNGs."""

import json

from chatserve.bench.sweep import add_speedups
from chatserve.cli import main


def test_sweep_two_configs_two_concurrencies_writes_json_and_plots(tmp_path, tiny_llama_dir, tiny_draft_dir):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    argv = ["bench", "--sweep", "--model", str(tiny_llama_dir), "--no-progress",
            "--config", "off=--no-spec", "--config", f"draft=--draft-model {tiny_draft_dir} --no-adaptive",
            "--server-args", "--kv-cache-memory 8M --threads 1", "--concurrency", "1,2",
            "--num-requests", "3", "--max-tokens", "8", "--out", str(out), "--plots", str(plots),
            "--markdown", str(tmp_path / "t.md")]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    points = result["points"]
    assert [(p["config"], p["concurrency"]) for p in points] == [("off", 1), ("off", 2), ("draft", 1), ("draft", 2)]
    for p in points:
        summary = p["report"]["summary"]
        assert summary["num_completed"] == 3 and summary["num_failed"] == 0
        assert p["report"]["meta"]["concurrency"] == p["concurrency"]
        drafted = summary["speculation"]["drafted"]
        assert (drafted > 0) == (p["config"] == "draft"), p["config"]
        assert "--no-spec" in p["serve_args"] or "--draft-model" in p["serve_args"]
        # the prompts repeat at every point: suffix decoding must not draft the replies it saw
        i = p["serve_args"].index("--suffix-corpus-tokens")
        assert p["serve_args"][i + 1] == "0"
    assert all(p["speedup_vs_off"] == 1.0 for p in points if p["config"] == "off")
    assert all(p["speedup_vs_off"] > 0 for p in points)
    table = (tmp_path / "t.md").read_text().splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| off | 1 |") and table[-1].startswith("| draft | 2 |")
    names = sorted(path.name for path in plots.iterdir())
    assert names == ["acceptance_hist.png", "itl_cdf.png", "latency_vs_concurrency.png", "speedup_vs_off.png"]
    assert sorted(result["plots"]) == sorted(str(plots / n) for n in names)
    for name in names:
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_speedup_is_reference_tpot_over_config_tpot():
    def point(config, concurrency, tpot):
        return {"config": config, "concurrency": concurrency, "report": {"summary": {"tpot_ms": {"mean": tpot}}}}

    points = [point("off", 1, 30.0), point("off", 4, 60.0), point("ngram", 1, 20.0), point("ngram", 4, 80.0),
              point("ngram", 8, 90.0)]
    add_speedups(points)
    assert [p["speedup_vs_off"] for p in points] == [1.0, 1.0, 1.5, 0.75, None]
