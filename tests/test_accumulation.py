from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bert_reduce import GlobalBatchLoss
from bert_reduce.accumulation import accumulation_steps

LOGITS = torch.zeros(1, 2, 3)  # [b, s, v]: every scored token's loss is log(3)


def micro_batch(scored: int) -> dict[str, torch.Tensor]:
    return {"labels": torch.tensor([[1 if i < scored else -100 for i in range(2)]])}


def test_each_group_is_begun_and_never_runs_while_the_loader_is_at_its_end() -> None:
    handed, finished = [], []

    def loader() -> Iterator[dict[str, torch.Tensor]]:
        for scored in (2, 0, 1, 1, 0, 0):
            handed.append(scored)
            yield micro_batch(scored)
        finished.append(True)

    loss_fn, at_end, shares = GlobalBatchLoss(), [], []
    for group in accumulation_steps(loader(), loss_fn, 2):
        # Accelerate's end_of_dataloader: the last batch handed over, the loader not finished.
        at_end.append(len(handed) == 6 and not finished)
        shares += [float(loss_fn(LOGITS, mb)) for mb in group]
        loss_fn.end()
    assert at_end == [False, False, False] and finished
    # Each share divides by its step's scored tokens: begin() saw both micro-batches.
    log3 = float(torch.tensor(3.0).log())
    assert shares == pytest.approx([log3, 0.0, log3 / 2, log3 / 2, 0.0, 0.0])


def test_a_short_last_step_and_a_bad_count_are_refused() -> None:
    with pytest.raises(ValueError, match=r"last optimizer step has 1 micro-batches, not steps=2"):
        list(accumulation_steps([micro_batch(1)] * 3, GlobalBatchLoss(), 2))
    with pytest.raises(ValueError, match=r"must be >= 1, got 0"):
        list(accumulation_steps([], GlobalBatchLoss(), 0))
