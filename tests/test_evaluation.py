from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from bert_reduce.evaluation import eval_batches

DATA = [{"labels": torch.tensor([i, -100])} for i in range(5)]


def test_a_padding_distributed_sampler_is_refused_before_any_batch() -> None:
    loader = DataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, 2, 0, shuffle=False))
    with pytest.raises(ValueError, match=r"its DistributedSampler repeats 1 of the 5 samples"):
        next(eval_batches(loader))


def test_batches_must_carry_labels() -> None:
    from bert_reduce.evaluation import _scoring_nothing

    with pytest.raises(KeyError, match=r"mappings with 'labels'"):
        _scoring_nothing({"input_ids": torch.zeros(1, 2)}, -100)
    empty = _scoring_nothing(
        {"labels": torch.ones(1, 2), "loss_mask": torch.ones(1, 2), "num_scored": 2}, -100
    )
    assert empty["labels"].eq(-100).all() and not empty["loss_mask"].any()
    assert empty["num_scored"] == 0
