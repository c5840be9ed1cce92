"""Lightning integration: exact global-batch training steps and the samplers that feed them.

Importing this package imports Lightning; ``import bert_reduce`` alone does not.
"""

from bert_reduce.lightning.exact_module import (
    ExactMLMModule,
    LRSchedulerFactory,
    OptimizerFactory,
    split_micro_batches,
)
from bert_reduce.lightning.rng_state import RNGStateCheckpoint
from bert_reduce.lightning.run_checkpoint import RunCheckpoint
from bert_reduce.lightning.stop_on_signal import StopOnSignal
from bert_reduce.lightning.validation_perplexity import (
    ValidationPerplexityCallback,
    ValidationResult,
)
from bert_reduce.sampling import (
    GlobalBatchSampler,
    ShardedEvalBatchSampler,
    check_no_repeated_samples,
    check_sampler_placement,
)

__all__ = [
    "ExactMLMModule",
    "GlobalBatchSampler",
    "LRSchedulerFactory",
    "OptimizerFactory",
    "RNGStateCheckpoint",
    "RunCheckpoint",
    "ShardedEvalBatchSampler",
    "StopOnSignal",
    "ValidationPerplexityCallback",
    "ValidationResult",
    "check_no_repeated_samples",
    "check_sampler_placement",
    "split_micro_batches",
]
