"""Hugging Face ``EsmForMaskedLM`` as a recipe model: ``python train.py model=hf_esm2``.

Its outputs are :class:`~bert_reduce.recipe.model.ESM2Model`'s (docs/pytorch_loop.md, "The
recipe with a Hugging Face ESM model"). Needs the ``hf`` extra, imported when it is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from bert_reduce.hf.lm_head import lm_head_inputs
from bert_reduce.recipe.config import HFEsm2ModelConfig


class HFEsm2Model(nn.Module):
    """``transformers.EsmForMaskedLM`` behind the recipe's model interface.

    Args:
        config: Its shape (or checkpoint) and options; ``None``:
            :class:`~bert_reduce.recipe.config.HFEsm2ModelConfig`'s defaults, the model
            ``python train.py model=hf_esm2`` trains.

    Raises:
        FileNotFoundError: If ``pretrained_path`` is not a directory with a ``config.json``.
        ModuleNotFoundError: Without ``transformers`` (install the ``hf`` extra).
    """

    def __init__(self, config: HFEsm2ModelConfig | None = None) -> None:
        super().__init__()
        c = config or HFEsm2ModelConfig()
        try:
            from transformers import EsmConfig, EsmForMaskedLM
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                "model=hf_esm2 needs Hugging Face transformers: pip install 'bert_reduce[hf]'."
            ) from error
        if c.pretrained_path is not None:
            if not (Path(c.pretrained_path) / "config.json").is_file():
                raise FileNotFoundError(
                    f"model.pretrained_path={c.pretrained_path!r} is not a Hugging Face "
                    "checkpoint directory (no config.json); save one with "
                    "model.save_pretrained(DIR)."
                )
            self.model = EsmForMaskedLM.from_pretrained(
                c.pretrained_path, local_files_only=True, attn_implementation=c.attn_implementation
            )
            # from_pretrained returns the model in eval mode; Lightning keeps a module's modes,
            # so it would train without dropout. A module starts in training mode.
            self.model.train()
        else:
            hf_config = EsmConfig(
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads,
                intermediate_size=c.ffn_size,
                max_position_embeddings=c.max_position_embeddings,
                hidden_dropout_prob=c.dropout,
                attention_probs_dropout_prob=c.dropout,
                position_embedding_type="rotary",
                emb_layer_norm_before=False,
                token_dropout=c.token_dropout,
                pad_token_id=c.pad_id,
                mask_token_id=c.mask_id,
                initializer_range=c.init_std,
                tie_word_embeddings=True,
            )
            # transformers reads the attention kernel from this field (no public setter).
            hf_config._attn_implementation = c.attn_implementation  # noqa: SLF001
            self.model = EsmForMaskedLM(hf_config)
        # The contact-prediction head is not on the masked-LM path: it never gets a gradient,
        # which DDP would refuse as unused parameters.
        self.model.esm.contact_head.requires_grad_(False)
        self.fused_head = c.fused_head

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
