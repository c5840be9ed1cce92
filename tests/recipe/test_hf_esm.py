"""The Hugging Face ESM recipe model: config, construction, local checkpoints, LM-head inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from bert_reduce.recipe.build import build_from_config
from bert_reduce.recipe.config import HFEsm2ModelConfig
from tests.helpers.recipe_runs import compose_config
from tests.helpers.reference import assert_close_by_name

pytest.importorskip("transformers")

from bert_reduce.recipe.hf_esm import HFEsm2Model

TINY_SHAPE = HFEsm2ModelConfig(hidden_size=16, num_layers=1, num_heads=2, ffn_size=32)
TINY = ["model.hidden_size=16", "model.num_layers=1", "model.num_heads=2", "model.ffn_size=32"]


def make(*overrides: str) -> DictConfig:
    return compose_config("model=hf_esm2", *overrides)


def test_defaults_are_esm2_8m_and_typed() -> None:
    cfg = make()
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads) == (320, 6, 20)
    assert cfg.model.ffn_size == 1280 and cfg.model.pretrained_path is None
    with pytest.raises(ConfigCompositionException, match=r"model\.num_layers=six"):
        make("model.num_layers=six")
    with pytest.raises(ConfigCompositionException, match=r"model\.tie_embeddings"):
        make("model.tie_embeddings=false")  # the own model's key, not this one's


def test_instantiated_model_gives_sbv_logits_and_fused_head_inputs() -> None:
    torch.manual_seed(0)
    model = build_from_config(make(*TINY).model)
    assert isinstance(model, HFEsm2Model) and model.fused_head
    ids = torch.randint(4, 24, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    model.eval()
    logits = model(ids, mask)["token_logits"]
    assert logits.shape == (9, 3, 33)
    model.train()
    head = model(ids, mask)
    assert set(head) == {"hidden_states", "hidden_layout", "output_weight", "output_bias"}
    assert head["hidden_states"].shape == (3, 9, 16) and head["hidden_layout"] == "bs"
    assert head["output_weight"] is model.model.esm.embeddings.word_embeddings.weight  # tied
    recomputed = head["hidden_states"] @ head["output_weight"].T + head["output_bias"]
    torch.testing.assert_close(recomputed.transpose(0, 1), logits, rtol=1e-6, atol=1e-6)
    assert "token_logits" in model(ids, mask, logits=True)
    model.fused_head = False
    assert "token_logits" in model(ids, mask)


def test_pretrained_path_loads_a_local_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = HFEsm2Model(TINY_SHAPE)
    saved.model.save_pretrained(tmp_path)
    loaded = build_from_config(make(f"model.pretrained_path={tmp_path}").model)
    assert loaded.model.config.hidden_size == 16  # the checkpoint's shape, not the config's
    # In training mode, as a model built from a config (from_pretrained returns eval mode).
    assert all(module.training for module in loaded.modules())
    assert_close_by_name(loaded.state_dict(), saved.state_dict(), rtol=0, atol=0)


def test_clear_errors() -> None:
    with pytest.raises(FileNotFoundError, match=r"model\.pretrained_path='/nonexistent'"):
        HFEsm2Model(HFEsm2ModelConfig(pretrained_path="/nonexistent"))
    model = HFEsm2Model(TINY_SHAPE)
    ids = torch.randint(4, 24, (1, 8))
    with pytest.raises(ValueError, match=r"data\.pack_sequences=false"):
        model(ids, cu_seqlens=torch.tensor([0, 3, 8]))
