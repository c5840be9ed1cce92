"""Generator states survive a checkpoint: the draws after a restore are those of the original."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch

from bert_reduce.lightning import RNGStateCheckpoint
from bert_reduce.lightning.rng_state import get_rng_states, set_rng_states


def draws() -> tuple:
    return (random.random(), np.random.rand(), torch.rand(3).tolist(), torch.randn(()).item())


def test_states_round_trip_through_a_weights_only_checkpoint(tmp_path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    draws()
    np.random.randn()  # leaves a cached gaussian in NumPy's state
    saved = get_rng_states()
    expected = draws()
    torch.save(saved, tmp_path / "rng.pt")
    draws()  # move every generator on
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert draws() == expected


def test_callback_restores_at_the_first_training_step(caplog) -> None:
    callback = RNGStateCheckpoint()
    state = callback.state_dict()
    expected = draws()
    callback.load_state_dict(state)
    draws()  # what runs between loading and the first step (sanity check, loaders)
    trainer = SimpleNamespace(world_size=1, global_rank=0)
    callback.on_train_batch_start(trainer, None, None, 0)
    assert draws() == expected
    moved = draws()
    callback.on_train_batch_start(trainer, None, None, 1)  # only once
    assert draws() != moved
    # Another number of ranks: restore what it can, and say the masks will differ.
    callback.load_state_dict(state)
    callback.on_train_batch_start(SimpleNamespace(world_size=2, global_rank=1), None, None, 0)
    assert "random states of 1 rank(s), this run has 2" in caplog.text
