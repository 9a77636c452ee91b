"""AsyncEngine over the real engine (tiny model): streaming, cancellation, errors, no leaks."""

import asyncio
import threading
import time

import pytest

from chatserve.async_engine import AsyncEngine, Conversation
from chatserve.config import EngineConfig
from chatserve.engine import Engine
from chatserve.sampling_params import SamplingParams


@pytest.fixture
def aengine(tiny_llama_dir):
    ae = AsyncEngine(Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20)), "tiny")
    yield ae
    ae.shutdown()


async def wait_pool_free(ae, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        st = ae.stats()
        if st["num_free_blocks"] == st["num_blocks"] and st["num_running"] == 0 and st["num_waiting"] == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"pool not free: {ae.stats()}")


def test_stream_matches_sync_generate(aengine, tiny_llama_dir):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ids = aengine.tokenize("Hello")

    async def run():
        out = [d async for d in aengine.generate(ids, params)]
        await wait_pool_free(aengine)
        return out

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "length" and deltas[-1].stats.num_generated == 20
    sync = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20)).generate([ids], params)[0]
    assert sum((d.token_ids for d in deltas), []) == sync["token_ids"]


def test_cancel_mid_stream_frees_blocks(aengine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def run():
        n = 0
        agen = aengine.generate(aengine.tokenize("Hello " * 20), params)
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        await wait_pool_free(aengine)
        return n

    assert asyncio.run(run()) == 3


def test_task_cancellation_aborts(aengine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def consume(started: asyncio.Event):
        async for _ in aengine.generate(aengine.tokenize("Hi"), params):
            started.set()

    async def run():
        # cancelled right after its first delta: a fixed sleep let a fast machine finish all 500 tokens
        started = asyncio.Event()
        task = asyncio.create_task(consume(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_pool_free(aengine)

    asyncio.run(run())


def test_too_long_prompt_raises_before_streaming(aengine):
    async def run():
        with pytest.raises(ValueError, match="context"):
            async for _ in aengine.generate([5] * 5000, SamplingParams(max_tokens=4)):
                pass
        # and the engine still serves
        out = [d async for d in aengine.generate([5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
        assert out[-1].finished

    asyncio.run(run())


def test_conversation_reuses_prefix(aengine):
    params = SamplingParams(max_tokens=8, temperature=0.0)

    async def run():
        conv = Conversation(aengine, system="You are terse. " * 20)
        first = [d async for d in conv.send("Hello", params)]
        second = [d async for d in conv.send("Again", params)]
        return first[-1].stats, second[-1].stats

    s1, s2 = asyncio.run(run())
    assert s1.cached_tokens == 0
    assert s2.cached_tokens >= 16 * ((s1.prompt_tokens - 1) // 16) - 16


def test_the_grammar_tokenizer_is_built_at_start_on_a_thread_of_its_own(aengine):
    """Built before any request, on its own thread: never inside an engine step, where the first
    response_format request would hold up every running stream for the build (~1.4 s on Qwen).
    The structured request then uses that build."""
    from chatserve.grammar import GrammarTokenizer

    build = aengine.engine.grammar_tokenizer
    wait_until(lambda: build.built_on is not None)  # no request has been sent: only start() can build
    assert build.built_on == GrammarTokenizer.THREAD_NAME
    params = SamplingParams(max_tokens=40, temperature=0.0, json_schema='{"type": "object"}')

    async def run():
        out = [d async for d in aengine.generate(aengine.tokenize("{"), params)]
        await wait_pool_free(aengine)
        return out

    deltas = asyncio.run(run())
    assert "".join(d.text for d in deltas).startswith("{")
    assert aengine.engine.grammar_tokenizer is build and build.built_on == GrammarTokenizer.THREAD_NAME


def test_an_engine_without_a_server_builds_the_grammar_tokenizer_at_its_first_structured_request(tiny_llama_dir):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=8 << 20))
    engine.generate([engine.tokenizer.encode("Hi")], SamplingParams(max_tokens=4))
    assert engine.grammar_tokenizer.built_on is None
    engine.generate([engine.tokenizer.encode("{")], SamplingParams(max_tokens=4, json_schema='{"type": "object"}'))
    assert engine.grammar_tokenizer.built_on == threading.current_thread().name


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)
