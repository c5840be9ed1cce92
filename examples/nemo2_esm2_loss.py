"""Using bert_reduce's loss in NeMo 2: an ESM-2-style LightningModule as NeMo drives it.

NeMo 2 (``nemo.lightning.MegatronStrategy``) wraps the LightningModule in
``nemo.lightning.megatron_parallel.MegatronParallel``, which runs Megatron-Core's
forward-backward schedule. For every micro-batch it calls, on the module:

1. ``data_step(dataloader_iter)``: fetch the micro-batch and keep this rank's
   context-parallel shard of it (:func:`mlm_data_step`);
2. ``training_step(batch)`` (``validation_step`` in validation): the forward pass, returning
   ``{"token_logits": [s, b, v]}`` (:func:`mlm_forward_step`);
3. ``training_loss_reduction()`` (``validation_loss_reduction()``): a *fresh*
   :class:`~bert_reduce.BERTMLMLossWithReduction` whose ``setup(batch)`` and
   ``forward(forward_out)`` give Megatron ``(loss_sum, num_tokens, report)``;

and, once all micro-batches are in, yet another fresh loss object's ``reduce(reports)`` for
the logged loss. No state survives between these objects, and none is needed.

The Megatron flags that make the gradient that of the exact global mean over masked tokens:

* ``TransformerConfig(calculate_per_token_loss=True)``: the schedule back-propagates each
  micro-batch's ``loss_sum``, sums ``num_tokens``, and ``finalize_model_grads`` divides the
  gradients once by the token count all-reduced over data x context ranks;
* ``DistributedDataParallelConfig(average_in_collective=False)``: gradients are summed, not
  averaged, over data-parallel ranks (Megatron asserts this with per-token losses);
* ``finalize_model_grads_func``: set by NeMo's ``MegatronOptimizerModule``.

:func:`nemo_trainer` builds the trainer (on a GPU machine); ``tests/nemo/`` drives
:class:`MLMLightningModule` through ``MegatronParallel`` on CPU, and ``tests/nemo/test_fit.py``
runs real ``nl.Trainer`` fits (``examples/nemo2_recipe.py`` is the recipe form).
:class:`TokenMLP` is a per-token stand-in for ESM-2's Megatron BERT encoder, so that a
context-parallel shard of the sequence gives exactly the logits of the full sequence there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import move_data_to_device
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn
from typing_extensions import override

from bert_reduce import BERTMLMLossWithReduction, get_batch_on_this_cp_rank

__all__ = [
    "MLMLightningModule",
    "TokenMLP",
    "mlm_config",
    "mlm_data_step",
    "mlm_ddp_config",
    "mlm_forward_step",
    "nemo_trainer",
]


def mlm_config(**overrides: Any) -> TransformerConfig:
    """A Megatron config with the flags the exact per-token reduction needs.

    Args:
        **overrides: Any ``TransformerConfig`` field (model sizes, parallel sizes, ...).

    Returns:
        The config, with ``calculate_per_token_loss=True`` unless overridden.
    """
    fields: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "calculate_per_token_loss": True,
    }
    fields.update(overrides)
    return TransformerConfig(**fields)


def mlm_ddp_config(**overrides: Any) -> DistributedDataParallelConfig:
    """Megatron DDP settings for per-token losses: gradients summed over DP ranks, not averaged."""
    return DistributedDataParallelConfig(**{"average_in_collective": False, **overrides})


def mlm_data_step(dataloader_iter: Iterator[Any], device: torch.device | None = None) -> dict:
    """The next micro-batch, cut to this context-parallel rank's shard, on ``device``.

    Sliced on the host, then moved: a ``num_scored`` count (``NumScoredCollator``) becomes
    this shard's, with no device sync, and no transfer touches it.

    Args:
        dataloader_iter: Yields ``[b, s]`` batches (``text``, ``labels``, ``loss_mask``, ...),
            or NeMo's ``(batch, batch_idx, dataloader_idx)`` triples.
        device: Where the model lives; the batch stays where it is when ``None``.

    Returns:
        A new dict with every ``[b, s]`` tensor sliced along ``s`` into Megatron's
        load-balanced ``2 * cp`` chunks (unchanged without context parallelism).
    """
    batch = next(dataloader_iter)
    if isinstance(batch, tuple) and len(batch) == 3:
        batch = batch[0]
    batch = get_batch_on_this_cp_rank(batch)
    if device is not None:
        batch = move_data_to_device(batch, device)
    return batch


def mlm_forward_step(model: pl.LightningModule, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The model's outputs for one micro-batch: ``{"token_logits": [s, b, v]}``."""
    return model(batch["text"])


class TokenMLP(MegatronModule):
    """Embedding, one MLP block and a vocabulary projection, applied to each token alone.

    Args:
        config: The Megatron config (``hidden_size`` is used).
        vocab_size: Number of token ids.
    """

    def __init__(self, config: TransformerConfig, vocab_size: int) -> None:
        super().__init__(config)
        # Megatron's schedules look the model type up on the model.
        self.model_type = ModelType.encoder_or_decoder
        hidden = config.hidden_size
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )
        self.output_layer = nn.Linear(hidden, vocab_size)

    def set_input_tensor(self, input_tensor: list[Tensor | None]) -> None:
        """Megatron's pipeline hook; this model is a single stage, so its input is the batch.

        Raises:
            NotImplementedError: If a previous pipeline stage sent an activation.
        """
        if any(tensor is not None for tensor in input_tensor):
            raise NotImplementedError("TokenMLP does not support pipeline parallelism.")

    def forward(self, text: Tensor) -> dict[str, Tensor]:
        """Logits for ``[b, s]`` token ids, in Megatron's ``[s, b, v]`` layout."""
        hidden = self.embedding(text.transpose(0, 1))
        hidden = hidden + self.mlp(hidden)
        return {"token_logits": self.output_layer(hidden)}


class MLMLightningModule(pl.LightningModule):
    """The hooks NeMo 2's ``MegatronParallel`` calls, with bert_reduce's loss.

    Mirrors BioNeMo's ``BioBertLightningModule``: the loss reductions are *methods* that return
    a new object per call (NeMo calls them once per micro-batch and once more for ``reduce``).

    Args:
        config: Megatron config; keep ``calculate_per_token_loss=True`` (see :func:`mlm_config`).
        vocab_size: Number of token ids.
        val_drop_last: Passed to the validation loss; the reduction is exact either way.
    """

    def __init__(
        self, config: TransformerConfig, vocab_size: int, val_drop_last: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.val_drop_last = val_drop_last
        self.module: TokenMLP | None = None

    @override
    def configure_model(self) -> None:
        """Build the network; NeMo's strategy calls this once the parallel state is set up."""
        if self.module is None:
            self.module = TokenMLP(self.config, self.vocab_size)

    @override
    def forward(self, text: Tensor) -> dict[str, Tensor]:
        """Logits ``{"token_logits": [s, b, v]}`` for ``[b, s]`` token ids."""
        if self.module is None:
            raise RuntimeError("Call configure_model() (NeMo's strategy does) before forward.")
        return self.module(text)

    def data_step(self, dataloader_iter: Iterator[Any]) -> dict:
        """See :func:`mlm_data_step`; the batch goes where the parameters are."""
        return mlm_data_step(dataloader_iter, next(self.parameters()).device)

    def forward_step(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """See :func:`mlm_forward_step`."""
        return mlm_forward_step(self, batch)

    @override
    def training_step(
        self, batch: Mapping[str, Tensor], batch_idx: int | None = None
    ) -> dict[str, Tensor]:
        """NeMo calls this per micro-batch on the last pipeline stage: the forward pass."""
        return self.forward_step(batch)

    @override
    def validation_step(
        self, batch: Mapping[str, Tensor], batch_idx: int | None = None
    ) -> dict[str, Tensor]:
        """As :meth:`training_step`, in validation."""
        return self.forward_step(batch)

    def training_loss_reduction(self) -> BERTMLMLossWithReduction:
        """A new training loss; nothing is retained for downstream metrics."""
        return BERTMLMLossWithReduction()

    def validation_loss_reduction(self) -> BERTMLMLossWithReduction:
        """A new validation loss; its reports hold ``(loss_sum, num_tokens)`` only."""
        return BERTMLMLossWithReduction(validation_step=True, val_drop_last=self.val_drop_last)


def nemo_trainer(
    devices: int = 1,
    context_parallel_size: int = 1,
    max_steps: int = 100,
    accelerator: str = "gpu",
) -> pl.Trainer:
    """A NeMo 2 trainer set up for the exact per-token reduction (GPU; NeMo needs CUDA).

    Train with ``trainer.fit(MLMLightningModule(mlm_config(), vocab_size=33), datamodule)``
    and an optimizer from ``nemo.lightning.MegatronOptimizerModule`` (which installs
    Megatron's ``finalize_model_grads``).

    Args:
        devices: GPUs per node.
        context_parallel_size: Sequence shards; ``mlm_data_step`` slices batches to match.
        max_steps: Optimizer steps.
        accelerator: Lightning accelerator name.

    Returns:
        A ``nemo.lightning.Trainer`` with a ``MegatronStrategy`` whose DDP sums gradients.
    """
    from nemo import lightning as nl

    strategy = nl.MegatronStrategy(
        context_parallel_size=context_parallel_size, ddp=mlm_ddp_config()
    )
    return nl.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_steps=max_steps
    )
