"""Structured configs of ``train.py``: typed dataclasses registered in Hydra's ConfigStore.

``conf/config.yaml`` and each group's YAML start from these schemas (:func:`register_configs`),
so every value is type-checked when the config is composed. Each node with a ``_target_`` is
built with ``hydra.utils.instantiate``, except the model and the data, whose ``_target_``
class takes the node itself as one typed config (``ESM2Model()`` is ``python train.py``'s).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from bert_reduce.engine import LossOptions
from bert_reduce.normalization import Normalization


@dataclass
class ModelConfig:
    """The shape and options of :class:`bert_reduce.recipe.model.ESM2Model`.

    Attributes:
        vocab_size: Number of tokens (33 for the ESM alphabet).
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Attention heads; must divide ``hidden_size``.
        ffn_size: Width of the feed-forward layer (ESM-2 uses ``4 * hidden_size``).
        dropout: Dropout on attention probabilities and on each block's residual branches.
        tie_embeddings: Share the LM decoder weight with the token embeddings (as ESM-2).
        pad_id: The ``<pad>`` id; its embedding row starts at zero.
        init_std: Standard deviation of the normal weight initialization.
        fused_head: Return the decoder's inputs in training mode, for the loss's masked-only
            fused head (:meth:`~bert_reduce.recipe.model.ESM2Model.forward`'s ``logits``).
    """

    _target_: str = "bert_reduce.recipe.model.ESM2Model"
    vocab_size: int = 33
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_size: int = 256
    dropout: float = 0.1
    tie_embeddings: bool = True
    pad_id: int = 1
    init_std: float = 0.02
    fused_head: bool = True


@dataclass
class HFEsm2ModelConfig:
    """:class:`bert_reduce.recipe.hf_esm.HFEsm2Model`, ESM-2 8M's shape by default.

    Attributes:
        pretrained_path: A local Hugging Face checkpoint directory to load (its config gives
            the shape, the sizes below are then unused); ``None`` builds from them.
        vocab_size, hidden_size, num_layers, num_heads, ffn_size, pad_id, init_std,
            fused_head: As :class:`ModelConfig`'s.
        max_position_embeddings: Longest input (ESM-2: 1026).
        dropout: Hidden and attention dropout.
        token_dropout: ESM-2's rescaling of embeddings by the fraction of masked tokens.
        mask_id: The ``<mask>`` id (used by ``token_dropout``).
        attn_implementation: ``"sdpa"`` or ``"eager"`` (Hugging Face's choices).
    """

    _target_: str = "bert_reduce.recipe.hf_esm.HFEsm2Model"
    pretrained_path: str | None = None
    vocab_size: int = 33
    hidden_size: int = 320
    num_layers: int = 6
    num_heads: int = 20
    ffn_size: int = 1280
    max_position_embeddings: int = 1026
    dropout: float = 0.0
    token_dropout: bool = True
    pad_id: int = 1
    mask_id: int = 32
    init_std: float = 0.02
    attn_implementation: str = "sdpa"
    fused_head: bool = True


@dataclass
class DataConfig:
    """The data of :class:`bert_reduce.recipe.datamodule.ESMDataModule`.

    Attributes:
        global_batch_size: Samples per optimizer step over all ranks.
        micro_batch_size: Samples per forward pass on one rank; ``global_batch_size`` must be
            a multiple of ``micro_batch_size`` times the number of ranks.
        val_micro_batch_size: Samples per validation batch (``micro_batch_size`` when
            ``None``).
        max_length: Most tokens per sample, ``<cls>`` and ``<eos>`` included; longer
            sequences are cropped to a random window.
        mask_prob: BERT selection probability (80% ``<mask>``, 10% random, 10% kept).
        seed: Seed of the shuffling, crops and masks (``conf/data/default.yaml``: the run's).
        train_path: FASTA/CSV/TSV/Parquet file of training sequences; ``None`` uses the
            built-in synthetic corpus.
        val_path: File of validation sequences; ``None`` holds out ``val_fraction`` of
            ``train_path`` (or makes a separate synthetic set).
        column: Column of the sequences in CSV/TSV/Parquet files.
        val_fraction: Share of ``train_path`` held out when there is no ``val_path``.
        num_train_sequences: Size of the synthetic training corpus.
        num_val_sequences: Size of the synthetic validation set.
        corpus_seed: Seed of the synthetic corpus.
        shuffle: Draw a new order of the training set every epoch.
        pad_to_multiple_of: Round padded lengths up to a multiple of this.
        num_workers: DataLoader worker processes.
        pack_sequences: Pack each training micro-batch into one row without padding
            (:class:`~bert_reduce.recipe.data.PackedMicroBatchCollator`); validation stays
            padded. Same losses as unpacked, less compute on padding.
    """

    _target_: str = "bert_reduce.recipe.datamodule.ESMDataModule"
    global_batch_size: int = 32
    micro_batch_size: int = 8
    val_micro_batch_size: int | None = None
    max_length: int = 128
    mask_prob: float = 0.15
    seed: int = 0
    train_path: str | None = None
    val_path: str | None = None
    column: str = "sequence"
    val_fraction: float = 0.05
    num_train_sequences: int = 20_000
    num_val_sequences: int = 1_003
    corpus_seed: int = 0
    shuffle: bool = True
    pad_to_multiple_of: int = 1
    num_workers: int = 0
    pack_sequences: bool = False


# The config's names of the Normalization modes, built from that enum so that the modes are
# written once. A structured config cannot hold Normalization itself: OmegaConf reads an enum
# override by member *name* (`Normalization["per_sequence"]` fails; the name is PER_SEQUENCE)
# and writes the name to config.yaml, so `loss.normalization=per_sequence` would be refused.
NormalizationName = Enum(  # type: ignore[misc]
    "NormalizationName",
    [(mode.value, mode.value) for mode in Normalization],
    type=str,
    module=__name__,
)
NormalizationName.__doc__ = (
    "The loss normalizations of :class:`bert_reduce.normalization.Normalization`, named by "
    "their values (``per_token``, ...), as the config and the command line write them."
)


@dataclass
class LossConfig:
    """The training loss, :class:`bert_reduce.BERTMLMLossWithReduction`, and its options.

    The fields are :class:`bert_reduce.LossOptions`' (same names, same defaults, checked
    there). Validation always reports the per-token mean (``val_loss``, ``val_ppl``).
    """

    _target_: str = "bert_reduce.BERTMLMLossWithReduction"
    normalization: NormalizationName = NormalizationName.per_token  # type: ignore[valid-type]
    constant_per_sequence: int | None = LossOptions.constant_per_sequence
    weight_resolution: int | None = LossOptions.weight_resolution
    # "all", "nonzero", a row count or a fraction: a union OmegaConf cannot type.
    capacity: Any = LossOptions.capacity
    cross_entropy: str = LossOptions.cross_entropy
    ignore_index: int | None = LossOptions.ignore_index


@dataclass
class OptimizerConfig:
    """A ``torch.optim`` optimizer, built later on the parameters (``_partial_``)."""

    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 2e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class SchedulerConfig:
    """:func:`bert_reduce.recipe.optim.warmup_cosine_schedule`, built on the optimizer."""

    _target_: str = "bert_reduce.recipe.optim.warmup_cosine_schedule"
    _partial_: bool = True
    warmup_steps: int = 20
    total_steps: int = "${trainer.max_steps}"  # type: ignore[assignment]
    min_lr_ratio: float = 0.1


@dataclass
class OptimConfig:
    """Optimizer, learning-rate schedule (``null`` for a constant rate) and clipping."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig | None = field(default_factory=SchedulerConfig)
    gradient_clip_val: float | None = 1.0


@dataclass
class TrainerConfig:
    """``lightning.pytorch.Trainer``; ``precision: auto``: see ``build.resolve_precision``."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    strategy: str = "auto"
    precision: str = "auto"
    max_steps: int = 400
    max_epochs: int = -1
    val_check_interval: int = 100
    check_val_every_n_epoch: int | None = None
    log_every_n_steps: int = 1
    num_sanity_val_steps: int = 2
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    use_distributed_sampler: bool = False
    deterministic: bool = False


@dataclass
class CheckpointConfig:
    """:class:`bert_reduce.recipe.callbacks.RunCheckpoint`; see its arguments."""

    _target_: str = "bert_reduce.recipe.callbacks.RunCheckpoint"
    dirpath: str | None = None
    filename: str = "step{step:06d}"
    every_n_train_steps: int = 100
    keep_last: int | None = None
    save_last: bool = True


@dataclass
class ValidationPerplexityConfig:
    """:class:`bert_reduce.lightning.ValidationPerplexityCallback` (``val_loss``, ``val_ppl``)."""

    _target_: str = "bert_reduce.lightning.ValidationPerplexityCallback"
    loss_key: str = "val_loss"
    ppl_key: str = "val_ppl"
    prog_bar: bool = True


@dataclass
class ProgressBarConfig:
    """``TQDMProgressBar``."""

    _target_: str = "lightning.pytorch.callbacks.TQDMProgressBar"
    refresh_rate: int = 10


@dataclass
class CallbacksConfig:
    """The Trainer's callbacks; set one to ``null`` to drop it."""

    checkpoint: CheckpointConfig | None = field(default_factory=CheckpointConfig)
    val_perplexity: ValidationPerplexityConfig | None = field(
        default_factory=ValidationPerplexityConfig
    )
    progress_bar: ProgressBarConfig | None = field(default_factory=ProgressBarConfig)


@dataclass
class TrainConfig:
    """The whole run.

    Attributes:
        seed: Seeds the model initialization, data order, crops and masks.
        resume: ``auto`` (continue the run directory's run, or start it) or a checkpoint
            file; docs/recipe.md, "Resume".
        overwrite: Allow a new run in a run directory that holds another run, deleting that
            run's outputs; docs/recipe.md, "The run directory".
        validate_at_end: Validate after training unless the last step was just validated.
        tensorboard: Also log to TensorBoard when it is installed.
        plot: Write ``curves.png`` at the end.
        cpu_threads: PyTorch threads per process when no GPU is present (``null``: PyTorch's
            default). Small models run fastest on one thread, and on a busy machine more
            threads than free cores slow training down many times over.
    """

    # Any: the model group's schema (base_model or base_hf_esm2_model) types it.
    model: Any = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)
    seed: int = 0
    resume: str | None = None
    overwrite: bool = False
    validate_at_end: bool = True
    tensorboard: bool = True
    plot: bool = True
    cpu_threads: int | None = 1


def register_configs() -> None:
    """Store ``base_config``, each group's ``base_<group>`` schema and ``base_hf_esm2_model``."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=TrainConfig)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="model", name="base_hf_esm2_model", node=HFEsm2ModelConfig)
    for group in dataclasses.fields(TrainConfig):  # the other groups: data, loss, ...
        if group.default_factory is not dataclasses.MISSING:
            store.store(group=group.name, name=f"base_{group.name}", node=group.default_factory)
