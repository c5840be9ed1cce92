"""What only NeMo 2 needs: exact validation loss and perplexity through NeMo's own hooks.

Import this package only where NeMo 2 (``nemo.lightning``) is installed; the rest of
bert_reduce never imports it.
"""

from bert_reduce.nemo.validation_data import (
    ExactValidationDataSampler,
    PaddedEvalDataset,
    RealSampleTracker,
)
from bert_reduce.nemo.validation_perplexity import NeMoValidationPerplexityCallback

__all__ = [
    "ExactValidationDataSampler",
    "NeMoValidationPerplexityCallback",
    "PaddedEvalDataset",
    "RealSampleTracker",
]
