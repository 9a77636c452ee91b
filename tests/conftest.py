"""Shared fixtures: tiny random Llama / Qwen2 checkpoints (offline) and a fresh-engine factory.

TRITON_INTERPRET must be set before any module defining @triton.jit kernels is imported.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny_models import make_tiny_model  # noqa: E402


def pytest_sessionstart(session):
    """Build (or load) the C++ CPU kernels once, in this process, before any test starts a server
    subprocess: a build there (~1-2 min on a fresh machine) would run into its start-up timeout."""
    from kernels import cpu_ext

    cpu_ext.extension()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    """A different random Llama with the same tokenizer: most of its drafts get rejected."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_draft"), "llama", seed=7, num_layers=1)


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)
