"""AppState: what all routes of one app share (engine, config, limits, metrics, what is open), and
the engine calls.

The event loop only awaits here: tokenization runs in a worker thread and generation on the
engine's own thread. Closing a generation early (aclose, task cancel) aborts its request.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from chatserve import protocol as P
from chatserve.config import ServerConfig
from chatserve.metrics import RequestTimer, ServerMetrics
from chatserve.sampling_params import Delta, SamplingParams
from chatserve.server.access import AccessControl
from chatserve.server.admission import Admission


class AppState:
    def __init__(self, engine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.model_name = config.served_model_name or engine.model_name
        # Settings for what a request or websocket leaves out: the model's generation_config.json values.
        self.sampling_defaults: dict = dict(engine.sampling_defaults) if config.use_generation_config else {}
        self.metrics = ServerMetrics(engine, self.model_name)
        self.access = AccessControl(config, config.max_prompt_tokens or engine.max_model_len)
        self.admission = Admission(config, engine.max_num_seqs)
        self.created = int(time.time())
        self.connections: set = set()  # open websocket Connections, for the shutdown drain
        self.request_ids: set[str] = set()  # engine requests being streamed, for the shutdown drain

    def abort_all(self) -> None:
        """Abort every running engine request; each stream then ends with finish_reason "abort"."""
        for request_id in list(self.request_ids):
            self.engine.abort(request_id)

    async def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> list[int]:
        """The chat template runs in a worker thread. Any failure is the messages' fault (a template
        may refuse, e.g. roles that do not alternate), so it is a client error."""
        try:
            if continue_final_message:  # the prompt ends inside the last message, with no end-of-turn after it
                return await asyncio.to_thread(self.engine.tokenize_chat, messages, False, tools,
                                               continue_final_message=True)
            return await asyncio.to_thread(self.engine.tokenize_chat, messages, add_generation_prompt, tools)
        except Exception as e:
            raise P.ProtocolError(P.BAD_MESSAGE, f"cannot apply the chat template: {e}", param="messages") from None

    async def tokenize(self, text: str) -> list[int]:
        try:
            return await asyncio.to_thread(self.engine.tokenize, text)
        except Exception as e:
            raise P.ProtocolError(P.BAD_MESSAGE, f"cannot tokenize the prompt: {e}", param="prompt") from None

    async def detokenize(self, token_ids: list[int]) -> str:
        try:
            return await asyncio.to_thread(self.engine.detokenize, token_ids)
        except Exception as e:
            raise P.ProtocolError(P.BAD_MESSAGE, f"cannot detokenize: {e}", param="tokens") from None

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       timer: RequestTimer, prompt_source_id: str | None = None) -> AsyncIterator[Delta]:
        """engine.generate plus metrics; closing this early (aclose, cancel) aborts the request.
        prompt_source_id: an earlier choice of the same request, whose prompt blocks this one shares.

        The engine's ValueError before the first delta becomes ProtocolError(invalid_prompt); an
        exception after that becomes ProtocolError(engine_error). An "error" delta is passed on.
        """
        deltas = self.engine.generate(prompt_ids, params, request_id, prompt_source_id)
        is_finished, num_deltas = False, 0
        self.request_ids.add(request_id)
        try:
            async for delta in deltas:
                num_deltas += 1
                timer.on_delta(len(delta.token_ids))
                if delta.finished:
                    is_finished = True
                    timer.finish(delta.finish_reason, len(prompt_ids), delta.stats)
                yield delta
                if is_finished:
                    return
        except Exception as e:
            if isinstance(e, ValueError) and not num_deltas:
                is_finished = True  # never admitted: nothing to abort or count
                raise P.ProtocolError(P.INVALID_PROMPT, str(e)) from None
            timer.finish("error", len(prompt_ids), None)
            raise P.ProtocolError(P.ENGINE_ERROR, f"generation failed: {e}", 500) from None
        finally:
            self.request_ids.discard(request_id)
            if not is_finished:
                await deltas.aclose()
                self.engine.abort(request_id)  # idempotent; the engine's own finally may have done it
                timer.finish("abort", len(prompt_ids), None)
