"""bert_reduce.hf.token_losses: the model's inputs and the per-sample terms of HF batches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bert_reduce.engine import LossOptions, mode_terms, scored_weights
from bert_reduce.hf.token_losses import sample_loss_terms, split_model_inputs
from bert_reduce.normalization import Normalization
from tests.helpers import hf_trainer as H

MODES = [Normalization.PER_TOKEN, Normalization.PER_SEQUENCE, Normalization.CONSTANT]
CONSTANT = 7


def _batch() -> dict[str, torch.Tensor]:
    return H.stack(H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED))


def _options(mode: Normalization) -> LossOptions:
    return LossOptions(normalization=mode, constant_per_sequence=CONSTANT)


def _terms(batch, weights, losses, mode):
    return mode_terms(batch, weights, losses, _options(mode))


def test_model_inputs_leave_out_the_loss_keys() -> None:
    batch = {**_batch(), "loss_mask": torch.ones(8, 1), "num_scored": 36}
    assert sorted(split_model_inputs(batch)) == ["attention_mask", "input_ids"]


@pytest.mark.parametrize("mode", MODES)
def test_sample_terms_of_rows(mode: Normalization) -> None:
    batch = _batch()
    weights = scored_weights(batch)
    losses = torch.rand(weights.shape, dtype=torch.float64)
    samples = sample_loss_terms(batch, weights, losses, _options(mode))
    assert samples.shape == (8, 2)
    numerator, denominator = _terms(batch, weights, losses, mode)
    torch.testing.assert_close(samples.sum(0), torch.stack([numerator, denominator.double()]))
    for row in range(8):
        alone = {key: value[row : row + 1] for key, value in batch.items()}
        pair = _terms(alone, weights[row : row + 1], losses[row : row + 1], mode)
        torch.testing.assert_close(samples[row], torch.stack([pair[0], pair[1].double()]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("boundaries", ["position_ids", "cu_seq_lens_q"])
def test_sample_terms_of_packed_sequences(mode: Normalization, boundaries: str) -> None:
    # DataCollatorWithFlattening's [1, T] row: each packed sequence is one sample, with the
    # terms it has as a row of its own.
    from transformers import DataCollatorWithFlattening

    rows = H.samples(H.TRAIN_LENGTHS, H.TRAIN_MASKED)
    features = [
        {"input_ids": row["input_ids"][:n].tolist(), "labels": [-100, *row["labels"][1:n].tolist()]}
        for row, n in zip(rows, H.TRAIN_LENGTHS, strict=True)
    ]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=boundaries == "cu_seq_lens_q")
    packed = collator(features)
    if boundaries == "cu_seq_lens_q":
        del packed["position_ids"]
    weights = scored_weights(packed)
    losses = torch.rand(weights.shape, dtype=torch.float64)
    samples = sample_loss_terms(packed, weights, losses, _options(mode))
    assert samples.shape == (8, 2)
    start = 0
    for index, length in enumerate(H.TRAIN_LENGTHS):
        part = slice(start, start + length)
        alone = {"labels": packed["labels"][:, part]}
        pair = _terms(alone, weights[:, part], losses[:, part], mode)
        torch.testing.assert_close(samples[index], torch.stack([pair[0], pair[1].double()]))
        start += length
