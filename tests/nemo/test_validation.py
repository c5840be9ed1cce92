"""The pieces of exact NeMo 2 validation, in one process; real fits: ``test_fit.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo.lightning.megatron_parallel")

import torch
from nemo import lightning as nl
from nemo.lightning.data import WrappedDataLoader
from torch.utils.data import DataLoader

from bert_reduce.nemo import ExactValidationDataSampler, PaddedEvalDataset, RealSampleTracker
from tests.helpers.nemo_bert import VAL_SAMPLES, val_dataset


def test_padded_eval_dataset_adds_only_unscored_samples() -> None:
    data = val_dataset(VAL_SAMPLES)
    padded = PaddedEvalDataset(data, 8)
    assert len(padded) == 16
    assert all(torch.equal(padded[i]["text"], data[i]["text"]) for i in range(VAL_SAMPLES))
    assert all(not padded[i]["loss_mask"].any() for i in range(VAL_SAMPLES, 16))
    with pytest.raises(ValueError, match="non-empty dataset"):
        PaddedEvalDataset(val_dataset(0), 8)


def test_real_sample_tracker_records_each_pass() -> None:
    tracker = RealSampleTracker([[0, 1], [12, 13], [14, 15]], num_real=13)
    assert len(tracker) == 3
    assert list(tracker) == [[0, 1], [12, 13], [14, 15]]
    assert tracker.real_samples_in_first(4) == 3 and tracker.real_samples_in_first(6) == 3
    iterator = iter(tracker)  # a new pass starts a new record
    assert tracker.is_real == []
    next(iterator)
    assert tracker.real_samples_in_first(2) == 2
    with pytest.raises(ValueError, match="dealt only 2"):
        tracker.real_samples_in_first(4)


def test_sampler_copies_settings_and_reads_mode_without_trainer() -> None:
    nemo_sampler = nl.MegatronDataSampler(
        seq_len=12, micro_batch_size=2, global_batch_size=8, init_consumed_samples=16
    )
    sampler = ExactValidationDataSampler.from_sampler(nemo_sampler)
    assert vars(sampler) == vars(nemo_sampler)
    # No trainer (NeMo's Fabric strategy): NeMo's `mode` attribute, else a training loader.
    assert sampler.loader_mode(WrappedDataLoader(mode="validation", dataset=[0])) == "validation"
    assert sampler.loader_mode(DataLoader([0])) == "train"
