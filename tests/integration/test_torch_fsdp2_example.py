"""examples/torch_fsdp2_loop.py under ``torchrun`` on CPU: 2 ranks log the losses of 1 rank.

With the fused head (the default) and with the model's logits (``--head logits``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.dist_utils import HANG_GUARD_S

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, *args: str) -> dict[int, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "examples/torch_fsdp2_loop.py",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([\d.]+)", result.stdout)}


def test_two_ranks_log_the_losses_of_one() -> None:
    two = torchrun(2, "--steps=3", "--micro-batch-size=2")
    one = torchrun(1, "--steps=3", "--micro-batch-size=4")
    assert sorted(two) == [1, 2, 3] and two[1] != two[3]
    # The fused head (the default) trains as the model's own logits do.
    logits = torchrun(2, "--steps=3", "--micro-batch-size=2", "--head=logits")
    for step, loss in logits.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), step
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), step
