"""An EAGLE head's acceptance at T = 0, offline: no timing, so it can run beside anything.

The target answers the held-out prompts of chatserve/data/prompts.json (chat, code, edit; the
head is trained on data/head_prompts.json), or `paste`: questions on files of 1-2.6k tokens (issue
#13's paste workload, benchmarks/data/long_context.json), greedily, its features recorded as it generates
(head_data.FeatureRecorder). Then each head drafts, in EagleHead.forward_unrolled, a chain of
`--depth` tokens from every reply position at once: pass s at row p + s is the (s+1)-th draft
from anchor p, exactly as drafting computes it (tests/chatserve/test_eagle.py holds the two
equal). A draft counts if it and every draft before it in its chain equal the target's greedy
tokens. Printed per workload: the share of chains whose first 1..depth drafts all hold, and the
mean accepted length (tokens per verification, bonus included) of a fixed-k chain for k = 1..depth,
over every anchor and "walked" as serving walks a reply: from each anchor the next one is the
position after the drafts accepted there, so a hard stretch (drafts rejected) is an anchor at
every position and an easy one at every (a + 1)-th. Walked is what serving measures (the session
31 head on code at k = 4: 1.86 walked, 1.88 served, 2.09 over every anchor).
The head runs in float32 here; served, its weights are quantized like the target's.

Where should a chain stop? Printed per workload: how well the head's softmax probability of its
draft predicts that the draft is accepted (bins, for the first and second draft), and walked chains
of up to `--depth` drafts stopped where the product of those probabilities falls below each
`--stop-at` value, as served chains stop (SpecState.least_gain): tokens, drafts and head steps
a verification.

Would a draft tree pay? `--top 4` also counts how often the target's token is among the head's
first 2..4 candidates at the first position, and with `--verify-costs` (the JSON of
benchmarks/verify_rows.py: one target forward over 1..5 rows, measured) prints, per workload, the
best fixed chain against the best tree of that shape: w candidates for the first token, the chain
going on from the first candidate (1 + w + (k - 1) rows; a sibling needs its own row, since it is
a different token at the same position). Speed-up estimates from the forward times alone, the
head's own steps counted at `--head-step-ms` each: (tokens per verification) x T(1) / (T(rows) +
drafting).

At T > 0 (`--temperature`, `--top-p`): the replies are sampled at that setting (seeded), and a
sampled draft from the head's distribution q is accepted with probability sum_x min(p(x), q(x)), p the
target's distribution under the same setting (rejection sampling; Leviathan et al.). Printed per
workload and pass s: that expected acceptance along the reply (the head reading its own features
for s > 0, as a chain whose drafts so far were accepted), its chain estimate 1 + sum_k prod_s alpha_s,
and beside it the greedy agreement (the head's argmax against the target's) at the same positions.
`--draft-temperatures` tries other q for the same p: the head's logits at temperature T x r (r = 0:
its argmax, one-hot), any of which rejection sampling keeps lossless. (The chain lines above those then
count drafts equal to the sampled reply's tokens.)

    .venv/bin/python benchmarks/head_acceptance.py --model smollm2-135m-instruct \
        --heads ~/.cache/chatserve/heads/<hash>/eagle-head.pt other.pt --out benchmarks/results/head_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chatserve.config import EngineConfig  # noqa: E402
from chatserve.engine import Engine  # noqa: E402
from chatserve.head_data import FeatureRecorder  # noqa: E402
from chatserve.head_store import load_head  # noqa: E402
from chatserve.loading import read_config, resolve  # noqa: E402
from chatserve.sampling_params import SamplingParams  # noqa: E402
from chatserve.train_head import chain_hits, walked_length  # noqa: E402
from spec.adaptive import AcceptanceEMA  # noqa: E402
from spec.sampling import logits_to_probs  # noqa: E402

PROMPTS = json.loads((ROOT / "chatserve/data/prompts.json").read_text())
LONG_CONTEXT = ROOT / "benchmarks/data/long_context.json"


def paste_prompts() -> list[str]:
    """Issue #13's paste workload as single turns: each file of benchmarks/long_context.py's paste
    sessions (1-2.6k tokens) with each of its questions (the follow-ups asked with the file again)."""
    data = json.loads(LONG_CONTEXT.read_text())
    first, *follow_ups = data["paste_turns"]
    prompts = []
    for name, code in data["files"].items():
        opening = first.format(name=name, code=code)
        paste = opening[: opening.index("```\n\n") + 5]
        prompts += [opening] + [f"{paste}{q}" for q in follow_ups]
    return prompts


def replies(engine: Engine, kind: str, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
            seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(token ids, features, num prompt tokens) of the target's answer to each prompt of `kind`:
    greedy at temperature 0, else sampled (request i seeded seed + i)."""
    tok = engine.tokenizer
    texts = paste_prompts() if kind == "paste" else PROMPTS[kind]
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in texts]
    recorder = FeatureRecorder()
    engine.feature_observer = recorder.observe
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed + i if temperature > 0 else None) for i in range(len(prompts))]
        outs = engine.generate(prompts, params)
    finally:
        engine.feature_observer = None
    sequences = []
    for prompt, out in zip(prompts, outs):
        ids = (prompt + out["token_ids"])[:-1]  # the last token is never fed
        sequences.append((torch.tensor(ids), recorder.features(out["request_id"], len(ids)), len(prompt)))
    return sequences


def probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[rows, n] float32 logits -> the distribution sampling draws from at that setting (0: one-hot argmax)."""
    rows = len(logits)
    return logits_to_probs(logits, torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.long),
                           torch.full((rows,), top_p), torch.zeros(rows))


@torch.no_grad()
def sampled_acceptance(head, embed, lm_head, ids: torch.Tensor, features: torch.Tensor, num_prompt: int,
                       depth: int, temperature: float, top_p: float, ratios: list[float]) -> dict:
    """One reply's expected acceptance of a sampled draft at each reply anchor and pass s (the (s+1)-th
    draft of a chain from that anchor, reading the head's own features as drafting does): for each
    draft temperature ratio r, [anchors, depth] sum_x min(p, q_r) (nan past the reply), and "greedy":
    whether the head's argmax is the target's at those rows. p: lm_head over the target's final feature
    of the row, under (temperature, top_p); q_r: the head's kept logits under (temperature x r, top_p),
    over the target's vocabulary; "sure": the head's softmax probability of its argmax (at T = 1), what a
    served chain stops on."""
    feats_in = torch.cat((torch.zeros_like(features[:1]), features[:-1])).float()[None]
    passes = head.forward_unrolled(feats_in, embed(ids[None]).float(), depth)
    t = len(ids)
    anchors = torch.arange(num_prompt, t - 1)
    out = {r: torch.full((len(anchors), depth), float("nan")) for r in [*ratios, "greedy", "sure"]}
    kept = head.head_token_ids
    for s, y in enumerate(passes):
        rows = anchors + s
        ok = rows < t - 1
        predicted = F.rms_norm(y[0, rows[ok]], head.norm.weight.shape, head.norm.weight, head.norm.eps)
        head_logits = head.lm_head(predicted).float()  # [ok rows, kept]
        target_logits = lm_head(head.target_features(features[rows[ok]].float())).float()  # [ok rows, vocab]
        p = probs(target_logits, temperature, top_p)[:, kept]  # q is 0 outside the kept ids
        for r in ratios:
            out[r][ok, s] = torch.minimum(p, probs(head_logits, temperature * r, top_p)).sum(-1)
        out["greedy"][ok, s] = (kept[head_logits.argmax(-1)] == target_logits.argmax(-1)).float()
        out["sure"][ok, s] = head_logits.softmax(-1).amax(-1)
    return out


def chain_estimate(alpha: torch.Tensor, depth: int) -> list[float]:
    """[anchors, depth] per-pass acceptance (nan past a reply) -> 1 + sum_{j<=k} mean prod_{s<=j} alpha_s,
    k = 1..depth: a fixed chain's expected tokens per verification, each pass's acceptance taken
    as independent of the others'."""
    cum = torch.nan_to_num(alpha, nan=0.0).cumprod(dim=1)
    return [round(1 + float(cum[:, :k].mean(0).sum()), 3) for k in range(1, depth + 1)]


def streaks(hits: list[torch.Tensor], emas: list[float], lags=(1, 2, 4, 8, 16)) -> dict:
    """Is a head's acceptance a request's level or a streak, and how fast should a request's
    estimate of it move (AdaptiveDraftLength's ema; SpecMethod.accept_ema)? Each reply walked with
    one draft a verification (from anchor p the next is p + 2 after a hit, p + 1 after a miss):
    its first-draft outcomes in serving order. Printed: each reply's rate; P(hit) after a hit and
    after a miss `lag` verifications back; for each ema, the estimate before each verification
    (AcceptanceEMA from the workload's own rate, what the engine-wide estimate tends to) against
    the outcome: the slope of outcome on estimate (1 = calibrated, below: it over-reacts) and the
    Brier score (mean squared error; `constant`: the workload's rate at every step)."""
    walks = []
    for reply in hits:
        first, p, walk = reply[:, 0].tolist(), 0, []
        while p < len(first):
            walk.append(int(first[p]))
            p += int(first[p]) + 1
        walks.append(walk)
    outcomes = [x for w in walks for x in w]
    if not outcomes:
        return {}
    rate = sum(outcomes) / len(outcomes)

    def after(lag: int, previous: int) -> float:
        pairs = [w[i] for w in walks for i in range(lag, len(w)) if w[i - lag] == previous]
        return round(sum(pairs) / len(pairs), 4) if pairs else float("nan")

    def fit(estimates: list[float]) -> dict:
        n = len(outcomes)
        mq, mx = sum(estimates) / n, rate
        var = sum((q - mq) ** 2 for q in estimates) / n
        cov = sum((q - mq) * (x - mx) for q, x in zip(estimates, outcomes)) / n
        return {"slope": round(cov / var, 3) if var else float("nan"),
                "brier": round(sum((q - x) ** 2 for q, x in zip(estimates, outcomes)) / n, 4)}

    by_ema = {}
    for ema in emas:
        estimates = []
        for walk in walks:
            alpha = AcceptanceEMA(ema, rate)
            for x in walk:
                estimates.append(alpha.rate)
                alpha.update(1, x)
        by_ema[str(ema)] = fit(estimates)
    return {"verifications": len(outcomes), "rate": round(rate, 4),
            "per_reply": [round(sum(w) / len(w), 3) for w in walks if w],
            "after_hit_miss": {str(lag): (after(lag, 1), after(lag, 0)) for lag in lags},
            "constant_brier": round(sum((rate - x) ** 2 for x in outcomes) / len(outcomes), 4), "ema": by_ema}


def walked_stopped(hits: list[torch.Tensor], sure: list[torch.Tensor], cap: int, least: float) -> tuple[float, ...]:
    """walked_length for chains that stop as served chains do (EagleMethod.propose): up to
    `cap` drafts while the product of the head's probabilities of them (sure[i], chain_hits) stays
    >= least. -> (tokens, drafts, head steps) per verification; a head step is paid for each draft
    and for the one cut."""
    return walk_summary(walk_rule(hits, sure, cap, least, 0.0))[:3]


def walk_rule(hits: list[torch.Tensor], sure: list[torch.Tensor], cap: int, keep_below, go_on_below,
              rate: float = 1.0) -> list[tuple[int, int, int]]:
    """Chains as a rule walks them: each forward computes a draft and its probability; draft s (from
    0) is kept while the chain's probability P (the product so far) >= keep_below[s], and the next
    forward runs while P x rate >= go_on_below[s], up to cap drafts (thresholds: a number for every
    depth, or a list by depth). -> (tokens, drafts, forwards) of each verification."""
    keep_below = keep_below if isinstance(keep_below, list) else [keep_below] * cap
    go_on_below = go_on_below if isinstance(go_on_below, list) else [go_on_below] * cap
    steps = []
    for reply, probs in zip(hits, sure):
        accepted, probs = reply[:, :cap].sum(1).tolist(), probs[:, :cap].cumprod(dim=1).tolist()
        p = 0
        while p < len(accepted):
            kept = forwards = 0
            for s in range(cap):
                forwards += 1
                if probs[p][s] < keep_below[s]:
                    break
                kept += 1
                if probs[p][s] * rate < go_on_below[s]:
                    break
            a = min(accepted[p], kept)
            steps.append((a + 1, kept, forwards))
            p += a + 1
    return steps


def walk_summary(steps: list[tuple[int, int, int]], target_seconds=None,
                 step_seconds: float = 0.0) -> tuple[float, float, float, float | None]:
    """walk_rule's verifications -> (tokens, drafts, forwards) per verification, and with
    target_seconds (rows -> one target forward) the estimated speed-up over plain decoding:
    tokens x T(1) / sum of (T(1 + drafts) + forwards x step_seconds)."""
    n = len(steps)
    tokens = sum(t for t, _, _ in steps)
    speedup = None
    if target_seconds is not None:
        seconds = sum(target_seconds(1 + d) + f * step_seconds for _, d, f in steps)
        speedup = tokens * target_seconds(1) / seconds
    return tokens / n, sum(d for _, d, _ in steps) / n, sum(f for _, _, f in steps) / n, speedup


def calibration(hits: torch.Tensor, sure: torch.Tensor, passes: int = 2) -> list[list[tuple]]:
    """[chains, depth] hits and head probabilities -> probability_bins per pass s < passes, pass s > 0
    over the chains whose first s drafts held (a served chain's later drafts are made only then)."""
    return [probability_bins(sure[:, s], hits[:, s].float(),
                             torch.ones(len(hits), dtype=torch.bool) if s == 0 else hits[:, s - 1].bool())
            for s in range(passes)]


def probability_bins(sure: torch.Tensor, accepted: torch.Tensor, given: torch.Tensor) -> list[tuple]:
    """[n] head probabilities, acceptances (0/1, or expected) and a mask -> the masked rows in
    CALIBRATION_BINS of the probability: (low, high, drafts, mean probability, mean acceptance)."""
    bins = []
    for low, high in CALIBRATION_BINS:
        m = given & (sure >= low) & (sure < high)
        if m.any():
            bins.append((low, high, int(m.sum()), round(float(sure[m].mean()), 3), round(float(accepted[m].mean()), 3)))
    return bins


CALIBRATION_BINS = ((0.0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 0.9), (0.9, 1.01))


def chain_or_tree(first_s_right: list[float], top_n: list[float], target_ms: list[float], head_ms: float) -> dict:
    """The best fixed chain and the best tree (w candidates first, a chain from the first one) that
    one verification of len(target_ms) rows at most allows, as speed-ups over one-row decoding."""
    t1, best = target_ms[0], {"chain": (1.0, 0), "tree": (1.0, (1, 0))}
    for k in range(1, min(len(first_s_right), len(target_ms) - 1) + 1):
        tokens = 1 + sum(first_s_right[:k])
        best["chain"] = max(best["chain"], (tokens * t1 / (target_ms[k] + k * head_ms), k))
    for w in range(2, len(top_n) + 1):
        for k in range(1, len(first_s_right) + 1):
            rows = 1 + w + (k - 1)
            if rows > len(target_ms):
                break
            tokens = 1 + top_n[w - 1] + sum(first_s_right[1:k])  # later drafts only after the first candidate
            best["tree"] = max(best["tree"], (tokens * t1 / (target_ms[rows - 1] + k * head_ms), (w, k)))
    return {name: {"speedup": round(v, 3), "shape": shape} for name, (v, shape) in best.items()}


def lm_head_as(linear: torch.nn.Linear, fmt: str) -> torch.nn.Module:
    """A head's kept LM head in `fmt`: float as trained, int8 rows (what an int4 model's LM head gets), or
    int4 (quant.apply's choice for a linear of that shape: Q4_K, else groups of 32; served since session 49)."""
    from quant.apply import quantize_module

    return linear if fmt == "float" else quantize_module(linear, "int4", is_head=fmt == "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--heads", nargs="+", required=True, help="head files to compare")
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--kinds", nargs="+", default=["chat", "code", "edit"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top", type=int, default=4, help="count the first token among the head's first 1..N candidates")
    ap.add_argument("--verify-costs", type=Path, default=None,
                    help="benchmarks/verify_rows.py JSON: estimate chain against tree speed-ups from its forward times")
    ap.add_argument("--context", type=int, default=1024, help="which context of --verify-costs to use")
    ap.add_argument("--head-step-ms", type=float, default=3.6, help="one head draft step (session 17, Qwen 1.5B)")
    ap.add_argument("--stop-at", type=float, nargs="*", default=[0.05, 0.1, 0.15, 0.2, 0.3],
                    help="also walk chains of up to --depth drafts stopped where the head's probability of "
                         "the chain falls below each of these (as served chains stop)")
    ap.add_argument("--keep-at", type=float, nargs="*", default=[],
                    help="also walk chains that keep a draft already computed while the chain's probability is "
                         "at least each of these (its verification row's price), going on while it is at least "
                         "each --stop-at value above it (the head step's price added)")
    ap.add_argument("--target-ms", type=float, nargs="*", default=None,
                    help="target forward ms for 1, 2, ... rows: estimate each walk's speed-up over plain decoding, "
                         "tokens x T(1) / sum of (T(1 + drafts) + head steps x --head-step-ms)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: replies sampled at it, and a sampled draft's expected acceptance measured")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-temperatures", type=float, nargs="+", default=[1.0],
                    help="with --temperature: the head's drafts at temperature T x each (0: its argmax)")
    ap.add_argument("--emas", type=float, nargs="*", default=[0.02, 0.05, 0.1, 0.2, 0.3],
                    help="a request's acceptance estimate's weights to fit against its walked outcomes (streaks)")
    ap.add_argument("--lm-heads", nargs="+", default=["float"], choices=["float", "int8", "int4"],
                    help="each head again with its kept LM head in each format (served: int8 under int4 weights)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    target_ms = None
    if args.verify_costs:
        points = json.loads(args.verify_costs.read_text())["points"]
        target_ms = next(p["target_ms_by_rows"] for p in points if p["context"] == args.context)

    engine = Engine(EngineConfig(model=args.model, quantization=args.quantization, max_num_seqs=8,
                                 enable_prefix_caching=False))
    target_dir = resolve(args.model)
    cfg = read_config(target_dir)
    heads = {}
    for path in args.heads:
        for fmt in args.lm_heads:
            head = load_head(Path(path).expanduser(), args.model, target_dir, cfg, engine.max_model_len, torch.float32)
            head.lm_head = lm_head_as(head.lm_head, fmt)
            heads[path if fmt == "float" else f"{path}:{fmt}"] = head
    # the replies' features as the EAGLE-3 heads read them (the final feature last: what an EAGLE-1 head reads)
    layers = {h.feature_layers for h in heads.values() if h.feature_layers}
    if len(layers) > 1:
        raise SystemExit(f"--heads: EAGLE-3 heads of different layers ({sorted(layers)}) cannot share one recording")
    engine.models.target_runner.feature_layers = layers.pop() if layers else ()
    data = {kind: replies(engine, kind, args.max_tokens, args.temperature, args.top_p) for kind in args.kinds}
    embed = engine.models.target.embed_tokens
    results = {"model": args.model, "max_tokens": args.max_tokens, "depth": args.depth, "top": args.top,
               "temperature": args.temperature, "top_p": args.top_p, "draft_temperatures": args.draft_temperatures,
               "verify_costs": str(args.verify_costs) if args.verify_costs else None, "context": args.context,
               "target_ms_by_rows": target_ms, "head_step_ms": args.head_step_ms, "heads": {}}
    for path, head in heads.items():
        rows = {}
        for kind, sequences in data.items():
            both = [chain_hits(head, embed, ids, features[:, -head.feature_width :], num_prompt, args.depth, args.top)
                    for ids, features, num_prompt in sequences]
            hits = torch.cat([h for h, _, _ in both]).float()
            sure = torch.cat([p for _, _, p in both])
            all_first = hits.mean(0)  # P(first s+1 drafts right)
            top_n = torch.cat([c for _, c, _ in both]).float().mean(0)  # P(first token among the first n)
            mean_len = [1 + float(all_first[:k].sum()) for k in range(1, args.depth + 1)]
            walked = [walked_length([h for h, _, _ in both], k) for k in range(1, args.depth + 1)]
            stopped = {least: [round(x, 3) for x in walked_stopped([h for h, _, _ in both], [p for _, _, p in both],
                                                                   args.depth, least)]
                       for least in args.stop_at}
            rows[kind] = {"chains": len(hits), "first_s_right": [round(float(x), 4) for x in all_first],
                          "mean_accepted_length": [round(x, 3) for x in mean_len],
                          "walked_accepted_length": [round(x, 3) for x in walked],
                          "first_in_top_n": [round(float(x), 4) for x in top_n],
                          "stopped_walked": {str(least): dict(zip(("tokens", "drafts", "head_steps"), v))
                                             for least, v in stopped.items()},
                          "calibration": calibration(hits, sure),
                          "streaks": streaks([h for h, _, _ in both], args.emas)}
            print(f"{Path(path).name:30s} {kind:5s} chains {len(hits):5d}  first 1..{args.depth} right "
                  f"{' '.join(f'{x:.2f}' for x in all_first)}  mean accepted length k=1..{args.depth} "
                  f"{' '.join(f'{x:.2f}' for x in mean_len)} (walked {' '.join(f'{x:.2f}' for x in walked)})  "
                  f"first token in top 1..{args.top} "
                  f"{' '.join(f'{x:.2f}' for x in top_n)}", flush=True)
            for s, bins in enumerate(rows[kind]["calibration"]):
                print(f"{'':30s} {kind:5s} draft {s + 1} by the head's probability: "
                      + "  ".join(f"[{lo:.1f}, {hi:.1f}) {n} at {p:.2f} accepted {a:.2f}" for lo, hi, n, p, a in bins))
            st = rows[kind]["streaks"]
            if st:
                print(f"{'':30s} {kind:5s} one draft a verification: rate {st['rate']:.3f} over {st['verifications']}, "
                      f"replies {min(st['per_reply']):.2f}-{max(st['per_reply']):.2f}; after a hit / a miss "
                      + ", ".join(f"lag {lag} {a:.2f} / {b:.2f}" for lag, (a, b) in st["after_hit_miss"].items())
                      + f"; estimate slope / Brier (constant {st['constant_brier']:.4f}) "
                      + ", ".join(f"ema {e} {v['slope']:.2f} / {v['brier']:.4f}" for e, v in st["ema"].items()),
                      flush=True)
            for least, (tokens, drafts, steps) in stopped.items():
                print(f"{'':30s} {kind:5s} walked, up to {args.depth} drafts stopped below {least}: "
                      f"{tokens:.3f} tokens a verification, {drafts:.2f} drafts, {steps:.2f} head steps", flush=True)
            if args.keep_at or args.target_ms:
                rows[kind]["walks"] = rule_walks([h for h, _, _ in both], [p for _, _, p in both], args)
                for name, v in rows[kind]["walks"].items():
                    print(f"{'':30s} {kind:5s} {name:34s} {v['tokens']:.3f} tokens, {v['drafts']:.2f} drafts, "
                          f"{v['head_steps']:.2f} head steps" + (f": {v['speedup']:.3f}x plain (estimated)"
                                                                  if "speedup" in v else ""), flush=True)
            if target_ms:
                est = chain_or_tree(rows[kind]["first_s_right"], rows[kind]["first_in_top_n"], target_ms,
                                    args.head_step_ms)
                rows[kind]["chain_or_tree"] = est
                print(f"{'':30s} {kind:5s} best chain {est['chain']['speedup']:.2f}x (k = {est['chain']['shape']}), "
                      f"best tree {est['tree']['speedup']:.2f}x (w, k = {est['tree']['shape']}), "
                      f"from T(rows) at context {args.context}", flush=True)
            if args.temperature > 0:
                rows[kind]["sampled"] = sampled_rows(head, embed, engine.models.target.lm_head, sequences, args)
                for r, row in rows[kind]["sampled"].items():
                    print(f"{'':30s} {kind:5s} T {args.temperature} top-p {args.top_p} draft "
                          f"{'greedy agreement' if r == 'greedy' else f'at T x {r}':16s} per pass "
                          f"{' '.join(f'{x:.2f}' for x in row['per_pass'])}  chain k=1..{args.depth} "
                          f"{' '.join(f'{x:.2f}' for x in row['chain'])}", flush=True)
                    for s, bins in enumerate(row.get("calibration", [])):
                        print(f"{'':30s} {kind:5s} draft {s + 1} at T x {r}, acceptance by the head's probability: "
                              + "  ".join(f"[{lo:.1f}, {hi:.1f}) {n} at {p:.2f} accepted {a:.2f}"
                                          for lo, hi, n, p, a in bins), flush=True)
        results["heads"][str(path)] = {"info": {k: v for k, v in head.info.items() if k != "train_config"},
                                       "train_config": head.info.get("train_config"), "workloads": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))


def rule_walks(hits: list[torch.Tensor], sure: list[torch.Tensor], args) -> dict:
    """walk_rule's walks for --depth: fixed chains, the --stop-at stops, and each --keep-at keep with each
    --stop-at above it as the go-on threshold; with --target-ms, each walk's estimated speed-up."""
    walks = {f"fixed k={k}": walk_rule(hits, sure, k, 0.0, 0.0) for k in range(1, args.depth + 1)}
    walks.update({f"stop below {least}": walk_rule(hits, sure, args.depth, least, 0.0) for least in args.stop_at})
    walks.update({f"keep >= {keep}, go on >= {least}": walk_rule(hits, sure, args.depth, keep, least)
                  for keep in args.keep_at for least in args.stop_at if least > keep})
    t = args.target_ms
    target = (lambda rows: t[min(rows, len(t)) - 1]) if t else None
    out = {}
    for name, steps in walks.items():
        tokens, drafts, steps_a, speedup = walk_summary(steps, target, args.head_step_ms)
        row = {"tokens": tokens, "drafts": drafts, "head_steps": steps_a}
        if speedup is not None:
            row["speedup"] = speedup
        out[name] = {k: round(v, 3) for k, v in row.items()}
    return out


def sampled_rows(head, embed, lm_head, sequences, args) -> dict:
    """sampled_acceptance over a workload's replies -> {ratio or "greedy": per-pass mean, chain estimate}."""
    parts = [sampled_acceptance(head, embed, lm_head, ids, features[:, -head.feature_width :], num_prompt,
                                args.depth, args.temperature, args.top_p, args.draft_temperatures)
             for ids, features, num_prompt in sequences if len(ids) - 1 > num_prompt]
    rows = {}
    for r in [*args.draft_temperatures, "greedy"]:
        alpha = torch.cat([part[r] for part in parts])
        rows[str(r)] = {"per_pass": [round(float(x), 4) for x in alpha.nanmean(0)],
                        "chain": chain_estimate(alpha, args.depth)}
        if r != "greedy":  # does the probability a served chain stops on predict a sampled draft's acceptance?
            sure = torch.cat([part["sure"] for part in parts])
            rows[str(r)]["calibration"] = [probability_bins(sure[:, s], alpha[:, s], ~alpha[:, s].isnan())
                                           for s in range(min(2, args.depth))]
    return rows


if __name__ == "__main__":
    main()
