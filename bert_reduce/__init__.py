"""bert_reduce: exact, NaN-free loss reduction for BERT masked-language models.

The names here are the handful a user needs; helpers live in their modules
(:mod:`bert_reduce.functional`, :mod:`bert_reduce.reports`, :mod:`bert_reduce.normalization`,
:mod:`bert_reduce.context_parallel`, :mod:`bert_reduce.packing`, :mod:`bert_reduce.lightning`).
They are imported on first use, so ``import bert_reduce`` stays quick and loads neither NeMo nor
Megatron-Core nor Lightning until something needs them. The loss functions are named by what
they take (``token_``: ``[b, s]`` per-token losses, ``cross_entropy_``: ``[s, b, v]`` logits,
``linear_cross_entropy_``: the output layer's inputs), then what they return (``_token_losses``,
``_loss_sum``, ``_weighted_sum``): ``docs/bionemo.md#names-kept-for-code-ported-from-bionemo``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # Megatron-Core / NeMo 2: the MegatronLossReduction family and its reports.
    "BERTMLMLossWithReduction": "bert_reduce.reduction",
    "MegatronLossReduction": "bert_reduce.reduction",
    "PerTokenLossDict": "bert_reduce.reports",
    "DataParallelGroupLossAndIO": "bert_reduce.reports",
    "SameSizeLossDict": "bert_reduce.reports",
    # The loss options every integration takes.
    "LossOptions": "bert_reduce.engine",
    # Plain PyTorch loops (DDP, FSDP2) and Hugging Face models.
    "GlobalBatchLoss": "bert_reduce.torch_loop",
    # Perplexity (torchmetrics).
    "TokenPerplexity": "bert_reduce.metrics",
    # The maths, named <what goes in>_<what comes out> (see the module docstring).
    "token_loss_sum": "bert_reduce.normalization",
    "cross_entropy_token_losses": "bert_reduce.cross_entropy",
    "cross_entropy_loss_sum": "bert_reduce.cross_entropy",
    "linear_cross_entropy_token_losses": "bert_reduce.linear_cross_entropy",
    "linear_cross_entropy_loss_sum": "bert_reduce.linear_cross_entropy",
    "linear_cross_entropy_weighted_sum": "bert_reduce.linear_cross_entropy",
    "Normalization": "bert_reduce.normalization",
    # Batches: context-parallel slicing and sequence packing.
    "get_batch_on_this_cp_rank": "bert_reduce.context_parallel",
    "pack_batch": "bert_reduce.packing",
    # NeMo 2 / BioNeMo names, for ported code (docs/bionemo.md).
    "masked_token_loss": "bert_reduce.normalization",
    "unreduced_token_loss_fn": "bert_reduce.cross_entropy",
}

__all__ = [
    "BERTMLMLossWithReduction",
    "DataParallelGroupLossAndIO",
    "GlobalBatchLoss",
    "LossOptions",
    "MegatronLossReduction",
    "Normalization",
    "PerTokenLossDict",
    "SameSizeLossDict",
    "TokenPerplexity",
    "cross_entropy_loss_sum",
    "cross_entropy_token_losses",
    "get_batch_on_this_cp_rank",
    "linear_cross_entropy_loss_sum",
    "linear_cross_entropy_token_losses",
    "linear_cross_entropy_weighted_sum",
    "masked_token_loss",  # NeMo 2 / BioNeMo name, for ported code (docs/bionemo.md)
    "pack_batch",
    "token_loss_sum",
    "unreduced_token_loss_fn",  # BioNeMo name, for ported code (docs/bionemo.md)
]

if TYPE_CHECKING:
    from bert_reduce.context_parallel import get_batch_on_this_cp_rank
    from bert_reduce.cross_entropy import (
        cross_entropy_loss_sum,
        cross_entropy_token_losses,
        unreduced_token_loss_fn,
    )
    from bert_reduce.engine import LossOptions
    from bert_reduce.linear_cross_entropy import (
        linear_cross_entropy_loss_sum,
        linear_cross_entropy_token_losses,
        linear_cross_entropy_weighted_sum,
    )
    from bert_reduce.metrics import TokenPerplexity
    from bert_reduce.normalization import Normalization, masked_token_loss, token_loss_sum
    from bert_reduce.packing import pack_batch
    from bert_reduce.reduction import BERTMLMLossWithReduction, MegatronLossReduction
    from bert_reduce.reports import (
        DataParallelGroupLossAndIO,
        PerTokenLossDict,
        SameSizeLossDict,
    )
    from bert_reduce.torch_loop import GlobalBatchLoss


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bert_reduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
