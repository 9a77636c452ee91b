"""Engine: add_request / step / abort. Owns the scheduler, the runners and the proposer.

step() is the only loop: schedule -> propose drafts -> one target forward over a ragged
batch -> sample or verify -> update (append tokens, roll back, free, finish) -> deltas.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

import torch

from chatserve.batch import BatchItem
from chatserve.config import EngineConfig, SpecConfig
from chatserve.grammar import GrammarMatcher, GrammarTokenizer, json_schema_grammar, lark_grammar
from chatserve.loading import LoadedModels, load_models
from chatserve.request import Request, Status
from chatserve.sampler import Sampler
from chatserve.sampling_params import Delta, SamplingParams
from chatserve.scheduler import ScheduledSeq, Scheduler
from chatserve.spec_runner import SpecRunner
from chatserve.tokenizer import IncrementalDetokenizer


def process_memory() -> dict:
    """{"rss_bytes", "peak_rss_bytes"} from /proc/self/status (zeros where there is none)."""
    fields = {"VmRSS:": "rss_bytes", "VmHWM:": "peak_rss_bytes"}
    out = dict.fromkeys(fields.values(), 0)
    try:
        for line in open("/proc/self/status"):
            key, *rest = line.split()
            if key in fields:
                out[fields[key]] = int(rest[0]) * 1024
    except OSError:
        pass
    return out


def _num_prompt_positions(s: ScheduledSeq) -> int:
    """How many of the tokens fed for `s` sit at prompt positions (all of a prefill chunk, none of a
    decode; a preempted request's recompute counts its prompt again)."""
    start = s.req.num_computed_tokens
    return max(0, min(start + s.num_new_tokens, s.req.num_prompt_tokens) - start)


class Engine:
    def __init__(self, config: EngineConfig, models: LoadedModels | None = None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.models = models or load_models(config)
        self.tokenizer = self.models.tokenizer
        self.sampling_defaults = self.models.sampling_defaults  # settings a request leaves out (the server's)
        self.max_model_len = self.models.max_model_len
        self.block_manager = self.models.block_manager
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.stall_limit)
        self.sampler = Sampler(self.tokenizer.eos_token_ids)
        self.spec = SpecRunner.create(config.spec, self.models, config.max_num_seqs) if config.spec else None
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        # For requests with a json_schema or grammar: built by its start() (AsyncEngine) or the first such request
        self.grammar_tokenizer = GrammarTokenizer(self.tokenizer.hf, self.tokenizer.eos_token_ids)
        self.num_prompt_tokens_computed = 0  # prompt positions fed to the target (prefix-cache hits are not)
        # train-head's data: called as observer(scheduled, items, features) after every step
        # with the target's features for every fed row (head_data.FeatureRecorder)
        self.feature_observer = None

    @classmethod
    def from_model(cls, model: str, **kwargs) -> "Engine":
        return cls(EngineConfig.from_dict({"model": model, **kwargs}))

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_source_id: str | None = None) -> str:
        """prompt_source_id: a running request with the same prompt (an earlier choice of one n > 1
        request); this one waits until that one has computed the prompt, then shares its blocks."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        req = Request(request_id, list(prompt_token_ids), params)
        req.detok = IncrementalDetokenizer(self.tokenizer.decode, params.stop)
        source = self.requests.get(prompt_source_id) if prompt_source_id is not None else None
        if source is not None and source.prompt_token_ids == req.prompt_token_ids:
            req.prompt_source = source
        if params.json_schema is not None or params.grammar is not None:
            req.grammar = self._grammar_matcher(params)
        if self.spec:
            self.spec.init_request(req)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ValueError (with the numbers) for a prompt this engine can never run.
        Reads only immutable state, so any thread may call it."""
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.models.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt: {n} tokens do not fit the model's context of {self.max_model_len} tokens "
                f"(at most {self.max_model_len - 1} prompt tokens)"
            )
        blocks_needed = -(-(n + 1) // self.block_manager.block_size)
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt: {n} tokens need {blocks_needed} KV blocks but the pool holds only "
                f"{self.block_manager.num_blocks}; raise --kv-cache-memory"
            )

    def _grammar_matcher(self, params: SamplingParams) -> GrammarMatcher:
        """A matcher for one request; ValueError naming response_format (a bad schema) or grammar."""
        field = "response_format" if params.json_schema is not None else "grammar"
        try:
            if params.json_schema is not None:
                grammar = json_schema_grammar(json.loads(params.json_schema))
            else:
                grammar = lark_grammar(params.grammar)
            return GrammarMatcher(self.grammar_tokenizer.get(), grammar)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    @property
    def spec_methods(self) -> tuple[str, ...]:
        """The SamplingParams.spec_method values this engine runs; the first is its default."""
        return tuple(self.spec.methods) if self.spec else ()

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for a spec_method this engine cannot run (no draft model or EAGLE
        head, or no speculation at all), or a logit_bias id outside the vocabulary. Any thread may
        call it between set_speculation calls."""
        vocab = self.models.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        method = params.spec_method
        if method is None or method in self.spec_methods:
            return
        if not self.spec_methods:
            raise ValueError(f"spec_method: this engine runs without speculation, so {method!r} is not available")
        needs = "an EAGLE head (spec.method 'eagle' or spec.eagle_head)" if method == "eagle" else "a draft model"
        raise ValueError(f"spec_method: {method!r} needs {needs} and this engine has none "
                         f"(available: {', '.join(self.spec_methods)})")

    def abort(self, request_id: str) -> Delta | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if self.spec:
            self.spec.abort(req)
        self.scheduler.finish(req, "abort")
        req.stats.finish_time = time.perf_counter()
        return Delta(request_id, "", [], "abort", req.stats)

    def set_speculation(self, spec: SpecConfig | None) -> None:
        """Switch speculation (off / another default method) between runs. Needs an idle engine;
        raises ValueError when spec.method cannot run with the loaded models (a draft model's
        method without one). The prefix cache is dropped so that compared runs start cold."""
        if self.has_unfinished():
            raise RuntimeError("set_speculation: requests are still running")
        self.spec = SpecRunner.create(spec, self.models, self.config.max_num_seqs) if spec else None
        self.block_manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Delta]:
        start = time.perf_counter()
        if self.spec:
            self.spec.plan(self.scheduler.running, self.scheduler.prefill_tokens_next_step(),
                           self.scheduler.num_streams_next_step())
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        num_prompts = sum(s.req.is_prefilling for s in scheduled)
        num_prompt_tokens = sum(s.num_new_tokens for s in scheduled if s.req.is_prefilling)
        self.num_prompt_tokens_computed += sum(_num_prompt_positions(s) for s in scheduled)
        if self.spec:
            self.spec.propose(scheduled)
        items = [self._batch_item(s) for s in scheduled]
        features = None
        forward_start = time.perf_counter()
        if (self.spec and self.spec.reads_features) or self.feature_observer:
            logits, cu_logits, features = self.models.target_runner.run_with_features(items)
            # The block ids as scheduled: a request that finishes below releases its table first.
            # (BatchItem(...), not dataclasses.replace: ~3x its Python, every step of an EAGLE engine)
            items = [BatchItem(it.token_ids, it.start_pos, list(it.block_ids), it.num_logits) for it in items]
        else:
            logits, cu_logits = self.models.target_runner.run(items)  # [num_logits, vocab]
        now = time.perf_counter()
        deltas = []
        for i, s in enumerate(scheduled):
            rows = logits[cu_logits[i] : cu_logits[i + 1]]
            delta = self._update(s, rows, now)
            if delta is not None:
                deltas.append(delta)
        if self.spec and not num_prompt_tokens:
            # the forward with its verification and sampling: at T > 0 a row's temperature, top-p and
            # softmax over the vocabulary cost ~1.5 ms on SmolLM2 (a fifth of its forward), which
            # adaptive k must pay for each draft it buys
            self.spec.observe_forward(sum(len(it.token_ids) for it in items), time.perf_counter() - forward_start)
        if features is not None and self.spec and self.spec.reads_features:
            self.spec.observe(scheduled, items, features)  # [num_tokens, hidden]
        if self.feature_observer:
            self.feature_observer(scheduled, items, features)
        self.scheduler.costs.observe(time.perf_counter() - start, num_prompt_tokens, len(scheduled) - num_prompts)
        return deltas

    def _batch_item(self, s: ScheduledSeq) -> BatchItem:
        req = s.req
        start = req.num_computed_tokens
        tokens = req.token_ids[start : start + s.num_new_tokens]
        if s.is_decode:
            # logits after the last token and after each draft: only those rows go through the
            # LM head (the whole chunk did once, so the last prompt chunk of a 1k-token prompt
            # paid for 512 rows of a 151,936-word head: seconds of TTFT)
            tokens = tokens + req.draft_token_ids
            num_logits = 1 + len(req.draft_token_ids)
        else:
            num_logits = 0
        return BatchItem(tokens, start, req.table.block_ids, num_logits)

    def _update(self, s: ScheduledSeq, rows: torch.Tensor, now: float) -> Delta | None:
        """Apply one step's result to one request: advance, append, roll back, finish."""
        req = s.req
        len_before = len(req.token_ids)
        if not s.is_decode:
            req.num_computed_tokens += s.num_new_tokens  # a mid-prompt chunk: nothing to emit
            self._commit(req)
            return None
        drafts = req.draft_token_ids
        if drafts:
            new_tokens, num_accepted = self.sampler.verify(req, rows, drafts, req.draft_probs)
            self.spec.record(req, len(drafts), num_accepted, s.num_lookahead_tokens)
            origins = ["accepted"] * num_accepted + ["bonus" if num_accepted == len(drafts) else "recovered"]
        else:
            if s.num_lookahead_tokens and req.spec is not None and req.spec.offer is not None:
                self.spec.record(req, 0, 0, s.num_lookahead_tokens)  # a chain stopped before its first draft
            new_tokens = self.sampler.sample(req, rows[-1:])
            origins = ["target"] * len(new_tokens)
        req.draft_token_ids, req.draft_probs = [], None
        # Valid target KV: everything fed except the rejected drafts.
        req.num_computed_tokens = len_before + len(new_tokens) - 1
        if req.stats.first_token_time is None:
            req.stats.first_token_time = now
        return self._append(req, new_tokens, origins, now)

    def _append(self, req: Request, new_tokens: list[int], origins: list[str], now: float) -> Delta:
        """Append tokens one at a time, stopping exactly at the first finish condition.
        origins: per token of new_tokens, how it came (sampling_params.TOKEN_ORIGINS)."""
        text_parts: list[str] = []  # per emitted token: the text it released
        emitted: list[int] = []
        reason = None
        for tok in new_tokens:
            req.token_ids.append(tok)
            emitted.append(tok)
            if req.grammar is not None:
                req.grammar.consume(tok)
            reason = self._finish_reason(req, tok)
            text_parts.append("")  # EOS and stop token ids add no text
            if reason != "stop":
                text, hit_stop = req.detok.add([tok])
                text_parts[-1] = text
                is_complete = req.grammar is not None and req.grammar.is_stopped  # only EOS could follow
                reason = "stop" if hit_stop or is_complete else reason
            if reason:
                break
        req.num_computed_tokens = min(req.num_computed_tokens, len(req.token_ids) - 1)
        req.num_draft_computed_tokens = min(req.num_draft_computed_tokens, req.num_computed_tokens)
        self.block_manager.truncate(req.table, len(req.token_ids))
        self._commit(req)
        req.stats.num_generated = req.num_output_tokens
        logprobs = None if req.new_logprobs is None else req.new_logprobs[: len(emitted)]
        req.new_logprobs = None
        origins = origins[: len(emitted)]
        if reason:
            text_parts[-1] += req.detok.flush()
            if self.spec:
                self.spec.finish(req)
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
            req.stats.finish_time = now
            return Delta(req.request_id, "".join(text_parts), emitted, reason, req.stats, logprobs=logprobs,
                         origins=origins, pieces=text_parts)
        return Delta(req.request_id, "".join(text_parts), emitted, logprobs=logprobs, origins=origins,
                     pieces=text_parts)

    def _commit(self, req: Request) -> None:
        """Two commit horizons: the target's KV makes blocks shareable (hashed), the draft's
        marks those it has computed too; after every chunk, so a long prompt is shared early."""
        self.block_manager.commit(req.table, req.token_ids, req.num_computed_tokens)
        self.block_manager.mark_draft_kv(req.table, min(req.num_draft_computed_tokens, req.num_computed_tokens))

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.tokenizer.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.max_model_len:
            return "length"
        return None

    # -- conveniences ---------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 deadline: float | None = None, on_step: Callable[[], None] | None = None) -> list[dict]:
        """Run a batch to completion; returns one dict per prompt (text, token_ids, logprobs, stats).
        deadline (a time.perf_counter() value): the requests still running after the step that
        passes it are aborted, their dicts hold what they produced, finish_reason "abort".
        on_step() is called after every step (a batch job's progress)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {i: {"request_id": i, "text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "stats": None} for i in ids}
        while self.has_unfinished():
            deltas = self.step()
            if deadline is not None and time.perf_counter() > deadline:
                deltas += [d for i in ids if results[i]["finish_reason"] is None and (d := self.abort(i))]
            for d in deltas:
                r = results[d.request_id]
                r["text"] += d.text
                r["token_ids"] += d.token_ids
                r["logprobs"] += d.logprobs or []
                if d.finished:
                    r["finish_reason"], r["stats"] = d.finish_reason, d.stats
            if on_step:
                on_step()
        return [results[i] for i in ids]

    def pool_stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size,
            "kv_usage": 1.0 - bm.num_free_blocks / bm.num_blocks,
            "num_cached_blocks": len(bm.cached_free),
            "prefix_cache_queries": bm.num_prefix_queries,
            "prefix_cache_hits": bm.num_prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    def memory_stats(self) -> dict:
        """Bytes: the process's resident set now and at its peak (Linux), the models' weights
        (parameters and buffers: each storage once, so the views of one load arena count it
        once, not once a view) and the KV pool (zeroed when made, so resident from the start:
        chatserve/kv_cache.py)."""
        models = [m for m in (self.models.target, self.models.draft) if m is not None]
        if self.models.eagle_runner is not None:
            models.append(self.models.eagle_runner.head)
        tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in models
                   for t in itertools.chain(m.parameters(), m.buffers())}
        pools = [r.kv_cache for r in (self.models.target_runner, self.models.draft_runner) if r is not None]
        if self.models.eagle_runner is not None:
            pools.append(self.models.eagle_runner)
        return {"weights_bytes": sum(tensors.values()), "kv_pool_bytes": sum(p.num_bytes for p in pools),
                **process_memory()}

    def check_no_leaks(self) -> None:
        """After all requests finished, every block is free (cached-free counts as free)."""
        bm = self.block_manager
        bm.check_invariants([r.table for r in self.requests.values()])
        assert not self.requests or any(r.status != Status.FINISHED for r in self.requests.values())
