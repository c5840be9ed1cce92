"""The ragged batch of the packing tests, padded, and packed with stand-in logits."""

from __future__ import annotations

import torch
from torch import Tensor

from bert_reduce import pack_batch
from tests.helpers.reference import make_mlm_batch

RAGGED_LENGTHS = (5, 12, 1, 9, 12, 3)
RAGGED_SEQ_LEN, RAGGED_VOCAB = 12, 11


def ragged_padded_batch(weighted: bool = False, seed: int = 3):
    """A right-padded ``[b, s]`` batch of sequences of ``RAGGED_LENGTHS``, and its ``[s, b, v]``
    logits and ``[b, s]`` bool of real (non-padding) positions.

    Labels are drawn as :func:`make_mlm_batch` draws them; the loss mask is 0 on padding and on
    all of sequence 2 (a sequence with no masked token), float weights if ``weighted``.
    """
    logits, labels, mask = make_mlm_batch(
        len(RAGGED_LENGTHS), RAGGED_SEQ_LEN, RAGGED_VOCAB, mask_prob=0.4, seed=seed
    )
    real = torch.arange(RAGGED_SEQ_LEN) < torch.tensor(RAGGED_LENGTHS)[:, None]
    mask[2] = False
    loss_mask = mask = mask & real
    if weighted:
        gen = torch.Generator().manual_seed(seed)
        loss_mask = torch.where(mask, torch.rand(mask.shape, generator=gen, dtype=torch.float64), 0)
    input_ids = torch.randint(1, RAGGED_VOCAB, (len(RAGGED_LENGTHS), RAGGED_SEQ_LEN))
    return logits, {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}, real


def pack_with_logits(batch: dict, logits_sbv: Tensor, multiple: int) -> dict:
    """Pack the batch and, as a stand-in model output, the logits ([T, 1, v])."""
    packed = pack_batch(
        {**batch, "logits": logits_sbv.transpose(0, 1)}, RAGGED_LENGTHS, pad_to_multiple_of=multiple
    )
    # Huge logits on padding slots: if padding were ever scored, the loss would change.
    padding = torch.ones(packed["labels"].shape[1], dtype=torch.bool)
    for start, n in zip(packed["cu_seqlens_padded"][:-1].tolist(), RAGGED_LENGTHS, strict=True):
        padding[start : start + n] = False
    packed["logits"] = torch.where(padding[None, :, None], 1e4, packed["logits"])
    packed["padding"] = padding
    return packed
