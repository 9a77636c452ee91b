"""`chatserve` command line: generate, serve, train-head, models, pull. Parsing and printing only."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from chatserve.config import DRAFT_CATCH_UPS, KV_CACHE_DTYPES, EngineConfig, ServerConfig, SpecConfig
from kernels.backend import DEVICES, KERNELS


def _engine_args(p: argparse.ArgumentParser, default_model: str, speculate_by_default: bool) -> None:
    from chatserve.spec_methods import SPEC_METHODS

    methods = ", ".join(f"{name} = {cls.label}" for name, cls in SPEC_METHODS.items())
    p.add_argument("--model", default=default_model, help="catalog name, local HF directory, .gguf file or hub id")
    p.add_argument("--draft-model", default=None,
                   help="draft model for speculation (same tokenizer)" + (
                       "; default: the catalog's draft for the model's tokenizer, if there is one" if speculate_by_default else ""))
    p.add_argument("--draft", choices=[*SPEC_METHODS, "model"], default=None,
                   help=f"the default speculation method ({methods}; 'model' = 'draft'); requests may ask "
                        f"for another one" + ("; default: draft with a fitting draft model, else suffix"
                                              if speculate_by_default else ""))
    p.set_defaults(speculate_by_default=speculate_by_default)
    p.add_argument("--no-spec", action="store_true", help="disable speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="maximum draft length k")
    p.add_argument("--num-free-draft-tokens", type=int, default=SpecConfig.num_free_draft_tokens, metavar="K",
                   help="maximum k of n-gram and suffix proposals under adaptive k, which prices their "
                        "verification rows (default %(default)s)")
    p.add_argument("--no-adaptive", action="store_true", help="always draft k tokens (no adaptive k)")
    p.add_argument("--eagle-head", default=None, metavar="PATH",
                   help="EAGLE head file for --draft eagle (default: the one `chatserve train-head` saved for "
                        "the model's weights)")
    p.add_argument("--no-costs-cache", action="store_true",
                   help="time adaptive k's cost table (~200 forwards) at this start and keep nothing; by default "
                        "it is kept in the cache dir by machine and models, and a later start reads it back")
    p.add_argument("--no-weights-cache", action="store_true",
                   help="convert the model's weights (int4 / int8) at this start and keep nothing; by default the "
                        "converted model is kept in the cache dir (~1.2 GB for a 1.5B) and a later start reads it back")
    p.add_argument("--draft-catch-up", default="decode", choices=DRAFT_CATCH_UPS,
                   help="when a draft model catches up on tokens it has not seen: in bounded chunks inside "
                        "decode steps (default), beside the target's prefill chunks, or all at once")
    p.add_argument("--suffix-corpus-tokens", type=int, default=1 << 16, metavar="N",
                   help="suffix decoding also matches the last N tokens of all requests' replies (default 65536); "
                        "0 = each request's own tokens only")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where the engine runs: cpu (default), cuda (fails at start without a CUDA device), "
                        "or auto (CUDA when torch sees one, else the CPU)")
    p.add_argument("--kernels", default="auto", choices=KERNELS,
                   help="attention and KV store: auto = Triton on CUDA, torch on the CPU; triton on the CPU "
                        "runs Triton's interpreter (needs TRITON_INTERPRET=1; slow, for testing the GPU path)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation and unquantized-weight dtype: auto = bfloat16 on CUDA; on the CPU float32 with "
                        "int4 / int8 weights (their kernels take float32), else bfloat16 where the CPU has native "
                        "bf16 (AVX-512 BF16 / AMX), else float32 (float32 for bit-exact comparisons)")
    p.add_argument("--quantization", "-q", default="auto", choices=["auto", "int4", "int8", "none", "bnb-int8", "bnb-nf4"],
                   help="weight quantization after loading: auto (default) = on the CPU int4 where its kernel "
                        "builds (groups of 32, 0.625 bytes per weight; LM head int8), else int8 (per channel); "
                        "on CUDA none; none = weights in --dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache format. auto: fp16 on the CPU with a float32 model (half the memory of fp32, "
                        "read by the C++ kernels; perplexity within 0.1%%), the model dtype on CUDA; fp32 keeps "
                        "the float32 cache")
    p.add_argument("--draft-kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                   help="the draft model's KV format (default: same as --kv-cache-dtype)")
    p.add_argument("--kv-cache-unquantized-layers", type=int, default=0, metavar="N",
                   help="with a quantized KV cache, keep the target's first N layers in the model dtype "
                        "(no longer needed for Qwen2.5: K smoothing handles its layer-0 K outliers)")
    p.add_argument("--no-kv-smooth-keys", action="store_true",
                   help="quantized KV caches: do not subtract the calibrated per-channel K mean "
                        "(smoothing is lossless and on by default; this is for comparisons)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, help="pool bytes, e.g. 2G or 512M")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="token budget per engine step (the prefill chunk size)")
    p.add_argument("--stall-limit", type=float, default=EngineConfig.stall_limit,
                   help="beside running streams, size prompt chunks so a step takes at most this many "
                        "decode steps (measured); 0 = only the token budget")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file to use instead of the tokenizer's")


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def speculation(args) -> tuple[str | None, str | None, str]:
    """(method, draft model, why) from the arguments. A named drafter is used as named (an
    incompatible draft model fails at load); `serve` without one takes an EAGLE head trained for
    the model's weights (`chatserve train-head`; measured faster than the 0.5B draft on pasted
    code and short prompts alike, docs/benchmarks.md session 33), else the catalog's draft for the
    model's tokenizer, else drafts by suffix decoding, which needs no model."""
    from chatserve.catalog import default_draft
    from chatserve.head_store import trained_head

    if args.no_spec:
        return None, None, "speculation off (--no-spec)"
    method = "draft" if args.draft == "model" else args.draft
    if args.draft_model:
        return method or "draft", args.draft_model, "as named"
    if method not in (None, "draft"):
        return method, None, "as named"
    if method is None and not args.speculate_by_default:
        return None, None, "speculation off"
    head = trained_head(args.model) if method is None and not args.eagle_head else None
    if head:
        return "eagle", None, (f"the EAGLE head trained for {args.model}'s weights ({head}; "
                               "--draft draft for the draft model)")
    chosen = default_draft(args.model)
    if chosen:
        return "draft", chosen, f"the catalog's draft model for {args.model}'s tokenizer"
    if method == "draft":
        raise ValueError(f"--draft draft: no catalog draft model shares {args.model}'s tokenizer; "
                         f"name one with --draft-model")
    return "suffix", None, f"no catalog draft model shares {args.model}'s tokenizer; suffix decoding needs none"


def engine_config(args, chosen: tuple[str | None, str | None, str] | None = None) -> EngineConfig:
    """The engine's config from the arguments; `chosen`: speculation(args) when the caller has it."""
    method, draft_model, _ = chosen or speculation(args)
    spec = None
    if method:
        spec = SpecConfig(
            method=method,
            draft_model=draft_model,
            num_draft_tokens=args.num_draft_tokens,
            num_free_draft_tokens=args.num_free_draft_tokens,
            adaptive=not args.no_adaptive,
            draft_kv_cache_dtype=args.draft_kv_cache_dtype,
            draft_catch_up=args.draft_catch_up,
            eagle_head=args.eagle_head,
            suffix_corpus_tokens=args.suffix_corpus_tokens,
            costs_cache_dir=None if args.no_costs_cache else str(_costs_cache_dir()),
        )
    from kernels.backend import resolve_device

    device = resolve_device(args.device)  # a missing GPU fails here, before anything loads
    quantization = _quantization(args.quantization, device)
    dtype = _dtype(args.dtype, device, quantization)
    return EngineConfig(
        model=args.model,
        device=device,
        kernels=args.kernels,
        dtype=dtype,
        kv_cache_dtype=_kv_cache_dtype(args.kv_cache_dtype, device, dtype),
        kv_cache_unquantized_layers=args.kv_cache_unquantized_layers,
        kv_smooth_keys=not args.no_kv_smooth_keys,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stall_limit=args.stall_limit,
        num_threads=args.threads,
        spec=spec,
        quantization=quantization,
        chat_template=args.chat_template,
        converted_cache_dir=None if args.no_weights_cache else str(_converted_cache_dir()),
    )


def _converted_cache_dir() -> Path:
    from chatserve.catalog import cache_dir

    return cache_dir() / "converted"


def _costs_cache_dir() -> Path:
    from chatserve.catalog import cache_dir

    return cache_dir() / "spec-costs"


def _dtype(choice: str, device: str, quantization: str | None) -> str:
    if choice != "auto":
        return choice
    if device == "cuda":
        return "bfloat16"
    from kernels import quant_matmul
    from kernels.cpu_features import default_dtype

    return default_dtype(quantization in ("int4", "int8") and quant_matmul.is_available())


def _kv_cache_dtype(choice: str, device: str, dtype: str) -> str:
    """auto: a float32 model on the CPU keeps its KV in 16 bits where the C++ kernels read it (half
    the bytes per token; at 2k tokens SmolLM2's decode step 14.6 -> 10.6 ms, Qwen 1.5B's 48 -> 46:
    docs/benchmarks.md, session 27): bf16 where the attention multiplies it on AMX tiles (a
    verification row at 2k tokens then costs a fraction of the widened loops': session 28), else
    fp16 (closer to float32 than bf16); else the model dtype."""
    if choice != "auto" or device == "cuda" or dtype != "float32":
        return choice
    from kernels import cpu_ext

    ext = cpu_ext.extension()
    if ext is None:
        return "auto"
    return "bf16" if ext.amx_enabled() else "fp16"


def _quantization(choice: str, device: str = "cpu") -> str | None:
    if choice == "auto" and device == "cuda":
        return None  # the int4 / int8 kernels are the CPU's
    if choice == "auto":
        from kernels import quant_matmul

        return "int4" if quant_matmul.is_available() else "int8"
    return None if choice == "none" else choice


def cmd_generate(args) -> int:
    from chatserve.engine import Engine
    from chatserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    engine = Engine(engine_config(args))
    tok = engine.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    engine.add_request(prompt_ids, params, "cli")
    text, token_ids, final = [], [], None
    while engine.has_unfinished():
        for d in engine.step():
            text.append(d.text)
            token_ids += d.token_ids
            if not args.json:
                print(d.text, end="", flush=True)
            if d.finished:
                final = d
    st = final.stats
    if args.json:
        out = {
            "text": "".join(text),
            "token_ids": token_ids,
            "prompt_tokens": len(prompt_ids),
            "finish_reason": final.finish_reason,
            "stats": {**st.to_dict(), "num_generated": len(token_ids)},
        }
        print(json.dumps(out))
    else:
        rate = f", acceptance {st.acceptance_rate:.0%}" if st.acceptance_rate is not None else ""
        tpot = f"{st.tpot_ms:.1f}" if st.tpot_ms is not None else "-"
        print(f"\n[{final.finish_reason}] {len(token_ids)} tokens, TTFT {st.ttft_ms:.0f} ms, TPOT {tpot} ms{rate}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    if args.replicas > 1:
        return cmd_serve_replicas(args)
    from chatserve.async_engine import AsyncEngine
    from chatserve.engine import Engine
    from chatserve.loading import limit_malloc_arenas
    from chatserve.server import run_server

    limit_malloc_arenas()  # before the engine's and uvicorn's threads exist
    chosen = speculation(args)  # once: it looks for a trained head in the cache
    config = engine_config(args, chosen)
    start = time.perf_counter()
    draft = None if not config.spec else (config.spec.draft_model or config.spec.method)
    print(f"loading {config.model} (draft: {draft}: {chosen[2]})...", file=sys.stderr, flush=True)
    engine = Engine(config)
    mem = {k: v / 2**30 for k, v in engine.memory_stats().items()}
    methods = ", ".join(engine.spec_methods) or "none"
    costs = f"; adaptive k's costs {engine.spec.costs_source}" if engine.spec else ""
    costs += f"; weights {engine.models.converted_source}"
    print(f"loaded {config.model} (draft: {draft}; methods: {methods}{costs}) in {time.perf_counter() - start:.1f} s; "
          f"weights {config.quantization or config.dtype}: {mem['weights_bytes']:.2f} GiB, resident "
          f"{mem['rss_bytes']:.2f} GiB (peak {mem['peak_rss_bytes']:.2f}), KV pool {mem['kv_pool_bytes']:.2f} GiB "
          f"(included)", file=sys.stderr)
    config_for_server = server_config(args)
    run_server(AsyncEngine(engine, config_for_server.served_model_name, draft), config_for_server)
    return 0


def cmd_serve_replicas(args) -> int:
    """`serve --replicas N`: N engines behind Ray Serve (chatserve/scale/), same flags."""
    from chatserve.scale.launch import require_ray, serve_replicas

    require_ray()  # before any loading: without ray this is a start error (exit 2)
    config = engine_config(args)
    draft = None if not config.spec else (config.spec.draft_model or config.spec.method)
    print(f"starting {args.replicas} replicas of {config.model} (draft: {draft}) on Ray Serve...", file=sys.stderr,
          flush=True)
    serve_replicas(config, server_config(args), args.replicas, draft)
    return 0


def server_config(args) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allowed_origins=tuple(args.allowed_origins or ()),
        max_message_bytes=args.max_message_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_connections=args.max_connections,
        max_queued_requests=args.max_queued_requests,
        max_pending_output_bytes=args.max_pending_output_bytes,
        shutdown_grace=args.shutdown_grace,
        served_model_name=args.served_model_name or args.model,
        use_generation_config=not args.no_generation_config,
    )


def _feature_layers(values: list[str] | None) -> tuple[int, ...] | None:
    """--feature-layers: None (not given), () for `final`, else the layer indices, increasing."""
    if values is None:
        return None
    if values == ["final"]:
        return ()
    try:
        layers = tuple(int(v) for v in values)
    except ValueError:
        raise SystemExit(f"--feature-layers: layer indices or `final`, got {' '.join(values)}") from None
    if list(layers) != sorted(set(layers)):
        raise SystemExit(f"--feature-layers: increasing layer indices, got {' '.join(values)}")
    return layers


def cmd_train_head(args) -> int:
    import torch

    from chatserve.engine import Engine
    from chatserve.loading import resolve
    from chatserve.train_head import VAL_DEPTH, TrainConfig, retain_freed_memory, run

    retain_freed_memory()  # a batch job: each step's large tensors reuse the last step's memory

    cfg = TrainConfig(minutes=args.minutes, max_steps=args.max_steps, max_data_tokens=args.max_data_tokens,
                      reply_tokens=args.reply_tokens, min_free_gb=args.min_free_gb,
                      head_vocab_size=args.head_vocab_size, fresh=args.fresh,
                      seed=args.seed, unroll=args.unroll, feature_weight=args.feature_weight,
                      greedy_weight=args.greedy_weight,
                      data_share=args.data_share, init=args.init, train_dtype=args.train_dtype,
                      head_intermediate_size=args.head_intermediate_size,
                      data_batch=args.data_batch, questions_per_task=args.questions_per_task,
                      sampled_questions=args.sampled_questions,
                      feature_layers=_feature_layers(args.feature_layers),
                      reply_only=args.loss_rows == "replies", request_weight=args.request_weight,
                      **{k: v for k, v in (("window", args.window), ("batch_tokens", args.batch_tokens),
                                            ("lr", args.lr)) if v})
    quantization = _quantization(args.quantization)
    dtype = _dtype(args.dtype, "cpu", quantization)
    engine = Engine(EngineConfig(
        model=args.model,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=_kv_cache_dtype("auto", "cpu", dtype),  # features as serve's default computes them
        max_model_len=args.max_model_len,
        max_num_seqs=args.data_batch,  # head_data.collect answers this many prompts at once
        # a batch job: no stream to keep from stalling, so prompt chunks take the whole budget
        # (on Qwen 1.5B, 64 prompts: 203 tokens/s against 188 at serve's 256 / 2.5; session 34)
        max_num_batched_tokens=512,
        stall_limit=0.0,
        enable_prefix_caching=False,  # every position fed, so its feature is recorded
        num_threads=args.threads,
    ))
    path = run(engine, args.model, resolve(args.model), cfg, args.out, show_progress=not args.quiet)
    if path is None:
        # the data lies beside --out's head: the next run must name the same file to find it
        out = ["--out", args.out] if args.out else []
        again = shlex.join(["chatserve", "train-head", "--model", args.model, *out, "--data-share", "0"])
        print(f"train-head: the budget went to collecting data (saved; it grows on the next run); nothing trained. "
              f"Train with: {again} (and this run's head and training flags)", file=sys.stderr)
        return 0
    info = torch.load(path, weights_only=True)["info"]
    if "imported_from" in info:  # no step of this run validated better than the head it went on from
        print(f"EAGLE head for {args.model}: {path}\n  still the one imported from {info['imported_from']}: this "
              f"run's {info['last_steps']} steps validated no better (its last held-out chain of {VAL_DEPTH}: "
              f"{info.get('last_val_accepted') or float('nan'):.2f} tokens a verification)\n"
              f"  serve with: chatserve serve --model {args.model} --draft eagle", file=sys.stderr)
        return 0
    layers = info.get("feature_layers")
    features = f"layers {', '.join(map(str, layers))} fused (EAGLE-3)" if layers else "the final feature (EAGLE-1)"
    print(f"EAGLE head for {args.model}: {path}\n  reads {features}; {info['steps']} steps in "
          f"{info['train_seconds']} s on {info['num_tokens']} tokens; vocabulary {info['num_kept']} ids covering "
          f"{info['coverage']:.1%} of reply tokens; last batch: top-1 agreement "
          f"{info['final'].get('top1', float('nan')):.2f}"
          + (f"; held-out replies: top-1 {info['val_top1']:.2f}, a chain of {VAL_DEPTH} accepts "
             f"{info['val_accepted']:.2f} tokens a verification (this run's last: {info['last_val_accepted']:.2f})"
             + (f", {info['val_walked']:.2f} walked as serving walks a reply" if info.get("val_walked") else "")
             if info.get("val_accepted") is not None and info.get("last_val_accepted") is not None else "") + "\n"
          f"  serve with: chatserve serve --model {args.model} --draft eagle", file=sys.stderr)
    return 0


def cmd_export_head(args) -> int:
    from chatserve.head_store import default_head_path, export_portable, train_hint, weights_hash
    from chatserve.loading import resolve

    head = Path(args.head) if args.head else default_head_path(weights_hash(resolve(args.model)))
    if not head.is_file():
        raise FileNotFoundError(f"no EAGLE head for {args.model} at {head}; {train_hint(args.model)}")
    export_portable(head, Path(args.out))
    print(f"{head} -> {args.out} ({Path(args.out).stat().st_size / 2**20:.1f} MiB); on another machine: "
          f"chatserve import-head --model {args.model} {args.out}", file=sys.stderr)
    return 0


def cmd_import_head(args) -> int:
    from chatserve.head_store import default_head_path, head_checkpoint_path, import_portable, weights_hash
    from chatserve.loading import resolve

    target_dir = resolve(args.model)
    out = Path(args.out) if args.out else default_head_path(weights_hash(target_dir))
    if out.is_file() and not args.force:
        raise ValueError(f"{out} holds a head already (trained here?); --force replaces it")
    import_portable(Path(args.file), args.model, target_dir, out)
    print(f"{args.file} -> {out}\n  serve with: chatserve serve --model {args.model} --draft eagle\n"
          f"  train it further with: chatserve train-head --model {args.model}"
          + (f" --out {shlex.quote(str(out))}" if args.out else ""), file=sys.stderr)
    stale = head_checkpoint_path(out)
    if stale.is_file():  # the replaced head's: train-head would go on from it, not from the imported head
        print(f"  note: {stale} is the replaced head's training checkpoint, and train-head goes on from a "
              f"checkpoint first; delete it to go on from the imported head", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from chatserve.catalog import cmd_models as show

    show()
    return 0


def cmd_pull(args) -> int:
    from chatserve.catalog import cmd_pull as pull

    pull(args.name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from chatserve.catalog import DEFAULT_TARGET, SMALL_MODEL

    parser = argparse.ArgumentParser(prog="chatserve", description="Low-latency speculative LLM chat server")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _engine_args(g, SMALL_MODEL, speculate_by_default=False)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="start the websocket / OpenAI-compatible chat server")
    _engine_args(s, DEFAULT_TARGET, speculate_by_default=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--allowed-origins", nargs="*", default=None)
    s.add_argument("--max-message-bytes", type=int, default=1 << 20)
    s.add_argument("--max-prompt-tokens", type=int, default=None)
    s.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="the largest websocket max_tokens and the default of a chat completion; HTTP requests "
                        "may ask for up to the context")
    s.add_argument("--max-connections", type=int, default=64, help="open websockets + in-flight HTTP generations")
    s.add_argument("--max-queued-requests", type=int, default=48, metavar="N",
                   help="generations allowed to wait beyond --max-num-seqs; past it new ones get 429 + Retry-After")
    s.add_argument("--max-pending-output-bytes", type=_bytes, default=256 << 10, metavar="BYTES",
                   help="output a websocket client may leave unread before it is dropped (close code 4008), "
                        "e.g. 256K")
    s.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long running generations may finish before they are aborted")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--no-generation-config", action="store_true",
                   help="ignore the model's generation_config.json sampling defaults (temperature, top_p, top_k, "
                        "min_p, repetition_penalty); requests that leave them out get chatserve's own")
    s.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N > 1: N engine replicas behind Ray Serve with conversation affinity (needs "
                        "pip install chatserve[scale]; docs/scale-out.md)")
    s.set_defaults(func=cmd_serve)
    _defaults_from_env(s)

    t = sub.add_parser("train-head", help="train an EAGLE draft head for a model on this machine (no network)")
    t.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, local HF directory or .gguf file")
    t.add_argument("--minutes", type=float, default=30.0,
                   help="wall-clock budget of this run, data included; run again to continue from the checkpoint")
    t.add_argument("--out", default=None, help="head file (default: the cache dir, keyed by a hash of the weights)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps in all")
    t.add_argument("--max-data-tokens", type=int, default=200_000, help="tokens of training data to collect")
    t.add_argument("--min-free-gb", type=float, default=10.0,
                   help="collecting stops before a round that could leave less than this free on the cache's "
                        "disk (the features take ~12 KB a token on Qwen 1.5B)")
    t.add_argument("--data-share", type=float, default=0.3,
                   help="share of --minutes for collecting data while fewer than --max-data-tokens are saved "
                        "(saved as it goes: a later run collects more; 1 = collect only, 0 = train only)")
    t.add_argument("--data-batch", type=int, default=32,
                   help="prompts answered at once while collecting data (more rows a step: more tokens a second)")
    t.add_argument("--questions-per-task", type=int, default=1, metavar="N",
                   help="while collecting: the model's own questions (chat, requests to write code) asked after "
                        "each task on pasted source; more moves the data to what users send (default 1)")
    t.add_argument("--sampled-questions", action="store_true",
                   help="while collecting: the model writes new questions for each --seed, sampled, and asked for "
                        "specific code requests, instead of its one greedy set a topic (used up after a few seeds)")
    t.add_argument("--reply-tokens", type=int, default=256, help="max tokens of each of the model's own replies")
    t.add_argument("--head-vocab-size", type=int, default=None,
                   help="rows of the head's LM head (most frequent ids); default 32768 for a new head, a resumed "
                        "head keeps its size")
    t.add_argument("--fresh", action="store_true", help="ignore saved data and checkpoint: start over")
    t.add_argument("--unroll", type=int, default=1,
                   help="training-time test: also train each row as the 2nd..Nth token of a drafted chain, "
                        "from the head's own features (N passes; each costs about one more pass)")
    t.add_argument("--feature-weight", type=float, default=1.0,
                   help="weight of the feature regression beside the token loss (EAGLE); 0 = the token loss alone "
                        "(EAGLE-3: the head's feature only serves its tokens), best with --unroll")
    t.add_argument("--greedy-weight", type=float, default=0.0,
                   help="weight of a cross-entropy on the model's top token beside the soft one over its "
                        "distribution (T = 0 accepts exactly that token); 0 = the soft one alone")
    t.add_argument("--window", type=int, default=None,
                   help="positions of each training window (default 256): the context the head's layer learns "
                        "to attend over; served, it attends over the whole conversation")
    t.add_argument("--batch-tokens", type=int, default=None,
                   help="positions per optimizer step (default 512), in batch-tokens // window windows")
    t.add_argument("--loss-rows", default="all", choices=["all", "replies"],
                   help="positions the loss is taken over: all, or the replies' only (prompts stay context, "
                        "as EAGLE's data masks the user's turns; a plain source file keeps all; on SmolLM2 "
                        "its head drafted worse: the prompts' rows teach it what replies copy)")
    t.add_argument("--request-weight", type=float, default=1.0, metavar="W",
                   help="draw the replies to requests (chat, and requests to write code: what users send) W times "
                        "as often per token as the tasks on given source code, and weigh their held-out replies W "
                        "times in the validation that picks the saved head (default 1: by length alone)")
    t.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 6e-4): warm-up, then a cosine to a tenth over the run")
    t.add_argument("--feature-layers", nargs="+", default=None, metavar="LAYER",
                   help="the model layers a new head fuses as its input (EAGLE-3), or `final` for the final norm's "
                        "output alone (EAGLE-1); default: a resumed head's, else 2, L // 2 and L - 3")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--init", default="random", choices=["random", "last-layer"],
                   help="a new head's layer: at random, or a copy of the model's last layer (fc passes the token's "
                        "embedding); ignored when resuming")
    t.add_argument("--head-intermediate-size", type=int, default=None, metavar="N",
                   help="a new head's MLP width (default: the model's; the MLP is most of the head's layer, so a "
                        "narrower one trains and drafts faster); a resumed head keeps its own")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="as for serve: features come from the model as it will be served")
    t.add_argument("--train-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the training step's compute dtype (weights and the saved head stay float32); auto: "
                        "bfloat16 where the CPU has AMX (amx_bf16), else float32")
    t.add_argument("--quantization", "-q", default="auto",
                   choices=["auto", "int4", "int8", "none", "bnb-int8", "bnb-nf4"], help="as for serve")
    t.add_argument("--max-model-len", type=int, default=4096)
    t.add_argument("--threads", type=int, default=None, help="torch threads")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train_head)

    e = sub.add_parser("export-head", help="write a model's trained EAGLE head as a portable file (31 MiB for a "
                                           "1.5B model) for import-head on another machine")
    e.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, local HF directory or .gguf file")
    e.add_argument("--head", default=None, help="head file (default: the cache's head for the model's weights)")
    e.add_argument("out", help="the portable file to write")
    e.set_defaults(func=cmd_export_head)
    i = sub.add_parser("import-head", help="make a portable head (export-head) this machine's head for the model: "
                                           "served by --draft eagle, and where train-head goes on from")
    i.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, local HF directory or .gguf file")
    i.add_argument("--out", default=None, help="head file (default: the cache dir, keyed by a hash of the weights)")
    i.add_argument("--force", action="store_true", help="replace a head already there")
    i.add_argument("file", help="a portable head written by export-head")
    i.set_defaults(func=cmd_import_head)

    m = sub.add_parser("models", help="list the model catalog")
    m.set_defaults(func=cmd_models)
    p = sub.add_parser("pull", help="fetch a catalog model into the cache")
    p.add_argument("name")
    p.set_defaults(func=cmd_pull)

    from chatserve.bench.cli import add_arguments as add_bench_arguments, cmd_bench

    b = sub.add_parser("bench", help="latency benchmark against a server (TTFT/TPOT/ITL, sweeps, baseline)")
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)
    return parser


ENV_PREFIX = "CHATSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _defaults_from_env(parser: argparse.ArgumentParser) -> None:
    """Each flag of `parser` takes its default from CHATSERVE_<FLAG> when that is set (--api-key:
    CHATSERVE_API_KEY), so a container sets flags in its environment; the command line still wins.
    Switches take 1/true/yes/on or 0/false/no/off; list flags take space- or comma-separated items."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        name = ENV_PREFIX + action.dest.upper()
        if action.help != argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env: {name}]".lstrip()
        if name in os.environ:
            try:
                action.default = _env_value(action, os.environ[name])
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{name}={os.environ[name]!r}: {e}")


def _env_value(action: argparse.Action, text: str):
    if isinstance(action, argparse._StoreTrueAction):
        if text.strip().lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected one of {', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}")
        return text.strip().lower() in _TRUE
    if action.nargs in ("*", "+"):
        return text.replace(",", " ").split()
    value = action.type(text) if action.type else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"chatserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
