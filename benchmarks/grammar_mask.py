"""What a grammar mask costs per token: llguidance (what the engine uses, chatserve/grammar.py)
and, when it imports, xgrammar, on a JSON schema with the models' real tokenizers.

Walks a pretty-printed JSON document that matches the schema, token by token as the model's
tokenizer splits it: at each token computes the mask of allowed next tokens, then consumes the
token. Prints microseconds per token (median over the walk, p90, max) and writes JSON.

    python benchmarks/grammar_mask.py                     # the catalog models found locally
    PYTHONPATH=/tmp/xg python benchmarks/grammar_mask.py  # with xgrammar installed there
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chatserve.grammar import JSON_OPTIONS, GrammarMatcher, grammar_tokenizer, json_schema_grammar  # noqa: E402
from chatserve.tokenizer import Tokenizer  # noqa: E402

MODELS = Path.home() / ".cache/chatserve/models"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                     "required": ["name", "vip"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["id", "customer", "items", "status", "notes"],
    "additionalProperties": False,
}
DOCUMENT = {"id": 4711, "customer": {"name": "Ada Lovelace", "vip": True},
            "items": [{"sku": "ABC-1234", "quantity": 2, "price": 19.99},
                      {"sku": "XYZ-0042", "quantity": 1, "price": 5.5}],
            "status": "shipped", "notes": "Leave the parcel at the back door, please."}


def summary(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))], "max_us": us[-1],
            "mean_us": statistics.fmean(us)}


def walk(token_ids: list[int], mask, consume, reset, repeats: int) -> dict:
    """Per token: the fastest of `repeats` walks (mask time, consume time)."""
    mask_s = [float("inf")] * len(token_ids)
    consume_s = [float("inf")] * len(token_ids)
    for _ in range(repeats):
        reset()
        for i, t in enumerate(token_ids):
            start = time.perf_counter()
            mask()
            mid = time.perf_counter()
            consume(t)
            mask_s[i] = min(mask_s[i], mid - start)
            consume_s[i] = min(consume_s[i], time.perf_counter() - mid)
    return {"mask": summary(mask_s), "consume": summary(consume_s)}


def bench_llguidance(tok: Tokenizer, vocab_size: int, token_ids: list[int], repeats: int) -> dict:
    start = time.perf_counter()
    ll_tok = grammar_tokenizer(tok.hf, tok.eos_token_ids)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    matcher = GrammarMatcher(ll_tok, json_schema_grammar(SCHEMA))
    compile_s = time.perf_counter() - start
    assert matcher.num_valid(token_ids) == len(token_ids), "the document must match the schema"
    m = matcher.matcher
    bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # [vocab / 32] one bit per token
    engine_path = walk(token_ids, lambda: matcher.mask(vocab_size), m.consume_token, m.reset, repeats)
    raw = walk(token_ids, lambda: m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4),
               m.consume_token, m.reset, repeats)
    return {"tokenizer_build_s": tokenizer_s, "grammar_compile_s": compile_s,
            "engine_mask": engine_path, "raw_bitmask": raw}


def bench_xgrammar(tok: Tokenizer, vocab_size: int, token_ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab_size)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, vocab / 32] int32
    result = walk(token_ids, lambda: matcher.fill_next_token_bitmask(bitmask),
                  lambda t: _check(matcher.accept_token(t)), matcher.reset, repeats)
    return {"tokenizer_build_s": tokenizer_s, "grammar_compile_s": compile_s, "raw_bitmask": result}


def _check(accepted: bool) -> None:
    assert accepted, "xgrammar refused a token of the document"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/grammar_mask.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = json.dumps(DOCUMENT, indent=2)
    results = {"schema": SCHEMA, "document_chars": len(text), "json_options": JSON_OPTIONS,
               "threads": 1, "models": {}}
    for name in args.models:
        model_dir = MODELS / name
        if not (model_dir / "tokenizer.json").exists():
            print(f"{name}: not in {MODELS}, skipped")
            continue
        tok = Tokenizer(model_dir)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]  # LM head rows
        token_ids = tok.hf.encode(text, add_special_tokens=False)
        row = {"vocab_size": vocab_size, "tokenizer_size": len(tok.hf), "num_tokens": len(token_ids),
               "llguidance": bench_llguidance(tok, vocab_size, token_ids, args.repeats)}
        try:
            row["xgrammar"] = bench_xgrammar(tok, vocab_size, token_ids, args.repeats)
        except ImportError as e:
            row["xgrammar"] = f"not installed: {e}"
        results["models"][name] = row
        print_row(name, row)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


def print_row(name: str, row: dict) -> None:
    print(f"{name}: vocab {row['vocab_size']}, {row['num_tokens']} tokens")
    for lib in ("llguidance", "xgrammar"):
        r = row[lib]
        if isinstance(r, str):
            print(f"  {lib}: {r}")
            continue
        print(f"  {lib}: tokenizer {r['tokenizer_build_s']:.2f} s, grammar {r['grammar_compile_s'] * 1e3:.1f} ms")
        for what in ("engine_mask", "raw_bitmask"):
            if what in r:
                m, c = r[what]["mask"], r[what]["consume"]
                print(f"    {what:12s} mask median {m['median_us']:8.1f} us  p90 {m['p90_us']:8.1f}  max "
                      f"{m['max_us']:9.1f}   consume median {c['median_us']:6.1f} us")


if __name__ == "__main__":
    main()
