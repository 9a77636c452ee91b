import pytest
import torch


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)
