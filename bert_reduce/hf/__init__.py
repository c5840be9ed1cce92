"""Hugging Face ``transformers`` integration (the ``hf`` extra).

* :func:`lm_head_inputs`: the fused masked-only head's inputs of an ``EsmForMaskedLM`` or
  ``BertForMaskedLM`` (hidden states, output weight and bias), without their logits.
"""

from bert_reduce.hf.lm_head import lm_head_inputs

__all__ = ["lm_head_inputs"]
