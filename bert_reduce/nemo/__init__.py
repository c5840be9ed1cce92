"""What only NeMo 2 needs: exact validation through NeMo's hooks; the count in its data step.

Import this package only where NeMo 2 (``nemo.lightning``) is installed; the rest of
bert_reduce never imports it.
"""

from bert_reduce.nemo.data_step import num_scored_data_step
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
    "num_scored_data_step",
]
