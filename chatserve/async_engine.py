"""AsyncEngine: Engine.step on its own thread; each request gets an asyncio.Queue of deltas.

The event loop never runs model work and the engine thread never touches a socket: the
loop sends commands through a thread-safe inbox, the thread answers with
loop.call_soon_threadsafe(queue.put_nowait, delta). Before the thread starts, the constructing
thread (which loaded the model) gives up its OpenMP team, so the engine thread's parallel ops
are not throttled (chatserve/openmp.py).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
import uuid
from typing import AsyncIterator

from chatserve.engine import Engine
from chatserve.openmp import release_thread_team
from chatserve.sampling_params import Delta, SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine, model_name: str, draft_name: str | None = None):
        self.engine = engine
        self.model_name = model_name
        self.draft_name = draft_name
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults  # the model's generation_config.json settings
        self.vocab_size = engine.tokenizer.vocab_size  # ids detokenize accepts: [0, vocab_size)
        self.max_num_seqs = engine.config.max_num_seqs  # how many requests run at once; the rest wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outboxes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._stats: dict = engine.pool_stats() | self._spec_stats()
        engine.grammar_tokenizer.start()  # off the engine thread: the first schema request must not stall a step
        self.released_openmp_team = release_thread_team()
        self._thread = threading.Thread(target=self._run, name="chatserve-engine", daemon=True)
        self._thread.start()

    @property
    def spec_methods(self) -> tuple[str, ...]:
        """SamplingParams.spec_method values the engine runs, its default first."""
        return self.engine.spec_methods

    # -- called from the event loop ---------------------------------------------------------
    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:
        return self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message)

    @property
    def are_tool_tags_tokens(self) -> bool:
        """The tokenizer has <tool_call> and </tool_call> as tokens of their own (Qwen2.5's)."""
        return self.engine.tokenizer.are_tool_tags_tokens

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
        prompt_source_id: str | None = None,
    ) -> AsyncIterator[Delta]:
        """Stream deltas until the request finishes. Raises ValueError before the first delta
        for a prompt that can never run. Stopping the iteration (aclose, task cancelled)
        aborts the request and frees its blocks. prompt_source_id: Engine.add_request's."""
        self.engine.check_prompt(prompt_token_ids)
        self.engine.check_params(params)
        request_id = request_id or uuid.uuid4().hex
        outbox: asyncio.Queue = asyncio.Queue()
        self._outboxes[request_id] = (asyncio.get_running_loop(), outbox)
        self._send(("add", request_id, list(prompt_token_ids), params, prompt_source_id))
        finished = False
        try:
            while not finished:
                delta = await outbox.get()
                finished = delta.finished
                if delta.finish_reason == "error":
                    raise RuntimeError(delta.error or "engine error")
                yield delta
        finally:
            if not finished:
                self.abort(request_id)
            self._outboxes.pop(request_id, None)

    async def stream(self, messages: list[dict], params: SamplingParams) -> AsyncIterator[Delta]:
        """Chat helper for apps: messages -> deltas."""
        async for delta in self.generate(self.tokenize_chat(messages), params):
            yield delta

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> dict:
        """A snapshot taken by the engine thread after its last step (no lock needed)."""
        return dict(self._stats)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._drain_inbox()
            if not engine.has_unfinished():
                self._stats = engine.pool_stats() | self._spec_stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                deltas = engine.step()
            except Exception as exc:  # a model failure must not take the server down
                traceback.print_exc()
                deltas = self._fail_all(f"engine step failed: {exc!r}")
            for delta in deltas:
                self._deliver(delta)
            self._stats = engine.pool_stats() | self._spec_stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, prompt_source_id = command
                if request_id not in self._outboxes:
                    continue  # the caller already gave up
                try:
                    self.engine.add_request(prompt, params, request_id, prompt_source_id)
                except ValueError as exc:
                    self._deliver(Delta(request_id, "", [], "error", error=str(exc)))
            elif command[0] == "abort":
                delta = self.engine.abort(command[1])
                if delta is not None:
                    self._deliver(delta)

    def _fail_all(self, message: str) -> list[Delta]:
        out = []
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            out.append(Delta(request_id, "", [], "error", error=message))
        return out

    def _deliver(self, delta: Delta) -> None:
        target = self._outboxes.get(delta.request_id)
        if target is None:
            return
        loop, outbox = target
        try:
            loop.call_soon_threadsafe(outbox.put_nowait, delta)
        except RuntimeError:  # the loop is closed
            pass

    def _spec_stats(self) -> dict:
        spec = self.engine.spec
        st = spec.stats if spec else None
        return {
            "spec_num_drafts": st.num_spec_steps if st else 0,
            "spec_num_draft_tokens": st.num_draft_tokens if st else 0,
            "spec_num_accepted_tokens": st.num_accepted_tokens if st else 0,
            "spec_accepted_by_position": list(st.accepted_by_position) if st else [],
        }


class Conversation:
    """A chat whose every turn re-sends the history; the prefix cache makes that cheap."""

    def __init__(self, engine: AsyncEngine, system: str | None = None):
        self.engine = engine
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []

    async def send(self, content: str, params: SamplingParams) -> AsyncIterator[Delta]:
        self.messages.append({"role": "user", "content": content})
        reply = []
        async for delta in self.engine.stream(self.messages, params):
            reply.append(delta.text)
            yield delta
        self.messages.append({"role": "assistant", "content": "".join(reply)})
