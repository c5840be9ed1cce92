from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_reduce.recipe.data import (
    BACKGROUND_FREQUENCIES,
    MLMCollator,
    MLMDataset,
    PackedMicroBatchCollator,
    load_sequences,
    mask_tokens,
    read_fasta,
    synthetic_proteins,
)
from bert_reduce.recipe.tokenizer import ESMTokenizer


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_fasta_multiline_records(tmp_path: Path) -> None:
    path = write(tmp_path / "x.fasta", ">a desc\nMKV\nla\n\n>b\nGGG\n")
    assert read_fasta(path) == ["MKVLA", "GGG"]
    assert load_sequences(path) == ["MKVLA", "GGG"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("x.fa", ">a\nMKV\n>b\nMK1V\n", r"x\.fa, line 4: character\(s\) \['1'\]"),
        ("x.fa", "MKV\n>a\nMKV\n", r"x\.fa, line 1: sequence data before any '>' header"),
        ("x.fa", ">a\n>b\nMKV\n", r"x\.fa, line 1: FASTA record without residues"),
        ("x.fa", "\n\n", r"No sequences in .*x\.fa: the dataset is empty"),
        ("bad.csv", "sequence\nMKV\nMK*\n", r"bad\.csv, row 3: character\(s\) \['\*'\]"),
        ("empty.csv", "sequence\n", "the dataset is empty"),
        ("x.txt", "MKV", "expected a suffix in"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_sequences(write(tmp_path / name, text))


def test_csv_and_tsv(tmp_path: Path) -> None:
    csv_path = write(tmp_path / "x.csv", "id,sequence\n1,MKV\n2,gga\n")
    assert load_sequences(csv_path) == ["MKV", "GGA"]
    tsv_path = write(tmp_path / "x.tsv", "seq\tid\nMKV\t1\n")
    assert load_sequences(tsv_path, column="seq") == ["MKV"]
    with pytest.raises(KeyError, match=r"no column 'sequence'; its columns are \['seq', 'id'\]"):
        load_sequences(tsv_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sequences(tmp_path / "missing.fasta")


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"sequence": ["MKV", "GGA"]}), path)
    assert load_sequences(path) == ["MKV", "GGA"]


def test_synthetic_corpus_is_deterministic_and_realistic() -> None:
    corpus = synthetic_proteins(3000, seed=3)
    assert corpus == synthetic_proteins(3000, seed=3)
    assert corpus != synthetic_proteins(3000, seed=4)
    assert all(seq[0] == "M" for seq in corpus)
    lengths = np.array([len(seq) for seq in corpus])
    assert 250 <= np.median(lengths) <= 310
    assert lengths.min() >= 30 and lengths.max() <= 2000
    counts = Counter("".join(seq[1:] for seq in corpus))
    total = sum(counts.values())
    expected = np.array(list(BACKGROUND_FREQUENCIES.values()))
    expected = expected / expected.sum()
    observed = np.array([counts[aa] / total for aa in BACKGROUND_FREQUENCIES])
    np.testing.assert_allclose(observed, expected, atol=2e-3)


def test_mask_statistics() -> None:
    tokenizer = ESMTokenizer()
    ids = torch.full((200_000,), tokenizer.vocab["A"])
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:1000] = False
    masked, selected = mask_tokens(ids, maskable, np.random.default_rng(0), tokenizer)
    assert not selected[:1000].any()
    rate = selected[1000:].double().mean().item()
    assert abs(rate - 0.15) < 0.003
    chosen = masked[selected]
    fractions = [
        (chosen == tokenizer.mask_id).double().mean().item(),
        ((chosen != tokenizer.mask_id) & (chosen != ids[0])).double().mean().item(),
        (chosen == ids[0]).double().mean().item(),
    ]
    # Random replacements are residues; 1 in 20 is "A" again and counts as unchanged.
    np.testing.assert_allclose(fractions, [0.8, 0.1 * 19 / 20, 0.1 + 0.1 / 20], atol=0.01)
    assert torch.equal(masked[~selected], ids[~selected])


def test_samples_depend_on_seed_epoch_and_index_only() -> None:
    corpus = synthetic_proteins(50, seed=1)
    dataset = MLMDataset(corpus, max_length=64, seed=7)
    forward = [dataset[(2, i)] for i in range(50)]
    backward = [dataset[(2, i)] for i in reversed(range(50))][::-1]
    for a, b in zip(forward, backward, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key])
    other_epoch = dataset[(3, 0)]
    assert not torch.equal(forward[0]["loss_mask"], other_epoch["loss_mask"])
    val = MLMDataset(corpus, max_length=64, seed=7, stream=1)[(2, 0)]
    assert not torch.equal(forward[0]["loss_mask"], val["loss_mask"])
    assert torch.equal(dataset[0]["labels"], dataset[(0, 0)]["labels"])


def test_crop_and_specials() -> None:
    tokenizer = ESMTokenizer()
    corpus = ["MKVLAG" * 20, "MKV"]
    dataset = MLMDataset(corpus, max_length=10, seed=0)
    starts = set()
    for epoch in range(20):
        sample = dataset[(epoch, 0)]
        labels = sample["labels"]
        assert labels.numel() == 10
        assert labels[0] == tokenizer.cls_id and labels[-1] == tokenizer.eos_id
        window = tokenizer.decode(labels[1:-1])
        starts.add(corpus[0].find(window))
        assert window in corpus[0]
        assert not sample["loss_mask"][[0, -1]].any()
    assert len(starts) > 1  # the crop window moves between epochs
    assert dataset[1]["labels"].tolist() == tokenizer.encode("MKV")
    with pytest.raises(ValueError, match="at least 3"):
        MLMDataset(corpus, max_length=2)
    with pytest.raises(ValueError, match="the dataset is empty"):
        MLMDataset([], max_length=8)


def test_collator_pads() -> None:
    dataset = MLMDataset(["MKVLA", "MK"], max_length=16, seed=0, mask_prob=1.0)
    batch = MLMCollator(pad_id=1, pad_to_multiple_of=4)([dataset[0], dataset[1]])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum(1).tolist() == [7, 4]
    assert (batch["input_ids"][1, 4:] == 1).all()
    assert batch["loss_mask"].sum(1).tolist() == [5, 2]
    assert not batch["loss_mask"][~batch["attention_mask"]].any()


def test_packed_micro_batches_hold_the_same_tokens_and_host_counts() -> None:
    dataset = MLMDataset(synthetic_proteins(6, seed=2), max_length=40, seed=0, mask_prob=0.4)
    samples = [dataset[(0, i)] for i in range(6)]
    packed = PackedMicroBatchCollator(micro_batch_size=4)(samples)["micro_batches"]
    assert len(packed) == 2  # 4 + 2 samples
    for micro_batch, chunk in zip(packed, (samples[:4], samples[4:]), strict=True):
        assert micro_batch["input_ids"].shape == (1, sum(s["input_ids"].numel() for s in chunk))
        for key in ("input_ids", "labels", "loss_mask"):
            assert torch.equal(micro_batch[key][0], torch.cat([s[key] for s in chunk]))
        assert micro_batch["cu_seqlens"].tolist() == [
            0,
            *np.cumsum([len(s["labels"]) for s in chunk]),
        ]
        # A Python int, which no device transfer touches: the packed row's total.
        assert type(micro_batch["num_scored"]) is int
        assert micro_batch["num_scored"] == int(micro_batch["loss_mask"].sum())
    batch = MLMCollator()(samples)  # padded: one count per sample (split into micro-batches later)
    assert batch["num_scored"] == tuple(int(s["loss_mask"].sum()) for s in samples)
    assert all(type(count) is int for count in batch["num_scored"])
