"""Hugging Face ``transformers`` integration (the ``hf`` extra).

``ExactMLMTrainer`` is imported on first use, so ``import bert_reduce.hf`` does not load
``transformers.Trainer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bert_reduce.hf.lm_head import lm_head_inputs

__all__ = ["ExactMLMTrainer", "lm_head_inputs"]

if TYPE_CHECKING:
    from bert_reduce.hf.exact_trainer import ExactMLMTrainer


def __getattr__(name: str) -> Any:
    if name == "ExactMLMTrainer":
        from bert_reduce.hf.exact_trainer import ExactMLMTrainer

        return ExactMLMTrainer
    raise AttributeError(f"module 'bert_reduce.hf' has no attribute {name!r}")
