from __future__ import annotations

import math

import pytest
import torch

from bert_reduce.recipe.optim import warmup_cosine_schedule


def test_warmup_cosine_schedule() -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = warmup_cosine_schedule(optimizer, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[14:] == pytest.approx([0.1] * 6)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        warmup_cosine_schedule(optimizer, 1, 10, min_lr_ratio=2.0)
