"""Hugging Face ``EsmForMaskedLM`` as a recipe model: ``python train.py model=hf_esm2``.

The model is built from an ``EsmConfig`` (ESM-2 8M's shape by default) or loaded from a local
checkpoint directory (``save_pretrained``'s; nothing is downloaded). Its outputs are those of
the recipe's own :class:`~bert_reduce.recipe.model.ESM2Model` (the fused head's inputs from
:func:`bert_reduce.hf.lm_head_inputs`), so the same exact loss trains it.

Needs ``transformers`` (the ``hf`` extra); it is imported when the model is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from bert_reduce.hf.lm_head import lm_head_inputs
from bert_reduce.recipe.config import HFEsm2ModelConfig

__all__ = ["HFEsm2Model"]


class HFEsm2Model(nn.Module):
    """``transformers.EsmForMaskedLM`` behind the recipe's model interface.

    The defaults are :class:`~bert_reduce.recipe.config.HFEsm2ModelConfig`'s: ``HFEsm2Model()``
    is the model ``python train.py model=hf_esm2`` trains.

    Args:
        pretrained_path: A local Hugging Face checkpoint directory to load (its config gives
            the shape, the arguments below are then unused); ``None`` builds from them.
        vocab_size: Number of tokens (33: the ESM alphabet of the recipe's tokenizer).
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer layers.
        num_heads: Attention heads; must divide ``hidden_size``.
        ffn_size: Width of the feed-forward layer.
        max_position_embeddings: Longest input (ESM-2: 1026).
        dropout: Hidden and attention dropout.
        token_dropout: ESM-2's rescaling of embeddings by the fraction of masked tokens.
        pad_id: The ``<pad>`` id.
        mask_id: The ``<mask>`` id (used by ``token_dropout``).
        init_std: Standard deviation of the weight initialization.
        attn_implementation: ``"sdpa"`` or ``"eager"`` (Hugging Face's choices).
        fused_head: As :class:`~bert_reduce.recipe.model.ESM2Model`'s.

    Raises:
        FileNotFoundError: If ``pretrained_path`` is not a directory with a ``config.json``.
        ModuleNotFoundError: Without ``transformers`` (install the ``hf`` extra).
    """

    def __init__(
        self,
        pretrained_path: str | None = HFEsm2ModelConfig.pretrained_path,
        vocab_size: int = HFEsm2ModelConfig.vocab_size,
        hidden_size: int = HFEsm2ModelConfig.hidden_size,
        num_layers: int = HFEsm2ModelConfig.num_layers,
        num_heads: int = HFEsm2ModelConfig.num_heads,
        ffn_size: int = HFEsm2ModelConfig.ffn_size,
        max_position_embeddings: int = HFEsm2ModelConfig.max_position_embeddings,
        dropout: float = HFEsm2ModelConfig.dropout,
        token_dropout: bool = HFEsm2ModelConfig.token_dropout,
        pad_id: int = HFEsm2ModelConfig.pad_id,
        mask_id: int = HFEsm2ModelConfig.mask_id,
        init_std: float = HFEsm2ModelConfig.init_std,
        attn_implementation: str = HFEsm2ModelConfig.attn_implementation,
        fused_head: bool = HFEsm2ModelConfig.fused_head,
    ) -> None:
        super().__init__()
        try:
            from transformers import EsmConfig, EsmForMaskedLM
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                "model=hf_esm2 needs Hugging Face transformers: pip install 'bert_reduce[hf]'."
            ) from error
        if pretrained_path is not None:
            if not (Path(pretrained_path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"model.pretrained_path={pretrained_path!r} is not a Hugging Face checkpoint "
                    "directory (no config.json); save one with model.save_pretrained(DIR)."
                )
            self.model = EsmForMaskedLM.from_pretrained(
                pretrained_path, local_files_only=True, attn_implementation=attn_implementation
            )
            # from_pretrained returns the model in eval mode; Lightning keeps a module's modes,
            # so it would train without dropout. A module starts in training mode.
            self.model.train()
        else:
            config = EsmConfig(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                intermediate_size=ffn_size,
                max_position_embeddings=max_position_embeddings,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                position_embedding_type="rotary",
                emb_layer_norm_before=False,
                token_dropout=token_dropout,
                pad_token_id=pad_id,
                mask_token_id=mask_id,
                initializer_range=init_std,
                tie_word_embeddings=True,
            )
            config._attn_implementation = attn_implementation
            self.model = EsmForMaskedLM(config)
        # The contact-prediction head is not on the masked-LM path: it never gets a gradient,
        # which DDP would refuse as unused parameters.
        self.model.esm.contact_head.requires_grad_(False)
        self.fused_head = fused_head

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        cu_seqlens_padded: Tensor | None = None,
        logits: bool | None = None,
    ) -> dict[str, Any]:
        """:meth:`ESM2Model.forward <bert_reduce.recipe.model.ESM2Model.forward>` of a padded batch.

        Packed rows (``cu_seqlens``, ``cu_seqlens_padded``) are refused: Hugging Face's ESM has
        no variable-length attention on CPU.

        Raises:
            ValueError: On a packed batch.
        """
        if cu_seqlens is not None or cu_seqlens_padded is not None:
            raise ValueError(
                "model=hf_esm2 takes padded [b, s] batches, not packed rows: set "
                "data.pack_sequences=false."
            )
        if logits is None:
            logits = not (self.training and self.fused_head)
        if logits:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            return {"token_logits": out.transpose(0, 1)}
        return lm_head_inputs(self.model, input_ids=input_ids, attention_mask=attention_mask)
