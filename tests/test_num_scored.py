"""num_scored: counted on the host by any collator, left alone by every device transfer."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import default_collate

from bert_reduce import linear_cross_entropy_token_losses
from bert_reduce.num_scored import NumScoredCollator, count_scored

# A device no tensor can be read back from on the host, standing in for an accelerator.
DEVICE = torch.device("meta")


def bionemo_layout_batch() -> dict[str, torch.Tensor]:
    """What BioNeMo's ``bert_padding_collate_fn`` returns (bionemo-llm 2.x,
    ``bionemo/llm/data/collate.py``): ``text``, ``types``, ``attention_mask``, ``labels``
    (the original tokens, padded with -1), ``loss_mask`` and ``is_random``; scored positions
    are the ``loss_mask``'s, not the labels'."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 4, 6])
    real = torch.arange(8) < lengths[:, None]
    loss_mask = real & (torch.rand(3, 8, generator=gen) < 0.4)
    labels = torch.where(real, torch.randint(4, 24, (3, 8), generator=gen), -1)
    return {
        "text": torch.where(loss_mask, 32, labels.clamp(min=1)),
        "types": torch.zeros(3, 8, dtype=torch.long),
        "attention_mask": real,
        "labels": labels,
        "loss_mask": loss_mask,
        "is_random": torch.zeros(3, 8, dtype=torch.long),
    }


def bionemo_collated(per_sample: bool = False) -> dict:
    samples = [{k: v[i] for k, v in bionemo_layout_batch().items()} for i in range(3)]
    return NumScoredCollator(default_collate, per_sample=per_sample)(samples)


def test_hugging_face_collator_counts_its_labels() -> None:
    pytest.importorskip("transformers")
    from transformers import DataCollatorForLanguageModeling

    from examples.hf_trainer_esm2 import build_tokenizer, parse_args

    tokenizer = build_tokenizer(parse_args([]))  # a real EsmTokenizer over the ESM alphabet
    samples = [tokenizer(s) for s in ("MKVLAAGIWMKVL", "MSTNPKPQRKTKRNTNRRPQ", "MAL")]
    collate = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0)
    batch = NumScoredCollator(collate)(samples)
    expected = (batch["labels"] != -100).sum(dim=1)
    assert type(batch["num_scored"]) is int and batch["num_scored"] == int(expected.sum()) > 0
    per_sample = NumScoredCollator(
        DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0), per_sample=True
    )(samples)
    assert per_sample["num_scored"] == tuple(expected.tolist())
    assert all(type(n) is int for n in per_sample["num_scored"])


def test_bionemo_layout_counts_the_loss_mask_not_the_labels() -> None:
    batch = bionemo_collated()
    assert batch["num_scored"] == int(batch["loss_mask"].sum())
    assert batch["num_scored"] < int((batch["labels"] != -100).sum())


def test_counts_survive_every_device_transfer() -> None:
    batch, per_sample = bionemo_collated(), bionemo_collated(per_sample=True)
    # Lightning's and NeMo's transfer (move_data_to_device), and a loop moving tensors only.
    for moved in (
        move_data_to_device(batch, DEVICE),
        move_data_to_device(per_sample, DEVICE),
        {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
    ):
        assert moved["loss_mask"].device == DEVICE
        assert moved["num_scored"] in (batch["num_scored"], per_sample["num_scored"])


def test_errors_name_the_batch_key() -> None:
    batch = bionemo_layout_batch()
    with pytest.raises(KeyError, match=r"loss_mask'\] or batch\['labels'\].*\['text'\]"):
        count_scored({"text": batch["text"]})
    with pytest.raises(TypeError, match="returns a dict of tensors, got tuple"):
        NumScoredCollator(lambda samples: (samples,))([1])
    with pytest.raises(TypeError, match="a tuple of ints"):
        linear_cross_entropy_token_losses(
            torch.zeros(2, 1, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1, 2), num_scored=(1, 1.0),
        )  # fmt: skip
