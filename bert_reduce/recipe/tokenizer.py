"""The ESM-2 alphabet: 33 tokens, amino acids plus ``<cls> <pad> <eos> <unk> <mask>``.

The order is ESM-2's own (``esm.data.Alphabet.from_architecture("ESM-1b")``), so token ids
match the published checkpoints; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

AMINO_ACIDS: str = "ACDEFGHIKLMNPQRSTVWY"
"""The 20 standard amino acids, the residues of the built-in corpus."""

ESM_ALPHABET: tuple[str, ...] = (
    "<cls>",
    "<pad>",
    "<eos>",
    "<unk>",
    *"LAGVSERTIDPKQNFYMHWCXBUZO.-",
    "<null_1>",
    "<mask>",
)
"""ESM-2's 33 tokens in id order."""


class ESMTokenizer:
    """Maps protein sequences to ESM-2 token ids and back.

    One character is one token; the alphabet has ambiguity and gap characters
    (``X B U Z O . -``) besides the 20 amino acids.

    Attributes:
        vocab: Token string to id.
        cls_id, pad_id, eos_id, mask_id: Ids of the special tokens.
        residue_ids: Ids of the 20 standard amino acids (what random replacement draws from).
    """

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {token: i for i, token in enumerate(ESM_ALPHABET)}
        self.cls_id = self.vocab["<cls>"]
        self.pad_id = self.vocab["<pad>"]
        self.eos_id = self.vocab["<eos>"]
        self.mask_id = self.vocab["<mask>"]
        self.residue_ids: tuple[int, ...] = tuple(self.vocab[aa] for aa in AMINO_ACIDS)
        self._char_ids = {t: i for t, i in self.vocab.items() if len(t) == 1}

    def invalid_characters(self, sequence: str) -> list[str]:
        """The distinct characters of ``sequence`` that are not in the alphabet, in order."""
        return list(dict.fromkeys(c for c in sequence.upper() if c not in self._char_ids))

    def encode(self, sequence: str) -> list[int]:
        """Token ids of ``sequence``, wrapped in ``<cls> ... <eos>``.

        Args:
            sequence: Residues, one character each (case-insensitive).

        Returns:
            ``len(sequence) + 2`` ids.

        Raises:
            ValueError: Naming the characters outside the alphabet.
        """
        try:
            ids = [self._char_ids[char] for char in sequence.upper()]
        except KeyError:
            bad = self.invalid_characters(sequence)
            raise ValueError(
                f"Sequence has character(s) {bad} outside the ESM alphabet "
                f"{''.join(t for t in ESM_ALPHABET if len(t) == 1)!r}."
            ) from None
        return [self.cls_id, *ids, self.eos_id]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """The tokens of ``ids`` joined into one string (special tokens written out)."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return "".join(ESM_ALPHABET[i] for i in ids)
