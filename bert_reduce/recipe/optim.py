"""The learning-rate schedule of the recipe: linear warm-up, then cosine decay."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from bert_reduce.recipe.config import SchedulerConfig


def warmup_cosine_schedule(
    optimizer: Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = SchedulerConfig.min_lr_ratio,
) -> LambdaLR:
    """Linear warm-up, then cosine decay of the learning rate.

    The factor on the peak learning rate rises linearly from ~0 to 1 over ``warmup_steps``,
    then falls to ``min_lr_ratio`` along a cosine until ``total_steps``, and stays there.

    Args:
        optimizer: Its learning rates are the peak values.
        warmup_steps: Optimizer steps of linear warm-up (0 for none).
        total_steps: Step at which the decay ends (``trainer.max_steps``).
        min_lr_ratio: Final learning rate as a fraction of the peak.

    Returns:
        A scheduler to step once per optimizer step.

    Raises:
        ValueError: On negative steps or a ratio outside ``[0, 1]``.
    """
    if warmup_steps < 0 or total_steps < 0:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) and total_steps ({total_steps}) must be >= 0."
        )
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}.")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
