"""``python train.py`` run as a user runs it: the end-to-end guarantee of the recipe.

The same global batches give the same per-step ``train_loss`` and final ``val_ppl`` whatever
the micro-batch size and number of DDP processes (gloo), on a validation set whose size
divides neither the batch sizes nor the number of ranks; and a run stopped after step k and
resumed writes the rows of an uninterrupted run. The README's runs print no warning.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers.recipe_runs import (
    run_train_py,
    train,
    train_losses,
    validations,
    warnings_printed,
)

pytestmark = pytest.mark.slow

SPLITS = [(16, 1), (4, 1), (2, 2), (8, 2)]  # (micro_batch_size, devices)
PACKED = (4, 2)  # also packing each micro-batch into one row: the same losses again


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int] | str, Path]:
    # One Hydra multirun sweeps the single-process splits (its jobs share one interpreter,
    # which saves a start-up); DDP runs launch their own processes, one run each.
    sweep = tmp_path_factory.mktemp("sweep")
    single = [micro for micro, devices in SPLITS if devices == 1]
    micro_sizes = ",".join(map(str, single))
    train(sweep, "trainer.max_steps=3", f"data.micro_batch_size={micro_sizes}", multirun=True)
    runs = {(micro, 1): sweep / str(job) for job, micro in enumerate(single)}
    for micro, devices in SPLITS:
        if devices > 1:
            run_dir = tmp_path_factory.mktemp(f"m{micro}_d{devices}")
            train(
                run_dir,
                "trainer.max_steps=3",
                f"data.micro_batch_size={micro}",
                f"trainer.devices={devices}",
            )
            runs[micro, devices] = run_dir
    micro, devices = PACKED
    run_dir = tmp_path_factory.mktemp("packed")
    train(
        run_dir,
        "trainer.max_steps=3",
        f"data.micro_batch_size={micro}",
        f"trainer.devices={devices}",
        "data.pack_sequences=true",
    )
    runs["packed"] = run_dir
    return runs


def test_same_losses_for_every_split(split_runs: dict[tuple[int, int] | str, Path]) -> None:
    reference = split_runs[SPLITS[0]]
    ref_losses = train_losses(reference)
    ref_val = validations(reference)
    assert sorted(ref_losses) == [1, 2, 3]
    assert sorted(ref_val) == [3]  # validated once, at the end
    # Training did something: the loss moved (so equal losses are not trivially equal).
    assert ref_losses[1] != ref_losses[3]
    for split, run_dir in split_runs.items():
        losses = train_losses(run_dir)
        assert sorted(losses) == [1, 2, 3], split
        for step, loss in ref_losses.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (split, step)
        (val_loss, val_ppl), (ref_loss, ref_ppl) = validations(run_dir)[3], ref_val[3]
        assert val_ppl == pytest.approx(ref_ppl, rel=1e-5), split
        assert val_loss == pytest.approx(ref_loss, rel=1e-5), split


def test_run_directory_outputs(split_runs: dict[tuple[int, int] | str, Path]) -> None:
    run_dir = split_runs[2, 2]
    header = next(csv.reader(open(run_dir / "metrics.csv")))
    assert {"step", "train_loss", "val_loss", "val_ppl"} <= set(header)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    resolved = (run_dir / "config.yaml").read_text()
    assert "micro_batch_size: 2" in resolved and "devices: 2" in resolved
    assert "${" not in resolved  # interpolations resolved


def test_resume_gives_the_rows_of_an_uninterrupted_run(
    split_runs: dict[tuple[int, int] | str, Path], tmp_path: Path
) -> None:
    # The uninterrupted run: 3 steps, micro-batch 16, one process. Stop it after step 1
    # (same schedule: total_steps stays 3) and resume on 2 processes with micro-batch 8:
    # the checkpoint counts global batches, so the layout may change.
    full = split_runs[16, 1]
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["optim.scheduler.total_steps=3", "callbacks.checkpoint.every_n_train_steps=1"]
    train(first, *common, "trainer.max_steps=1", "data.micro_batch_size=16")
    train(
        second,
        *common,
        "trainer.max_steps=3",
        "data.micro_batch_size=8",
        "trainer.devices=2",
        f"resume={first / 'checkpoints' / 'last.ckpt'}",
    )
    expected = train_losses(full)
    resumed = {**train_losses(first), **train_losses(second)}
    assert sorted(train_losses(second)) == [2, 3]
    assert sorted(resumed) == sorted(expected)
    for step, loss in expected.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), step
    assert validations(second)[3] == pytest.approx(validations(full)[3], rel=1e-5)


def test_multirun_wrote_one_run_directory_per_job(
    split_runs: dict[tuple[int, int] | str, Path],
) -> None:
    for split, run_dir in split_runs.items():
        micro, devices = PACKED if split == "packed" else split
        resolved = (run_dir / "config.yaml").read_text()
        assert f"micro_batch_size: {micro}" in resolved and f"devices: {devices}" in resolved


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=hf_esm2"],
        ["trainer.devices=2", "loss.normalization=per_sequence"],
        ["resume=auto"],
    ],
    ids=["default", "hf_esm2", "ddp", "resume-auto"],
)
def test_runs_print_no_warning(overrides: list[str], tmp_path: Path) -> None:
    # The README's runs as a user starts them, shortened (2 steps, small data), with every
    # Python warning shown (PYTHONWARNINGS=default: deprecations too) and the progress bar on.
    result = run_train_py(
        *overrides,
        "trainer.max_steps=2",
        "data.num_train_sequences=64",
        "data.num_val_sequences=16",
        f"hydra.run.dir={tmp_path}",
        env={"PYTHONWARNINGS": "default", "HF_HUB_OFFLINE": "1"},
    )
    assert not warnings_printed(result), "\n".join(warnings_printed(result))
