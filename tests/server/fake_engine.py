"""FakeEngine: the AsyncEngine interface with scripted replies, for server tests without a model.

Tokens are characters (token id = ord(c)), so tests can read prompts back. A fake block pool
shrinks while a request runs and refills when it finishes or is aborted; `token_delay` paces
the stream so cancel and disconnect land mid-generation.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from typing import AsyncIterator, Callable

from chatserve.sampling_params import Delta, RequestStats, SamplingParams


class FakeEngine:
    def __init__(self, reply: str = "Hello! How can I help?", *, token_delay: float = 0.0,
                 tokens_per_delta: int = 1, max_model_len: int = 2048, num_blocks: int = 256,
                 block_size: int = 16, model_name: str = "fake-model", draft_name: str | None = "ngram",
                 reply_fn: Callable[[str, SamplingParams], str] | None = None,
                 spec_methods: tuple[str, ...] | None = None, max_num_seqs: int = 16,
                 sampling_defaults: dict | None = None):
        self.model_name, self.draft_name, self.max_model_len = model_name, draft_name, max_model_len
        self.sampling_defaults = sampling_defaults or {}  # as if from generation_config.json
        self.max_num_seqs = max_num_seqs
        self.vocab_size = 0x110000  # token id = code point
        if spec_methods is None:  # like the real engine: a named draft model also offers n-gram
            spec_methods = () if not draft_name else ("ngram",) if draft_name == "ngram" else ("draft", "ngram")
        self.spec_methods = spec_methods
        self.reply, self.reply_fn = reply, reply_fn
        self.token_delay, self.tokens_per_delta = token_delay, tokens_per_delta
        self.num_blocks, self.block_size, self.num_free_blocks = num_blocks, block_size, num_blocks
        self.prompts: list[list[int]] = []  # every admitted prompt, in order
        self.params: list[SamplingParams] = []
        self.abort_calls: list[str] = []
        self.num_running = 0
        self.num_cancelled_streams = 0  # generators closed before their final delta
        self.counters = dict(prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, spec_num_drafts=0,
                             spec_num_draft_tokens=0, spec_num_accepted_tokens=0)
        self.error: str | None = None  # set to make every request fail after its first token ...
        self.error_style = "delta"  # ... with an "error" Delta, or "raise" a RuntimeError from generate
        self._aborted: set[str] = set()

    # ---- tokenizer

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))

    are_tool_tags_tokens = False  # the tags are spelled in characters

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:
        for i, message in enumerate(messages):
            if message["role"] == "system" and i != 0:
                raise ValueError("a system message must come first")
            if i and message["role"] == messages[i - 1]["role"] == "assistant":
                raise LookupError("roles must alternate")  # like jinja's TemplateError: not a ValueError
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        offered = f"<tools>{json.dumps(tools)}</tools>" if tools else ""  # so tests can see what was offered
        if continue_final_message:  # the last message left open
            text = text.removesuffix(f"</{messages[-1]['role']}>")
        return self.tokenize(offered + text + "<assistant>" * add_generation_prompt)

    # ---- generation

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       prompt_source_id: str | None = None) -> AsyncIterator[Delta]:
        """prompt_source_id is taken and not acted on: sharing blocks is the real engine's (its tests)."""
        request_id = request_id or uuid.uuid4().hex
        prompt_text = self.detokenize(prompt_token_ids)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; the context holds {self.max_model_len}")
        reply = self.reply_fn(prompt_text, params) if self.reply_fn else self.reply
        reply_ids, finish_reason = self._apply_limits(reply, params, len(prompt_token_ids))
        num_blocks = math.ceil((len(prompt_token_ids) + len(reply_ids)) / self.block_size)
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"needs {num_blocks} KV blocks; only {self.num_free_blocks} are free")
        stats = self._admit(prompt_token_ids, params)
        self.num_free_blocks -= num_blocks
        self.num_running += 1
        is_finished = False
        try:
            step = self.tokens_per_delta
            for start in range(0, max(len(reply_ids), 1), step):
                await asyncio.sleep(self.token_delay)
                if request_id in self._aborted:
                    is_finished = True
                    yield Delta(request_id, "", [], "abort", stats)
                    return
                if self.error is not None and start > 0:
                    if self.error_style == "raise":
                        raise RuntimeError(self.error)
                    is_finished = True
                    yield Delta(request_id, "", [], "error", stats, error=self.error)
                    return
                chunk = reply_ids[start:start + step]
                origins = self._count_step(stats, chunk, params)
                is_last = start + step >= len(reply_ids)
                if is_last:
                    stats.finish_time = time.perf_counter()
                    is_finished = True
                yield Delta(request_id, self.detokenize(chunk), chunk, finish_reason if is_last else None,
                            stats if is_last else None, origins=origins, pieces=list(map(chr, chunk)))
        finally:
            if not is_finished:
                self.num_cancelled_streams += 1
            self.num_free_blocks += num_blocks
            self.num_running -= 1

    def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        self._aborted.add(request_id)

    def stats(self) -> dict:
        used = self.num_blocks - self.num_free_blocks
        return dict(num_running=self.num_running, num_waiting=0, num_blocks=self.num_blocks,
                    num_free_blocks=self.num_free_blocks, block_size=self.block_size,
                    kv_usage=used / self.num_blocks, spec_accepted_by_position=[self.counters["spec_num_drafts"]],
                    **self.counters)

    # ---- helpers

    def _apply_limits(self, reply: str, params: SamplingParams, num_prompt_tokens: int) -> tuple[list[int], str]:
        finish_reason = "stop"
        for stop in params.stop:
            if stop in reply:
                reply = reply[:reply.index(stop)]
        budget = min(params.max_tokens, self.max_model_len - num_prompt_tokens)
        if len(reply) > budget:
            reply, finish_reason = reply[:budget], "length"
        return self.tokenize(reply), finish_reason

    def _admit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStats:
        """Prefix cache: the longest whole-block prefix shared with an earlier prompt."""
        cached = 0
        for earlier in self.prompts:
            n = 0
            for a, b in zip(earlier, prompt_token_ids):
                if a != b:
                    break
                n += 1
            cached = max(cached, n // self.block_size * self.block_size)
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        self.counters["prefix_cache_queries"] += len(prompt_token_ids)
        self.counters["prefix_cache_hits"] += cached
        now = time.perf_counter()
        return RequestStats(prompt_tokens=len(prompt_token_ids), cached_tokens=cached, arrival_time=now,
                            first_scheduled_time=now)

    def _count_step(self, stats: RequestStats, chunk: list[int], params: SamplingParams) -> list[str]:
        """-> how each token of the chunk came (Delta.origins)."""
        origins = ["target"] * len(chunk)
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()
        elif self.spec_methods and params.num_draft_tokens != 0:
            origins = ["accepted"] * (len(chunk) - 1) + ["recovered"]
            stats.spec_method = params.spec_method or self.spec_methods[0]
            # pretend each step drafted 4 tokens and accepted all but the last emitted one
            stats.spec.update(4, len(chunk) - 1)
            self.counters["spec_num_drafts"] += 1
            self.counters["spec_num_draft_tokens"] += 4
            self.counters["spec_num_accepted_tokens"] += len(chunk) - 1
        stats.num_generated += len(chunk)
        return origins
