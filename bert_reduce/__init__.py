"""bert_reduce: exact, NaN-free, sync-free loss reduction for BERT masked-language models.

Public names are imported on first use, so ``import bert_reduce`` stays quick and loads
neither NeMo nor Megatron-Core nor Lightning until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "BERTMLMLossWithReduction": "bert_reduce.reduction",
    "DataParallelGroupLossAndIO": "bert_reduce.reduction",
    "MegatronLossReduction": "bert_reduce.reduction",
    "PerTokenLossDict": "bert_reduce.reduction",
    "SameSizeLossDict": "bert_reduce.reduction",
    "reduce_loss_reports": "bert_reduce.reduction",
    "masked_token_loss": "bert_reduce.functional",
    "unreduced_token_loss_fn": "bert_reduce.functional",
    "validate_masked_labels": "bert_reduce.functional",
    "get_batch_on_this_cp_rank": "bert_reduce.distributed",
    "masked_cross_entropy": "bert_reduce.cross_entropy",
    "masked_token_losses": "bert_reduce.cross_entropy",
    "linear_masked_token_losses": "bert_reduce.linear_cross_entropy",
    "TokenPerplexity": "bert_reduce.metrics",
    "ValidationPerplexityCallback": "bert_reduce.lightning.callbacks",
    "Normalization": "bert_reduce.normalization",
    "normalized_loss_terms": "bert_reduce.normalization",
    "sequence_normalizers": "bert_reduce.normalization",
    "get_packed_batch_on_this_cp_rank": "bert_reduce.packing",
    "pack_batch": "bert_reduce.packing",
    "packed_context_parallel_indices": "bert_reduce.packing",
    "unpack_sequences": "bert_reduce.packing",
}

__all__ = [
    "BERTMLMLossWithReduction",
    "DataParallelGroupLossAndIO",
    "MegatronLossReduction",
    "Normalization",
    "PerTokenLossDict",
    "SameSizeLossDict",
    "TokenPerplexity",
    "ValidationPerplexityCallback",
    "get_batch_on_this_cp_rank",
    "get_packed_batch_on_this_cp_rank",
    "linear_masked_token_losses",
    "masked_cross_entropy",
    "masked_token_loss",
    "masked_token_losses",
    "normalized_loss_terms",
    "pack_batch",
    "packed_context_parallel_indices",
    "reduce_loss_reports",
    "sequence_normalizers",
    "unpack_sequences",
    "unreduced_token_loss_fn",
    "validate_masked_labels",
]

if TYPE_CHECKING:
    from bert_reduce.cross_entropy import masked_cross_entropy, masked_token_losses
    from bert_reduce.distributed import get_batch_on_this_cp_rank
    from bert_reduce.functional import (
        masked_token_loss,
        unreduced_token_loss_fn,
        validate_masked_labels,
    )
    from bert_reduce.lightning.callbacks import ValidationPerplexityCallback
    from bert_reduce.linear_cross_entropy import linear_masked_token_losses
    from bert_reduce.metrics import TokenPerplexity
    from bert_reduce.normalization import (
        Normalization,
        normalized_loss_terms,
        sequence_normalizers,
    )
    from bert_reduce.packing import (
        get_packed_batch_on_this_cp_rank,
        pack_batch,
        packed_context_parallel_indices,
        unpack_sequences,
    )
    from bert_reduce.reduction import (
        BERTMLMLossWithReduction,
        DataParallelGroupLossAndIO,
        MegatronLossReduction,
        PerTokenLossDict,
        SameSizeLossDict,
        reduce_loss_reports,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bert_reduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
