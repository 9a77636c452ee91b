"""Training data for an EAGLE head, made on this machine with no network: token sequences with
the target's features (final-norm outputs) at every position.

Sources, interleaved until a token or time budget runs out:
- the target's own greedy replies to prompts: those shipped in data/head_prompts.json (chat and
  code, kept apart from the benchmark prompts), then questions on whole files and tasks on
  snippets of the Python standard library's source ("explain this code", ...) and questions on
  the reference manual's topics, alternating with prompts the target writes itself on the
  file's everyday topics and requests to write code it writes on its programming topics. The head
  learns what the target says.
- plain standard-library source, for code as it is written.
Features come from the engine's own runner, so a head is trained on exactly what it reads when
serving (same dtype, quantization): a reply's are recorded as the engine generates it
(Engine.feature_observer, FeatureRecorder), plain source's by one prefill in scratch blocks of its
pool (ModelRunner.run_with_features). Recording while generating halves the target's work: on
Qwen2.5-Coder-1.5B the second prefill over prompt and reply took half the data phase.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from chatserve.batch import BatchItem
from chatserve.block_manager import BlockTable
from chatserve.sampling_params import SamplingParams

PROMPTS_FILE = Path(__file__).parent / "data" / "head_prompts.json"
HELD_OUT_FILE = Path(__file__).parent / "data" / "prompts.json"  # what benchmarks measure a head on
# what model_questions asks the target to write: kind -> (head_prompts.json's topics, its request)
QUESTION_KINDS = {"chat": ("topics", "question_request"), "code": ("code_topics", "code_request")}
# model_questions(sampled=True): the request each kind is asked with instead (head_prompts.json's keys),
# and the temperature its questions are sampled at
SAMPLED_REQUESTS = {"chat": "question_request", "code": "specific_code_request"}
QUESTION_TEMPERATURE = 0.8
SNIPPET_LINES = 40  # lines of stdlib source per "source task" prompt
FILE_LINES = (60, 250)  # a whole stdlib file this long is pasted into a "file task" (~0.6-2.5k tokens)
RAW_TOKENS = 768  # tokens per plain source sequence
DOC_CHARS = 1500  # characters quoted from a documentation topic
QUESTIONS_PER_TOPIC = 6  # prompts the target writes on each topic of head_prompts.json (chat or code)
QUESTION_TOKENS = 256  # the most it writes for one topic's
FEATURE_DTYPE = torch.bfloat16  # stored features: half the memory of float32, float32's range


@dataclass
class Sequence:
    token_ids: torch.Tensor  # [T] int64
    # [T, width] FEATURE_DTYPE: the target's features at each position as its runner returns them
    # (ModelRunner.run_with_features: the captured layers' normalized outputs, if any, then the final norm's)
    features: torch.Tensor
    num_prompt_tokens: int  # the target's reply starts here (len(token_ids) for plain text)


def stdlib_sources(seed: int) -> Iterator[str]:
    """The standard library's .py files (no tests, no site-packages), in a seeded order, read lazily."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def snippets(text: str, num_lines: int) -> list[str]:
    """Pieces of about num_lines lines, cut at blank lines."""
    pieces, current = [], []
    for line in text.splitlines():
        current.append(line)
        if len(current) >= num_lines and not line.strip():
            pieces.append("\n".join(current).strip("\n"))
            current = []
    if current:
        pieces.append("\n".join(current).strip("\n"))
    return [p for p in pieces if p.strip()]


def user_turns(seed: int, questions: Iterator[str] | None = None, per_task: int = 1) -> Iterator[str]:
    """The user turns to answer: the shipped prompts (seeded order), each followed by a task on
    the standard library, so every round of replies mixes conversation and code; then tasks, each
    followed by `per_task` of `questions` (model_questions) while they last. (Measured on SmolLM2: with
    the 40 shipped prompts first and tasks after, 4% of the replies were conversation and the
    head's first draft was accepted ~20% of the time on held-out chat against ~46% on code. On
    Qwen 1.5B's union of four phases at one question a task, the tasks' long pasted source made
    73% of the tokens and the questions 25%: more questions a task move the data to what users send.)"""
    if per_task < 1:
        raise ValueError(f"need per_task >= 1, got {per_task}")
    data = json.loads(PROMPTS_FILE.read_text())
    shipped = data["chat"] + data["code"]
    random.Random(seed).shuffle(shipped)
    tasks = source_tasks(data["source_tasks"], seed, data["file_tasks"])
    questions = iter(()) if questions is None else questions
    for prompt in shipped:
        yield prompt
        yield from itertools.islice(tasks, 1)
    for task in tasks:
        yield task
        yield from itertools.islice(questions, per_task)
    yield from questions


def model_questions(engine, seed: int, batch: int, written: dict[str, list[str]] | None = None,
                    kind: str = "chat", sampled: bool = False) -> Iterator[str]:
    """Prompts the target writes itself: for each topic of head_prompts.json (seeded order; kind
    "code": each of its code_topics, with code_request) it is asked, greedily and `batch` topics at
    once, for QUESTIONS_PER_TOPIC messages a user might send about it, one a line; a line that is
    one of the held-out prompts (HELD_OUT_FILE, spaces and case aside) is dropped. Why: 141 shipped
    chat prompts are too few. A Qwen head trained on them and ~1,200 code tasks agreed with the
    target on 69% of its training replies' positions and on 50% of held-out ones (memorized), and
    its first draft held on 31% of held-out chat positions against 57% on code. `written` (the data
    phase's state: topic -> the messages written on it) keeps each topic's messages once written,
    and a topic found there is not asked again: a resumed phase, which skips the prompts already
    answered, no longer has the target write them all again first (on Qwen 1.5B two batches of 128
    topics, minutes of its time that are not data).
    sampled: the target writes a new set for each seed, sampled at QUESTION_TEMPERATURE (seeded by
    seed and topic) and, for code, asked for specific requests (SAMPLED_REQUESTS), kept in `written`
    under question_key(topic, seed). Why: greedy, a topic has one set, and the code requests of
    four phases were generic and alike across topics ("Write a script that reads a file and counts
    the number of lines" on C++ strings)."""
    data = json.loads(PROMPTS_FILE.read_text())
    topics_key, request_key = QUESTION_KINDS[kind]
    if sampled:
        request_key = SAMPLED_REQUESTS[kind]
    topics = list(data.get(topics_key, ()))
    random.Random(seed).shuffle(topics)
    held_out = held_out_prompts()
    tok = engine.tokenizer
    written = {} if written is None else written
    keys = {topic: question_key(topic, seed) if sampled else topic for topic in topics}
    for i in range(0, len(topics), batch):
        todo = [topic for topic in topics[i : i + batch] if keys[topic] not in written]
        asks = [tok.apply_chat_template([{"role": "user", "content": data[request_key].format(
            n=QUESTIONS_PER_TOPIC, topic=topic)}]) for topic in todo]
        params = [SamplingParams(max_tokens=QUESTION_TOKENS, temperature=QUESTION_TEMPERATURE, top_p=0.95,
                                 seed=prompt_key(keys[topic]) % 2**31) if sampled
                  else SamplingParams(max_tokens=QUESTION_TOKENS, temperature=0.0) for topic in todo]
        for topic, out in zip(todo, engine.generate(asks, params) if asks else ()):
            lines = [q for q in question_lines(out["text"]) if _normal(q) not in held_out]
            written[keys[topic]] = lines[:QUESTIONS_PER_TOPIC]
        for topic in topics[i : i + batch]:
            yield from written[keys[topic]]


def question_key(topic: str, seed: int) -> str:
    """Where `written` keeps the questions sampled on topic for seed (model_questions(sampled=True))."""
    return f"{topic} [seed {seed}]"


def question_topic(key: str) -> str:
    """The topic of a `written` key (question_key's, or a greedy set's: the topic itself)."""
    return re.sub(r" \[seed \d+\]$", "", key)


REQUEST_KINDS = ("chat", "code requests")  # what users send; the rest: tasks on given source, plain source


def sequence_kinds(sequences: list[Sequence], questions: dict[str, list[str]], tokenizer) -> list[str]:
    """What each sequence answered: "chat" (head_prompts.json's chat prompts, and the messages the
    target wrote on its chat topics), "code requests" (its code prompts, and the requests to write
    code the target wrote on its code_topics), "plain" (source text, no reply) or "other" (the tasks
    on standard-library source: "explain this code", ...). By the prompt's token ids, laid out as
    collect() lays out a user turn; a prompt laid out otherwise is "other". In the data of sessions
    85-86 (1.05M tokens) requests were 25% of the tokens and tasks on source 74%."""
    data = json.loads(PROMPTS_FILE.read_text())
    topic_kinds = {topic: kind for kind, (topics_key, _) in QUESTION_KINDS.items() for topic in data.get(topics_key, ())}
    texts = {text: topic_kinds[question_topic(key)] for key, lines in questions.items()
             if question_topic(key) in topic_kinds for text in lines}
    texts.update({text: kind for kind in QUESTION_KINDS for text in data.get(kind, ())})
    names = {"chat": "chat", "code": "code requests"}
    layouts = {tuple(tokenizer.apply_chat_template([{"role": "user", "content": t}])): names[k] for t, k in texts.items()}
    return ["plain" if s.num_prompt_tokens >= len(s.token_ids)
            else layouts.get(tuple(s.token_ids[: s.num_prompt_tokens].tolist()), "other") for s in sequences]


def held_out_prompts() -> set[str]:
    """The prompts benchmarks measure a head on (HELD_OUT_FILE's lists), normalized (_normal)."""
    data = json.loads(HELD_OUT_FILE.read_text()) if HELD_OUT_FILE.exists() else {}
    return {_normal(p) for v in data.values() if isinstance(v, list) for p in v if isinstance(p, str)}


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def alternate(*iterators: Iterator[str]) -> Iterator[str]:
    """One item of each in turn; an exhausted one drops out, the others go on."""
    live = list(iterators)
    while live:
        for it in list(live):
            item = next(it, None)
            if item is None:
                live.remove(it)
            else:
                yield item


def question_lines(text: str) -> list[str]:
    """The messages of a reply that lists them one a line: numbering, bullets, bold and quotes
    taken off; dropped: lines of fewer than 3 words (a stray word), those ending in a colon ("Here
    are six messages:"), a field's label ("Output: ..."), and lines that are not a sentence (not
    starting with a capital letter, or ending in `{` or `;`: code the target wrote under a request)."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:[-*\u2022]|\d+[.)])\s*", "", line.replace("**", "")).strip().strip('"').strip()
        words = line.split()
        if (len(words) >= 3 and not line.endswith((":", "{", ";")) and not words[0].endswith(":")
                and line[0].isupper()):
            lines.append(line)
    return lines


def source_tasks(templates: list[str], seed: int, file_templates: list[str] | tuple = ()) -> Iterator[str]:
    """Per stdlib file: a question on the whole file when it has FILE_LINES lines (file_templates:
    "give me an overview", ...; users paste files, and a reply about one refers back a thousand
    tokens or more), tasks on two of its snippets ("explain this code", ...), a request to write
    one of its documented functions from its docstring (new code, as users ask for), and every
    other file a question on a topic of the Python documentation that ships with the stdlib.
    Which snippets and which function depends on the seed: with the first two and the first
    function of every file, each new seed asked again about the snippets earlier seeds had
    (1,103 of the stdlib's 5,859) and had no function left to ask for (203 of 980, each asked once)."""
    templates = itertools.cycle(templates)
    file_tasks = itertools.cycle(file_templates) if file_templates else None
    docs = doc_topics(seed)
    pick = random.Random(seed)
    for i, text in enumerate(stdlib_sources(seed + 1)):
        if file_tasks and FILE_LINES[0] <= text.count("\n") + 1 <= FILE_LINES[1]:
            yield next(file_tasks).format(code=text.strip("\n"))
        pieces = snippets(text, SNIPPET_LINES)
        for j in sorted(pick.sample(range(len(pieces)), min(2, len(pieces)))):
            yield next(templates).format(code=pieces[j])
        functions = writing_tasks(text)
        if functions:
            yield pick.choice(functions)
        if i % 2 == 1:
            yield from itertools.islice(docs, 1)


def writing_tasks(source: str) -> list[str]:
    """"Write this function" requests from a module's public top-level functions with a docstring
    of a sentence or more: the name, the parameters and the docstring's first paragraph. Measured
    why: a SmolLM2 head trained mostly on replies about given code agreed with the target on 84%
    of such replies held out, but on 46% of held-out requests for new code."""
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    tasks = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
        if len(doc) < 40:
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        tasks.append(f"Write a Python function `{signature}` that does the following:\n\n{doc}")
    return tasks


def doc_topics(seed: int) -> Iterator[str]:
    """Questions on the reference manual's topics (pydoc_data, what `help("assert")` shows), each
    topic's opening paragraphs quoted; nothing when this Python was built without them."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    names = sorted(topics)
    random.Random(seed).shuffle(names)
    for name in names:
        text = topics[name].strip()
        cut = text.rfind("\n\n", 0, DOC_CHARS)
        text = text[: cut if cut > 0 else DOC_CHARS]
        yield f"Explain this part of the Python documentation in plain words, with a short example:\n\n{text}"


def plain_sources(tokenizer, seed: int) -> Iterator[list[int]]:
    """Stdlib source as token sequences of RAW_TOKENS (a file's short tail is dropped)."""
    for text in stdlib_sources(seed):
        ids = tokenizer.encode(text)
        for i in range(0, len(ids) - RAW_TOKENS // 4, RAW_TOKENS):
            yield ids[i : i + RAW_TOKENS]


def target_features(engine, token_ids: list[int]) -> torch.Tensor:
    """[T, width] FEATURE_DTYPE: the target's features for token_ids, one prefill in scratch
    blocks of the engine's pool (given back)."""
    bm, table = engine.block_manager, BlockTable()
    if not bm.allocate(table, len(token_ids)):
        raise ValueError(f"train-head: the KV pool cannot hold a {len(token_ids)}-token sequence")
    try:
        _, _, features = engine.models.target_runner.run_with_features([BatchItem(token_ids, 0, table.block_ids, 1)])
    finally:
        bm.free(table)
    return features.to(FEATURE_DTYPE)


class FeatureRecorder:
    """Engine.feature_observer for generate(): keeps, per request, the target's feature at every
    position it feeds (prefill chunks and decodes; a recomputed position is overwritten)."""

    def __init__(self):
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # request id -> position -> [width]
        self.num_fed = 0  # rows observed (progress)

    def observe(self, scheduled, items, features: torch.Tensor) -> None:
        self.num_fed += len(features)
        row = 0
        for s, item in zip(scheduled, items):
            kept = self.rows.setdefault(s.req.request_id, {})
            for i in range(len(item.token_ids)):
                kept[item.start_pos + i] = features[row + i].to(FEATURE_DTYPE)
            row += len(item.token_ids)

    def features(self, request_id: int, num_positions: int) -> torch.Tensor | None:
        """[num_positions, width] for positions 0.., or None if one was never fed (a prefix-cache hit)."""
        kept = self.rows.pop(request_id, {})
        if any(p not in kept for p in range(num_positions)):
            return None
        return torch.stack([kept[p] for p in range(num_positions)])


def prompt_key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


@dataclass
class Collected:
    """What the data phase has so far: sequences, the rounds they came from (a resumed phase
    skips as many source pieces, the order being seeded), the prompts already answered (skipped
    when resumed, whatever the order: the prompt set may have changed), the seconds spent on it in
    all, whether every prompt and source piece has been used, and how many of the sequences
    (the first `saved`) have their features in the data's feature file (save_collected)."""
    sequences: list[Sequence]
    rounds: int = 0
    seconds: float = 0.0
    exhausted: bool = False
    asked: set[int] = dataclasses.field(default_factory=set)  # prompt_key of every user turn answered
    saved: int = 0
    feature_layers: tuple[int, ...] = ()  # the target layers captured beside the final feature (EAGLE-3's)
    # topic -> the prompts the target wrote itself on it (model_questions, both kinds), kept for a resumed phase
    questions: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    disk_full: bool = False  # this call stopped before a round that could have left under keep_free bytes free

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


def collect(engine, *, max_tokens: int, seconds: float, reply_tokens: int, seed: int = 0, batch: int = 16,
            questions_per_task: int = 1, sampled_questions: bool = False, progress=None,
            resume: Collected | None = None, checkpoint=None, checkpoint_seconds: float = 300.0,
            disk: Path | None = None, keep_free: int = 0) -> Collected:
    """Sequences of about max_tokens tokens in all, collecting for at most `seconds`: each round
    answers `batch` prompts (greedy, up to reply_tokens each; user_turns: questions_per_task of the
    target's own questions after each task on source, model_questions(sampled=sampled_questions))
    and adds one plain source sequence.
    The round in flight at the deadline is cut there: replies keep what was fed, prompts with no
    reply token fed yet are dropped (asked again by a resumed run). progress(num_tokens) is called after
    every engine step and every sequence. A reply's last token is never fed to the target, so its
    sequence ends one token short (the feature before it predicts it).
    resume goes on from what an earlier call collected (killed, or out of time); checkpoint(state)
    is called every checkpoint_seconds and at the end, so a killed run loses minutes, not the phase.
    disk: the folder the checkpoint writes features to. No round starts that could leave less than
    keep_free bytes free there once its features and those not yet saved are written (disk_full)."""
    tok = engine.tokenizer
    layers = tuple(engine.models.target_runner.feature_layers)
    if resume and resume.sequences and tuple(resume.feature_layers) != layers:
        raise ValueError(f"train-head: the saved data holds features of layers {list(resume.feature_layers)}, "
                         f"not {list(layers)}; collect it again (--fresh) or train on the same layers")
    state = (dataclasses.replace(resume, sequences=list(resume.sequences), asked=set(resume.asked),
                                 questions=dict(resume.questions), feature_layers=layers,
                                 disk_full=False)
             if resume else Collected([], feature_layers=layers))
    questions = alternate(model_questions(engine, seed, batch, state.questions, sampled=sampled_questions),
                          model_questions(engine, seed, batch, state.questions, kind="code", sampled=sampled_questions))
    turns, raw = user_turns(seed, questions, per_task=questions_per_task), plain_sources(tok, seed)
    if state.asked:
        turns = (t for t in turns if prompt_key(t) not in state.asked)
    else:  # saved before prompts were recorded: skip by count
        for _ in itertools.islice(turns, state.rounds * batch):
            pass
    for _ in itertools.islice(raw, state.rounds):
        pass
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0)
    num_tokens = state.num_tokens
    if progress and num_tokens:
        progress(num_tokens)
    start = last_save = time.perf_counter()
    spent = state.seconds

    def add(token_ids: list[int], num_prompt: int, features: torch.Tensor | None = None) -> None:
        nonlocal num_tokens
        if features is None:
            features = target_features(engine, token_ids)
        state.sequences.append(Sequence(torch.tensor(token_ids), features, num_prompt))
        num_tokens += len(token_ids)
        if progress:
            progress(num_tokens)

    deadline = start + seconds
    row_bytes = (len(layers) + 1) * engine.models.target.config.hidden_size * FEATURE_DTYPE.itemsize
    # a round's rows, about: `batch` replies of reply_tokens after prompts no longer than them, and a source piece
    round_rows = batch * 2 * reply_tokens + RAW_TOKENS
    while num_tokens < max_tokens and time.perf_counter() < deadline and not state.exhausted:
        if disk is not None:
            unsaved = sum(len(s.token_ids) for s in state.sequences[state.saved :])
            if free_bytes(disk) - (unsaved + round_rows) * row_bytes < keep_free:
                state.disk_full = True
                break
        texts = list(itertools.islice(turns, batch))
        asked = [(t, tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        # a snippet is cut at blank lines, and a file without any (a data table) makes one longer
        # than the context: skip it rather than fail the run
        prompts = [(t, p) for t, p in asked if len(p) + reply_tokens <= engine.models.max_model_len]
        state.asked.update(prompt_key(t) for t in texts)
        recorder = FeatureRecorder()
        engine.feature_observer = recorder.observe
        try:  # a round of 128 prompts takes minutes: progress every step, and it ends on time
            outs = engine.generate([p for _, p in prompts], params, deadline=deadline,
                                   on_step=lambda: progress and progress(num_tokens + recorder.num_fed))
        finally:
            engine.feature_observer = None
        for (text, prompt), out in zip(prompts, outs):
            token_ids = (prompt + out["token_ids"])[:-1]
            if out["finish_reason"] == "abort" and len(out["token_ids"]) < 2:
                # cut off by the deadline before a reply token was fed: asked again next time
                state.asked.discard(prompt_key(text))
                continue
            add(token_ids, len(prompt), recorder.features(out["request_id"], len(token_ids)))
        out_of_time = time.perf_counter() >= deadline
        text = None if out_of_time else next(raw, None)
        if text:
            add(text, len(text))
        state.rounds += 1
        state.exhausted = not asked and not text and not out_of_time
        state.seconds = spent + time.perf_counter() - start
        if checkpoint and time.perf_counter() - last_save > checkpoint_seconds:
            checkpoint(state)
            last_save = time.perf_counter()
    state.seconds = spent + time.perf_counter() - start
    if checkpoint:
        checkpoint(state)
    return state


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds `folder` (or its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def choose_vocab(sequences: list[Sequence], vocab_size: int, num_kept: int, always: list[int]) -> torch.Tensor:
    """The head's vocabulary: the num_kept ids that the data's next tokens use most (replies
    counted twice: drafting predicts replies), ties and the rest filled by the lowest ids
    (byte-level BPE ranks merges by frequency), plus `always` (end of turn...). Sorted."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.token_ids.tolist())
        counts.update(seq.token_ids[seq.num_prompt_tokens :].tolist())
    num_kept = min(num_kept, vocab_size)
    ranked = sorted(range(vocab_size), key=lambda t: (-counts[t], t))[:num_kept]
    return torch.tensor(sorted(set(ranked) | {t for t in always if 0 <= t < vocab_size}), dtype=torch.long)


def coverage(sequences: list[Sequence], head_token_ids: torch.Tensor) -> float:
    """Share of reply tokens (all tokens when there are no replies) inside the head's vocabulary."""
    kept = set(head_token_ids.tolist())
    replies = [s.token_ids[s.num_prompt_tokens :] for s in sequences if s.num_prompt_tokens < len(s.token_ids)]
    tokens = torch.cat(replies or [s.token_ids for s in sequences]).tolist()
    return sum(t in kept for t in tokens) / max(len(tokens), 1)


DATA_FORMAT = 2


def features_path(path: Path) -> Path:
    """The feature file beside the data file `path` (<head>-data.pt -> <head>-data.features)."""
    return Path(path).with_suffix(".features")


def save_collected(path: Path, state: Collected, target_hash: str) -> None:
    """Write the data phase's state: the features of sequences not yet saved appended to
    features_path(path) (raw FEATURE_DTYPE rows, [rows, hidden]), then the rest (token ids,
    lengths, where replies start, the rounds...) to `path`, atomically. The sequences just
    written then read their features from a memory map of the file instead of the heap, so
    neither collection nor training holds the data in memory: Qwen 1.5B's 1.94M tokens are
    6.0 GB of features, and a training run that loaded them whole was killed at 24 GB.
    Rows past what `path` last recorded (a run killed between the two writes) are cut first."""
    from chatserve.head_store import write_atomic

    seqs = state.sequences
    lengths = [len(s.token_ids) for s in seqs]
    hidden = seqs[0].features.shape[1] if seqs else 0
    start = sum(lengths[: state.saved])
    fpath = features_path(path)
    fpath.parent.mkdir(parents=True, exist_ok=True)
    with open(fpath, "ab") as f:
        f.truncate(start * hidden * FEATURE_DTYPE.itemsize)
        f.seek(0, 2)
        for s in seqs[state.saved :]:
            f.write(s.features.to(FEATURE_DTYPE).contiguous().view(torch.int16).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    rows = sum(lengths)
    record = {"format": DATA_FORMAT, "target_hash": target_hash, "rounds": state.rounds, "seconds": state.seconds,
              "exhausted": state.exhausted, "asked": sorted(state.asked), "hidden": hidden, "rows": rows,
              "feature_layers": list(state.feature_layers),
              "questions": dict(state.questions),
              "token_ids": torch.cat([s.token_ids for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long),
              "lengths": torch.tensor(lengths, dtype=torch.long),
              "num_prompt_tokens": torch.tensor([s.num_prompt_tokens for s in seqs], dtype=torch.long)}
    write_atomic(Path(path), lambda tmp: torch.save(record, tmp))
    if rows:
        mapped = _map_features(fpath, rows, hidden)
        for s, offset, n in zip(seqs[state.saved :], _offsets(lengths, state.saved), lengths[state.saved :]):
            s.features = mapped[offset : offset + n]
    state.saved = len(seqs)


def load_collected(path: Path, target_hash: str | None) -> Collected | None:
    """The data saved at `path` (save_collected) for the target with this weight hash (None: for
    whichever target it was saved for), its features memory-mapped; None if there is none, or it
    is for other weights. A file from before
    the feature file (format 1: every sequence's features inside it) loads whole, and moves its
    features to the feature file at the next save."""
    if not Path(path).is_file():
        return None
    record = torch.load(path, weights_only=True)
    if target_hash is not None and record["target_hash"] != target_hash:
        return None
    if record.get("format") != DATA_FORMAT:
        sequences = [Sequence(*fields) for fields in record["sequences"]]
        if "rounds" not in record:  # from before the phase could resume: where it stopped is unknown, so it is final
            return Collected(sequences, exhausted=True)
        return Collected(sequences, record["rounds"], record["seconds"], record["exhausted"],
                         set(record.get("asked", ())))
    lengths = record["lengths"].tolist()
    mapped = _map_features(features_path(path), record["rows"], record["hidden"]) if record["rows"] else None
    ids = record["token_ids"].split(lengths)
    sequences = [Sequence(ids[i], mapped[o : o + n], int(record["num_prompt_tokens"][i]))
                 for i, (o, n) in enumerate(zip(_offsets(lengths, 0), lengths))]
    return Collected(sequences, record["rounds"], record["seconds"], record["exhausted"], set(record["asked"]),
                     saved=len(sequences), feature_layers=tuple(record.get("feature_layers", ())),
                     questions=dict(record.get("questions", {})))


def _offsets(lengths: list[int], first: int) -> list[int]:
    """The first row of each sequence from index `first` on, in a file of all of them in order."""
    return list(itertools.accumulate(lengths[:-1], initial=0))[first:] if lengths else []


def _map_features(fpath: Path, rows: int, hidden: int) -> torch.Tensor:
    """[rows, hidden] FEATURE_DTYPE, a memory map of the first rows of the file: pages come from the
    page cache as windows touch them, and the kernel can drop them again. Shared, not private:
    a private writable map counts against the kernel's commit limit, and under its default
    overcommit heuristic one larger than RAM + swap is refused (Qwen 1.5B's 2.11M tokens, 25.9 GB
    on 23 GiB, session 81). Nothing writes through it: training copies the rows it reads."""
    if not fpath.is_file() or fpath.stat().st_size < rows * hidden * FEATURE_DTYPE.itemsize:
        raise ValueError(f"train-head: {fpath} holds fewer than {rows} feature rows; delete it and its "
                         f"data file to collect again")
    return torch.from_file(str(fpath), shared=True, size=rows * hidden, dtype=FEATURE_DTYPE).view(rows, hidden)
