"""A small ESM-2-style protein language model: a pre-LayerNorm transformer encoder.

Like ESM-2: no absolute positions, rotary embeddings on queries and keys, pre-LN GELU blocks,
a final LayerNorm and a ``dense -> GELU -> LayerNorm -> decoder`` head, tied by default.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bert_reduce.forward_output import (
    HIDDEN_LAYOUT_KEY,
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
)
from bert_reduce.recipe.config import ModelConfig


class RotaryEmbedding(nn.Module):
    """Rotary position embeddings (RoFormer), applied to ``[b, heads, s, head_dim]`` tensors.

    Args:
        head_dim: Size of one attention head; must be even.
        base: The frequency base (10000 in ESM-2).

    Raises:
        ValueError: If ``head_dim`` is odd.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"Rotary embeddings need an even head_dim, got {head_dim}.")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` and ``k`` (both ``[b, heads, s, head_dim]``) by their positions.

        Args:
            q: Queries.
            k: Keys.
            positions: ``[s]`` integer positions; ``0 .. s - 1`` when ``None``.

        Returns:
            The rotated ``(q, k)``.
        """
        if positions is None:
            positions = torch.arange(q.size(-2), device=q.device)
        angles = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class _SelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        self.rotary = RotaryEmbedding(self.head_dim)
        self.dropout = dropout

    def forward(self, x: Tensor, attn_mask: Tensor, positions: Tensor | None) -> Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            self.qkv(x).view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )
        q, k = self.rotary(q, k, positions)
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.out(attended.transpose(1, 2).reshape(batch, seq, hidden))


class _Block(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, ffn_size: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn = _SelfAttention(hidden_size, num_heads, dropout)
        self.ffn_norm = nn.LayerNorm(hidden_size)
        self.ffn = nn.Sequential(
            nn.Linear(hidden_size, ffn_size), nn.GELU(), nn.Linear(ffn_size, hidden_size)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, attn_mask: Tensor, positions: Tensor | None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), attn_mask, positions))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class ESM2Model(nn.Module):
    """ESM-2-style masked-language model.

    Args:
        config: Its shape and options; ``None``: :class:`~bert_reduce.recipe.config.ModelConfig`'s
            defaults, the model ``python train.py`` trains.

    Raises:
        ValueError: If ``num_heads`` does not divide ``hidden_size``, or a size is not
            positive, or ``dropout`` is outside ``[0, 1)``.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        c = config or ModelConfig()
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size"):
            if getattr(c, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(c, name)}.")
        if c.hidden_size % c.num_heads:
            raise ValueError(
                f"model.num_heads={c.num_heads} must divide model.hidden_size={c.hidden_size}."
            )
        if not 0.0 <= c.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {c.dropout}.")
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_id)
        self.layers = nn.ModuleList(
            _Block(c.hidden_size, c.num_heads, c.ffn_size, c.dropout) for _ in range(c.num_layers)
        )
        self.final_norm = nn.LayerNorm(c.hidden_size)
        self.lm_dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.lm_norm = nn.LayerNorm(c.hidden_size)
        self.lm_decoder = nn.Linear(c.hidden_size, c.vocab_size)
        self.fused_head = c.fused_head
        self._init_weights(c.init_std, c.num_layers)
        if c.tie_embeddings:
            self.lm_decoder.weight = self.embed_tokens.weight

    def _init_weights(self, std: float, num_layers: int) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        # Residual branches scaled by depth (GPT-2) keep the stream's variance steady.
        for block in self.layers:
            nn.init.normal_(block.attn.out.weight, std=std / math.sqrt(2 * num_layers))
            nn.init.normal_(block.ffn[2].weight, std=std / math.sqrt(2 * num_layers))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        cu_seqlens_padded: Tensor | None = None,
        *,
        logits: bool | None = None,
    ) -> dict[str, Tensor | str]:
        """Logits (or the decoder's inputs) of a padded ``[b, s]`` batch or a packed ``[1, T]`` row.

        Args:
            input_ids: ``[b, s]`` int token ids, or ``[1, T]`` packed sequences.
            attention_mask: ``[b, s]``, true (non-zero) for real tokens and false for padding;
                padding is never attended to. All true when ``None``. Not used when packed.
            cu_seqlens: ``[n + 1]`` boundaries of the ``n`` real sequences packed in the row
                (as :func:`bert_reduce.pack_batch` returns them): each token attends only to
                its own sequence, and rotary positions restart at 0 with every sequence.
            cu_seqlens_padded: ``[n + 1]`` where each sequence starts in the row when they are
                padded (``cu_seqlens`` when ``None``); padding slots are never attended to.
            logits: Return ``token_logits`` (``True``) or the decoder's inputs (``False``);
                ``None``: the inputs in training mode with ``fused_head``, else the logits.

        Returns:
            ``{"token_logits": [s, b, v]}``, sequence first as in Megatron (``[T, 1, v]``
            when packed); or ``{"hidden_states": [b, s, h], "hidden_layout": "bs",
            "output_weight": [v, h], "output_bias": [v]}``, whose ``F.linear`` gives them.

        Raises:
            ValueError: If ``input_ids`` is not ``[b, s]``, the mask's shape differs, or a
                packed row has ``b != 1``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [b, s], got shape {tuple(input_ids.shape)}.")
        positions = None
        if cu_seqlens is not None:
            if input_ids.size(0) != 1:
                raise ValueError(
                    f"Packed input_ids must be one [1, T] row, got shape {tuple(input_ids.shape)}."
                )
            attn_mask, positions = _packed_attention(
                input_ids.size(1), cu_seqlens, cu_seqlens_padded
            )
        elif attention_mask is None:
            attn_mask = torch.ones_like(input_ids, dtype=torch.bool)[:, None, None, :]
        elif attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} must match input_ids "
                f"of shape {tuple(input_ids.shape)} ([b, s])."
            )
        else:
            attn_mask = attention_mask.bool()[:, None, None, :]
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x, attn_mask, positions)
        x = self.lm_norm(F.gelu(self.lm_dense(self.final_norm(x))))
        if logits is None:
            logits = not (self.training and self.fused_head)
        if logits:
            return {"token_logits": self.lm_decoder(x).transpose(0, 1)}
        # [b, s, h] as computed: the loss reads it in this layout without a copy.
        return {
            HIDDEN_STATES_KEY: x,
            HIDDEN_LAYOUT_KEY: "bs",
            OUTPUT_WEIGHT_KEY: self.lm_decoder.weight,
            OUTPUT_BIAS_KEY: self.lm_decoder.bias,
        }


def _packed_attention(
    total: int, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Block-diagonal ``[1, 1, T, T]`` attention mask and ``[T]`` positions of a packed row."""
    starts = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    starts, cu_seqlens = starts.long(), cu_seqlens.long()
    num_sequences = starts.numel() - 1
    token = torch.arange(total, device=starts.device)
    sequence = torch.searchsorted(starts[1:].contiguous(), token, right=True)
    clamped = sequence.clamp(max=num_sequences - 1)
    position = token - starts[clamped]
    real = (sequence < num_sequences) & (position < cu_seqlens.diff()[clamped])
    mask = (sequence[:, None] == sequence[None, :]) & real[None, :]
    # A padding slot past the last sequence has no key of its own: let it see itself rather
    # than give attention a row of -inf (NaN); its output is never scored.
    mask |= torch.eye(total, dtype=torch.bool, device=mask.device)
    return mask[None, None], position
