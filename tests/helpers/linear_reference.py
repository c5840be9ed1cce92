"""Independent references for the fused LM head: ``F.linear`` then ``F.cross_entropy``, fp64."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
    """``sum(coef * F.cross_entropy(F.linear(hidden, weight, bias)))`` over ``coef != 0``.

    Returns the fp64 ``[b, s]`` losses (0 where ``coef == 0``) and the gradients of the
    weighted sum w.r.t. hidden, weight and bias (``None`` without bias).
    """
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (hidden, weight)]
    bias_leaf = None if bias is None else bias.detach().to(torch.float64).requires_grad_(True)
    logits = F.linear(leaves[0], leaves[1], bias_leaf)
    logits_bsv = logits.transpose(0, 1) if layout == "sb" else logits
    scored = coef != 0
    per_token = F.cross_entropy(logits_bsv[scored], labels[scored], reduction="none")
    (per_token * coef[scored].to(torch.float64)).sum().backward()
    losses = torch.zeros(labels.shape, dtype=torch.float64).index_put((scored,), per_token)
    grads = [leaf.grad for leaf in leaves] + [None if bias_leaf is None else bias_leaf.grad]
    return losses.detach(), *grads
