"""A small ESM-2-style protein language model: a pre-LayerNorm transformer encoder.

Like ESM-2: token embeddings without absolute positions, rotary position embeddings on the
queries and keys, pre-LN blocks with a GELU feed-forward, a final LayerNorm, and a
``dense -> GELU -> LayerNorm -> decoder`` language-model head whose decoder weight is tied to
the embeddings by default. Like Megatron, the output is ``{"token_logits": [s, b, v]}``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ESM2Model", "RotaryEmbedding"]


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

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate ``q`` and ``k`` (both ``[b, heads, s, head_dim]``) by their positions."""
        positions = torch.arange(q.size(-2), device=q.device, dtype=self.inv_freq.dtype)
        angles = torch.outer(positions, self.inv_freq)
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

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            self.qkv(x).view(batch, seq, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )
        q, k = self.rotary(q, k)
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=key_mask[:, None, None, :],
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

    def forward(self, x: Tensor, key_mask: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), key_mask))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class ESM2Model(nn.Module):
    """ESM-2-style masked-language model.

    Args:
        vocab_size: Number of tokens (33 for the ESM alphabet).
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Attention heads; must divide ``hidden_size``.
        ffn_size: Width of the feed-forward layer (ESM-2 uses ``4 * hidden_size``).
        dropout: Dropout on attention probabilities and on each block's residual branches.
        tie_embeddings: Share the LM decoder weight with the token embeddings (as ESM-2).
        pad_id: The ``<pad>`` id; its embedding row starts at zero.
        init_std: Standard deviation of the normal weight initialization.

    Raises:
        ValueError: If ``num_heads`` does not divide ``hidden_size``, or a size is not
            positive, or ``dropout`` is outside ``[0, 1)``.
    """

    def __init__(
        self,
        vocab_size: int = 33,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        ffn_size: int = 256,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        pad_id: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "ffn_size": ffn_size,
        }
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"model.{name} must be positive, got {value}.")
        if hidden_size % num_heads:
            raise ValueError(
                f"model.num_heads={num_heads} must divide model.hidden_size={hidden_size}."
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {dropout}.")
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_id)
        self.layers = nn.ModuleList(
            _Block(hidden_size, num_heads, ffn_size, dropout) for _ in range(num_layers)
        )
        self.final_norm = nn.LayerNorm(hidden_size)
        self.lm_dense = nn.Linear(hidden_size, hidden_size)
        self.lm_norm = nn.LayerNorm(hidden_size)
        self.lm_decoder = nn.Linear(hidden_size, vocab_size)
        self._init_weights(init_std, num_layers)
        if tie_embeddings:
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

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> dict[str, Tensor]:
        """Logits for every position.

        Args:
            input_ids: ``[b, s]`` int token ids.
            attention_mask: ``[b, s]``, true (non-zero) for real tokens and false for padding;
                padding is never attended to. All true when ``None``.

        Returns:
            ``{"token_logits": [s, b, v]}``, sequence first as in Megatron.

        Raises:
            ValueError: If ``input_ids`` is not ``[b, s]`` or the mask's shape differs.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [b, s], got shape {tuple(input_ids.shape)}.")
        if attention_mask is None:
            key_mask = torch.ones_like(input_ids, dtype=torch.bool)
        elif attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} must match input_ids "
                f"of shape {tuple(input_ids.shape)} ([b, s])."
            )
        else:
            key_mask = attention_mask.bool()
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x, key_mask)
        x = self.lm_norm(F.gelu(self.lm_dense(self.final_norm(x))))
        return {"token_logits": self.lm_decoder(x).transpose(0, 1)}
