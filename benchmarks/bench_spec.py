"""Speculation on vs off, ours vs transformers, one process, one run, batch 1.

For each temperature: our engine without speculation, with the n-gram proposer and with the
draft model (when given), then transformers `generate` plain, with `assistant_model` and
with `prompt_lookup_num_tokens`. Prints tokens/s, TPOT, acceptance rate and mean accepted
length; writes JSON and a PNG of tokens/s per configuration. Each run also records the thread's
CPU time: with `--threads 1` the CPU ms per token barely move with other load on a shared
machine, so the speedups are given both ways.

    python benchmarks/bench_spec.py --target smollm2-135m-instruct --workload edit   # int8 weights, bf16
    (transformers runs the same bf16 weights unquantized: it has no int8 CPU path of its own)
    python benchmarks/bench_spec.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --workload code --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((Path(__file__).resolve().parent.parent / "chatserve/data/prompts.json").read_text())


def run_ours(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One request at a time (batch 1); totals over all prompts."""
    tokens = drafted = accepted = steps = 0
    tpots, seconds, cpu, outputs = [], 0.0, 0.0, []
    for i, p in enumerate(prompts):
        sp = SamplingParams(**{**params.__dict__, "seed": None if params.seed is None else params.seed + i})
        start, cpu_start = time.perf_counter(), time.thread_time()
        out = engine.generate([p], sp)[0]
        seconds += time.perf_counter() - start
        cpu += time.thread_time() - cpu_start
        st = out["stats"]
        tokens += st.num_generated
        drafted += st.num_drafted
        accepted += st.num_accepted
        steps += st.num_spec_steps
        tpots.append(st.tpot_ms)
        outputs.append(out["token_ids"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "cpu_ms_per_token": cpu * 1e3 / tokens, "tpot_ms": statistics.median(tpots), "num_drafted": drafted, "num_accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + steps) / steps if steps else None, "outputs": outputs}


def run_hf(model, prompts: list[list[int]], max_tokens: int, temperature: float, **gen_kwargs) -> dict:
    tokens, seconds, cpu = 0, 0.0, 0.0
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    for p in prompts:
        x = torch.tensor([p])
        start, cpu_start = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                 pad_token_id=0, **sample, **gen_kwargs)
        seconds += time.perf_counter() - start
        cpu += time.thread_time() - cpu_start
        tokens += out.shape[1] - len(p)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_ms_per_token": cpu * 1e3 / tokens}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(results)
    names = list(results[temps[0]])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(temps)
    for j, t in enumerate(temps):
        ax.bar([i + j * width for i in range(len(names))], [results[t][n]["tokens_per_s"] for n in names],
               width, label=f"temperature {t}")
    ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("tokens/s (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--workload", default="edit", choices=sorted(PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="ours and transformers' dtype")
    ap.add_argument("--quantization", default="int8", help="ours: int8 weight-only, or none")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/spec.json")
    args = ap.parse_args()

    draft_spec = SpecConfig(method="draft", draft_model=args.draft, num_draft_tokens=args.num_draft_tokens) if args.draft else None
    configs = {"spec off": None, "ngram": SpecConfig(method="ngram", num_draft_tokens=args.num_draft_tokens)}
    if draft_spec:
        configs["draft model"] = draft_spec
    if args.threads:
        torch.set_num_threads(args.threads)
    quant = None if args.quantization == "none" else args.quantization
    engine = Engine(EngineConfig(model=args.target, dtype=args.dtype, quantization=quant, kv_cache_memory=1 << 30,
                                 spec=draft_spec))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[args.workload][: args.num_prompts]]
    hf = hf_draft = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from chatserve.loading import resolve

        load = lambda m: AutoModelForCausalLM.from_pretrained(str(resolve(m)), dtype=getattr(torch, args.dtype)).eval()  # noqa: E731
        hf = load(args.target)
        hf_draft = load(args.draft) if args.draft else None
    print(f"{args.target} + {args.draft or '-'}; {args.workload} x {len(prompts)}; {args.max_tokens} tokens; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    results: dict = {}
    for temp in args.temperatures:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, ignore_eos=False, seed=0 if temp else None)
        row = results[str(temp)] = {}
        for name, spec in configs.items():
            engine.set_speculation(spec)
            row[f"ours {name}"] = r = run_ours(engine, prompts, params)
            acc = f", acceptance {r['acceptance_rate']:.0%}, mean accepted length {r['mean_accepted_length']:.2f}" if r["acceptance_rate"] is not None else ""
            print(f"  T={temp} ours {name:12s} {r['tokens_per_s']:6.1f} tok/s  TPOT {r['tpot_ms']:6.1f} ms  "
                  f"CPU {r['cpu_ms_per_token']:6.1f} ms/token{acc}", flush=True)
        if temp == 0:
            base = row["ours spec off"]["outputs"]
            for name in configs:
                row[f"ours {name}"]["greedy_equal_to_spec_off"] = row[f"ours {name}"]["outputs"] == base
        if hf is not None:
            row["hf plain"] = run_hf(hf, prompts, args.max_tokens, temp)
            row["hf prompt lookup"] = run_hf(hf, prompts, args.max_tokens, temp, prompt_lookup_num_tokens=args.num_draft_tokens)
            if hf_draft is not None:
                row["hf assisted"] = run_hf(hf, prompts, args.max_tokens, temp, assistant_model=hf_draft)
            for name in ("hf plain", "hf prompt lookup", "hf assisted"):
                if name in row:
                    print(f"  T={temp} {name:17s} {row[name]['tokens_per_s']:6.1f} tok/s  "
                          f"CPU {row[name]['cpu_ms_per_token']:6.1f} ms/token", flush=True)
        off = row["ours spec off"]["tokens_per_s"]
        for name in list(row):
            row[name]["speedup_vs_ours_spec_off"] = row[name]["tokens_per_s"] / off
            row[name]["cpu_speedup_vs_ours_spec_off"] = row["ours spec off"]["cpu_ms_per_token"] / row[name]["cpu_ms_per_token"]
            row[name].pop("outputs", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "loadavg": os.getloadavg(), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
