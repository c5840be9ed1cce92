"""``python train.py`` run as a user runs it: the end-to-end guarantee of the recipe.

The same global batches give the same rows whatever the micro-batch size, packing, number of
DDP processes and resume point (docs/recipe.md, "The end-to-end guarantee"); no run prints a
warning; every rank of a run (here ``build.run`` itself, on 2 launched processes) ends the
process group it started.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bert_reduce.recipe.build import run
from tests.helpers.dist_utils import run_launched
from tests.helpers.recipe_runs import (
    TINY,
    WARNINGS_SHOWN,
    assert_no_warning,
    assert_same_rows,
    compose_config,
    run_train_py,
    train,
)

pytestmark = pytest.mark.slow

Split = tuple[int, int, bool]  # (micro_batch_size, devices, packed)
SINGLE = [(16, 1, False), (16, 1, True), (4, 1, False), (4, 1, True)]  # one multirun
DDP = [(2, 2, False), (8, 2, True)]
REFERENCE = SINGLE[0]


def split_of(run_dir: Path) -> Split:
    cfg = OmegaConf.load(run_dir / "config.yaml")
    return cfg.data.micro_batch_size, cfg.trainer.devices, cfg.data.pack_sequences


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Split, Path]:
    # One Hydra multirun sweeps the single-process splits (its jobs share one interpreter,
    # which saves start-ups); DDP runs launch their own processes, one run each. A
    # checkpoint every step: the resume below starts from step 1's.
    jobs = train(
        tmp_path_factory.mktemp("sweep"),
        "trainer.max_steps=3",
        "callbacks.checkpoint.every_n_train_steps=1",
        "data.micro_batch_size=16,4",
        "data.pack_sequences=false,true",
        multirun=True,
    )
    runs = {split_of(job): job for job in jobs}
    assert sorted(runs) == sorted(SINGLE)  # one run directory per job
    for micro, devices, packed in DDP:
        run_dir = tmp_path_factory.mktemp(f"m{micro}_d{devices}")
        train(
            run_dir,
            "trainer.max_steps=3",
            f"data.micro_batch_size={micro}",
            f"trainer.devices={devices}",
            f"data.pack_sequences={str(packed).lower()}",
        )
        runs[micro, devices, packed] = run_dir
    return runs


def test_same_losses_for_every_split(split_runs: dict[Split, Path]) -> None:
    for split, run_dir in split_runs.items():
        assert split_of(run_dir) == split
        assert_same_rows(run_dir, split_runs[REFERENCE], steps=[1, 2, 3])


def test_run_directory_outputs(split_runs: dict[Split, Path]) -> None:
    # metrics.csv's columns: read by test_same_losses_for_every_split.
    run_dir = split_runs[DDP[0]]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert "${" not in (run_dir / "config.yaml").read_text()  # interpolations resolved


def test_resume_gives_the_rows_of_an_uninterrupted_run(
    split_runs: dict[Split, Path], tmp_path: Path
) -> None:
    # The uninterrupted run: 3 steps, micro-batch 16, one process. Resume its checkpoint of
    # step 1 on 2 processes with micro-batch 8: the checkpoint counts global batches, so the
    # layout may change.
    full = split_runs[REFERENCE]
    step1 = full / "checkpoints" / "step000001.ckpt"
    overrides = ["trainer.max_steps=3", "data.micro_batch_size=8", "trainer.devices=2"]
    train(tmp_path, *overrides, f"resume={step1}")
    assert_same_rows(tmp_path, full, steps=[2, 3])


def test_the_default_run_prints_no_warning(tmp_path: Path) -> None:
    # The README's run as a user starts it (progress bar, TensorBoard, curves.png), shortened
    # (2 steps, small data), with resume=auto into its empty run directory.
    result = run_train_py(
        "resume=auto",
        "trainer.max_steps=2",
        "data.num_train_sequences=64",
        "data.num_val_sequences=16",
        f"hydra.run.dir={tmp_path}",
        env=WARNINGS_SHOWN,
    )
    assert_no_warning(result)


def _run_on_this_rank(run_dir: str) -> None:
    run(compose_config(*TINY, "trainer.max_steps=1", "trainer.devices=2"), run_dir)
    # No gloo thread left for the interpreter's shutdown to race (build.py, _fit's decorator).
    tasks = Path("/proc/self/task")  # Linux names its threads there
    threads = [(task / "comm").read_text() for task in tasks.iterdir()] if tasks.is_dir() else []
    assert not torch.distributed.is_initialized()
    assert not [name for name in threads if "gloo" in name], threads


def test_every_rank_ends_the_process_group_it_started(tmp_path: Path) -> None:
    run_launched(_run_on_this_rank, 2, str(tmp_path))
