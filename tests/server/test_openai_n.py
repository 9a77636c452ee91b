"""n > 1 choices through the official `openai` client against a real `chatserve serve` (tiny model,
draft-model speculation on): indices 0..n-1 whole and streamed, seeded choices that differ and
reproduce, greedy choices that agree, the prompt computed once, usage, every block back after."""

import re
from collections import defaultdict

import httpx
import openai
import pytest

from chatserve.openai_protocol import MAX_CHOICES

from .real_server import RealServer, wait_health, wait_pool_free

MESSAGES = [{"role": "user", "content": "Tell me a story about a b c."}]


def streamed_choices(chunks) -> tuple[dict, dict, list]:
    """index -> joined text, index -> finish_reason, and the usage chunks."""
    texts, reasons, usages = defaultdict(str), {}, []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            texts[choice.index] += (delta.content or "") if delta is not None else choice.text
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    return dict(texts), reasons, usages


def prompt_tokens_computed(server: str) -> float:
    text = httpx.get(server + "/metrics").text
    return float(re.search(r'^chatserve:prompt_tokens_computed_total\{model_name="tiny"\} (\S+)$', text, re.M).group(1))


def test_three_sampled_choices_whole_and_streamed(drafted_server, drafted_client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    reply = drafted_client.chat.completions.create(**kw)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1, "choices with derived seeds came out the same"
    assert all(c.finish_reason == "length" for c in reply.choices)
    one = drafted_client.chat.completions.create(**{**kw, "n": 1})
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == 3 * 16

    chunks = list(drafted_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed, reasons, [usage] = streamed_choices(chunks)
    assert sorted(streamed) == [0, 1, 2] and reasons == {0: "length", 1: "length", 2: "length"}
    assert len(set(streamed.values())) > 1
    assert usage.completion_tokens == 3 * 16 and usage.prompt_tokens == reply.usage.prompt_tokens
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert len({chunk.id for chunk in chunks}) == 1
    wait_pool_free(drafted_server)


def test_seeded_choices_reproduce_whole_and_streamed(drafted_server, drafted_client):
    """Without speculation for the request: with the draft model, a seeded reply depends on what
    the prefix cache held (the draft's catch-up changes how much noise each step draws), for
    n = 1 as much as for n > 1."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=11, n=3,
              extra_body={"ignore_eos": True, "speculation": False})
    texts = [c.message.content for c in drafted_client.chat.completions.create(**kw).choices]
    assert len(set(texts)) == 3
    assert [c.message.content for c in drafted_client.chat.completions.create(**kw).choices] == texts
    streamed, _, _ = streamed_choices(drafted_client.chat.completions.create(stream=True, **kw))
    assert streamed == dict(enumerate(texts))
    one = drafted_client.chat.completions.create(**{**kw, "n": 1, "seed": 12})
    assert one.choices[0].message.content == texts[1]  # choice i samples with seed + i
    wait_pool_free(drafted_server)


def test_greedy_choices_are_identical_on_both_endpoints(drafted_server, drafted_client):
    chat = drafted_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                  n=2, logprobs=True, extra_body={"ignore_eos": True})
    first, second = chat.choices
    assert first.message.content == second.message.content and len(first.logprobs.content) == 12
    assert [t.token for t in first.logprobs.content] == [t.token for t in second.logprobs.content]
    completion = drafted_client.completions.create(model="tiny", prompt="a b c a b", max_tokens=8, temperature=0,
                                                   n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text
    streamed, _, _ = streamed_choices(drafted_client.completions.create(
        model="tiny", prompt="a b c a b", max_tokens=8, temperature=0, n=2, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == {0: completion.choices[0].text, 1: completion.choices[0].text}
    wait_pool_free(drafted_server)


@pytest.fixture(scope="module")
def unstalled_server(tiny_llama_dir, tiny_draft_dir):
    """Without stall-free batching the prompts of all choices fit one step, so they would all be
    computed in it, before any block is cached, unless choices 1.. wait for choice 0 (with it, the
    scheduler happens to feed one prompt a step, and the cache shares the prompt anyway)."""
    srv = RealServer(tiny_llama_dir, "--draft-model", str(tiny_draft_dir), "--no-adaptive", "--stall-limit", "0")
    yield srv.base
    srv.stop()


def test_the_prompt_is_computed_once(unstalled_server):
    """A 53-token prompt: choice 0 computes all of it; choices 1-3 attach its 3 full blocks and
    compute only the 5-token tail (whose last token gives their first logits), not 4 x 53."""
    client = openai.OpenAI(base_url=unstalled_server + "/v1", api_key="unused", max_retries=0)
    prompt = [(11 * i + 5) % 200 + 20 for i in range(53)]  # blocks of 16 tokens (the server's default)
    before = prompt_tokens_computed(unstalled_server)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.8, n=4,
                                      extra_body={"ignore_eos": True})
    assert len(reply.choices) == 4 and reply.usage.prompt_tokens == 53
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    wait_pool_free(unstalled_server)
    assert prompt_tokens_computed(unstalled_server) - before == 53 + 3 * 5


def test_a_disconnect_aborts_every_choice_and_frees_every_block(drafted_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0, "n": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", drafted_server + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i > 12:
                break
    wait_health(drafted_server, lambda h: h["num_generations"] == 0)  # the admission of all 3 given back
    assert wait_pool_free(drafted_server)["num_waiting"] == 0


def test_n_out_of_range_is_a_400_naming_n(drafted_server, drafted_client):
    for n in (0, MAX_CHOICES + 1):
        with pytest.raises(openai.BadRequestError) as e:
            drafted_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=n)
        assert e.value.body["param"] == "n" and f"[1, {MAX_CHOICES}]" in e.value.body["message"]
    wait_pool_free(drafted_server)
