"""Protein sequences in, masked-language-model samples out, each from its own random stream.

Why its own: docs/recipe.md, "The end-to-end guarantee".
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from bert_reduce.num_scored import NUM_SCORED_KEY, count_scored
from bert_reduce.packing import pack_batch
from bert_reduce.recipe.tokenizer import ESMTokenizer

__all__ = [
    "BACKGROUND_FREQUENCIES",
    "MLMCollator",
    "MLMDataset",
    "PackedMicroBatchCollator",
    "load_sequences",
    "mask_tokens",
    "read_fasta",
    "read_table",
    "synthetic_proteins",
]

BACKGROUND_FREQUENCIES: dict[str, float] = {
    "A": 8.25, "C": 1.37, "D": 5.45, "E": 6.75, "F": 3.86, "G": 7.07, "H": 2.27,
    "I": 5.96, "K": 5.84, "L": 9.66, "M": 2.42, "N": 4.06, "P": 4.70, "Q": 3.93,
    "R": 5.53, "S": 6.56, "T": 5.34, "V": 6.87, "W": 1.08, "Y": 2.92,
}  # fmt: skip
"""Amino-acid composition of UniProtKB/Swiss-Prot (percent), the synthetic corpus' source."""

FASTA_SUFFIXES = (".fasta", ".fa", ".faa", ".fas")
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet")


_TOKENIZER = ESMTokenizer()  # the alphabet the readers check against


def _check_residues(sequence: str, where: str) -> None:
    bad = _TOKENIZER.invalid_characters(sequence)
    if bad:
        raise ValueError(f"{where}: character(s) {bad} are not amino acids of the ESM alphabet.")


def _check_not_empty(sequences: Sequence[str], source: str) -> None:
    if not sequences:
        raise ValueError(f"No sequences in {source}: the dataset is empty.")


def _read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of ``path``, without a leading byte-order mark.

    Raises:
        ValueError: If the file is not UTF-8, naming the line and the offending bytes.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}, line {line}: not UTF-8 text (byte(s) {data[error.start : error.end]!r} at "
            f"offset {error.start}); a Latin-1 or Windows-1252 file, say. Convert it to UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8 {path} > converted{Path(path).suffix}"
        ) from None


def read_fasta(path: str | os.PathLike[str]) -> list[str]:
    """The sequences of a FASTA file, each possibly spread over several lines.

    Args:
        path: A FASTA file (``>header`` lines followed by residue lines).

    Returns:
        One string per record, in file order.

    Raises:
        ValueError: On a file that is not UTF-8 (a byte-order mark is fine), residue lines
            before the first header, characters outside the ESM alphabet (naming the file and
            line number), a record without residues, or a file without any record.
    """
    sequences: list[str] = []
    current: list[str] | None = None
    header_line = 0
    # A closing ">" finishes the last record, as each header finishes the one before it.
    for line_number, raw in enumerate([*_read_text(path).split("\n"), ">"], start=1):
        line = raw.strip()
        if line.startswith(">"):
            if current is not None:
                if not current:
                    raise ValueError(f"{path}, line {header_line}: FASTA record without residues.")
                sequences.append("".join(current).upper())
            current, header_line = [], line_number
        elif line:
            if current is None:
                raise ValueError(
                    f"{path}, line {line_number}: sequence data before any '>' header."
                )
            _check_residues(line, f"{path}, line {line_number}")
            current.append(line)
    _check_not_empty(sequences, str(path))
    return sequences


def read_table(path: str | os.PathLike[str], column: str = "sequence") -> list[str]:
    """The sequences in one column of a CSV, TSV or Parquet file.

    CSV and TSV are read with the standard library; Parquet needs ``pyarrow``.

    Args:
        path: A ``.csv``, ``.tsv`` or ``.parquet`` file with a header row.
        column: Name of the column holding the sequences.

    Returns:
        One string per row, in file order.

    Raises:
        KeyError: If ``column`` is missing (the message lists the columns).
        ValueError: On a CSV/TSV that is not UTF-8 (a byte-order mark is fine), characters
            outside the ESM alphabet or an empty cell (naming the row), or a file without rows.
        ImportError: For Parquet without ``pyarrow``.
    """
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ImportError(f"Reading {path} needs pyarrow: pip install pyarrow") from error
        table = pq.read_table(path)
        columns, first_row = table.column_names, 0
        values = table.column(column).to_pylist() if column in columns else []
    else:
        handle = io.StringIO(_read_text(path), newline="")
        reader = csv.DictReader(handle, delimiter="\t" if path.suffix == ".tsv" else ",")
        # first_row: line numbers as a spreadsheet shows them, the header is line 1
        columns, first_row = reader.fieldnames, 2
        values = [row[column] for row in reader] if column in (columns or []) else []
    if column not in (columns or []):
        raise KeyError(f"{path} has no column {column!r}; its columns are {columns}.")
    sequences = []
    for offset, value in enumerate(values):
        where = f"{path}, row {first_row + offset}"
        sequence = "" if value is None else str(value).strip()
        if not sequence:
            raise ValueError(f"{where}: empty sequence in column {column!r}.")
        _check_residues(sequence, where)
        sequences.append(sequence.upper())
    _check_not_empty(sequences, str(path))
    return sequences


def load_sequences(path: str | os.PathLike[str], column: str = "sequence") -> list[str]:
    """Sequences from a FASTA, CSV, TSV or Parquet file, chosen by its suffix.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: On an unknown suffix, or see :func:`read_fasta` and :func:`read_table`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Sequence file {path} does not exist.")
    suffix = path.suffix.lower()
    if suffix in FASTA_SUFFIXES:
        return read_fasta(path)
    if suffix in TABLE_SUFFIXES:
        return read_table(path, column)
    raise ValueError(f"Cannot read {path}: expected a suffix in {FASTA_SUFFIXES + TABLE_SUFFIXES}.")


def synthetic_proteins(
    num_sequences: int,
    seed: int = 0,
    median_length: int = 280,
    length_sigma: float = 0.6,
    min_length: int = 30,
    max_length: int = 2000,
) -> list[str]:
    """A deterministic synthetic protein corpus, made without any download.

    Residues drawn from :data:`BACKGROUND_FREQUENCIES` after a leading methionine, log-normal
    lengths clipped to ``[min_length, max_length]`` (docs/recipe.md, "The built-in corpus").

    Args:
        num_sequences: How many sequences.
        seed: The corpus is a pure function of the arguments.
        median_length: Median length in residues.
        length_sigma: Standard deviation of the log-length.
        min_length: Shortest length.
        max_length: Longest length.

    Returns:
        ``num_sequences`` upper-case strings.

    Raises:
        ValueError: If ``num_sequences`` is not positive or the length bounds are inconsistent.
    """
    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}.")
    if not 1 < min_length <= max_length:
        raise ValueError(f"Need 1 < min_length <= max_length, got {min_length}, {max_length}.")
    rng = np.random.default_rng([seed, 0x5EED])
    lengths = np.exp(rng.normal(np.log(median_length), length_sigma, num_sequences))
    lengths = np.clip(np.rint(lengths), min_length, max_length).astype(np.int64)
    codes = np.frombuffer("".join(BACKGROUND_FREQUENCIES).encode("ascii"), dtype=np.uint8)
    probs = np.array(list(BACKGROUND_FREQUENCIES.values()))
    body = rng.choice(len(codes), size=int((lengths - 1).sum()), p=probs / probs.sum())
    text = codes[body].tobytes().decode("ascii")
    starts = np.concatenate([[0], np.cumsum(lengths - 1)])
    return ["M" + text[starts[i] : starts[i + 1]] for i in range(num_sequences)]


def mask_tokens(
    input_ids: Tensor,
    maskable: Tensor,
    rng: np.random.Generator,
    tokenizer: ESMTokenizer,
    mask_prob: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """BERT masking of one sequence, 15% / 80-10-10 by default.

    Each maskable token is selected with probability ``mask_prob``; a selected token becomes
    ``<mask>`` 80% of the time, a random amino acid 10%, and stays itself 10%. The draws have a
    fixed size, so the outcome depends on ``rng`` and the length only.

    Args:
        input_ids: ``[s]`` int64 token ids of one sequence.
        maskable: ``[s]`` bool, true where a token may be selected (residues, not specials).
        rng: The sample's own generator.
        tokenizer: Gives the ``<mask>`` id and the residue ids.
        mask_prob: Selection probability.

    Returns:
        ``(masked_ids, loss_mask)``: ``[s]`` int64 model inputs and ``[s]`` bool selection.
    """
    length = input_ids.numel()
    selected = torch.from_numpy(rng.random(length) < mask_prob) & maskable
    action = torch.from_numpy(rng.random(length))
    random_ids = torch.as_tensor(tokenizer.residue_ids)[
        torch.from_numpy(rng.integers(0, len(tokenizer.residue_ids), length))
    ]
    masked = input_ids.clone()
    masked = torch.where(selected & (action < 0.8), tokenizer.mask_id, masked)
    masked = torch.where(selected & (action >= 0.8) & (action < 0.9), random_ids, masked)
    return masked, selected


class MLMDataset(Dataset[dict[str, Tensor]]):
    """Masked-language-model samples of protein sequences.

    A sample is ``<cls> residues <eos>``, cropped to a random window of ``max_length - 2``
    residues; crop and mask come from a generator seeded with ``(seed, stream, epoch, index)``.
    Index it with ``(epoch, index)`` (from
    :class:`~bert_reduce.recipe.datamodule.EpochKeyedBatchSampler`) or ``index`` (epoch 0).

    Args:
        sequences: The protein sequences.
        max_length: Most tokens per sample, ``<cls>`` and ``<eos>`` included.
        seed: Seed of the crops and masks.
        stream: Separates the random streams of datasets sharing a seed (train 0, val 1).
        mask_prob: BERT selection probability.
        tokenizer: The ESM tokenizer (a new one when ``None``).

    Raises:
        ValueError: If ``sequences`` is empty or ``max_length < 3``.
    """

    def __init__(
        self,
        sequences: Sequence[str],
        max_length: int = 128,
        seed: int = 0,
        stream: int = 0,
        mask_prob: float = 0.15,
        tokenizer: ESMTokenizer | None = None,
    ) -> None:
        _check_not_empty(sequences, "the sequence list")
        if max_length < 3:
            raise ValueError(f"data.max_length must be at least 3, got {max_length}.")
        self.sequences = sequences
        self.max_length = max_length
        self.seed = seed
        self.stream = stream
        self.mask_prob = mask_prob
        self.tokenizer = tokenizer or ESMTokenizer()

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, key: int | tuple[int, int]) -> dict[str, Tensor]:
        """One sample: ``input_ids``, ``labels`` and ``loss_mask``, each ``[s]``."""
        epoch, index = key if isinstance(key, tuple) else (0, key)
        rng = np.random.default_rng([self.seed, self.stream, epoch, index])
        sequence = self.sequences[index]
        room = self.max_length - 2
        if len(sequence) > room:
            start = int(rng.integers(0, len(sequence) - room + 1))
            sequence = sequence[start : start + room]
        labels = torch.tensor(self.tokenizer.encode(sequence), dtype=torch.int64)
        maskable = torch.ones_like(labels, dtype=torch.bool)
        maskable[0] = maskable[-1] = False
        input_ids, loss_mask = mask_tokens(labels, maskable, rng, self.tokenizer, self.mask_prob)
        return {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask}


class MLMCollator:
    """Pads samples into a ``[b, s]`` batch.

    Args:
        pad_id: The ``<pad>`` id.
        pad_to_multiple_of: Round ``s`` up to a multiple of this (8 suits tensor cores).
    """

    def __init__(self, pad_id: int = 1, pad_to_multiple_of: int = 1) -> None:
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[Mapping[str, Tensor]]) -> dict[str, Any]:
        """Pad ``samples`` into one batch.

        Returns:
            ``input_ids`` and ``labels`` (``[b, s]`` int64, padded with ``pad_id``),
            ``attention_mask`` and ``loss_mask`` (``[b, s]`` bool, false on padding), and
            ``num_scored`` (a tuple of ``b`` Python ints, each sample's count of scored
            positions, counted on the host: :mod:`bert_reduce.num_scored`).
        """
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        longest = max(sample["input_ids"].numel() for sample in samples)
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(samples)
        batch = {
            "input_ids": torch.full((batch_size, length), self.pad_id, dtype=torch.int64),
            "attention_mask": torch.zeros((batch_size, length), dtype=torch.bool),
            "labels": torch.full((batch_size, length), self.pad_id, dtype=torch.int64),
            "loss_mask": torch.zeros((batch_size, length), dtype=torch.bool),
        }
        for row, sample in enumerate(samples):
            size = sample["input_ids"].numel()
            batch["attention_mask"][row, :size] = True
            for key in ("input_ids", "labels", "loss_mask"):
                batch[key][row, :size] = sample[key]
        batch[NUM_SCORED_KEY] = count_scored(batch, per_sample=True)
        return batch


class PackedMicroBatchCollator:
    """Cuts this rank's share of a global batch into micro-batches, each packed into one row.

    Each micro-batch is :func:`bert_reduce.pack_batch` of ``micro_batch_size`` consecutive
    samples (packed here, where the lengths are host ints: ``docs/packing.md``), with
    ``num_scored``, the row's count of scored positions, as a Python ``int``.

    Args:
        micro_batch_size: Samples per packed micro-batch.
        pad_id: The ``<pad>`` id.
        pad_to_multiple_of: Pad each sequence to a multiple of this inside the row (``2 *
            cp_size`` for context parallelism).
    """

    def __init__(self, micro_batch_size: int, pad_id: int = 1, pad_to_multiple_of: int = 1) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}.")
        self.micro_batch_size = micro_batch_size
        self.collate = MLMCollator(pad_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: Sequence[Mapping[str, Tensor]]) -> dict[str, list[dict[str, Any]]]:
        """``{"micro_batches": [packed micro-batch, ...]}`` of ``samples``, in sample order."""
        micro_batches = []
        for start in range(0, len(samples), self.micro_batch_size):
            chunk = samples[start : start + self.micro_batch_size]
            lengths = [sample["input_ids"].numel() for sample in chunk]
            packed = pack_batch(
                self.collate(chunk), lengths, pad_to_multiple_of=self.pad_to_multiple_of
            )
            packed[NUM_SCORED_KEY] = sum(packed[NUM_SCORED_KEY])
            micro_batches.append(packed)
        return {"micro_batches": micro_batches}
