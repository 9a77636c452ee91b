"""Incremental detokenization: never half a character, never any part of a stop string."""

from chatserve.tokenizer import IncrementalDetokenizer, Tokenizer


def stream(tok, ids, stop=()):
    d = IncrementalDetokenizer(tok.decode, stop)
    pieces, hit = [], False
    for t in ids:
        text, hit = d.add([t])
        pieces.append(text)
        if hit:
            break
    pieces.append(d.flush())
    return pieces, hit


def test_multibyte_characters_are_never_split(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    text = "héllo wörld ✓ 日本語 🙂!"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: several tokens per character
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_never_sent(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode("The answer is 42. STOP here and more")
    pieces, hit = stream(tok, ids, stop=("STOP",))
    assert hit
    assert "".join(pieces) == "The answer is 42. "
    assert not any("S" in p for p in pieces[-3:] if p.strip())  # no partial "STO" ever went out


def test_holdback_releases_text_that_cannot_start_a_stop(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode("abcdef")
    pieces, hit = stream(tok, ids, stop=("xyz",))
    assert not hit and "".join(pieces) == "abcdef"


def test_chat_template_validation(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids).endswith("assistant\n")
    for bad in ([], [{"role": "user"}], [{"role": "robot", "content": "x"}], "hi"):
        try:
            tok.apply_chat_template(bad)
        except ValueError as e:
            assert "messages" in str(e)
        else:
            raise AssertionError(f"accepted {bad!r}")


def test_continue_final_message_leaves_the_reply_open(tiny_llama_dir):
    tok = Tokenizer(tiny_llama_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon a"}]
    closed = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False))
    opened = tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True))
    assert opened.endswith("Once upon a") and closed.startswith(opened) and len(closed) > len(opened)


def test_chat_template_file_replaces_the_tokenizer_s(tiny_llama_dir, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    tok = Tokenizer(tiny_llama_dir, path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "[user] hi\n[assistant] "
    assert Tokenizer(tiny_llama_dir).apply_chat_template([{"role": "user", "content": "hi"}]) != ids


def test_a_missing_or_broken_chat_template_fails_at_load(tiny_llama_dir, tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError):
        Tokenizer(tiny_llama_dir, tmp_path / "nope.jinja")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="broken.jinja"):
        Tokenizer(tiny_llama_dir, broken)
