from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bert_reduce.recipe.config import ModelConfig
from bert_reduce.recipe.model import ESM2Model, RotaryEmbedding

SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, ffn_size=64)


def test_output_layout_tied_head_and_fused_head_outputs_in_training_only() -> None:
    model = ESM2Model(SMALL)
    ids = torch.randint(4, 24, (3, 7))
    logits = model(ids, logits=True)["token_logits"]
    assert logits.shape == (7, 3, 33)
    assert model.lm_decoder.weight is model.embed_tokens.weight
    untied = ESM2Model(replace(SMALL, tie_embeddings=False))
    assert untied.lm_decoder.weight is not untied.embed_tokens.weight
    names = {name for name, _ in model.named_parameters()}
    assert "lm_decoder.weight" not in names  # tied: one parameter, counted once
    fused = model(ids)
    assert set(fused) == {"hidden_states", "hidden_layout", "output_weight", "output_bias"}
    assert fused["hidden_layout"] == "bs" and fused["hidden_states"].shape == (3, 7, 32)
    # The loss and gradients of these outputs are the logits': test_module.py.
    assert fused["output_weight"] is model.embed_tokens.weight
    assert set(model.eval()(ids)) == {"token_logits"}
    assert set(ESM2Model(replace(SMALL, fused_head=False))(ids)) == {"token_logits"}


def test_padding_does_not_change_real_positions() -> None:
    model = ESM2Model(SMALL).double().eval()
    ids = torch.randint(4, 24, (2, 9))
    ids[1, 5:] = 1
    mask = ids != 1
    batched = model(ids, mask)["token_logits"]
    alone = model(ids[1:, :5], mask[1:, :5])["token_logits"]
    torch.testing.assert_close(batched[:5, 1], alone[:, 0], rtol=1e-12, atol=1e-12)
    # Without the mask the padding would be attended to: the check above can fail.
    unmasked = model(ids, None)["token_logits"]
    assert not torch.allclose(unmasked[:5, 1], alone[:, 0])


def test_rotary_scores_depend_on_relative_position_only() -> None:
    rotary = RotaryEmbedding(8).double()
    q_vec, k_vec = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    length = 12
    q = q_vec.expand(1, 1, length, 8)
    k = k_vec.expand(1, 1, length, 8)
    rq, rk = rotary(q, k)
    scores = rq[0, 0] @ rk[0, 0].T  # scores[i, j] = <R_i q, R_j k>
    for offset in range(-3, 4):
        diagonal = torch.diagonal(scores, offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal))
    assert not torch.allclose(torch.diagonal(scores, 0)[:1], torch.diagonal(scores, 2)[:1])


def test_dropout_only_in_training() -> None:
    model = ESM2Model(replace(SMALL, dropout=0.5))
    ids = torch.randint(4, 24, (2, 6))
    model.eval()
    torch.testing.assert_close(model(ids)["token_logits"], model(ids)["token_logits"])
    model.train()
    first, second = (model(ids, logits=True)["token_logits"] for _ in range(2))
    assert not torch.allclose(first, second)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 30, "num_heads": 4}, "num_heads=4 must divide model.hidden_size=30"),
        ({"num_layers": 0}, "model.num_layers must be positive"),
        ({"dropout": 1.0}, r"model.dropout must be in \[0, 1\)"),
    ],
)
def test_bad_sizes_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ESM2Model(ModelConfig(**kwargs))


def test_input_shape_errors() -> None:
    model = ESM2Model(SMALL)
    with pytest.raises(ValueError, match=r"input_ids must be \[b, s\]"):
        model(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 4\)"):
        model(torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("pad_to_multiple_of", [1, 4])
def test_packed_row_equals_padded_batch(pad_to_multiple_of: int) -> None:
    from bert_reduce.packing import pack_batch

    model = ESM2Model(SMALL).double().eval()
    lengths = [5, 9, 2, 7]
    ids = torch.randint(4, 24, (4, 9))
    mask = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]
    ids[~mask] = 1
    padded = model(ids, mask)["token_logits"]  # [s, b, v]
    packed = pack_batch(
        {"input_ids": ids, "attention_mask": mask}, pad_to_multiple_of=pad_to_multiple_of
    )
    out = model(
        packed["input_ids"],
        cu_seqlens=packed["cu_seqlens"],
        cu_seqlens_padded=packed["cu_seqlens_padded"],
    )["token_logits"]
    assert out.shape[1] == 1
    starts = packed["cu_seqlens_padded"].tolist()
    for row, length in enumerate(lengths):
        torch.testing.assert_close(
            out[starts[row] : starts[row] + length, 0], padded[:length, row], rtol=1e-12, atol=1e-12
        )
    assert torch.isfinite(out).all()
    # Without the boundaries, the row is one long sequence: the check above can fail.
    merged = model(packed["input_ids"])["token_logits"]
    assert not torch.allclose(merged[: lengths[0], 0], padded[: lengths[0], 0])
