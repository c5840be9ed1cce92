from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_seed() -> None:
    torch.manual_seed(0)
