"""What only NeMo 2 needs: exact validation loss and perplexity through NeMo's own hooks.

Import this package only where NeMo 2 (``nemo.lightning``) is installed; the rest of
bert_reduce never imports it.
"""

from bert_reduce.nemo.validation import (
    ExactValidationDataSampler,
    NeMoValidationPerplexityCallback,
    PaddedEvalDataset,
)

__all__ = [
    "ExactValidationDataSampler",
    "NeMoValidationPerplexityCallback",
    "PaddedEvalDataset",
]
