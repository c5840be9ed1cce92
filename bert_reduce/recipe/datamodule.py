"""The recipe's LightningDataModule: the same global batches on any number of ranks.

Its samplers shard the data: run with ``Trainer(use_distributed_sampler=False)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from bert_reduce.lightning import GlobalBatchSampler, ShardedEvalBatchSampler
from bert_reduce.lightning._lightning_private import training_batches_done
from bert_reduce.recipe.config import DataConfig
from bert_reduce.recipe.data import (
    MLMCollator,
    MLMDataset,
    PackedMicroBatchCollator,
    load_sequences,
    synthetic_proteins,
)
from bert_reduce.recipe.tokenizer import ESMTokenizer


class EpochKeyedBatchSampler:
    """Wraps a :class:`GlobalBatchSampler` to yield ``(epoch, index)`` keys, and to resume.

    Lightning sets the epoch on ``self.sampler`` (the wrapped sampler's), read when iteration
    starts. With ``resume`` set to ``(epoch, batches_done)``, the next pass over that epoch
    skips the batches done.

    Args:
        batch_sampler: Yields this rank's indices of each global batch.
    """

    def __init__(self, batch_sampler: GlobalBatchSampler) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = batch_sampler.sampler
        self.resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.sampler.epoch
        resume, self.resume = self.resume, None
        skip = resume[1] if resume is not None and resume[0] == epoch else 0
        for indices in itertools.islice(self.batch_sampler, skip, None):
            yield [(epoch, index) for index in indices]


class ResumableDataLoader(DataLoader):
    """A training DataLoader whose position in the epoch is saved in checkpoints.

    The position is the trainer's count of processed global batches in the epoch, read
    through ``progress`` when the checkpoint is written (not what the loader prefetched).

    Args:
        progress: Returns ``(epoch, global batches processed in it)``.
        kwargs: Passed to ``DataLoader``; ``batch_sampler`` must be an
            :class:`EpochKeyedBatchSampler`.
    """

    def __init__(
        self, *args: Any, progress: Callable[[], tuple[int, int]], seed: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(*args, generator=torch.Generator(), **kwargs)
        self.progress = progress
        self.seed = seed

    @override
    def __iter__(self) -> Iterator[Any]:
        # DataLoader draws its worker base seed from `generator` when iteration starts: seeded
        # by (seed, epoch), the draw neither depends on the run's history (a resumed run sees
        # the same worker seeds) nor consumes the global generator that dropout draws from.
        epoch = self.batch_sampler.sampler.epoch  # type: ignore[union-attr]
        seed = np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0]
        self.generator.manual_seed(int(seed))
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "batches_done": ...}`` of the training run."""
        epoch, batches_done = self.progress()
        return {"epoch": epoch, "batches_done": batches_done}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume after ``state_dict["batches_done"]`` batches of ``state_dict["epoch"]``."""
        self.batch_sampler.resume = (state_dict["epoch"], state_dict["batches_done"])  # type: ignore[union-attr]


class ESMDataModule(pl.LightningDataModule):
    """Protein MLM data: files or the built-in synthetic corpus, masked per sample.

    Args:
        config: The data, batch sizes and seeds; ``None``:
            :class:`~bert_reduce.recipe.config.DataConfig`'s defaults.

    Raises:
        ValueError: If ``mask_prob`` is not in ``(0, 1]``; if ``val_fraction`` leaves no
            training or no validation sample.
    """

    def __init__(self, config: DataConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or DataConfig()
        if not 0.0 < c.mask_prob <= 1.0:
            raise ValueError(
                f"data.mask_prob={c.mask_prob}: the masking probability must be in (0, 1] (0 "
                "masks no token, so there is no loss to train on). The BERT/ESM-2 value is 0.15."
            )
        self.tokenizer = ESMTokenizer()
        self.collate = MLMCollator(self.tokenizer.pad_id, c.pad_to_multiple_of)
        self.train_collate = (
            PackedMicroBatchCollator(c.micro_batch_size, self.tokenizer.pad_id)
            if c.pack_sequences
            else self.collate
        )
        self.train_dataset: MLMDataset | None = None
        self.val_dataset: MLMDataset | None = None

    def _sequences(self) -> tuple[list[str], list[str]]:
        c = self.config
        if c.train_path is None:
            sequences = synthetic_proteins(c.num_train_sequences, seed=c.corpus_seed)
        else:
            sequences = load_sequences(c.train_path, c.column)
        if c.val_path is not None:
            return sequences, load_sequences(c.val_path, c.column)
        if c.train_path is None:
            return sequences, synthetic_proteins(c.num_val_sequences, seed=c.corpus_seed + 1)
        num_val = round(len(sequences) * c.val_fraction)
        if not 0 < num_val < len(sequences):
            raise ValueError(
                f"data.val_fraction={c.val_fraction} of the {len(sequences)} sequences in "
                f"{c.train_path} leaves {num_val} for validation and "
                f"{len(sequences) - num_val} for training; both must be non-zero "
                "(or set data.val_path)."
            )
        order = np.random.default_rng([self.config.seed, 0x5B17]).permutation(len(sequences))
        val = [sequences[i] for i in order[:num_val]]
        train = [sequences[i] for i in order[num_val:]]
        return train, val

    @override
    def setup(self, stage: str) -> None:
        """Read or generate the sequences (once)."""
        if self.train_dataset is not None:
            return
        train, val = self._sequences()
        c = self.config
        common = {"max_length": c.max_length, "seed": c.seed, "mask_prob": c.mask_prob}
        self.train_dataset = MLMDataset(train, stream=0, tokenizer=self.tokenizer, **common)
        self.val_dataset = MLMDataset(val, stream=1, tokenizer=self.tokenizer, **common)

    def _replicas_and_rank(self) -> dict[str, int]:
        trainer = self.trainer
        if trainer is None:
            return {}
        return {"num_replicas": trainer.world_size, "rank": trainer.global_rank}

    @override
    def train_dataloader(self) -> ResumableDataLoader:
        """This rank's share of each global batch, one share per optimizer step.

        :class:`~bert_reduce.lightning.ExactMLMModule` cuts each share into micro-batches.

        Raises:
            ValueError: As :class:`~bert_reduce.lightning.GlobalBatchSampler`.
        """
        self.setup("fit")  # a no-op once the data is read
        assert self.train_dataset is not None
        batch_sampler = GlobalBatchSampler(
            len(self.train_dataset),
            self.config.global_batch_size,
            self.config.micro_batch_size,
            shuffle=self.config.shuffle,
            seed=self.config.seed,
            **self._replicas_and_rank(),
        )
        return ResumableDataLoader(
            self.train_dataset,
            batch_sampler=EpochKeyedBatchSampler(batch_sampler),
            collate_fn=self.train_collate,
            num_workers=self.config.num_workers,
            progress=lambda: training_batches_done(self.trainer),
            seed=self.config.seed,
        )

    @override
    def val_dataloader(self) -> DataLoader:
        """This rank's contiguous slice of the validation set, every sample exactly once.

        Raises:
            ValueError: If the validation set holds fewer samples than there are ranks.
        """
        self.setup("validate")  # a no-op once the data is read
        assert self.val_dataset is not None
        placement = self._replicas_and_rank()
        ranks = placement.get("num_replicas", 1)
        if len(self.val_dataset) < ranks:
            # A rank without a validation batch skips the validation loop and its collectives,
            # and the other ranks wait for it: refuse instead.
            raise ValueError(
                f"The validation set holds {len(self.val_dataset)} sequence(s), fewer than the "
                f"{ranks} ranks (trainer.devices x trainer.num_nodes): every rank needs at least "
                "one. Use more validation sequences (data.val_path, data.val_fraction or "
                "data.num_val_sequences) or fewer devices."
            )
        return DataLoader(
            self.val_dataset,
            batch_sampler=ShardedEvalBatchSampler(
                len(self.val_dataset),
                self.config.val_micro_batch_size or self.config.micro_batch_size,
                **placement,
            ),
            collate_fn=self.collate,
            num_workers=self.config.num_workers,
            # Its own generator: starting validation must not draw from the global generator,
            # whose state the training steps' dropout continues from.
            generator=torch.Generator().manual_seed(self.config.seed),
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """``{"global_batch_size": ...}``: checkpoints count global batches of this size.

        A resume with another size is refused before training starts, by
        :func:`bert_reduce.recipe.run_directory.resume_point`.
        """
        return {"global_batch_size": self.config.global_batch_size}
