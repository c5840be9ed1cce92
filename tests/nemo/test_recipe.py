"""``examples/nemo2_recipe.py`` configures the loss and flags; test_checkpoint.py runs it."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl

from bert_reduce import BERTMLMLossWithReduction
from tests.helpers.nemo_bert import recipe


def test_recipe_configures_the_loss_and_the_megatron_flags() -> None:
    configured = recipe("unused", devices=2)
    assert configured.model.config.calculate_per_token_loss is True
    assert configured.trainer.strategy.ddp.average_in_collective is False
    loss = fdl.build(configured.model.loss_reduction_class)(validation_step=True)
    assert isinstance(loss, BERTMLMLossWithReduction)
    assert loss.validation_step and loss.options.capacity == "all"
