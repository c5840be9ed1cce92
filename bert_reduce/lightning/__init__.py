"""Lightning integration: exact global-batch training steps and the samplers that feed them.

Importing this package imports Lightning; ``import bert_reduce`` alone does not. The samplers
are :mod:`bert_reduce.sampling`'s (plain torch), re-exported here.
"""

from bert_reduce.lightning.exact_module import (
    ExactMLMModule,
    LRSchedulerFactory,
    OptimizerFactory,
    split_micro_batches,
)
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
    "ShardedEvalBatchSampler",
    "ValidationPerplexityCallback",
    "ValidationResult",
    "check_no_repeated_samples",
    "check_sampler_placement",
    "split_micro_batches",
]
