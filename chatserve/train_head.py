"""`chatserve train-head`: train an EAGLE head (chatserve/models/eagle_head.py) for a target, on
this CPU, within a wall-clock budget, resumably.

Loss as in EAGLE (arXiv:2401.15077): for every position i, the head reads (f_{i-1}, t_i) and
predicts f^_i; loss = smooth-L1(f^_i, f_i) + 0.1 * cross-entropy(softmax(lm(f_i)), lm(f^_i)),
where lm is the head's LM head (the target's rows for the kept ids, frozen) and f the target's
features (its final norm's output; an EAGLE-3 head reads fused low, middle and high layers as
f_{i-1} and still predicts the final f_i: TrainConfig.feature_layers, EagleHead.input_features).
The target's embedding is shared and frozen too; fc, the layer and its norm train (and the fuse).
The step's matmuls run in bfloat16 under autocast where the CPU has AMX, or AVX-512 BF16 that runs
them faster than float32 (choose_train_dtype);
weights, gradients, optimizer state and the saved head stay float32.
Inputs get uniform noise (+-0.1, as EAGLE) so that the head tolerates its own predicted features
when it drafts in a chain. Windows of `window` positions are cut from the data (features of the
whole sequence, so a window's first row still sees the true previous feature).

Files (beside the head, by default in the cache dir keyed by the target's weight hash):
<head>-data.pt and <head>-data.features (the collected data, its features memory-mapped:
head_data.save_collected; written every checkpoint_seconds while it is collected, and
a run that finds fewer than max_data_tokens in it collects more first, in its data_share of the
budget, so data grows over runs and survives a kill), <head>-checkpoint.pt (head, optimizer, step,
seconds; written every checkpoint_seconds and at the end) and the head itself. Running the
command again continues from the checkpoint for another --minutes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from chatserve.head_data import (REQUEST_KINDS, Collected, Sequence, choose_vocab, collect, coverage, free_bytes,
                                 load_collected, save_collected, sequence_kinds)
from chatserve.head_store import (HEAD_FORMAT, default_head_path, head_checkpoint_path, head_data_path, save_head,
                                  weights_hash, write_atomic)
from chatserve.loading import release_free_memory
from chatserve.models.eagle_head import EagleHead
from kernels.cpu_features import cpu_flags, has_amx, has_native_bf16

CHECKPOINT_FORMAT = 1
FEATURE_NOISE = 0.1  # EAGLE's uniform noise on input features
CE_WEIGHT = 0.1  # EAGLE's weight of the token loss next to the feature loss
UNROLL_DECAY = 0.8  # weight of the s-th unrolled pass (training-time test): 0.8**s
VAL_EVERY = 20  # every 20th reply sequence is held out to validate on (none with fewer than 20 replies)
VAL_POSITIONS = 4096  # reply positions validated at most (a few seconds on Qwen 1.5B's head)
NEW_HEAD_VOCAB_SIZE = 32768  # a new head's LM head rows unless --head-vocab-size says
# Steps between loading.release_free_memory() calls (malloc_trim). With retain_freed_memory() alone
# the heap only grew: a Qwen 1.5B run on 1.2M tokens went from 14 to 21 GB in 7 minutes of steps
# and was killed for memory at 24 GB (without it: 12-15 GB, 6.7 s a step against 4.4). Trimmed
# every 20 steps it rose ~2.5 GB between trims and fell back to ~15 GB at each, ~4.5 s a step
# (a trim gives back the step's freed blocks too, so the next step faults them in once).
TRIM_EVERY = 20
VAL_DEPTH = 4  # drafts in the chain a head is chosen by (validate_chain)
VAL_CHAIN_POSITIONS = 2048  # reply positions (chain anchors) it scores at most: 4 passes each


@dataclass(frozen=True)
class TrainConfig:
    minutes: float = 30.0  # this run's wall-clock budget (data collection included)
    max_steps: int | None = None  # stop at this many optimizer steps in all (tests, smoke runs)
    data_share: float = 0.3  # of the budget for collecting data, while fewer than max_data_tokens are saved
    max_data_tokens: int = 200_000
    # collecting stops before a round that could leave less free on the data's disk (~12 KB a token
    # on Qwen 1.5B: its 3.4M tokens were 40 GB, and a disk they left 5.5 GB free failed a pip install)
    min_free_gb: float = 10.0
    reply_tokens: int = 256  # max_tokens of each of the target's greedy replies
    data_batch: int = 32  # prompts answered at once while collecting (the engine's max_num_seqs must allow them)
    # of the target's own questions (chat and requests to write code) asked after each task on source
    questions_per_task: int = 1
    # the target writes new questions for each seed, sampled, and asked for specific code requests
    # (head_data.model_questions(sampled=True)) instead of its one greedy set a topic
    sampled_questions: bool = False
    head_vocab_size: int | None = None  # N: the head's LM head rows; None: NEW_HEAD_VOCAB_SIZE, or a resumed head's
    window: int = 256
    unroll: int = 1  # passes of training-time test (EagleHead.forward_unrolled); 1 = EAGLE-1's training
    feature_weight: float = 1.0  # of the feature regression; 0 = the token loss alone (EAGLE-3)
    greedy_weight: float = 0.0  # of the cross-entropy on the target's top token, beside the soft one (loss_fn)
    # 512 positions at lr 6e-4: on SmolLM2 (docs/benchmarks.md "Session 42") 4x the optimizer steps for
    # the same compute, and a better head than 2048 at 3e-4 given 1.5x the positions
    batch_tokens: int = 512
    reply_only: bool = False  # loss over reply positions only (prompts stay context); see batch_windows
    # a sequence answering a request (head_data.REQUEST_KINDS: chat, requests to write code) is drawn
    # this many times as often per token as one on given source (tasks, plain source): served, the
    # head drafts replies to requests, and tasks on source were 74% of the data's tokens; validation,
    # which picks the saved head, weighs held-out replies alike
    request_weight: float = 1.0
    lr: float = 6e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # each run's lr follows a cosine from lr down to lr * this over its budget
    seed: int = 0
    init: str = "random"  # a new head's layer: "random" (HF's init) or "last-layer" (the target's last layer, fc = [0 | I])
    # a new head's MLP width; None: the target's (a resumed head keeps its own; asking another is a ValueError)
    head_intermediate_size: int | None = None
    checkpoint_seconds: float = 300.0  # also how often it validates (~10-20 s on Qwen 1.5B's head)
    fresh: bool = False  # start over even if a checkpoint exists
    train_dtype: str = "auto"  # the step's compute dtype: "auto", "float32" or "bfloat16" (choose_train_dtype)
    # the target layers a new head fuses (EAGLE-3); () = the final feature (EAGLE-1); None = those of the
    # checkpoint or data being resumed, else eagle3_layers()
    feature_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if not self.request_weight > 0:
            raise ValueError(f"train-head: --request-weight must be > 0, got {self.request_weight}")
        if self.questions_per_task < 1:
            raise ValueError(f"train-head: --questions-per-task must be >= 1, got {self.questions_per_task}")


INITS = ("random", "last-layer")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layer: 2, L // 2, L - 3 (fewer on a target of few layers).
    On SmolLM2-135M's data they beat the final feature: a chain of 4 accepted 1.67 against 1.50
    (benchmarks/head_features.py, docs/benchmarks.md "Session 35")."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


TRAIN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def retain_freed_memory() -> bool:
    """Have glibc keep freed memory for the next allocation instead of unmapping it; for this batch
    job's process only. glibc serves every allocation over its mmap threshold (at most 32 MB) with a
    fresh mmap and unmaps it on free, so each step's large tensors (logits over [2048, 16384] in
    float32: 134 MB each) were page-faulted in again: on Qwen 1.5B's head ~1M faults and ~3 s in
    the kernel per unrolled step. With mmap off and trimming only past 2 GB, the step's blocks come
    back from the heap. Not for the server: its memory has to fall back after a peak. -> whether
    glibc took both settings (False without glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


@functools.cache
def bf16_matmul_speedup(rows: int = 512, width: int = 1536, reps: int = 3) -> float:
    """float32 seconds over bfloat16 seconds of a [rows, width] @ [width, 2 * width] matmul on this
    process's threads (best of `reps` each, after a warm-up): what autocast's dtype buys here.
    ~0.1-0.3 s on two cores; measured once a process, so a run's steps and its record agree."""
    a, b = torch.randn(rows, width), torch.randn(width, 2 * width)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = a.to(dtype), b.to(dtype)
        x @ w
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            x @ w
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


# bf16 has to beat fp32 by this much to be chosen on a measurement: its rounding is not free
BF16_MIN_SPEEDUP = 1.2


def choose_train_dtype(name: str, flags: frozenset[str]) -> torch.dtype:
    """The compute dtype of a training step: `name` itself, or for "auto" bfloat16 where `flags`
    (kernels.cpu_features.cpu_flags()) list AMX-BF16 (has_amx), float32 where bf16 is not native
    (has_native_bf16), and between the two bfloat16 if bf16_matmul_speedup() is BF16_MIN_SPEEDUP or
    more. On a Xeon with AMX a 2048x1536 @ 1536x4096 matmul on 2 threads ran at ~2,270 GFLOP/s in bf16
    against ~320 in fp32; with AVX-512 BF16 alone an Intel machine ran bf16 the slower (161 against
    277), a Zen 4 2.3x the faster (a Qwen 1.5B head's step 1.35 s against 3.30: docs/benchmarks.md
    "Session 64")."""
    if name == "auto":
        if has_amx("bf16", flags):
            return torch.bfloat16
        if not has_native_bf16(flags):
            return torch.float32
        return torch.bfloat16 if bf16_matmul_speedup() >= BF16_MIN_SPEEDUP else torch.float32
    if name not in TRAIN_DTYPES:
        raise ValueError(f"train_dtype: one of auto, {', '.join(TRAIN_DTYPES)}, got {name!r}")
    return TRAIN_DTYPES[name]


def new_head(target, target_dir: Path, max_positions: int, head_token_ids: torch.Tensor, seed: int,
             init: str = "random", feature_layers: tuple[int, ...] = (),
             intermediate_size: int | None = None) -> EagleHead:
    """A float32 head: fc and the layer at random (HF's init), the norm at 1, the LM head the
    target's rows for head_token_ids, read from the checkpoint (a quantized target has no float rows).
    With feature_layers, a fuse of those layers' normalized outputs at std 1 / sqrt(fan-in): its
    output starts at about unit RMS, as the final feature it stands for.

    init "last-layer" starts the layer as a copy of the target's last decoder layer and fc as
    [0 | I] (the token's embedding alone): the head then begins as the target's last layer run on
    the residual stream's first term, and its weights already live in the target's feature space.
    `intermediate_size`: the layer's MLP width (None: the target's; "last-layer" needs the target's)."""
    if init not in INITS:
        raise ValueError(f"init: one of {', '.join(INITS)}, got {init!r}")
    cfg = target.config
    if init == "last-layer" and intermediate_size not in (None, cfg.intermediate_size):
        raise ValueError(f"init last-layer copies the target's layer: its MLP width is {cfg.intermediate_size}, "
                         f"not {intermediate_size}")
    torch.manual_seed(seed)
    head = EagleHead(cfg, max_positions, head_token_ids, feature_layers=feature_layers,
                     intermediate_size=intermediate_size).float()
    std = getattr(cfg, "initializer_range", 0.02)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    if head.fuse is not None:
        torch.nn.init.normal_(head.fuse.weight, std=head.fuse.in_features**-0.5)
    if init == "last-layer":
        copy_last_layer(head, target_dir, cfg.num_hidden_layers - 1)
        hidden = head.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, hidden:].copy_(torch.eye(hidden))
            head.fc.bias.zero_()
    set_vocab(head, target, target_dir, head_token_ids)
    return head


def copy_last_layer(head: EagleHead, target_dir: Path, layer: int) -> None:
    """head.layer's weights := the target checkpoint's decoder layer `layer` (float, read from the
    checkpoint: a quantized target has no float weights)."""
    from types import SimpleNamespace

    from chatserve.models.loader import _check_complete, _checkpoint_index, _open_files, _read

    sources = _checkpoint_index(Path(target_dir))
    loaded: set[str] = set()
    shapes = SimpleNamespace(layers=[head.layer])  # what _read asks of a model: the fused shards' sizes
    names = {f"layers.{layer}.{name}": param for name, param in head.layer.named_parameters()}
    with _open_files(sources) as files, torch.no_grad():
        for name, param in names.items():
            _read(param, name, sources, files, shapes, loaded)
    _check_complete(names, loaded, tie_word_embeddings=False)  # every fused shard too, as load_model checks


def set_vocab(head: EagleHead, target, target_dir: Path, head_token_ids: torch.Tensor) -> None:
    """Give head the LM head over head_token_ids: the target's rows for them, read from the
    checkpoint (a quantized target has no float rows), frozen. The rest of the head is untouched,
    so a resumed head can take the vocabulary of its grown data at no cost."""
    from chatserve.models.loader import read_tensor

    name = "embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"
    rows = read_tensor(target_dir, name)[head_token_ids].to(head.fc.weight.dtype)
    head.lm_head = type(head.lm_head)(rows.shape[1], rows.shape[0], bias=False)
    with torch.no_grad():
        head.lm_head.weight.copy_(rows)
    head.lm_head.weight.requires_grad_(False)
    head.head_token_ids = head_token_ids.long()


def batch_windows(sequences: list[Sequence], num_windows: int, window: int, gen: torch.Generator,
                  reply_only: bool = False, weights: torch.Tensor | None = None):
    """num_windows windows of up to `window` positions, sequences picked by length (times `weights`,
    one per sequence, if given), padded at the
    end -> (features_in [B, W, width] f_{i-1}, token_ids [B, W] t_i, targets [B, W, width] f_i,
    mask [B, W] bool: the rows the loss is taken over); width is the data's
    (EagleHead.feature_width). reply_only: a prompt's positions are context, not loss rows, in a
    sequence with a reply (a plain source has none: all its rows stay), as EAGLE's data masks the
    user's turns: served, the head drafts replies."""
    lengths = torch.tensor([len(s.token_ids) for s in sequences], dtype=torch.float)
    if weights is not None:
        lengths = lengths * weights
    hidden = sequences[0].features.shape[1]
    features_in = torch.zeros(num_windows, window, hidden)
    targets = torch.zeros(num_windows, window, hidden)
    token_ids = torch.zeros(num_windows, window, dtype=torch.long)
    mask = torch.zeros(num_windows, window, dtype=torch.bool)
    for b, i in enumerate(torch.multinomial(lengths, num_windows, replacement=True, generator=gen).tolist()):
        seq = sequences[i]
        n = len(seq.token_ids)
        replies = reply_only and seq.num_prompt_tokens < n  # loss rows from the reply's first on
        low = min(max(seq.num_prompt_tokens - window + 1, 0), max(n - window, 0)) if replies else 0
        start = low + int(torch.randint(max(n - window, 0) - low + 1, (1,), generator=gen))  # a loss row in it
        w = min(window, n - start)
        token_ids[b, :w] = seq.token_ids[start : start + w]
        targets[b, :w] = seq.features[start : start + w].float()
        lo = max(start - 1, 0)
        features_in[b, lo - start + 1 : w] = seq.features[lo : start + w - 1].float()  # row 0 at start 0: zeros
        mask[b, max(seq.num_prompt_tokens - start, 0) if replies else 0 : w] = True
    return features_in, token_ids, targets, mask


def split_validation(sequences: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """-> (train, validation): every VAL_EVERY-th reply sequence held out. Without it a head's
    training agreement says little: SmolLM2's session-13 head agrees with the target on 75% of its
    own training replies' positions and on 46% (code) / 20% (chat) of held-out ones."""
    replies = [i for i, s in enumerate(sequences) if s.num_prompt_tokens < len(s.token_ids)]
    held = set(replies[VAL_EVERY - 1 :: VAL_EVERY])
    return [s for i, s in enumerate(sequences) if i not in held], [sequences[i] for i in sorted(held)]


def spread_order(n: int) -> list[int]:
    """range(n) in an order whose every prefix is spread evenly over it (i x the golden ratio's
    fractional part, sorted: a low-discrepancy sequence), so a budget that stops early still
    samples the whole held-out set."""
    return sorted(range(n), key=lambda i: (i * 0.6180339887498949) % 1.0)


@torch.no_grad()
def validate(head: EagleHead, embed, sequences: list[Sequence], max_positions: int = VAL_POSITIONS) -> float:
    """Pass-0 top-1 agreement with the target over the reply positions of held-out sequences (no
    input noise): the first draft's acceptance at T = 0, as serving will see it, over sequences in
    spread_order like held_out_hits'. nan without any."""
    was_training = head.training
    head.eval()
    right = total = 0
    for seq in (sequences[i] for i in spread_order(len(sequences))):
        if total >= max_positions:
            break
        features = seq.features.float()[None]
        features_in = torch.cat((torch.zeros_like(features[:, :1]), features[:, :-1]), dim=1)
        y = head.forward_dense(features_in, embed(seq.token_ids[None]).float())
        predicted = F.rms_norm(y, head.norm.weight.shape, head.norm.weight, head.norm.eps)
        rows = slice(seq.num_prompt_tokens, None)
        agree = F.linear(predicted[0, rows], head.lm_head.weight).argmax(-1) == \
            F.linear(head.target_features(features[0, rows]), head.lm_head.weight).argmax(-1)
        right, total = right + int(agree.sum()), total + agree.numel()
    head.train(was_training)
    return right / total if total else float("nan")


@torch.no_grad()
def chain_hits(head: EagleHead, embed, ids: torch.Tensor, features: torch.Tensor, num_prompt: int, depth: int,
               top: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's reply positions drafted from as serving drafts: ([anchors, depth] bool, whether
    the chain from each reply anchor p has its first s+1 drafts all equal to the target's greedy
    tokens; [anchors, top] bool, whether the first token is among the head's first n + 1
    candidates; [anchors, depth] the head's softmax probability of its (s+1)-th draft, what a
    served chain stops on, 0 past the reply). Pass s of EagleHead.forward_unrolled at row p + s
    is the (s+1)-th draft from p (tests/chatserve/test_eagle.py holds it equal to drafting)."""
    feats_in = torch.cat((torch.zeros_like(features[:1]), features[:-1])).float()[None]  # row i reads f_{i-1}
    passes = head.forward_unrolled(feats_in, embed(ids[None]).float(), depth)
    t = len(ids)
    anchors = torch.arange(num_prompt, t - 1)  # a reply token accepted at p; row p predicts t_{p+1}
    right = torch.zeros(len(anchors), depth, dtype=torch.bool)
    sure = torch.zeros(len(anchors), depth)
    covered = torch.zeros(len(anchors), top, dtype=torch.bool)
    for s, y in enumerate(passes):
        rows = anchors + s
        ok = rows < t - 1
        predicted = F.rms_norm(y[0, rows[ok]], head.norm.weight.shape, head.norm.weight, head.norm.eps)
        logits = head.lm_head(predicted)  # [ok rows, kept]
        right[ok, s] = head.head_token_ids[logits.argmax(-1)] == ids[rows[ok] + 1]
        sure[ok, s] = logits.detach().float().softmax(-1).amax(-1)
        if s == 0:
            candidates = head.head_token_ids[logits.topk(top, dim=-1).indices]  # [anchors, top]
            covered = (candidates == ids[anchors + 1][:, None]).cumsum(dim=1).bool()
    return right.cumprod(dim=1).bool(), covered, sure


def held_out_hits(head: EagleHead, embed, sequences: list[Sequence], depth: int = VAL_DEPTH,
                  max_positions: float = VAL_CHAIN_POSITIONS) -> list[torch.Tensor]:
    """chain_hits' [anchors, depth] of held-out sequences with a reply (held_out_chains)."""
    return [right for right, _ in held_out_chains(head, embed, sequences, depth, max_positions)]


def held_out_chains(head: EagleHead, embed, sequences: list[Sequence], depth: int = VAL_DEPTH,
                    max_positions: float = VAL_CHAIN_POSITIONS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """chain_hits' (hits, sure), each [anchors, depth], of held-out sequences with a reply, until
    max_positions anchors (math.inf: every one) are scored (the head in eval mode meanwhile), taken in
    spread_order: the data's sequences come in the order they were collected (the shipped prompts
    first, then tasks and the target's own questions), and the first 2,048 anchors in that order were
    11 of 99 held-out replies, all early ones, scoring Qwen's session-66 head at 1.89 against 1.97
    over all 99."""
    was_training = head.training
    head.eval()
    chains, total = [], 0
    for seq in chained_replies(sequences):
        if total >= max_positions:
            break
        right, _, sure = chain_hits(head, embed, seq.token_ids, seq.features, seq.num_prompt_tokens, depth)
        chains.append((right, sure))
        total += len(right)
    head.train(was_training)
    return chains


def chained_replies(sequences: list[Sequence]) -> Iterator[Sequence]:
    """The sequences held_out_chains scores, in its order: those with a reply position to anchor a
    chain on, in spread_order."""
    return (sequences[i] for i in chained_indices(sequences))


def chained_indices(sequences: list[Sequence]) -> list[int]:
    """chained_replies' indices into sequences."""
    return [i for i in spread_order(len(sequences))
            if len(sequences[i].token_ids) - 1 > sequences[i].num_prompt_tokens]


def fit_stop_power(chains: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The power a such that a greedy chain whose drafts the head gave probabilities p_1 .. p_s
    (P = their product, what a served chain stops on) is accepted with probability P ** a, fitted by
    likelihood over every anchor and depth of held_out_chains (hits, sure): 1.0 is a calibrated
    head, below 1 an underconfident one (trained on the target's soft distribution, a head spreads
    probability the greedy target never samples). A grid of 0.01 over [0.2, 2]; 1.0 without data."""
    rows = [(right[sure > 0], sure.cumprod(dim=1)[sure > 0]) for right, sure in chains]
    if not rows or not sum(len(r) for r, _ in rows):
        return 1.0
    right = torch.cat([r for r, _ in rows]).double()
    log_p = torch.cat([p for _, p in rows]).double().clamp_min(1e-12).log()
    powers = torch.arange(20, 201, dtype=torch.float64) / 100
    q = (powers[:, None] * log_p[None]).exp().clamp(1e-9, 1 - 1e-9)  # [powers, positions]
    likelihood = (right * q.log() + (1 - right) * (1 - q).log()).sum(1)
    return round(float(powers[likelihood.argmax()]), 2)


def validate_chain(head: EagleHead, embed, sequences: list[Sequence], depth: int = VAL_DEPTH,
                   max_positions: int = VAL_CHAIN_POSITIONS, weights: torch.Tensor | None = None) -> float:
    """The mean accepted length (tokens per verification, the bonus token included) of a fixed
    chain of `depth` drafts from every reply position of held-out sequences, at T = 0: what a
    head is chosen by. Pass-0 agreement (validate) scores the first draft alone; a head trained
    with --unroll may trade a point of it for much better later drafts, and a served chain pays
    for those. Serving measures less (walked_length: hard stretches get a verification at every
    position); this is the smoother of the two to choose by. nan without any reply position.
    weights: each sequence's (request_weights), its anchors weighed by it, as training draws it."""
    hits = held_out_hits(head, embed, sequences, depth, max_positions)
    return every_anchor_length(hits, hit_weights(weights, sequences, len(hits)))


def hit_weights(weights: torch.Tensor | None, sequences: list[Sequence], num_hits: int) -> list[float] | None:
    """The weights (one per sequence) of the first num_hits replies held_out_hits scored, in its order."""
    return None if weights is None else [float(weights[i]) for i in chained_indices(sequences)[:num_hits]]


def every_anchor_length(hits: list[torch.Tensor], weights: list[float] | None = None) -> float:
    """1 + the mean over every anchor of hits (held_out_hits) of the drafts its chain gets accepted;
    with weights (one per reply), each reply's anchors count weights[i] times."""
    if not hits:
        return float("nan")
    accepted = torch.cat(hits).float().sum(1)
    if weights is None:
        return 1.0 + float(accepted.mean())
    w = torch.cat([torch.full((len(h),), float(wi)) for h, wi in zip(hits, weights, strict=True)])
    return 1.0 + float((w * accepted).sum() / w.sum())


def walked_length(hits: list[torch.Tensor], k: int) -> float:
    """Tokens per verification of a fixed chain of k drafts over replies as serving walks them:
    hits[i] [anchors, depth] (chain_hits) of reply i; from anchor p with a drafts accepted the
    next verification starts at p + a + 1. Below the mean over every anchor (validate_chain): a
    hard stretch is a verification at every position, an easy one at every (a + 1)-th, so what
    serving measures weighs the hard ones more (session 31's head on code: 1.86 walked, 1.88
    served, 2.09 over every anchor)."""
    tokens = steps = 0
    for reply in hits:
        accepted = reply[:, :k].sum(1).tolist()
        p = 0
        while p < len(accepted):
            tokens, steps, p = tokens + accepted[p] + 1, steps + 1, p + accepted[p] + 1
    return tokens / steps if steps else float("nan")


def loss_fn(head: EagleHead, embed, features_in, token_ids, targets, mask, noise_gen=None, unroll: int = 1,
            lm_weight: torch.Tensor | None = None, feature_weight: float = 1.0, greedy_weight: float = 0.0):
    """-> (loss, metrics): EAGLE's feature regression (x feature_weight) + 0.1 x token cross-entropy
    over the valid rows. feature_weight 0 is EAGLE-3's loss: the head's feature is only what its
    tokens need (it still feeds the next draft of a chain, which --unroll trains). unroll > 1 adds
    the passes of EagleHead.forward_unrolled (the 2nd.. token of a drafted chain, from the head's
    own features), pass s weighted UNROLL_DECAY**s; "top1" is pass 0's
    agreement, "top1_<s>" pass s's. Under bf16 autocast the matmuls run in bf16; the final norm,
    the softmaxes and the losses stay float32 (the .float() calls, no-ops in float32).
    lm_weight: the frozen LM head's weight as the matmuls take it (train() casts it to bf16 once:
    autocast re-casts a weight that needs no gradient at every use, 25M values three times a step);
    default head.lm_head.weight.
    greedy_weight adds that many times the cross-entropy on the target's top token ("greedy"): at T = 0 a
    draft is accepted when it is that token, so -log q(top) is the log of a greedy draft's acceptance, where
    the soft cross-entropy (forward KL) also spends a small head's capacity on the target's tail (LK losses,
    Samarin et al. 2026, make the same argument at T = 1)."""
    lm_weight = head.lm_head.weight if lm_weight is None else lm_weight
    targets = head.target_features(targets)  # the final feature (features_in stay raw: the head fuses them)
    if noise_gen is not None:
        features_in = features_in + (torch.rand(features_in.shape, generator=noise_gen) - 0.5) * 2 * FEATURE_NOISE
    with torch.no_grad():
        embeds = embed(token_ids).float()  # [B, W, hidden]
        target_logits = F.linear(targets, lm_weight)  # [B, W, kept]
        target_p = F.softmax(target_logits.float(), -1)  # [B, W, kept]
        target_top1 = target_logits.argmax(-1)  # [B, W]: bf16 -> float32 is exact, so float32's argmax
    outs = head.forward_unrolled(features_in, embeds, unroll) if unroll > 1 else [head.forward_dense(features_in, embeds)]
    loss, metrics = 0.0, {}
    for s, y in enumerate(outs):
        rows = mask.clone()
        rows[:, :s] = False  # a chain's (s+1)-th row needs its anchor inside the window
        if s > 0 and not rows.any():  # reply_only: replies this short in every window
            continue
        predicted = F.rms_norm(y.float(), head.norm.weight.shape, head.norm.weight, head.norm.eps)[rows]  # [rows, hidden]
        logp = F.log_softmax(F.linear(predicted, lm_weight).float(), -1)  # [rows, kept]
        feature_loss = F.smooth_l1_loss(predicted, targets[rows])
        token_loss = -(target_p[rows] * logp).sum(-1).mean()
        greedy_loss = -logp.gather(-1, target_top1[rows][:, None]).mean() if greedy_weight else 0.0
        token_part = CE_WEIGHT * (token_loss + greedy_weight * greedy_loss)
        loss = loss + UNROLL_DECAY**s * (feature_weight * feature_loss + token_part)
        agree = float((logp.detach().argmax(-1) == target_top1[rows]).float().mean())
        if s == 0:
            metrics = {"feature": float(feature_loss.detach()), "token": float(token_loss.detach()), "top1": agree}
            if greedy_weight:
                metrics["greedy"] = float(greedy_loss.detach())
        else:
            metrics[f"top1_{s}"] = agree
    return loss, {"loss": float(loss.detach()), **metrics}


def train(head: EagleHead, embed, sequences: list[Sequence], cfg: TrainConfig, seconds: float, state: dict,
          save=None, progress=None, val: list[Sequence] = (), on_best=None, weights: torch.Tensor | None = None,
          val_weights: torch.Tensor | None = None) -> dict:
    """Optimize head on sequences for `seconds` (or up to cfg.max_steps in all). state: {"step",
    "seconds", "optimizer"} from a checkpoint, or empty; updated. save(state) is called every
    cfg.checkpoint_seconds and at the end; progress(metrics) after every step, with its "step" (in
    all) and "done", how far the run is through its budget (run_fraction). With `val`, the
    head is validated at those times too (state["val_top1"]: validate; state["val_accepted"]:
    validate_chain, the best so far in "best_val_accepted"; state["val_walked"]: the same chains
    as serving walks them, walked_length), and on_best(val_accepted) is called
    when it beats the best. `weights`: each sequence's sampling weight per token (batch_windows);
    `val_weights` each held-out one's, what its anchors weigh in val_accepted. The forward and loss run in
    choose_train_dtype(cfg.train_dtype, cpu_flags()), validation in float32."""
    use_bf16 = choose_train_dtype(cfg.train_dtype, cpu_flags()) == torch.bfloat16
    params = [p for p in head.parameters() if p.requires_grad]
    # fused: one pass over each parameter's state instead of ~10 (AdamW was ~0.27 s of a 2 s step)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    if state.get("optimizer"):
        opt.load_state_dict(state["optimizer"])
        for group in opt.param_groups:  # a checkpoint's groups carry the flags it was saved with
            group.update(fused=True, foreach=None)
    lm_weight = head.lm_head.weight.detach().to(torch.bfloat16 if use_bf16 else head.lm_head.weight.dtype)
    state.setdefault("step", 0)
    state.setdefault("seconds", 0.0)
    gen = torch.Generator().manual_seed(cfg.seed * 1000003 + state["step"])
    num_windows = max(cfg.batch_tokens // cfg.window, 1)
    start = last_save = time.perf_counter()
    metrics: dict = {}
    head.train()
    first_step = state["step"]
    while time.perf_counter() - start < seconds and (cfg.max_steps is None or state["step"] < cfg.max_steps):
        done = run_fraction(cfg, time.perf_counter() - start, seconds, state["step"], first_step)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_scale(cfg, state["step"], done)
        with torch.enable_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                loss, metrics = loss_fn(head, embed, *batch_windows(sequences, num_windows, cfg.window, gen,
                                                                         cfg.reply_only, weights),
                                        noise_gen=gen, unroll=cfg.unroll, lm_weight=lm_weight,
                                        feature_weight=cfg.feature_weight, greedy_weight=cfg.greedy_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if state["step"] % TRIM_EVERY == TRIM_EVERY - 1:
            release_free_memory()
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(f"train-head: loss {metrics['loss']} at step {state['step']}")
        state["step"] += 1
        if progress:
            done = run_fraction(cfg, time.perf_counter() - start, seconds, state["step"], first_step)
            progress({**metrics, "step": state["step"], "done": done})
        if (save or val) and time.perf_counter() - last_save > cfg.checkpoint_seconds:
            state.update(seconds=state["seconds"] + time.perf_counter() - last_save, optimizer=opt.state_dict())
            _validate_into(state, head, embed, val, on_best, val_weights)
            if save:
                save(state)
            last_save = time.perf_counter()
    head.eval()
    state.update(seconds=state["seconds"] + time.perf_counter() - last_save, optimizer=opt.state_dict(),
                 metrics=metrics)
    _validate_into(state, head, embed, val, on_best, val_weights)
    if save:
        save(state)
    return state


def run_fraction(cfg: TrainConfig, elapsed: float, seconds: float, step: int, first_step: int) -> float:
    """How far (0-1) a run that began at optimizer step first_step is through its budget at step
    `step` (in all), `elapsed` of its `seconds` gone: by whichever of --minutes and --max-steps ends
    it first (the lr's schedule and the progress bar)."""
    done = elapsed / seconds if seconds > 0 else 0.0
    if cfg.max_steps is not None:
        done = max(done, (step - first_step) / max(cfg.max_steps - first_step, 1))
    return done


def lr_scale(cfg: TrainConfig, step: int, done: float) -> float:
    """The lr multiplier at optimizer step `step` (in all), `done` (0-1) of the way through this
    run's budget: a linear warm-up over the first cfg.warmup_steps, then a cosine from 1 down to
    cfg.min_lr_ratio at the end of the run. A resumed run starts again from the top (a warm
    restart); the head kept is the best validated one, so a restart cannot lose the best."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(max(done, 0.0), 1.0)))
    return warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def _validate_into(state: dict, head: EagleHead, embed, val: list[Sequence], on_best,
                   val_weights: torch.Tensor | None = None) -> None:
    if not val:
        return
    state["val_top1"] = validate(head, embed, val)
    hits = held_out_hits(head, embed, val)
    state["val_accepted"] = accepted = every_anchor_length(hits, hit_weights(val_weights, val, len(hits)))
    state["val_walked"] = walked_length(hits, VAL_DEPTH)
    if not accepted <= state.get("best_val_accepted", -1.0):
        state["best_val_accepted"] = accepted
        if on_best:
            on_best(accepted)


def run(engine, model: str, target_dir: Path, cfg: TrainConfig, out: Path | None = None,
        show_progress: bool = True) -> Path | None:
    """The whole command on a loaded engine (speculation off): data (collected, or read back),
    head (new, or from the checkpoint), training, and the servable head file. -> its path, or
    None when the data phase took the whole budget."""
    target_hash = weights_hash(target_dir)
    head_path = Path(out) if out else default_head_path(target_hash)
    data_path = head_data_path(head_path)
    ckpt_path = head_checkpoint_path(head_path)
    budget_start = time.perf_counter()
    seconds = cfg.minutes * 60
    target = engine.models.target
    data = load_collected(data_path, target_hash) if not cfg.fresh else None
    # no checkpoint but a head (imported, or its checkpoint gone): go on from the head
    ckpt = None if cfg.fresh else (_load_checkpoint(ckpt_path, target_hash)
                                   or _head_as_checkpoint(head_path, target_hash))
    layers = _feature_layers(cfg, ckpt, data, target.num_layers)
    if ckpt and cfg.head_intermediate_size not in (None, width := EagleHead.state_width(ckpt["head"])):
        raise ValueError(f"train-head: the checkpoint's head has an MLP width of {width}, not "
                         f"{cfg.head_intermediate_size}; continue with that, or start over with --fresh")
    engine.models.target_runner.feature_layers = layers  # what collect() records beside the final feature
    if cfg.data_share > 0 and (data is None or (not data.exhausted and data.num_tokens < cfg.max_data_tokens)):
        data = _collect(engine, cfg, seconds * cfg.data_share, show_progress, data,
                        lambda state: save_collected(data_path, state, target_hash), data_path.parent)
    if data is None or not data.sequences:
        raise ValueError(f"train-head: no training data at {data_path}; collect some with --data-share > 0")
    sequences = data.sequences
    remaining = max(seconds - (time.perf_counter() - budget_start), 0.0)
    if remaining == 0.0 and cfg.max_steps is None:
        return None  # the budget went to data (--data-share 1): nothing trained, no head written
    train_seqs, val = split_validation(sequences)
    if not ckpt:
        state = {"head_vocab_size": cfg.head_vocab_size or NEW_HEAD_VOCAB_SIZE}
        head = _new(engine, target_dir, train_seqs, cfg, state["head_vocab_size"], layers)
    else:  # the data may have grown since: the vocabulary follows it (the LM head is the target's, frozen)
        head, state = _resume(engine, ckpt)
        specials = engine.tokenizer.special_token_ids
        # its size as trained unless asked: re-chosen at the default, a Qwen head of 16,384 rows
        # grew to 32,788 and its draft step from 1.6 to 3.6 ms (session 31)
        # (a checkpoint from before the size was kept: its rows less the special ids, a few short)
        size = cfg.head_vocab_size or state.get("head_vocab_size") or \
            len(head.head_token_ids) - len(set(specials) & set(head.head_token_ids.tolist()))
        ids = choose_vocab(train_seqs, target.vocab_size, size, specials)
        state["head_vocab_size"] = size
        if not torch.equal(ids, head.head_token_ids):
            set_vocab(head, target, target_dir, ids)
    info = {"model": model, "num_sequences": len(sequences), "num_tokens": sum(len(s.token_ids) for s in sequences),
            "num_val_sequences": len(val),
            "coverage": coverage(sequences, head.head_token_ids), "num_kept": len(head.head_token_ids),
            "feature_layers": list(layers), "intermediate_size": head.intermediate_size,
            "prior_steps": state.get("prior_steps", 0),  # of a head this one went on from without its checkpoint
            "dtype": engine.config.dtype, "quantization": engine.config.quantization,
            "train_dtype": str(choose_train_dtype(cfg.train_dtype, cpu_flags())).removeprefix("torch."),
            "train_config": dataclasses.asdict(cfg)}
    embed = target.embed_tokens
    # the servable head is the best validated one; this run's held-out set may differ from the
    # last run's (more data), so the head on disk is scored again before it can be replaced
    state.pop("best_val_top1", None)  # what heads were chosen by before validate_chain
    state.pop("best_val_accepted", None)
    # held-out replies weigh as training draws them (--request-weight): the head is chosen for what users send
    val_weights = request_weights(val, data.questions, engine.tokenizer, cfg.request_weight, {})
    if val and ckpt and head_path.is_file():
        state["best_val_accepted"] = validate_chain(_load_servable(head_path, engine, target_hash) or head, embed, val,
                                                    weights=val_weights)

    def save(state: dict) -> None:
        _save(ckpt_path, {"format": CHECKPOINT_FORMAT, "target_hash": target_hash, "head": head.state_dict(),
                          "feature_layers": list(head.feature_layers), "state": state})

    def save_best(val_accepted: float) -> None:
        save_head(head_path, head, target_hash, {**info, "steps": state["step"], "train_seconds": round(state["seconds"], 1),
                                                 "val_top1": state["val_top1"], "val_accepted": val_accepted,
                                                 "val_walked": state["val_walked"]})

    # in percent of the run, whichever of its budgets (--minutes, --max-steps) ends it first, as the lr's
    # schedule counts it: a bar in seconds of --minutes showed 10 hours left of a run that --max-steps ended in 3.6
    bar = _bar(show_progress, total=1000, desc="training",
               bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")

    def progress(metrics: dict) -> None:
        if bar is not None:
            bar.update(max(min(int(1000 * metrics["done"]), 1000) - bar.n, 0))
            chained = {k: f"{v:.2f}" for k, v in metrics.items() if k.startswith("top1_")}
            # (a checkpoint from before val_walked resumes with val and val_len alone until it validates)
            held_out = {name: f"{state[key]:.2f}" for name, key in
                        (("val", "val_top1"), ("val_len", "val_accepted"), ("val_walk", "val_walked")) if key in state}
            bar.set_postfix(step=metrics["step"], loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}",
                            **chained, **held_out)

    weights = request_weights(train_seqs, data.questions, engine.tokenizer, cfg.request_weight, info)
    state = train(head, embed, train_seqs, cfg, remaining, state, save, progress, val, save_best, weights, val_weights)
    if bar is not None:
        bar.close()
    if not val:  # nothing to choose by: the last weights
        save_head(head_path, head, target_hash, {**info, "steps": state["step"],
                                                 "train_seconds": round(state["seconds"], 1)})
    record = torch.load(head_path, weights_only=True)
    if val:  # the saved head's calibration at T = 0, what its greedy chains' stop reads (EagleMethod)
        saved = _load_servable(head_path, engine, target_hash, record)
        record["info"]["greedy_stop_power"] = fit_stop_power(held_out_chains(saved or head, embed, val))
    record["info"].update(last_steps=state["step"], last_train_seconds=round(state["seconds"], 1),
                          final=state.get("metrics", {}), last_val_top1=state.get("val_top1"),
                          last_val_accepted=state.get("val_accepted"), last_val_walked=state.get("val_walked"))
    write_atomic(head_path, lambda tmp: torch.save(record, tmp))
    return head_path


def request_weights(sequences: list[Sequence], questions: dict[str, list[str]], tokenizer, weight: float,
                    info: dict) -> torch.Tensor | None:
    """Each sequence's sampling weight per token (TrainConfig.request_weight on those answering a
    request, head_data.sequence_kinds; 1 on the rest), or None at weight 1. info gets each kind's
    share of the tokens, and of the windows drawn."""
    if weight == 1.0:
        return None
    kinds = sequence_kinds(sequences, questions, tokenizer)
    weights = torch.tensor([weight if k in REQUEST_KINDS else 1.0 for k in kinds])
    lengths = torch.tensor([float(len(s.token_ids)) for s in sequences])
    shares = {}
    for kind in sorted(set(kinds)):
        rows = torch.tensor([k == kind for k in kinds])
        shares[kind] = {"tokens": round(float(lengths[rows].sum() / lengths.sum()), 4),
                        "drawn": round(float((lengths * weights)[rows].sum() / (lengths * weights).sum()), 4)}
    info["kind_shares"] = shares
    return weights


def _feature_layers(cfg: TrainConfig, ckpt: dict | None, data: Collected | None, num_layers: int) -> tuple[int, ...]:
    """The layers the head fuses: cfg's, else the checkpoint's or the saved data's, else
    eagle3_layers(); a checkpoint or data for other layers is a ValueError (resuming cannot mix them)."""
    saved = []
    if ckpt:
        saved.append(("checkpoint", tuple(ckpt.get("feature_layers", ()))))
    if data is not None and data.sequences:
        saved.append(("data", tuple(data.feature_layers)))
    if cfg.feature_layers is not None:
        layers = tuple(cfg.feature_layers)
    else:
        layers = saved[0][1] if saved else eagle3_layers(num_layers)
    name = lambda ls: " ".join(map(str, ls)) or "final"  # noqa: E731  as --feature-layers takes them
    for what, theirs in saved:
        if theirs != layers:
            raise ValueError(f"train-head: the saved {what} is for --feature-layers {name(theirs)}, not "
                             f"{name(layers)}; continue with those, or start over with --fresh")
    return layers


def _new(engine, target_dir: Path, sequences: list[Sequence], cfg: TrainConfig, vocab_size: int,
         layers: tuple[int, ...]) -> EagleHead:
    target = engine.models.target
    ids = choose_vocab(sequences, target.vocab_size, vocab_size, engine.tokenizer.special_token_ids)
    return new_head(target, target_dir, engine.max_model_len, ids, cfg.seed, cfg.init, layers,
                    cfg.head_intermediate_size)


def _load_servable(path: Path, engine, target_hash: str, record: dict | None = None) -> EagleHead | None:
    """The head saved at `path` (or its record, already read) in float and eval mode, with its info;
    None when it is for other weights or other feature layers than the engine's runner records."""
    record = torch.load(path, weights_only=True) if record is None else record
    if record.get("target_hash") != target_hash:
        return None
    head = EagleHead.from_state(engine.models.target.config, engine.max_model_len, record["state_dict"],
                                record.get("feature_layers", ())).float()
    if head.feature_layers != engine.models.target_runner.feature_layers:
        return None  # for other features than the data's: not comparable
    head.info = record.get("info", {})
    return head.eval()


def _resume(engine, ckpt: dict) -> tuple[EagleHead, dict]:
    head = EagleHead.from_state(engine.models.target.config, engine.max_model_len, ckpt["head"],
                                ckpt.get("feature_layers", ())).float()
    head.lm_head.weight.requires_grad_(False)
    return head, ckpt["state"]


def _collect(engine, cfg: TrainConfig, seconds: float, show_progress: bool, resume: Collected | None,
             checkpoint, disk: Path) -> Collected:
    bar = _bar(show_progress, total=cfg.max_data_tokens, unit="tok", desc="data (target replies + source)")

    def progress(num_tokens: int) -> None:
        if bar is not None:
            bar.update(min(num_tokens, bar.total) - bar.n)

    try:
        state = collect(engine, max_tokens=cfg.max_data_tokens, seconds=seconds, reply_tokens=cfg.reply_tokens,
                        seed=cfg.seed, batch=min(cfg.data_batch, engine.config.max_num_seqs),
                        questions_per_task=cfg.questions_per_task, sampled_questions=cfg.sampled_questions,
                        progress=progress,
                        resume=resume, checkpoint=checkpoint, checkpoint_seconds=cfg.checkpoint_seconds,
                        disk=disk, keep_free=int(cfg.min_free_gb * 2**30))
    finally:
        if bar is not None:
            bar.close()
    if state.disk_full:
        print(f"train-head: collecting stopped at {state.num_tokens:,} tokens: another round could leave less "
              f"than --min-free-gb {cfg.min_free_gb:g} GB free on {disk} ({free_bytes(disk) / 2**30:.1f} GB now); "
              f"training goes on with the data saved", file=sys.stderr)
    return state


def _bar(show: bool, **kwargs):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, **kwargs)


def _load_checkpoint(path: Path, target_hash: str) -> dict | None:
    if not path.is_file():
        return None
    record = torch.load(path, weights_only=True)
    if record.get("format") != CHECKPOINT_FORMAT or record["target_hash"] != target_hash:
        return None
    return record


def _head_as_checkpoint(path: Path, target_hash: str) -> dict | None:
    """A checkpoint that goes on from the servable head at `path` where it has none (one imported
    from a portable file, or trained elsewhere): its weights, a new optimizer, the step count at 0
    so the lr warms up again (Adam's first steps at the peak lr would shake a trained head), the
    head's earlier steps kept as "prior_steps"."""
    if not path.is_file():
        return None
    record = torch.load(path, weights_only=True)
    if record.get("format") != HEAD_FORMAT or record["target_hash"] != target_hash:
        return None
    info = record.get("info", {})
    prior = info.get("prior_steps", 0) + info.get("steps", 0)  # the steps that made the weights kept
    return {"format": CHECKPOINT_FORMAT, "target_hash": target_hash, "head": record["state_dict"],
            "feature_layers": record.get("feature_layers", []), "state": {"prior_steps": prior}}


def _save(path: Path, record: dict) -> None:
    write_atomic(path, lambda tmp: torch.save(record, tmp))
