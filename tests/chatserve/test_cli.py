"""CHATSERVE_* environment variables for every `serve` flag; the command line wins."""

from __future__ import annotations

import pytest

from chatserve.cli import ENV_PREFIX, build_parser, server_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) and name not in ("CHATSERVE_CACHE", "CHATSERVE_NO_CPU_KERNELS"):
            monkeypatch.delenv(name)


def serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_every_serve_flag_reads_its_variable(monkeypatch):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [a for a in serve._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 30
    for action in flags:
        assert f"[env: {ENV_PREFIX}{action.dest.upper()}]" in action.help, action.dest


def test_values_from_the_environment(monkeypatch):
    for name, value in dict(PORT="9000", DRAFT="ngram", API_KEY="sekret", NO_SPEC="true",
                            ALLOWED_ORIGINS="http://a.example, http://b.example", MAX_PENDING_OUTPUT_BYTES="1M",
                            SHUTDOWN_GRACE="2.5", DTYPE="float32", SERVED_MODEL_NAME="mine").items():
        monkeypatch.setenv(ENV_PREFIX + name, value)
    args = serve_args()
    assert (args.port, args.draft, args.api_key, args.no_spec, args.dtype) == (9000, "ngram", "sekret", True, "float32")
    config = server_config(args)
    assert config.allowed_origins == ("http://a.example", "http://b.example")
    assert config.max_pending_output_bytes == 1 << 20 and config.shutdown_grace == 2.5
    assert config.api_key == "sekret" and config.served_model_name == "mine"


def test_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("CHATSERVE_PORT", "9000")
    monkeypatch.setenv("CHATSERVE_ALLOWED_ORIGINS", "http://a.example")
    monkeypatch.setenv("CHATSERVE_DRAFT", "ngram")
    args = serve_args("--port", "9001", "--allowed-origins", "http://c.example", "--draft", "suffix")
    assert (args.port, args.allowed_origins, args.draft) == (9001, ["http://c.example"], "suffix")


def test_unset_and_false_switches(monkeypatch):
    assert serve_args().port == 8000 and not serve_args().no_spec
    monkeypatch.setenv("CHATSERVE_NO_SPEC", "0")
    assert serve_args().no_spec is False


def test_only_serve_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CHATSERVE_MODEL", "some-model")
    assert serve_args().model == "some-model"
    assert build_parser().parse_args(["generate", "hi"]).model != "some-model"


@pytest.mark.parametrize("name,value", [("PORT", "eighty"), ("DRAFT", "medusa"), ("NO_SPEC", "maybe"),
                                        ("MAX_PENDING_OUTPUT_BYTES", "lots")])
def test_bad_values_name_the_variable(monkeypatch, capsys, name, value):
    monkeypatch.setenv(ENV_PREFIX + name, value)
    with pytest.raises(SystemExit) as e:
        build_parser()
    assert e.value.code == 2 and f"{ENV_PREFIX}{name}={value!r}" in capsys.readouterr().err


def test_serve_on_cuda_without_a_gpu_fails_at_start_and_auto_falls_back(capsys, tiny_llama_dir):
    import torch

    from chatserve.cli import engine_config, main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["serve", "--model", str(tiny_llama_dir), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device cuda" in err and "sees no CUDA device" in err and "--device auto" in err
    config = engine_config(build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--device", "auto"]))
    assert config.device == "cpu" and config.kernels == "auto"


def test_free_draft_cap_reaches_the_spec_config_and_is_checked(tiny_llama_dir, capsys):
    from chatserve.cli import engine_config, main

    args = ["serve", "--model", str(tiny_llama_dir), "--draft", "suffix"]
    assert engine_config(build_parser().parse_args(args)).spec.num_free_draft_tokens == 16
    config = engine_config(build_parser().parse_args([*args, "--num-free-draft-tokens", "8"]))
    assert config.spec.num_free_draft_tokens == 8 and config.spec.num_draft_tokens == 4
    assert main([*args, "--num-free-draft-tokens", "64"]) == 2
    assert "num_free_draft_tokens: must be in [1, 32], got 64" in capsys.readouterr().err


def test_serve_keeps_the_cost_table_in_the_cache_dir_unless_told_not_to(tiny_llama_dir, tmp_path, monkeypatch):
    from chatserve.cli import engine_config

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path))
    args = ["serve", "--model", str(tiny_llama_dir), "--draft", "suffix"]
    assert engine_config(build_parser().parse_args(args)).spec.costs_cache_dir == str(tmp_path / "spec-costs")
    assert engine_config(build_parser().parse_args([*args, "--no-costs-cache"])).spec.costs_cache_dir is None


def test_auto_dtype_is_float32_where_the_quantized_kernels_run(tiny_llama_dir, monkeypatch):
    """The int4 / int8 C++ kernels take float32 activations and the decode stack is float32 only, so
    auto never picks bfloat16 for them, even on a CPU with native bf16; dense weights still may."""
    from chatserve.cli import engine_config
    from kernels import cpu_features, quant_matmul

    monkeypatch.setattr(cpu_features, "has_native_bf16", lambda: True)
    base = ["serve", "--model", str(tiny_llama_dir), "--no-spec"]
    if quant_matmul.is_available():
        for q in ("auto", "int4", "int8"):
            config = engine_config(build_parser().parse_args([*base, "-q", q]))
            assert config.dtype == "float32" and config.quantization in ("int4", "int8"), q
    assert engine_config(build_parser().parse_args([*base, "-q", "none"])).dtype == "bfloat16"
    assert engine_config(build_parser().parse_args([*base, "-q", "int4", "--dtype", "bfloat16"])).dtype == "bfloat16"


def test_serve_keeps_the_converted_weights_in_the_cache_dir_unless_told_not_to(tiny_llama_dir, tmp_path, monkeypatch):
    from chatserve.cli import engine_config

    monkeypatch.setenv("CHATSERVE_CACHE", str(tmp_path))
    args = ["serve", "--model", str(tiny_llama_dir)]
    assert engine_config(build_parser().parse_args(args)).converted_cache_dir == str(tmp_path / "converted")
    assert engine_config(build_parser().parse_args([*args, "--no-weights-cache"])).converted_cache_dir is None
