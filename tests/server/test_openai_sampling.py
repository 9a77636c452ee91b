"""logprobs / top_logprobs, presence and frequency penalties and logit_bias through the official
`openai` client against a real `chatserve serve` on the tiny model (n-gram speculation on)."""

import math

import httpx
import openai
import pytest

from .real_server import RealServer, wait_pool_free

MESSAGES = [{"role": "user", "content": "a b c a b c a b c"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = RealServer(tiny_llama_dir, "--draft", "ngram")
    yield srv.base
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def token_id(server: str, text: str) -> int:
    ids = httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"]
    return ids[-1]


def test_chat_top_logprobs_sum_to_the_sampling_distribution(client, server):
    """top_k = 3 at T = 0.7: the 5 top logprobs hold the whole distribution each token was drawn
    from (3 tokens, more on a tie in bf16, the rest at -9999), so they sum to 1 and the chosen
    token is among them with the same logprob."""
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.7, seed=1,
                                           logprobs=True, top_logprobs=5, extra_body={"top_k": 3, "ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 12
    # (no check that the tokens join to the text: on its own a token inside a UTF-8 character
    # reads as U+FFFD, as in vLLM, and the random tiny model writes many)
    for c in content:
        assert len(c.top_logprobs) == 5
        assert math.fsum(math.exp(t.logprob) for t in c.top_logprobs) == pytest.approx(1.0, abs=1e-3)
        assert any(t.token == c.token and t.logprob == pytest.approx(c.logprob, abs=1e-6) for t in c.top_logprobs)
        assert c.bytes == list(c.token.encode())
    wait_pool_free(server)


def test_streamed_logprobs_equal_the_whole_reply(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kw) for choice in chunk.choices
                if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in whole]
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in whole)  # greedy: the best


def test_completion_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(model="tiny", prompt="a b c a b", max_tokens=6, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_logit_bias_forces_a_token_and_penalties_stop_repeats(client, server):
    forced = token_id(server, "z")
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                           logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == "z" * 8
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    free = client.chat.completions.create(**kw).choices[0].message.content
    penalized = client.chat.completions.create(frequency_penalty=2, presence_penalty=2, **kw).choices[0].message.content
    assert len(set(penalized)) > len(set(free))


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, None),  # outside the vocabulary: the engine's message
])
def test_bad_values_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (param or "logit_bias") in error["message"]
    if param:
        assert error["param"] == param
