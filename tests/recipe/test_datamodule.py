"""The data module: resumable mid-epoch, every validation sample once, files and splits.

The same global batches and masks for any split: the sampler's
(tests/test_sampling.py) and the dataset's (tests/recipe/test_data.py) tests, and end to end
tests/recipe/test_train_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bert_reduce.lightning import ShardedEvalBatchSampler
from bert_reduce.recipe.config import DataConfig
from bert_reduce.recipe.datamodule import ESMDataModule


def datamodule(**kwargs) -> ESMDataModule:
    defaults = {"num_train_sequences": 48, "num_val_sequences": 11, "max_length": 32}
    dm = ESMDataModule(DataConfig(**{**defaults, **kwargs}))
    dm.setup("fit")
    return dm


def unpad(batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], ...]]:
    """Each sample's (input_ids, labels, loss_mask) without padding, in batch order."""
    keys = ("input_ids", "labels", "loss_mask")
    return [
        tuple(tuple(batch[key][row][keep].tolist()) for key in keys)
        for row, keep in enumerate(batch["attention_mask"])
    ]


def test_train_loader_resumes_mid_epoch() -> None:
    dm = datamodule(global_batch_size=8, micro_batch_size=4)
    loader = dm.train_dataloader()
    loader.batch_sampler.sampler.set_epoch(3)
    full = [unpad(batch) for batch in loader]
    assert len(full) == 6
    loader.progress = lambda: (3, 4)  # the trainer had processed 4 global batches of epoch 3
    state = loader.state_dict()
    assert state == {"epoch": 3, "batches_done": 4}
    resumed = dm.train_dataloader()
    resumed.batch_sampler.sampler.set_epoch(3)
    resumed.load_state_dict(state)
    assert [unpad(batch) for batch in resumed] == full[4:]
    assert [unpad(batch) for batch in resumed] == full  # the skip applies once
    other_epoch = dm.train_dataloader()
    other_epoch.load_state_dict(state)
    other_epoch.batch_sampler.sampler.set_epoch(4)
    assert len(list(other_epoch)) == 6  # a state of another epoch skips nothing


def test_validation_covers_every_sample_once() -> None:
    dm = datamodule(micro_batch_size=4)
    size = len(dm.val_dataset)
    assert isinstance(dm.val_dataloader().batch_sampler, ShardedEvalBatchSampler)
    loader = dm.val_dataloader()
    assert sum(batch["input_ids"].shape[0] for batch in loader) == size
    # The same masks every time validation runs.
    assert unpad(next(iter(loader))) == unpad(next(iter(dm.val_dataloader())))


def test_files_and_held_out_split(tmp_path: Path) -> None:
    fasta = tmp_path / "train.fasta"
    fasta.write_text("".join(f">s{i}\nMKV{'A' * (i % 7)}LG\n" for i in range(40)))
    dm = datamodule(train_path=str(fasta), val_fraction=0.1)
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (36, 4)
    assert (
        set(dm.train_dataset.sequences).isdisjoint(dm.val_dataset.sequences)
        or len(set(dm.train_dataset.sequences) | set(dm.val_dataset.sequences)) == 7
    )  # sequences repeat in this file; the split is by record
    val = tmp_path / "val.csv"
    val.write_text("sequence\nMKVLG\nMKAVLG\n")
    dm = datamodule(train_path=str(fasta), val_path=str(val))
    assert (len(dm.train_dataset), len(dm.val_dataset)) == (40, 2)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.001 .* leaves 0 for validation"):
        datamodule(train_path=str(fasta), val_fraction=0.001)
