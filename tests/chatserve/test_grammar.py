"""GrammarMatcher on the tiny models' real tokenizer (256 byte tokens + 3 specials; the LM head
has 272 rows): masks, EOS only where the grammar may end, tentative drafts leave no trace."""

import pytest
import torch

from chatserve.grammar import MAX_WHITESPACE, GrammarMatcher, grammar_tokenizer, json_schema_grammar
from chatserve.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
VOCAB = 272  # the tiny models' LM head rows


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return Tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def ll_tok(tok):
    return grammar_tokenizer(tok.hf, tok.eos_token_ids)


def matcher(ll_tok, schema=SCHEMA) -> GrammarMatcher:
    return GrammarMatcher(ll_tok, json_schema_grammar(schema))


def ids(tok, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False)


def allowed_text(tok, mask: torch.Tensor) -> set[str]:
    return {tok.hf.convert_ids_to_tokens(i) for i in mask.nonzero().flatten().tolist()}


def test_mask_at_start_allows_an_object_only(tok, ll_tok):
    mask = matcher(ll_tok).mask(VOCAB)
    assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
    assert mask[ids(tok, "{")[0]]
    assert not mask[ids(tok, "[")[0]] and not mask[ids(tok, "a")[0]]
    assert not mask[list(tok.eos_token_ids)].any()  # nothing is complete yet
    assert not mask[len(tok.hf):].any()  # the LM head's padding rows


def test_complete_object_stops_and_only_eos_follows(tok, ll_tok):
    m = matcher(ll_tok)
    for t in ids(tok, '{"ok":true}'):
        assert not m.is_stopped
        m.consume(t)
    assert m.is_stopped
    assert m.mask(VOCAB).nonzero().flatten().tolist() == list(tok.eos_token_ids)


def test_consume_refuses_a_token_the_mask_forbids(tok, ll_tok):
    m = matcher(ll_tok)
    with pytest.raises(RuntimeError, match="refused"):
        m.consume(ids(tok, "x")[0])


def test_masks_along_drafts_match_masks_after_emitting_them(tok, ll_tok):
    drafts = ids(tok, '{"ok":')
    m = matcher(ll_tok)
    before = m.mask(VOCAB)
    rows = m.masks_along(VOCAB, drafts)  # [k + 1, vocab]
    assert torch.equal(m.mask(VOCAB), before)  # rolled back
    emitted = matcher(ll_tok)
    for j, t in enumerate(drafts):
        assert torch.equal(rows[j], emitted.mask(VOCAB))
        assert torch.equal(m.mask(VOCAB, drafts[:j]), rows[j])
        emitted.consume(t)
    assert torch.equal(rows[-1], emitted.mask(VOCAB))
    assert {"t", "f"} <= allowed_text(tok, rows[-1]) and "1" not in allowed_text(tok, rows[-1])


def test_a_refused_draft_counts_and_rows_after_it_are_unconstrained(tok, ll_tok):
    m = matcher(ll_tok)
    drafts = ids(tok, '{"no')  # the only key is "ok"
    n = m.num_valid(drafts)
    assert n == 2  # '{' and '"'; 'n' is refused
    rows = m.masks_along(VOCAB, drafts)
    assert not rows[n, drafts[n]]  # the refused draft gets probability 0: verification rejects it
    assert rows[n + 1 :].all()
    assert m.num_valid(drafts) == n and m.mask(VOCAB)[ids(tok, "{")[0]]  # nothing consumed


def test_whitespace_between_tokens_is_bounded(tok, ll_tok):
    m = matcher(ll_tok)
    m.consume(ids(tok, "{")[0])
    space = ids(tok, " ")[0]
    assert m.num_valid([space] * (MAX_WHITESPACE + 4)) == MAX_WHITESPACE


def test_json_object_accepts_any_object(tok, ll_tok):
    m = matcher(ll_tok, {"type": "object"})
    text = ids(tok, '{"a": [1, 2.5, null], "b": {"c": "d"}}')
    assert m.num_valid(text) == len(text)


@pytest.mark.parametrize("schema, words", [
    ({"type": "nonsense"}, "nonsense"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ([1, 2], "JSON object"),
])
def test_bad_schemas_raise_value_error(schema, words):
    with pytest.raises(ValueError, match=words):
        json_schema_grammar(schema)


def test_an_eos_draft_ends_what_is_consumed_and_leaves_no_trace(tok, ll_tok):
    """After an EOS draft nothing is read (the request ends there if it is accepted), and
    llguidance's rollback does not count a consumed EOS: it is never consumed tentatively."""
    m, eos = matcher(ll_tok), tok.eos_token_ids[0]
    body = ids(tok, '{"ok":true}')
    rows = m.masks_along(VOCAB, body + [eos, ids(tok, "x")[0]])  # [len(body) + 3, vocab]
    assert rows[len(body)].nonzero().flatten().tolist() == [eos]
    assert rows[len(body) + 1 :].all() and m.mask(VOCAB, body + [eos]).all()
    assert m.num_valid(body + [eos]) == len(body) + 1  # still at the start
    for t in body + [eos]:
        m.consume(t)
    assert m.is_stopped


def test_sampler_masks_row_j_by_the_state_after_j_drafts(tok, ll_tok):
    """The model wants "x" at every position; verification still accepts the drafts and the
    bonus token is the best allowed one, and sampling never leaves the mask."""
    from chatserve.request import Request
    from chatserve.sampler import Sampler
    from chatserve.sampling_params import SamplingParams

    sampler, x, colon = Sampler(tok.eos_token_ids), ids(tok, "x")[0], ids(tok, ":")[0]
    req = Request("r", [1], SamplingParams(temperature=0.0))
    req.grammar = matcher(ll_tok)
    drafts = ids(tok, '{"ok"')
    rows = torch.zeros(len(drafts) + 1, VOCAB)  # [k + 1, vocab]
    rows[:, x] = 10.0
    rows[torch.arange(len(drafts)), drafts] = 5.0
    rows[-1, colon] = 1.0
    assert sampler.verify(req, rows, drafts, None) == (drafts + [colon], len(drafts))
    assert req.grammar.num_valid(drafts) == len(drafts)  # nothing consumed
    req = Request("s", [1], SamplingParams(temperature=1.0, seed=0))
    req.grammar = matcher(ll_tok)
    allowed = req.grammar.mask(VOCAB)
    assert all(allowed[sampler.sample(req, torch.randn(1, VOCAB) * 5)[0]] for _ in range(50))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_draft_vocabulary_without_any_allowed_token_drafts_evenly_among_them(tok, ll_tok, temperature):
    """An EAGLE head over a vocabulary subset gives -inf outside it; when the grammar allows
    only tokens outside, the draft is still a proper distribution over allowed tokens."""
    from chatserve.request import Request
    from chatserve.sampler import Sampler
    from chatserve.sampling_params import SamplingParams
    from chatserve.spec_methods.base import sample_draft

    req = Request("r", [1], SamplingParams(temperature=temperature, seed=0))
    req.grammar = matcher(ll_tok)
    req.draft_token_ids = ids(tok, '{"')  # next: "o" only
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, ids(tok, "x")[0]] = 0.0  # the head's only token
    token, probs = sample_draft(Sampler(tok.eos_token_ids), req, logits)
    assert token == ids(tok, "o")[0]
    assert probs is None or (probs[0, token] == 1.0 and probs.isfinite().all())
