"""An EAGLE head against its target (issue #14): the cost of one head draft step as a fraction of
a one-row target step, then acceptance, mean accepted length and decode speed with speculation
off, the EAGLE head and (if given) a draft model, at T = 0 on the held-out prompts of
chatserve/data/prompts.json (the head is trained on data/head_prompts.json), at batch 1 and 2,
in-process, one run (--lockstep: all engines at once, their steps interleaved, each round's
speed-up over off paired: on a noisy host the only reading that holds; --turn-steps 8 when the engines'
weights outgrow the L3, as a Qwen pair's do). Greedy outputs are checked equal to speculation off. Several --eagle-head
files run side by side as eagle1, eagle2, ... (e.g. an EAGLE-3 head and an EAGLE-1 head on the
same data); an EAGLE-3 head's fuse, paid once a target step on the rows it fed, is timed apart.
--variant runs the EAGLE head again with settings changed (a SpecConfig field or a SpecRunner
attribute), to pair a decision against the default inside one run, e.g.
--variant two_prices:keeps_computed_drafts=true no_stop:confidence_stop=false k8:num_draft_tokens=8
cal:calibrated_stop=true (greedy chains stop on the head's fitted power; eagle.greedy_stop_power=0.7 sets one)
(METHOD.ATTRIBUTE sets a speculation method's attribute, e.g. suffix.probe_every=4; upkeep:drafts=false
keeps the head up but drafts nothing: what being ready to draft costs). --no-eagle runs off and the draft
model alone (a target with no head), its variants then the draft's, e.g. --variant ema20:accept_ema=0.2

    python benchmarks/eagle_head.py --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --out benchmarks/results/eagle_qwen.json
"""
import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.batch import BatchItem  # noqa: E402
from chatserve.block_manager import BlockTable  # noqa: E402
from chatserve.config import EngineConfig, SpecConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())
LONG = ROOT / "benchmarks/data/long_context.json"  # long_context.py's files and turns


def workload_prompts(kind: str) -> list[str]:
    """A workload's user messages: prompts.json's held-out ones (code, chat, edit); for paste, each
    of long_context.py's files (1-2.8k tokens) with its paste session's first question."""
    if kind in PROMPTS:
        return PROMPTS[kind]
    data = json.loads(LONG.read_text())
    return [data["paste_turns"][0].format(name=name, code=code) for name, code in data["files"].items()]


def chat_prompts(tokenizer, kind: str, messages: list[str] | None = None) -> list[list[int]]:
    """A workload's user messages (workload_prompts, or `messages`) as the chat template lays out a first turn."""
    messages = workload_prompts(kind) if messages is None else messages
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in messages]


def best_ms(fn, reps: int = 5, before=None) -> float:
    """The fastest of `reps` calls of fn in ms (after one untimed), each after an untimed call of `before`."""
    fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


@torch.inference_mode()
def step_costs(engine: Engine, context: int) -> dict:
    """One-row target forward vs one head draft step (layer + norm + LM head), both at `context`: the
    modules' (head_step_ms, as sampled drafts run) and the C++ chain's (head_chain_ms, greedy drafts),
    each repeated on warm caches; and the chain's first draft as serving meets it, right after a target
    forward has streamed the target's weights through the caches (head_chain_after_target_ms)."""
    models, table = engine.models, BlockTable()
    assert engine.block_manager.allocate(table, context + 1)
    try:
        runner, head = models.eagle_runner, models.eagle_runner.head
        item = BatchItem([0], context, table.block_ids, 1)
        feature = torch.zeros(1, head.hidden_size, dtype=runner.block_features.dtype)
        raw = torch.zeros(1, head.feature_width, dtype=runner.block_features.dtype)
        target_ms = best_ms(lambda: models.target_runner.run([item]))
        # the step as served with this head: features too (an EAGLE-3 head's layers captured, in segments)
        target_features_ms = best_ms(lambda: models.target_runner.run_with_features([item]))
        head_ms = best_ms(lambda: head.compute_logits(head.norm(runner.run([item], feature))))
        # as served (EagleMethod.propose at T = 0): one greedy draft in the head's C++ chain, glue included
        def draft():
            return runner.greedy_chain([item], feature, [1], [0.0], [0.0])
        chain_ms = best_ms(draft) if draft() is not None else None  # None: the head has no C++ chain
        cold_ms = best_ms(draft, before=lambda: models.target_runner.run([item])) if chain_ms else None
        fuse_ms = best_ms(lambda: runner.input_features(raw))  # a decode row's, once a target step
    finally:
        engine.block_manager.free(table)
    return {"context": context, "target_ms": target_ms, "head_step_ms": head_ms, "ratio": head_ms / target_ms,
            "head_chain_ms": chain_ms, "chain_ratio": chain_ms / target_ms if chain_ms else None,
            "head_chain_after_target_ms": cold_ms,
            "target_features_ms": target_features_ms, "fuse_ms": fuse_ms}


def decode_run(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params)
    return summarize(outs, time.perf_counter() - start, batch)


def turn_order(names: list[str], round_index: int) -> list[str]:
    """The engines' order in round `round_index`: engine `round_index` of `names` leads, and every
    other round the rest follow in reverse, so over two rounds each of three engines follows each
    of the others once. With the cycle always one way (session 83), the second head always
    followed the first and the first always followed off, and the same two heads read 5.9 points
    apart on code when their places were swapped."""
    k = round_index % len(names)
    order = names[k:] + names[:k]
    return order if round_index % 2 == 0 else order[:1] + order[:0:-1]


def lockstep_runs(engines: dict[str, Engine], prompts: list[list[int]], batch: int, max_tokens: int,
                  first: int, turn_steps: int = 1) -> dict[str, dict]:
    """decode_run for every engine at once, their steps interleaved (in round `first`'s
    turn_order, `turn_steps` steps each a turn): a burst of this host's noise lands on all of
    them alike, where decode_run's engines, timed one after another, each took their own. Each
    engine's time is the sum of its own steps. Engines whose weights together outgrow the L3
    evict one another's: one step a turn then prices every step from a cold cache (l3_warning),
    and more steps a turn pay that once a turn."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    names = turn_order(list(engines), first)
    outs: dict[str, list] = {name: [] for name in names}
    spent = dict.fromkeys(names, 0.0)
    steps: dict[str, list[float]] = {name: [] for name in names}  # each step's seconds
    for i in range(0, len(prompts), batch):
        results = {}
        for name in names:
            ids = [engines[name].add_request(p, params) for p in prompts[i : i + batch]]
            results[name] = {rid: {"token_ids": [], "stats": None} for rid in ids}
        while any(engines[name].has_unfinished() for name in names):
            for name in names:
                for _ in range(turn_steps):
                    if not engines[name].has_unfinished():
                        break
                    start = time.perf_counter()
                    deltas = engines[name].step()
                    steps[name].append(time.perf_counter() - start)
                    spent[name] += steps[name][-1]
                    for d in deltas:
                        r = results[name][d.request_id]
                        r["token_ids"] += d.token_ids
                        if d.finished:
                            r["stats"] = d.stats
        for name in names:
            outs[name] += list(results[name].values())  # in the prompts' order
    return {name: {**summarize(outs[name], spent[name], batch), "median_step_ms": statistics.median(steps[name]) * 1e3}
            for name in engines}


def l3_warning(engines: dict[str, Engine], turn_steps: int) -> str | None:
    """Why a lockstep run at one step a turn would misprice these engines, or None: their weights
    together outgrow this CPU's L3 (session 57: the Qwen 1.5B beside its 0.5B draft stepped 47 ms
    alone and 69 in lockstep, the draft engine slowed most, so its adaptive pricing left drafting)."""
    if turn_steps > 1:
        return None
    try:
        l3 = int(Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip().rstrip("K")) << 10
    except (OSError, ValueError):
        return None
    weights = sum(e.memory_stats()["weights_bytes"] for e in engines.values())
    if weights <= l3:
        return None
    return (f"the engines' weights ({weights / 2**20:.0f} MiB) outgrow the L3 ({l3 / 2**20:.0f} MiB): at one step a "
            "turn each step may read its weights from a cold cache (the Qwen pair's ratios misled, session 57); "
            "--turn-steps 8 pays that once a turn, or run without --lockstep")


def served_head_steps(method) -> list[tuple[int, float]]:
    """Record each draft step an EAGLE method takes from now on, (rows drafting, seconds) as propose
    times it for SpecRunner's price (the head's forward, norm, kept logits and glue): the list, appended to."""
    timed: list[tuple[int, float]] = []
    propose = method.propose

    def recorded(reqs, ks):
        steps = propose(reqs, ks)
        timed.extend(steps)
        return steps

    method.propose = recorded
    return timed


def summarize(outs: list[dict], seconds: float, batch: int) -> dict:
    """A run's speed and acceptance from its requests' outputs (token_ids, stats)."""
    drafted = sum(o["stats"].num_drafted for o in outs)
    accepted = sum(o["stats"].num_accepted for o in outs)
    spec_steps = sum(o["stats"].num_spec_steps for o in outs)
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {"batch": batch, "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
            "acceptance": accepted / drafted if drafted else None, "num_drafted": drafted,
            "mean_accepted_length": (accepted + spec_steps) / spec_steps if spec_steps else None,  # tokens per step
            "drafts_per_step": drafted / spec_steps if spec_steps else None,  # per verification
            "token_ids": [o["token_ids"] for o in outs]}


# SpecRunner attributes a variant may set
RUNNER_SETTINGS = ("keeps_computed_drafts", "gap_limit", "reshapes_table", "prices_recent_rows")
# drafts=false: no method offers a draft, while the head is kept up as always (the target's features, the
# fuse, the head's rows): what an EAGLE engine pays for being ready to draft
RUNNER_SETTINGS += ("drafts",)
METHOD_SETTINGS = ("chain_in_cpp", "probe_every", "accept_ema")  # and the EAGLE method's


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'name:field=value,...' -> (name, SpecConfig fields, SpecRunner or EAGLE method attributes); values are
    read as Python literals (true/false too), else kept as strings."""
    import ast

    name, _, body = text.partition(":")
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    spec, runner = {}, {}
    for setting in filter(None, body.split(",")):
        key, _, raw = setting.partition("=")
        raw = {"true": "True", "false": "False"}.get(raw.lower(), raw)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if key in RUNNER_SETTINGS + METHOD_SETTINGS or "." in key:  # method.attribute: any method's
            runner[key] = value
        elif key in fields:
            spec[key] = value
        else:
            raise SystemExit(f"--variant {text!r}: {key!r} is neither a SpecConfig field nor one of "
                             f"{RUNNER_SETTINGS + METHOD_SETTINGS}")
    if not name or not (spec or runner):
        raise SystemExit(f"--variant {text!r}: expected name:setting=value[,setting=value...]")
    return name, spec, runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--eagle-head", nargs="*", default=[None],
                    help="head file(s) (default: the cache's head for the model's weights); several run as eagle1, ...")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--no-eagle", action="store_true",
                    help="no EAGLE head: --variant then changes the draft's settings")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each config per workload, alternated; the best counts")
    ap.add_argument("--lockstep", action="store_true",
                    help="run the configs' engines at once, steps interleaved one by one (lockstep_runs), and report "
                         "each round's speed over off's: speedup_vs_off is then their geometric mean, with its "
                         "standard error and the rounds ahead")
    ap.add_argument("--turn-steps", type=int, default=1,
                    help="with --lockstep: steps each engine takes a turn (more when the engines' weights outgrow the "
                         "L3 and evict one another's)")
    ap.add_argument("--variant", nargs="*", default=[], metavar="NAME:SETTING=VALUE,...",
                    help="the (first) EAGLE head (with --no-eagle the draft model) again with SpecConfig fields or "
                         f"the attributes {RUNNER_SETTINGS + METHOD_SETTINGS} changed, run beside the others as NAME")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=[*PROMPTS, "paste"],
                    help="prompts.json's sets (chat_wide / code_wide: 40 / 24 more); paste: a long file and a "
                         "question (its prefix cached before the rounds)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--costs-only", action="store_true", help="the step costs alone, no decode runs")
    ap.add_argument("--shared-table", action="store_true",
                    help="every variant prices with its base engine's start-up table (not one of its own): the pairing "
                         "compares pricing rules, not the luck of each engine's table")
    ap.add_argument("--distort-table", nargs="*", default=[], metavar="ROWS=FROM",
                    help="with --shared-table: price ROWS target rows as FROM rows in that table (e.g. 3=2)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="as `chatserve serve` (auto: bf16 on AMX, else fp16)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from chatserve.cli import _kv_cache_dtype

    kv = _kv_cache_dtype(args.kv_cache_dtype, "cpu", args.dtype)
    common = dict(model=args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory=1 << 30,
                  kv_cache_dtype=kv)
    # No suffix corpus: every workload runs its prompts at batch 1 then 2 and greedy replies repeat,
    # so a corpus of replies (mixed into draft and eagle requests) would draft replies it has seen.
    heads = [] if args.no_eagle else args.eagle_head or [None]
    if not heads and not args.draft_model:
        raise SystemExit("--no-eagle needs --draft-model")
    configs = {"off": None}
    for i, head in enumerate(heads, start=1):
        configs["eagle" if len(heads) == 1 else f"eagle{i}"] = SpecConfig(method="eagle", eagle_head=head,
                                                                            suffix_corpus_tokens=0)
    head_names, runner_settings = list(configs)[1:], {}
    if args.draft_model:
        configs["draft"] = SpecConfig(method="draft", draft_model=args.draft_model, suffix_corpus_tokens=0)
    base = head_names[0] if heads else "draft"  # what a variant changes
    for text in args.variant:
        name, fields, runner_settings[name] = parse_variant(text)
        configs[name] = dataclasses.replace(configs[base], **fields)
    results: dict = {"model": args.model, "rounds": args.rounds, "variants": args.variant, "kv_cache_dtype": kv,
                     "runs": {}}
    engines, head_steps = {}, {}
    for name, spec in configs.items():  # all loaded first: the runs below alternate between them
        engine = engines[name] = Engine(EngineConfig(**common, spec=spec))
        if args.shared_table and name == base and engine.spec.costs is not None:
            target = dict(engine.spec.costs.target_seconds)
            for text in args.distort_table:
                rows, _, like = text.partition("=")
                target[int(rows)] = target[int(like)]
            shared = dataclasses.replace(engine.spec.costs, target_seconds=target)
            results["shared_table_ms"] = {r: t * 1e3 for r, t in sorted(target.items())}
        if args.shared_table and (name == base or name in runner_settings) and engine.spec.costs is not None:
            engine.spec.set_measured_costs(shared)
        for key, value in runner_settings.get(name, {}).items():
            if key == "drafts":
                for method in engine.spec.methods.values():
                    method.offer = (lambda *args: None) if not value else method.offer
                continue
            method, _, attr = key.rpartition(".")
            method = method or (configs[base].method if attr in METHOD_SETTINGS else "")
            setattr(engine.spec.methods[method] if method else engine.spec, attr, value)
        engine.generate([engine.tokenizer.encode("warm-up")], SamplingParams(max_tokens=8, temperature=0.0))
        if engine.spec is not None and "eagle" in engine.spec.methods:
            head_steps[name] = served_head_steps(engine.spec.methods["eagle"])
        if name in head_names:
            costs, info = [step_costs(engine, c) for c in (128, 1024)], engine.models.eagle_runner.head.info
            info = {**info, "feature_layers": list(engine.models.eagle_runner.head.feature_layers)}
            if len(heads) == 1:
                results["step_costs"], results["head"] = costs, info  # as before several heads could run
            else:
                results.setdefault("heads", {})[name] = {"step_costs": costs, "head": info}
            print(name, json.dumps(costs), file=sys.stderr)
    if args.lockstep:
        results["turn_steps"] = args.turn_steps
        if warning := l3_warning(engines, args.turn_steps):
            results["l3_warning"] = warning
            print("warning:", warning, file=sys.stderr)
    tok = engines["off"].tokenizer
    for kind in () if args.costs_only else args.workloads:
        prompts = chat_prompts(tok, kind)
        if kind not in PROMPTS:  # every engine's prefix cache holds the files: the rounds time the replies
            for engine in engines.values():
                engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        for batch in args.batches:
            key, best = f"{kind}/b{batch}", {}
            ratios: dict[str, list[float]] = {name: [] for name in configs}
            for timed in head_steps.values():
                timed.clear()
            for r in range(args.rounds):  # off, eagle, ... then the reverse order: drift hits both alike
                if args.lockstep:
                    runs = lockstep_runs(engines, prompts, batch, args.max_tokens, first=r, turn_steps=args.turn_steps)
                else:
                    order = list(configs) if r % 2 == 0 else list(configs)[::-1]
                    runs = {name: decode_run(engines[name], prompts, batch, args.max_tokens) for name in order}
                for name, run in runs.items():
                    ratios[name].append(run["tok_per_s"] / runs["off"]["tok_per_s"])
                    if name not in best or run["tok_per_s"] > best[name]["tok_per_s"]:
                        best[name] = run
            for name in configs:
                run = best[name]
                run["greedy_equal"] = run["token_ids"] == best["off"]["token_ids"]
                if args.lockstep:
                    rs = ratios[name]
                    run["round_speedups"] = [round(x, 4) for x in rs]
                    run["speedup_se"] = statistics.stdev(rs) / len(rs) ** 0.5 if len(rs) > 1 else None
                    run["lockstep_speedup"] = statistics.geometric_mean(rs)
                results["runs"].setdefault(key, {})[name] = {k: v for k, v in run.items() if k != "token_ids"}
                if head_steps.get(name):  # the head's draft steps as served, by rows drafting
                    by_rows = {}
                    for rows, seconds in head_steps[name]:
                        by_rows.setdefault(rows, []).append(seconds * 1e3)
                    served = {rows: statistics.median(ms) for rows, ms in sorted(by_rows.items())}
                    results["runs"][key][name]["head_step_ms_served"] = served
                    if args.lockstep and 1 in served:
                        ratio = served[1] / best["off"]["median_step_ms"]
                        results["runs"][key][name]["head_step_over_off_step"] = ratio
                        print(f"{name:6s} {key}: a head step of one row {served[1]:.3f} ms served (median of "
                              f"{len(by_rows[1])}), {ratio:.3f} of off's median step "
                              f"{best['off']['median_step_ms']:.2f} ms", file=sys.stderr)
                paired = (f", x off {run['lockstep_speedup']:.3f} (se {run['speedup_se'] or 0:.3f}, rounds paired)"
                          if args.lockstep else "")
                print(f"{name:6s} {key}: {run['tok_per_s']:.2f} tok/s (best of {args.rounds}), acceptance "
                      f"{run['acceptance']}, equal {run['greedy_equal']}{paired}", file=sys.stderr)
            if args.lockstep:  # each variant against its base's default, round by round
                for name in runner_settings:
                    pairs = [v / b for v, b in zip(ratios[name], ratios[base])]
                    over = {"speedup": statistics.geometric_mean(pairs), "rounds_ahead": sum(x > 1 for x in pairs),
                            "se": statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else None}
                    results["runs"][key][name][f"over_{base}"] = over
                    print(f"{name:6s} {key}: x {base} {over['speedup']:.3f} (se {over['se'] or 0:.3f}, "
                          f"{over['rounds_ahead']} of {len(pairs)} rounds ahead)", file=sys.stderr)
    # each engine's cost table as service left it (ms): the prices its last decisions were made at
    results["served_costs_ms"] = {
        name: {"target": {r: e.spec.costs.target(r) * 1e3 for r in range(1, 7)}, "draft_1": e.spec.costs.draft(1) * 1e3,
               "head_1": e.spec.costs.head(1) * 1e3}
        for name, e in engines.items() if e.spec is not None and e.spec.costs is not None}
    for runs in results["runs"].values():
        for run in runs.values():
            run["speedup_vs_off"] = run.get("lockstep_speedup", run["tok_per_s"] / runs["off"]["tok_per_s"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["runs"], indent=1))


if __name__ == "__main__":
    main()
