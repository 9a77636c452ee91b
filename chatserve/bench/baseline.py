"""`--baseline transformers`: the same prompts through HF `generate` in this process (batch 1),
timed with a streamer, plus assisted generation (draft model) and prompt lookup (n-gram) when the
benchmarked servers speculate that way; and our-vs-baseline ratios at the lowest concurrency."""

from __future__ import annotations

import os
import sys
import time

from chatserve.bench.metrics import RequestRecord, aggregate
from chatserve.bench.workloads import plan_sessions

METHODS = ("plain", "assisted", "prompt_lookup")


class _TimingStreamer:
    """HF streamer protocol (put/end): timestamps each batch of new tokens. The first `put` is
    the prompt; assisted generation puts several accepted tokens at once."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.record.chunk_times.append(time.perf_counter())
        self.record.chunk_tokens.append(int(value.numel()))

    def end(self) -> None:
        self.record.end = time.perf_counter()


def run_transformers(model: str, prompts: list[str], max_tokens: int, temperature: float, dtype: str,
                     method: str = "plain", draft_model: str | None = None, num_draft_tokens: int = 4,
                     progress: bool = True, num_threads: int | None = None) -> list[RequestRecord]:
    """One greedy (temperature 0) or sampled `generate` per prompt, as a chat turn; batch 1. An
    unrecorded 4-token warm-up generate runs first, as the server benchmark warms up too."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatserve.loading import resolve

    if num_threads:
        torch.set_num_threads(num_threads)
    torch_dtype = getattr(torch, dtype)
    path = resolve(model)
    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    extra: dict = {}
    if method == "assisted":
        extra["assistant_model"] = AutoModelForCausalLM.from_pretrained(resolve(draft_model), dtype=torch_dtype).eval()
    elif method == "prompt_lookup":
        extra["prompt_lookup_num_tokens"] = num_draft_tokens
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def generate(prompt: str, record: RequestRecord, num_tokens: int) -> None:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        record.start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                  streamer=_TimingStreamer(record), pad_token_id=pad_id, **sampling, **extra)
        record.num_generated, record.prompt_tokens = out.shape[1] - ids.shape[1], ids.shape[1]

    generate("Warm-up request: say hello.", RequestRecord(-1, 0, start=0.0), 4)
    records = []
    for i, prompt in enumerate(tqdm(prompts, desc=f"transformers {method}", disable=not progress, leave=False)):
        records.append(RequestRecord(i, 0, start=0.0))
        generate(prompt, records[-1], max_tokens)
    return records


def method_of(serve_args: list[str] | None, server_draft: str | None) -> str:
    """The transformers counterpart of a server configuration."""
    args = serve_args or []
    if "--no-spec" in args:
        return "plain"
    if {"ngram", "suffix"} & set(args) or server_draft in ("ngram", "suffix"):
        return "prompt_lookup"  # transformers has no suffix decoding: prompt lookup is the nearest
    if "--draft-model" in args or server_draft:
        return "assisted"
    return "plain"


def add_baseline(result: dict, plan, args) -> None:
    """Run the baselines the points need and fill result['baseline'] and result['ratios']."""
    points = result["points"]
    server = points[0]["report"]["meta"]["server"]
    model = args.model or server.get("model")
    draft = args.draft_model or (server.get("draft") if server.get("draft") not in ("ngram", "suffix") else None)
    methods = {"plain"} | {method_of(p["serve_args"], server.get("draft")) for p in points}
    if draft is None:
        methods.discard("assisted")
    num = args.baseline_requests or 4
    # the first turns of the first sessions the benchmark sent, in its order
    prompts = [s.conversation.user_turns[0] for s in plan_sessions(plan.conversations, num, 1, plan.seed)]
    baseline = {"model": model, "draft_model": draft, "dtype": args.dtype, "threads": args.threads,
                "num_prompts": len(prompts),
                "loadavg_before": list(os.getloadavg()), "methods": {}}
    for method in [m for m in METHODS if m in methods]:
        records = run_transformers(model, prompts, plan.settings["max_tokens"], plan.settings.get("temperature", 0.0),
                                   args.dtype, method, draft, progress=plan.progress, num_threads=args.threads)
        duration = sum(r.end - r.start for r in records)
        baseline["methods"][method] = {"summary": aggregate(records, duration),
                                       "requests": [r.to_dict() for r in records]}
    baseline["loadavg_after"] = list(os.getloadavg())
    result["baseline"] = baseline
    result["ratios"] = ratios(points, baseline["methods"], server.get("draft"))
    print(format_ratios(result["ratios"]), file=sys.stderr)


def ratios(points: list[dict], methods: dict, server_draft: str | None) -> list[dict]:
    """Per configuration at its lowest concurrency: p50 TTFT and TPOT over transformers' plain
    generate and over its matching speculative method (< 1 means we are faster)."""
    lowest: dict[str, dict] = {}
    for p in points:
        if p["config"] not in lowest or (p["concurrency"] or 0) < (lowest[p["config"]]["concurrency"] or 0):
            lowest[p["config"]] = p
    out = []
    for config, p in lowest.items():
        ours = p["report"]["summary"]
        for vs in dict.fromkeys(("plain", method_of(p["serve_args"], server_draft))):
            if vs not in methods:
                continue
            hf = methods[vs]["summary"]
            out.append({"config": config, "concurrency": p["concurrency"], "vs": f"transformers {vs}",
                        "ttft_ratio": _ratio(ours["ttft_ms"]["p50"], hf["ttft_ms"]["p50"]),
                        "tpot_ratio": _ratio(ours["tpot_ms"]["p50"], hf["tpot_ms"]["p50"]),
                        "ours_tpot_ms": ours["tpot_ms"]["p50"], "baseline_tpot_ms": hf["tpot_ms"]["p50"],
                        "ours_ttft_ms": ours["ttft_ms"]["p50"], "baseline_ttft_ms": hf["ttft_ms"]["p50"]})
    return out


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def format_ratios(rows: list[dict]) -> str:
    head = f"{'config':<10} {'vs':<28} {'TTFT ms':>15} {'TPOT ms':>15} {'TPOT ratio':>10} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ttft = f"{r['ours_ttft_ms'] or 0:.0f}/{r['baseline_ttft_ms'] or 0:.0f}"
        tpot = f"{r['ours_tpot_ms'] or 0:.1f}/{r['baseline_tpot_ms'] or 0:.1f}"
        speedup = f"{1 / r['tpot_ratio']:.2f}x" if r["tpot_ratio"] else "-"
        ratio = f"{r['tpot_ratio']:.2f}" if r["tpot_ratio"] else "-"
        lines.append(f"{r['config']:<10} {r['vs']:<28} {ttft:>15} {tpot:>15} {ratio:>10} {speedup:>8}")
    return "\n".join(lines)
