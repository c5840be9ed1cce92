"""Independent references: ``torch.nn.functional.cross_entropy`` on the full, unsplit batch."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def make_mlm_batch(
    batch_size: int,
    seq_len: int,
    vocab: int,
    *,
    mask_prob: float = 0.3,
    empty_rows: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``[s, b, v]`` logits, ``[b, s]`` labels and a ``[b, s]`` bool loss mask.

    Unmasked labels are set to -100 so that nothing can rely on them; ``empty_rows`` get no
    masked token at all.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(seq_len, batch_size, vocab, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    mask = torch.rand(batch_size, seq_len, generator=gen) < mask_prob
    for row in empty_rows:
        mask[row] = False
    labels = torch.where(mask, labels, -100)
    return logits.to(dtype), labels, mask


def assert_close_by_name(actual: Mapping[str, Tensor], expected: Mapping[str, Tensor], **tol):
    """The same names, and each tensor of ``actual`` close to ``expected``'s (``tol``)."""
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], **tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def reference_loss(logits_sbv: Tensor, labels_bs: Tensor, mask_bs: Tensor) -> Tensor:
    """Mean cross-entropy over the masked tokens, in one pass, fp64."""
    logits_bsv = logits_sbv.to(torch.float64).transpose(0, 1)
    return F.cross_entropy(logits_bsv[mask_bs], labels_bs[mask_bs])


def loss_and_grad(loss_fn, logits_sbv: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
    """``loss_fn(logits, *args, **kwargs)`` on the logits in fp64 and its gradient w.r.t. them
    (zeros if the loss does not depend on them)."""
    logits = logits_sbv.detach().to(torch.float64).requires_grad_(True)
    loss = loss_fn(logits, *args, **kwargs)
    if loss.requires_grad:
        loss.backward()
    return loss.detach(), logits.grad if logits.grad is not None else torch.zeros_like(logits)


def reference_loss_and_grad(logits_sbv: Tensor, labels_bs: Tensor, mask_bs: Tensor):
    """The reference loss and its gradient w.r.t. the ``[s, b, v]`` logits, fp64."""
    return loss_and_grad(reference_loss, logits_sbv, labels_bs, mask_bs)


def weighted_reference(logits_sbv: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``sum(w * F.cross_entropy)`` over the scored tokens and its gradient, fp64.

    ``logits_sbv`` are ``[s, b, v]``; ``w`` is the ``[b, s]`` ``mask`` (0/1 or float weights).
    """

    def weighted_sum(logits: Tensor) -> Tensor:
        scored = mask != 0
        per_token = F.cross_entropy(
            logits.transpose(0, 1)[scored], labels[scored], reduction="none"
        )
        return (per_token * mask[scored].to(torch.float64)).sum()

    return loss_and_grad(weighted_sum, logits_sbv)


RAGGED_LENGTHS = (5, 12, 1, 9, 12, 3)
RAGGED_SEQ_LEN, RAGGED_VOCAB = 12, 11


def ragged_mlm_batch(seed: int = 3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A right-padded batch of sequences of ``RAGGED_LENGTHS``, for packing tests.

    Returns ``[s, b, v]`` logits, ``[b, s]`` labels (as :func:`make_mlm_batch` draws them), a
    ``[b, s]`` bool mask that is False on padding and on all of sequence 2, and the ``[b, s]``
    bool of real (non-padding) positions.
    """
    logits, labels, mask = make_mlm_batch(
        len(RAGGED_LENGTHS), RAGGED_SEQ_LEN, RAGGED_VOCAB, mask_prob=0.4, seed=seed
    )
    real = torch.arange(RAGGED_SEQ_LEN) < torch.tensor(RAGGED_LENGTHS)[:, None]
    mask[2] = False  # a sequence with no masked token
    return logits, labels, mask & real, real


# Micro-batches as row indices of uneven_mlm_batch(): unequal sizes, and rows 2 and 5 hold no
# masked token (row 5 alone is a micro-batch with none).
UNEVEN_MICRO_BATCHES = [[0, 1, 2], [3, 4], [5], [6]]
UNEVEN_VOCAB = 12


def uneven_mlm_batch(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """``[10, 7, 12]`` logits, ``[7, 10]`` labels and mask, for ``UNEVEN_MICRO_BATCHES``."""
    return make_mlm_batch(7, 10, UNEVEN_VOCAB, empty_rows=(2, 5), dtype=dtype, seed=3)
