"""lm_head_inputs: the fused head's inputs of Hugging Face ESM and BERT masked LMs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bert_reduce.hf import lm_head_inputs
from tests.helpers import hf_trainer as H


def test_head_is_restored_after_a_call_or_an_error_and_bad_calls_are_named() -> None:
    model = H.tiny_model("esm")
    lm_head_inputs(model, input_ids=torch.ones(2, 3, dtype=torch.long))
    assert "forward" not in vars(model.lm_head)
    with pytest.raises(IndexError):  # a token id outside the embedding table
        lm_head_inputs(model, input_ids=torch.full((2, 3), 10**6))
    assert "forward" not in vars(model.lm_head)
    with pytest.raises(ValueError, match="without 'labels'"):
        lm_head_inputs(model, input_ids=torch.ones(2, 3, dtype=torch.long), labels=None)
    with pytest.raises(TypeError, match="EsmForMaskedLM and BertForMaskedLM"):
        lm_head_inputs(torch.nn.Linear(2, 2), input=torch.ones(2))
