"""examples/hf_trainer_esm2.py and examples/hf_trainer_geneformer.py, briefly, in one process.

The training runs are end to end: ``slow``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from examples import hf_trainer_esm2, hf_trainer_geneformer

TINY_ESM = ["--hidden-size", "32", "--num-layers", "1", "--num-heads", "2", "--max-length", "40"]
SHORT_RUN = ["--batch-size", "4", "--accumulation", "2", "--max-steps", "2", "--eval-steps", "1"]


def _check(metrics: dict[str, float]) -> None:
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("fused_head", [False, True])
def test_esm2_example_trains_and_evaluates(tmp_path: Path, fused_head: bool) -> None:
    argv = [*TINY_ESM, *SHORT_RUN, "--train-sequences", "24", "--eval-sequences", "6"]
    argv += ["--output-dir", str(tmp_path / "run"), *(["--fused-head"] if fused_head else [])]
    _check(hf_trainer_esm2.main(argv))


@pytest.mark.slow
def test_esm2_example_fine_tunes_a_local_checkpoint(tmp_path: Path) -> None:
    args = hf_trainer_esm2.parse_args(TINY_ESM)
    tokenizer = hf_trainer_esm2.build_tokenizer(args)
    checkpoint = tmp_path / "checkpoint"
    hf_trainer_esm2.build_model(args, tokenizer).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    argv = ["--checkpoint", str(checkpoint), *SHORT_RUN, "--max-length", "40"]
    argv += ["--train-sequences", "24", "--eval-sequences", "6"]
    _check(hf_trainer_esm2.main([*argv, "--output-dir", str(tmp_path / "run")]))


@pytest.mark.slow
def test_geneformer_example_trains_and_evaluates(tmp_path: Path) -> None:
    # Geneformer's ~25k gene tokens, short cells and a tiny model.
    argv = ["--max-length", "96", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2"]
    argv += ["--train-cells", "16", "--eval-cells", "4", *SHORT_RUN]
    _check(hf_trainer_geneformer.main([*argv, "--output-dir", str(tmp_path / "run")]))


def test_examples_refuse_a_used_output_directory(tmp_path: Path) -> None:
    (tmp_path / "earlier.txt").write_text("keep me")
    for example in (hf_trainer_esm2, hf_trainer_geneformer):
        with pytest.raises(FileExistsError, match="not empty"):
            example.main(["--output-dir", str(tmp_path)])
    assert (tmp_path / "earlier.txt").read_text() == "keep me"
