"""bert_reduce: exact, NaN-free, sync-free loss reduction for BERT masked-language models.

The names here are the handful a user needs; helpers live in their modules
(:mod:`bert_reduce.functional`, :mod:`bert_reduce.reports`, :mod:`bert_reduce.normalization`,
:mod:`bert_reduce.context_parallel`, :mod:`bert_reduce.packing`, :mod:`bert_reduce.lightning`).
They are imported on first use, so ``import bert_reduce`` stays quick and loads neither NeMo nor
Megatron-Core nor Lightning until something needs them.
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
    # Plain PyTorch loops (DDP, FSDP2) and Hugging Face models.
    "GlobalBatchLoss": "bert_reduce.torch_loop",
    # Perplexity (torchmetrics).
    "TokenPerplexity": "bert_reduce.metrics",
    # The maths: masked cross-entropy, per-token losses, normalization modes.
    "masked_cross_entropy": "bert_reduce.cross_entropy",
    "masked_token_losses": "bert_reduce.cross_entropy",
    "linear_masked_token_losses": "bert_reduce.linear_cross_entropy",
    "linear_weighted_loss_sum": "bert_reduce.linear_cross_entropy",
    "masked_token_loss": "bert_reduce.functional",
    "unreduced_token_loss_fn": "bert_reduce.functional",
    "Normalization": "bert_reduce.normalization",
    # Batches: context-parallel slicing and sequence packing.
    "get_batch_on_this_cp_rank": "bert_reduce.context_parallel",
    "pack_batch": "bert_reduce.packing",
}

__all__ = [
    "BERTMLMLossWithReduction",
    "DataParallelGroupLossAndIO",
    "GlobalBatchLoss",
    "MegatronLossReduction",
    "Normalization",
    "PerTokenLossDict",
    "SameSizeLossDict",
    "TokenPerplexity",
    "get_batch_on_this_cp_rank",
    "linear_masked_token_losses",
    "linear_weighted_loss_sum",
    "masked_cross_entropy",
    "masked_token_loss",
    "masked_token_losses",
    "pack_batch",
    "unreduced_token_loss_fn",
]

if TYPE_CHECKING:
    from bert_reduce.context_parallel import get_batch_on_this_cp_rank
    from bert_reduce.cross_entropy import masked_cross_entropy, masked_token_losses
    from bert_reduce.functional import masked_token_loss, unreduced_token_loss_fn
    from bert_reduce.linear_cross_entropy import (
        linear_masked_token_losses,
        linear_weighted_loss_sum,
    )
    from bert_reduce.metrics import TokenPerplexity
    from bert_reduce.normalization import Normalization
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
