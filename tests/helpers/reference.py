"""Independent fp64 references: ``F.cross_entropy`` (after ``F.linear`` for the fused head) on
the full, unsplit batch. Nothing here uses bert_reduce.
"""

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


def token_losses(logits_sbv: Tensor, labels: Tensor, scored: Tensor) -> Tensor:
    """``F.cross_entropy`` of each ``scored`` ``[b, s]`` position, 0 elsewhere, fp64."""
    logits_bsv = logits_sbv.to(torch.float64).transpose(0, 1)
    per_token = F.cross_entropy(logits_bsv[scored], labels[scored], reduction="none")
    return torch.zeros(labels.shape, dtype=torch.float64).index_put((scored,), per_token)


def reference_loss(
    logits_sbv: Tensor,
    labels: Tensor,
    mask: Tensor,
    mode: str = "per_token",
    *,
    constant_per_sequence: int | None = None,
) -> Tensor:
    """The global loss of ``mode`` over the ``[b, s]`` batch, fp64; 0.0 when nothing counts.

    ``mask`` weighs each token (0/1 or float weights); every row is one sequence. ``"sum"`` is
    the weighted sum of the token losses, the numerator of every mode.
    """
    weights = mask.to(torch.float64)
    weighted = weights * token_losses(logits_sbv, labels, mask != 0)
    total = weighted.sum()  # 0 when nothing counts
    if mode == "sum":
        return total
    if mode == "per_token":
        return total / weights.sum() if weights.sum() != 0 else total
    if mode == "per_sequence":
        rows = weights.sum(1) != 0
        return (weighted[rows].sum(1) / weights[rows].sum(1)).mean() if rows.any() else total
    if mode == "constant":
        assert constant_per_sequence is not None
        return total / (constant_per_sequence * len(weights))
    raise AssertionError(mode)


def reference_loss_and_grad(
    logits_sbv: Tensor, labels: Tensor, mask: Tensor, mode: str = "per_token", **kwargs
) -> tuple[Tensor, Tensor]:
    """:func:`reference_loss` and its gradient w.r.t. the ``[s, b, v]`` logits, fp64."""
    logits = logits_sbv.detach().to(torch.float64).requires_grad_(True)
    loss = reference_loss(logits, labels, mask, mode, **kwargs)
    loss.backward()
    return loss.detach(), logits.grad


def make_head_batch(
    b: int = 4,
    s: int = 9,
    h: int = 6,
    v: int = 13,
    *,
    mask_prob: float = 0.3,
    empty_rows: tuple[int, ...] = (),
    layout: str = "sb",
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp64 hidden (``[s, b, h]`` or ``[b, s, h]``), ``[v, h]`` weight, ``[v]`` bias, labels, mask.

    Unscored labels are -100, so that nothing can rely on them.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (s, b, h) if layout == "sb" else (b, s, h)
    hidden = torch.randn(shape, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, s, generator=gen) < mask_prob
    for row in empty_rows:
        mask[row] = False
    labels = torch.where(mask, torch.randint(0, v, (b, s), generator=gen), -100)
    return hidden, weight, bias, labels, mask


def linear_reference(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    coef: Tensor,
    layout: str = "sb",
) -> tuple[Tensor, ...]:
    """The fused head's reference: :func:`token_losses` of ``F.linear(hidden, weight, bias)``.

    Returns the fp64 ``[b, s]`` losses (0 where ``coef == 0``) and the gradients of
    ``sum(coef * losses)`` w.r.t. hidden, weight and bias (``None`` without bias).
    """
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (hidden, weight)]
    bias_leaf = None if bias is None else bias.detach().to(torch.float64).requires_grad_(True)
    logits = F.linear(leaves[0], leaves[1], bias_leaf)
    losses = token_losses(logits if layout == "sb" else logits.transpose(0, 1), labels, coef != 0)
    (losses * coef.to(torch.float64)).sum().backward()
    grads = [leaf.grad for leaf in leaves] + [None if bias_leaf is None else bias_leaf.grad]
    return losses.detach(), *grads


# Micro-batches as row indices of uneven_mlm_batch(): unequal sizes, and rows 2 and 5 hold no
# masked token (row 5 alone is a micro-batch with none).
UNEVEN_MICRO_BATCHES = [[0, 1, 2], [3, 4], [5], [6]]


def uneven_mlm_batch(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """``[10, 7, 12]`` logits, ``[7, 10]`` labels and mask, for ``UNEVEN_MICRO_BATCHES``."""
    return make_mlm_batch(7, 10, 12, empty_rows=(2, 5), dtype=dtype, seed=3)
