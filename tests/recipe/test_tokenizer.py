from __future__ import annotations

import pytest

from bert_reduce.recipe.tokenizer import ESM_ALPHABET, ESMTokenizer


def test_alphabet_matches_esm2_ids() -> None:
    # Ids of esm.data.Alphabet.from_architecture("ESM-1b"), the ESM-2 alphabet.
    tokenizer = ESMTokenizer()
    assert len(tokenizer.vocab) == len(ESM_ALPHABET) == 33
    expected = {"<cls>": 0, "<pad>": 1, "<eos>": 2, "<unk>": 3, "L": 4, "A": 5, "G": 6,
                "M": 20, "C": 23, "X": 24, "-": 30, "<mask>": 32}  # fmt: skip
    assert {token: tokenizer.vocab[token] for token in expected} == expected
    assert tokenizer.encode("mKv") == [0, 20, 15, 7, 2]
    assert tokenizer.decode(tokenizer.encode("MKV")) == "<cls>MKV<eos>"
    assert sorted(tokenizer.residue_ids) == sorted(
        tokenizer.vocab[a] for a in "ACDEFGHIKLMNPQRSTVWY"
    )
    with pytest.raises(ValueError, match=r"\['J', '1'\]"):
        tokenizer.encode("MKJ1J")
