"""KV-cache quantization quality, computed by the engine itself on chatserve/data/eval_text.txt.

Per KV format, on one copy of the weights (an engine with its own pool per format):
- perplexity: the text is teacher-forced through the paged cache in chunks of --chunk tokens,
  so every chunk attends to K/V that earlier chunks wrote (quantized) into the pool, and its
  own new K/V are read back from the pool too; logits for every position, NLL of the next token;
- teacher-forced top-1 agreement with the unquantized cache over the same positions;
- free-running greedy agreement over --max-tokens tokens for a few prompts (position-wise
  match and first divergence against "auto");
- speculative acceptance (k fixed, adaptive off) with the target and/or draft cache quantized:
  n-gram prompt lookup (any model) and, with --draft-model, a draft model; the output must
  equal the plain run on the same target cache (lossless), which is checked and recorded. With
  a quantized cache "equal" is up to batch shape: the same token's K computed in a k+1-row
  verify batch and in a 1-row decode differs in the last fp32 bits, and where that straddles a
  rounding boundary of the int8/fp8 grid it moves a whole quantization step.
Quantized pools use K smoothing (chatserve/kv_smooth.py) as the engine does by default;
--smooth-keys off measures without it, both measures each quantized format both ways (rows
"int8" and "int8/unsmoothed"; speculation then runs with smoothing on).
Prints the numbers and writes JSON (with os.getloadavg()).

    python benchmarks/kv_quality.py --model smollm2-135m-instruct --dtype float32
    python benchmarks/kv_quality.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16 \
        --draft-model qwen2.5-coder-0.5b-instruct
    python benchmarks/kv_quality.py --model qwen2.5-coder-1.5b-instruct --quantization int4 \
        --formats auto fp16 bf16 --spec-methods ngram --out benchmarks/results/kv_quality_qwen15_kv16.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_common import EVAL_TEXT, engine_with_kv, load_avg, write_report  # noqa: E402

from chatserve.batch import BatchItem  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.loading import load_models  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]
GOALS = {"int8": 0.005, "fp8_e4m3": 0.02}  # allowed relative perplexity increase over auto
CHAT_PROMPTS = [
    "Explain what a least-recently-used cache is, then write a small Python class for one.",
    "Write a short story about a lighthouse keeper who keeps a detailed logbook.",
]
EDIT_REQUEST = "Add a method `renew(shelf, today)` that extends a loan by LOAN_DAYS, and show the whole class again."


def teacher_forced(engine, token_ids: list[int], chunk: int) -> tuple[float, torch.Tensor]:
    """-> (mean NLL of tokens 1..n-1, top-1 predictions [n - 1]). Feeds the text in chunks
    through the target runner and its pool (block ids 0.. used directly: the engine is idle,
    and its prefix cache is dropped afterwards since those blocks are overwritten)."""
    runner = engine.models.target_runner
    block_size = runner.block_size
    num_blocks = -(-len(token_ids) // block_size)
    assert num_blocks <= engine.block_manager.num_blocks and not engine.has_unfinished()
    nll, predictions = 0.0, []
    for start in range(0, len(token_ids) - 1, chunk):
        tokens = token_ids[start : start + chunk]
        end = start + len(tokens)
        logits, _ = runner.run([BatchItem(tokens, start, list(range(-(-end // block_size))), len(tokens))])
        targets = torch.tensor(token_ids[start + 1 : end + 1])  # [<= chunk]
        logits = logits[: len(targets)].float()  # [<= chunk, vocab]
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        predictions.append(logits.argmax(-1))
    engine.block_manager.reset_prefix_cache()
    return nll / (len(token_ids) - 1), torch.cat(predictions)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    engine.check_no_leaks()
    return [o["token_ids"] for o in outs]


def agreement(outs: list[list[int]], refs: list[list[int]]) -> dict:
    same = sum(a == b for out, ref in zip(outs, refs) for a, b in zip(out, ref))
    first = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(outs, refs)]
    return {"token_agreement": same / sum(len(r) for r in refs), "first_divergence": first}


def spec_run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """-> (outputs, acceptance rate = accepted / drafted over all prompts)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    engine.check_no_leaks()
    drafted = sum(o["stats"].num_drafted for o in outs)
    accepted = sum(o["stats"].num_accepted for o in outs)
    return [o["token_ids"] for o in outs], accepted / max(drafted, 1)


def build_prompts(tokenizer, text: str) -> tuple[list[list[int]], list[list[int]]]:
    """-> (greedy prompts, speculation prompts). The latter ask to repeat and edit code from
    the text, the case prompt lookup and drafts are for."""
    chat = lambda content: tokenizer.apply_chat_template([{"role": "user", "content": content}])  # noqa: E731
    code = text[text.index("```python") : text.index("```\n\nThe class above") + 3]
    greedy_prompts = [chat(p) for p in CHAT_PROMPTS] + [tokenizer.encode(text)[:400]]
    spec_prompts = [chat(f"{code}\n\n{EDIT_REQUEST}"), chat(CHAT_PROMPTS[0])]
    return greedy_prompts, spec_prompts


def variants(formats: list[str], smooth_keys: str) -> list[tuple[str, str, bool]]:
    """-> (row label, KV format, smoothing on?) per measured pool; "auto" never smooths."""
    out = []
    for fmt in formats:
        if fmt == "auto" or smooth_keys == "on":
            out.append((fmt, fmt, True))
        elif smooth_keys == "off":
            out.append((fmt, fmt, False))
        else:
            out += [(fmt, fmt, True), (f"{fmt}/unsmoothed", fmt, False)]
    return out


def quality_per_format(models, config, args, text_ids, greedy_prompts, budget) -> dict:
    rows, ref_preds, ref_outs = {}, None, None
    for label, fmt, smooth in variants(args.formats, args.smooth_keys):
        start = time.perf_counter()
        engine = engine_with_kv(models, config, fmt, budget, smooth_keys=smooth)
        smoothed = engine.models.target_runner.kv_cache.key_means is not None
        nll, preds = teacher_forced(engine, text_ids, args.chunk)
        outs = greedy(engine, greedy_prompts, args.max_tokens)
        if fmt == "auto":
            ref_preds, ref_outs = preds, outs
        row = {"kv_format": fmt, "smooth_keys": smoothed, "ppl": math.exp(nll), "nll": nll,
               "teacher_forced_top1_agreement": (preds == ref_preds).float().mean().item(),
               **agreement(outs, ref_outs), "seconds": time.perf_counter() - start}
        rows[label] = row
        print(f"  {label}: ppl {row['ppl']:.4f} ({row['seconds']:.0f} s)", flush=True)
        del engine
    for row in rows.values():
        row["ppl_change"] = row["ppl"] / rows["auto"]["ppl"] - 1
        if row["kv_format"] in GOALS:
            row["meets_goal"] = row["ppl_change"] <= GOALS[row["kv_format"]]
    return rows


def acceptance(models, config, args, spec_prompts, budget) -> dict:
    """Acceptance with the target and/or draft cache quantized; outputs checked against the
    plain run on the same target cache."""
    specs = {}
    if "ngram" in args.spec_methods:
        specs["ngram"] = SpecConfig(method="ngram", num_draft_tokens=args.k, adaptive=False)
    if args.draft_model and "draft" in args.spec_methods:
        specs["draft"] = SpecConfig(method="draft", draft_model=args.draft_model, num_draft_tokens=args.k,
                                    adaptive=False)
    combos = [(t, None) for t in args.formats]  # draft cache = target's
    if "draft" in specs:
        combos += [("auto", d) for d in args.formats if d != "auto"]  # only the draft quantized
    plain = {}
    rows = []
    smooth = args.smooth_keys != "off"
    for target_fmt, draft_fmt in combos:
        if target_fmt not in plain:
            plain[target_fmt] = greedy(engine_with_kv(models, config, target_fmt, budget, smooth_keys=smooth),
                                       spec_prompts, args.max_tokens)
        for method, spec in specs.items():
            if method == "ngram" and draft_fmt is not None:
                continue  # n-gram has no draft cache
            engine = engine_with_kv(models, config, target_fmt, budget, spec=spec, draft_kv_format=draft_fmt,
                                    smooth_keys=smooth)
            outs, rate = spec_run(engine, spec_prompts, args.max_tokens)
            row = {"method": method, "target_kv": target_fmt,
                   "draft_kv": (draft_fmt or target_fmt) if method == "draft" else None,
                   "smooth_keys": smooth, "acceptance": rate, "same_as_plain": outs == plain[target_fmt],
                   "first_divergence_from_plain": agreement(outs, plain[target_fmt])["first_divergence"]}
            rows.append(row)
            print(f"  spec {method:<5} target {target_fmt:<9} draft {str(row['draft_kv']):<9} "
                  f"acceptance {rate:.3f} same as plain {row['same_as_plain']} "
                  f"(first divergence {row['first_divergence_from_plain']})", flush=True)
    for row in rows:
        base = next(r for r in rows if r["method"] == row["method"] and r["target_kv"] == "auto"
                    and r["draft_kv"] in (None, "auto"))
        row["acceptance_change"] = row["acceptance"] - base["acceptance"]
    return {"k": args.k, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model", default=None, help="also measure draft-model acceptance")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    ap.add_argument("--quantization", default=None, help="weights, as EngineConfig.quantization (int4, int8)")
    ap.add_argument("--chunk", type=int, default=64, help="teacher-forcing chunk (tokens per forward)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--spec-methods", nargs="*", default=["ngram", "draft"], choices=["ngram", "draft"],
                    help="speculation methods whose acceptance to measure (none: skip)")
    ap.add_argument("--smooth-keys", default="on", choices=["on", "off", "both"],
                    help="K smoothing of quantized pools (chatserve/kv_smooth.py): on (the engine's "
                         "default), off, or both (each quantized format twice)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert args.formats[0] == "auto", "the first format is the reference: auto"
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = SpecConfig(method="draft", draft_model=args.draft_model) if args.draft_model else None
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=32 << 20, spec=spec,
                          max_num_seqs=4, num_threads=args.threads, quantization=args.quantization)
    models = load_models(config)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=4, num_threads=args.threads,
                          quantization=args.quantization)
    text = EVAL_TEXT.read_text()
    text_ids = models.tokenizer.encode(text)
    greedy_prompts, spec_prompts = build_prompts(models.tokenizer, text)
    budget = 640 << 20  # per engine; every prompt and the whole text fit many times over
    load_before = load_avg()
    print(f"{args.model} {args.dtype}: {len(text_ids)} text tokens, chunks of {args.chunk}; load {load_before}",
          flush=True)
    rows = quality_per_format(models, config, args, text_ids, greedy_prompts, budget)
    print(f"  {'format':<20} {'ppl':>8} {'change':>8} {'top1 agr':>9} {'greedy agr':>10}  first divergence")
    for fmt, row in rows.items():
        goal = {True: " met", False: " MISSED"}.get(row.get("meets_goal"), "")
        print(f"  {fmt:<20} {row['ppl']:>8.4f} {row['ppl_change']:>+8.3%} {row['teacher_forced_top1_agreement']:>9.4f}"
              f" {row['token_agreement']:>10.3f}  {row['first_divergence']}{goal}", flush=True)
    report = {"model": args.model, "dtype": args.dtype, "draft_model": args.draft_model,
              "text": str(EVAL_TEXT.name), "text_tokens": len(text_ids), "chunk": args.chunk,
              "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "goals": GOALS,
              "loadavg_before": load_before, "smooth_keys": args.smooth_keys, "formats": rows}
    if args.spec_methods:
        report["speculation"] = acceptance(models, config, args, spec_prompts, budget)
    report["loadavg_after"] = load_avg()
    # seconds each model's K-mean calibration took (None: it never ran, no smoothed pool)
    report["calibration_seconds"] = {name: getattr(m, "kv_key_means_seconds", None)
                                     for name, m in (("target", models.target), ("draft", models.draft)) if m}
    write_report(report, args.out, f"kv_quality_{args.model}_{args.dtype}.json")


if __name__ == "__main__":
    main()
