"""What a run's checkpoint directory holds, and the step a checkpoint was saved at."""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=True, mmap=True)["global_step"]
