"""Bad inputs, each with a test of what it gets: a clear error, or a correct result.

Their outcomes are the table of ``docs/errors.md`` (see ``tests/README.md``). Recipe probes call
:func:`bert_reduce.recipe.build.run` in this process with a config composed from ``conf/`` (what
``train.py`` does, minus the process start); the fault tests that need real processes and
signals are in ``tests/recipe/test_fault_tolerance.py``.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from bert_reduce import BERTMLMLossWithReduction, GlobalBatchLoss
from bert_reduce.cross_entropy import cross_entropy_loss_sum
from bert_reduce.lightning import split_micro_batches
from bert_reduce.megatron import output_layer_inputs
from bert_reduce.normalization import token_loss_sum
from bert_reduce.num_scored import count_scored
from bert_reduce.packing import pack_batch, unpack_sequences
from bert_reduce.recipe.build import run
from bert_reduce.recipe.config import DataConfig
from bert_reduce.recipe.data import load_sequences
from bert_reduce.recipe.datamodule import ESMDataModule
from bert_reduce.recipe.run_directory import LOCK_NAME, RunDirectory, RunDirectoryError
from bert_reduce.reports import REPORT_KEY
from tests.helpers.recipe_runs import (
    CHECKPOINTED,
    ROOT,
    compose_config,
    recipe_checkpoint,
    training_steps,
)
from tests.helpers.reference import make_mlm_batch

# Its probes run train.py's training in this process: the module runs in CI, outside the fast set.
pytestmark = pytest.mark.slow

DOC = ROOT / "docs" / "errors.md"
# Small enough for the one probe that trains to take seconds.
TINY = [*CHECKPOINTED, "trainer.max_steps=2", "cpu_threads=null", "data.max_length=32"]
TINY += ["model.num_layers=1"]


@dataclass(frozen=True)
class Probe:
    """A bad input and what it must get.

    ``run(tmp)`` either raises (``error`` and ``match`` say what it must raise) or returns
    the sentence for the table after checking the result itself.
    """

    where: str
    bad_input: str
    run: Callable[[Path], str]
    error: type[BaseException] | None = None
    match: str = ""


def probes(where: str, *rows: tuple) -> list[Probe]:
    """``Probe(where, *row)`` for each row: the bad input, its run, its error and match."""
    return [Probe(where, *row) for row in rows]


def train(tmp: Path, *overrides: str, fixed_run_dir: bool = True) -> str:
    """``python train.py TINY overrides hydra.run.dir=tmp/run``, in this process."""
    run(compose_config(*TINY, *overrides), tmp / "run", fixed_run_dir=fixed_run_dir)
    return "trained"


def used_run_directory(tmp: Path) -> Path:
    """What a finished run leaves: its lock file, metrics, config and checkpoints."""
    run_dir = tmp / "run"
    if not run_dir.is_dir():
        (run_dir / "checkpoints").mkdir(parents=True)
        recipe_checkpoint(run_dir / "checkpoints" / "last.ckpt", global_batch_size=16)
        (run_dir / "metrics.csv").write_text("step,train_loss\n1,3.5\n")
        (run_dir / "config.yaml").write_text("seed: 0\n")
        (run_dir / LOCK_NAME).write_text("pid 1 on host h, started 2026-11-30: train.py\n")
    return run_dir


def refused_untouched(tmp: Path, *overrides: str) -> str:
    """Train into a used run directory; whatever it raises, the directory must be unchanged."""
    run_dir = used_run_directory(tmp)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    try:
        return train(tmp, *overrides)
    finally:
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def bad_resume(content: bytes | str | None) -> Callable[[Path], str]:
    """Resume into the run's own directory from a missing (``None``), bad or half (``"half"``)
    checkpoint."""

    def probe(tmp: Path) -> str:
        path = used_run_directory(tmp) / "checkpoints" / "step000005.ckpt"
        if content == "half":
            whole = recipe_checkpoint(tmp / "whole.ckpt", 16).read_bytes()
            path.write_bytes(whole[: len(whole) // 2])
        elif content is not None:
            path.write_bytes(content)
        return refused_untouched(
            tmp, f"resume={path if content is not None else path.with_name('lats.ckpt')}"
        )

    return probe


def auto_resume_all_damaged(tmp: Path) -> str:
    """``resume=auto`` where the only checkpoint does not load: kept aside, run from step 0."""
    run_dir = used_run_directory(tmp)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:100])
    train(tmp, "resume=auto")
    assert (run_dir / "checkpoints" / "last.ckpt.damaged").stat().st_size == 100
    assert training_steps(run_dir) == [1, 2]  # the old row of step 1 replaced
    return (
        "trains from step 0: the file is kept as `last.ckpt.damaged` (a warning names it and "
        "the reason), `metrics.csv`'s rows are replaced as the steps are trained again"
    )


def concurrent_run(tmp: Path) -> str:
    with RunDirectory(tmp / "run") as directory:
        directory.start()
        return train(tmp)


def no_launcher(tmp: Path) -> str:
    with pytest.MonkeyPatch.context() as patch:
        for name in ("MASTER_ADDR", "NODE_RANK", "GROUP_RANK"):
            patch.delenv(name, raising=False)
        return train(tmp, "trainer.num_nodes=2", "trainer.accelerator=cpu")


def val_smaller_than_devices(tmp: Path) -> str:
    datamodule = ESMDataModule(
        DataConfig(global_batch_size=4, micro_batch_size=2, num_val_sequences=1)
    )
    # A real (unstarted) 2-process Trainer gives the data module its world size and rank.
    datamodule.trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False
    )
    datamodule.setup("fit")
    datamodule.val_dataloader()
    return "no error"


def bom_file(suffix: str, text: str) -> Callable[[Path], str]:
    def probe(tmp: Path) -> str:
        plain, bom = tmp / f"plain{suffix}", tmp / f"bom{suffix}"
        plain.write_text(text, encoding="utf-8")
        bom.write_text(text, encoding="utf-8-sig")
        assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
        assert load_sequences(bom) == load_sequences(plain) == ["MKTAYIAK", "MSEQ"]
        return "read as without the mark (the same sequences)"

    return probe


def latin1_fasta(tmp: Path) -> str:
    path = tmp / "proteins.fasta"
    path.write_bytes(">sp|P1|protéine 1\nMKTAYIAK\n".encode("latin-1"))
    return str(load_sequences(path))


def narrow_labels(tmp: Path) -> str:
    mask = torch.ones_like(LABELS, dtype=torch.bool)
    reference = F.cross_entropy(LOGITS.permute(1, 2, 0), LABELS, reduction="sum")
    for dtype in (torch.int16, torch.uint8):
        got, count, _ = BERTMLMLossWithReduction().forward(
            {"labels": LABELS.to(dtype), "loss_mask": mask}, {"token_logits": LOGITS}
        )
        torch.testing.assert_close(got, reference, rtol=1e-12, atol=0)
        assert int(count) == LABELS.numel()
    return "accepted: the same loss as int64 labels (read as int64)"


def negative_weight(check_labels: bool) -> Callable[[Path], str]:
    def probe(tmp: Path) -> str:
        weights = torch.ones(LABELS.shape, dtype=torch.float64)
        weights[0, 1] = -1.0
        loss_sum, _, _ = BERTMLMLossWithReduction(check_labels=check_labels).forward(
            {"labels": LABELS, "loss_mask": weights}, {"token_logits": LOGITS}
        )
        assert math.isnan(loss_sum)
        return "a NaN loss, as an out-of-vocabulary label (no host sync to check the sign)"

    return probe


def per_sequence_empty(tmp: Path) -> str:
    per_token_loss = torch.zeros(2, 0, dtype=torch.float64)
    mask = torch.zeros(2, 0, dtype=torch.bool)
    for mode, extra in (("per_sequence", {}), ("constant", {"constant_per_sequence": 4})):
        numerator, denominator = token_loss_sum(per_token_loss, mask, mode, **extra)
        assert float(numerator) == 0.0 and int(denominator) == 0, mode
    return "an empty loss: numerator 0, denominator 0 (per_sequence and constant)"


def calls(
    function: Callable[..., object], *args: object, **kwargs: object
) -> Callable[[Path], str]:
    """A probe that calls ``function(*args, **kwargs)``: an error, or "no error"."""

    def probe(tmp: Path) -> str:
        function(*args, **kwargs)
        return "no error"

    return probe


def head_without_weight() -> None:
    labels = torch.zeros(1, 2, dtype=torch.long)
    loss_fn = GlobalBatchLoss(group=None)
    loss_fn.begin([{"labels": labels}])
    loss_fn({"hidden_states": torch.zeros(1, 2, 4)}, {"labels": labels})


def bare_logits(tmp: Path) -> str:
    mask = LABELS % 2 == 0
    loss_fn = BERTMLMLossWithReduction()
    loss_fn.setup({"labels": LABELS, "loss_mask": mask})
    loss_sum, count, _ = loss_fn(LOGITS)
    expected = cross_entropy_loss_sum(LOGITS, LABELS, mask)
    assert torch.equal(loss_sum, expected[0]) and torch.equal(count, expected[1])
    return "scored as the logits, in the loss's `layout` (`[s, b, v]` here): the same loss"


def reports(*values: object) -> list[object]:
    """Reports of the given ``[2]`` values; other values as they are."""
    return [{REPORT_KEY: v} if isinstance(v, torch.Tensor) else v for v in values]


LOGITS, LABELS, _ = make_mlm_batch(2, 5, 33, mask_prob=1.0)  # every position scored
IDS = torch.ones(2, 8, dtype=torch.long)
ON_META = {"labels": LABELS.to("meta"), "loss_mask": torch.ones(LABELS.shape, device="meta")}
TRAIN, LIBRARY = "`train.py`", "library"
PROBES = probes(
    TRAIN,
    *(
        (f"`{bad}`", lambda t, bad=bad: train(t, bad), ValueError, rf"{bad}: .*must be in \(0, 1\]")
        for bad in ("data.mask_prob=0.0", "data.mask_prob=2.0")
    ),
    (
        "a new run into a directory that holds a run",
        refused_untouched,
        RunDirectoryError,
        "already holds a run.*Nothing was changed",
    ),
    (
        "a run into a directory where a run is running",
        concurrent_run,
        RunDirectoryError,
        "Another run is running in .*: pid .* holds",
    ),
    (
        "`overwrite=true` with `resume=` of the same directory",
        lambda t: refused_untouched(
            t, f"resume={t / 'run' / 'checkpoints' / 'last.ckpt'}", "overwrite=true"
        ),
        RunDirectoryError,
        "overwrite=true would delete",
    ),
    (
        "`resume=auto` without `hydra.run.dir` (the default run directory is made from the time)",
        lambda t: train(t, "resume=auto", fixed_run_dir=False),
        ValueError,
        "resume=auto resumes the run of the run directory, but this one .* is made from the "
        "current time",
    ),
    (
        "`resume=auto` with `overwrite=true`",
        lambda t: refused_untouched(t, "resume=auto", "overwrite=true"),
        RunDirectoryError,
        "resume=auto continues the run in the run directory, overwrite=true deletes it",
    ),
    (
        "`resume=auto` in a directory whose `last.ckpt` has another `data.global_batch_size`",
        lambda t: refused_untouched(t, "resume=auto", "data.global_batch_size=32"),
        ValueError,
        "trained with data.global_batch_size=16, this run has data.global_batch_size=32",
    ),
    (
        "`resume=auto` in a directory whose only checkpoint is damaged",
        auto_resume_all_damaged,
    ),
    *(
        (f"`resume=` {what}", bad_resume(content), error, match)
        for what, content, error, match in (
            ("a mistyped path", None, FileNotFoundError, "no such checkpoint file. Checkpoints in"),
            ("an empty checkpoint (0 bytes)", b"", ValueError, r"the file is empty \(0 bytes\)"),
            ("a file that is not a checkpoint", b"\x80\x04garbage", ValueError, "not a PyTorch"),
            ("a truncated checkpoint", "half", ValueError, "not a readable PyTorch checkpoint"),
        )
    ),
    (
        "`resume=` with another `data.global_batch_size`",
        lambda t: train(
            t,
            "data.global_batch_size=32",
            f"resume={recipe_checkpoint(t / 'elsewhere' / 'last.ckpt', 16)}",
        ),
        ValueError,
        "trained with data.global_batch_size=16, this run has data.global_batch_size=32",
    ),
    (
        "`trainer.num_nodes=2` without a launcher",
        no_launcher,
        RuntimeError,
        r"num_nodes=2.*not started by a multi-node launcher",
    ),
    (
        "a validation set smaller than the number of devices",
        val_smaller_than_devices,
        ValueError,
        "fewer than the 2 ranks",
    ),
    (
        "a FASTA file with a UTF-8 byte-order mark",
        bom_file(".fasta", ">a\nMKTAYIAK\n>b\nMSEQ\n"),
    ),
    (
        "a CSV file with a UTF-8 byte-order mark",
        bom_file(".csv", "id,sequence\na,MKTAYIAK\nb,MSEQ\n"),
    ),
    (
        "a FASTA file with a Latin-1 header",
        latin1_fasta,
        ValueError,
        r"proteins\.fasta, line 1: not UTF-8 text",
    ),
) + probes(
    LIBRARY,
    ("int16 / uint8 labels", narrow_labels),
    ("a negative weight in `loss_mask`", negative_weight(False)),
    (
        "a negative weight in `loss_mask`, `check_labels=True`",
        negative_weight(True),
        ValueError,
        r"loss_mask holds 1 negative weight\(s\); first at \[b=0, s=1\]",
    ),
    (
        "`labels` and `loss_mask` on another device than the logits",
        calls(BERTMLMLossWithReduction().forward, ON_META, {"token_logits": LOGITS}),
        ValueError,
        "token_logits is on cpu and labels on meta",
    ),
    ("`per_sequence` / `constant` normalization of a `[b, 0]` batch", per_sequence_empty),
    (
        "`unpack_sequences` on a `[T, v]` tensor",
        calls(unpack_sequences, torch.zeros(6, 33), torch.tensor([0, 3, 6]), 4, seq_dim=0),
        ValueError,
        r"needs packed of shape \[T, 1, \.\.\.\], got \(6, 33\)",
    ),
    (
        "`unpack_sequences` on a `[2, T]` tensor",
        calls(unpack_sequences, torch.zeros(2, 6), torch.tensor([0, 3, 6]), 4, seq_dim=1),
        ValueError,
        r"needs packed of shape \[1, T, \.\.\.\], got \(2, 6\)",
    ),
    ("a bare logits tensor as `forward_out`", bare_logits),
    (
        "a normalization typo (`'per_tokens'`)",
        calls(BERTMLMLossWithReduction, normalization="per_tokens"),
        ValueError,
        "'per_tokens' is not a normalization; choose one of 'per_token', 'per_sequence'",
    ),
    (
        "`pack_batch` with `labels` shorter than `input_ids`",
        calls(pack_batch, {"input_ids": IDS, "labels": IDS[:, :7], "attention_mask": IDS}),
        ValueError,
        r"'input_ids': \(2, 8\), 'labels': \(2, 7\)",
    ),
    (
        "`pack_batch` with float lengths",
        calls(pack_batch, {"labels": IDS}, [2.7, 3.0]),
        TypeError,
        "lengths must be integers",
    ),
    (
        "`pack_batch` on a batch of `b == 0` sequences",
        calls(pack_batch, {"labels": IDS[:0]}, []),
        ValueError,
        "b = 0 sequences",
    ),
    (
        "`reduce` given a report that is a string",
        calls(BERTMLMLossWithReduction().reduce, reports(torch.zeros(2), "loss")),
        TypeError,
        r"report 1 must be a mapping with key 'loss_sum_and_microbatch_size'",
    ),
    (
        "`reduce` given a report of shape `[3]`",
        calls(BERTMLMLossWithReduction().reduce, reports(torch.zeros(3))),
        ValueError,
        r"must have shape \[2\] or \[\.\.\., 2\] \(loss_sum, denominator\), got \(3,\)",
    ),
    (
        "one `int` `num_scored` for a batch `ExactMLMModule` splits into micro-batches",
        calls(split_micro_batches, {"labels": torch.zeros(4, 3), "num_scored": 5}, 2),
        ValueError,
        r"num_scored'\] = 5 counts the whole batch of 4 samples and cannot be split into 2",
    ),
    (
        "`NumScoredCollator` / `count_scored` on a batch already on the GPU",
        calls(count_scored, {"loss_mask": ON_META["loss_mask"].bool()}),
        ValueError,
        r"batch\['loss_mask'\] is on meta: reading it to count would synchronize",
    ),
    (
        "`GlobalBatchLoss` given hidden states without `output_weight`",
        calls(head_without_weight),
        KeyError,
        r"forward_out has no 'output_weight' key",
    ),
    (
        "`output_layer_inputs` on a model without an output layer",
        calls(output_layer_inputs, torch.nn.Linear(2, 2), torch.zeros(1, 2)),
        TypeError,
        r"needs a Megatron-Core language model with an `output_layer`.*got Linear",
    ),
    (
        "`reduce` given per-token and legacy `avg` reports mixed",
        calls(BERTMLMLossWithReduction().reduce, reports(torch.zeros(2), {"avg": torch.ones(1)})),
        ValueError,
        "Cannot reduce these reports",
    ),
)


def describe(result: str | BaseException, tmp: Path) -> str:
    """The table's cell: the sentence, or ``Error: message`` with the temporary paths hidden."""
    if not isinstance(result, BaseException):
        return result
    message = " ".join(str(result).split()).replace(str(tmp), "DIR").replace("|", "\\|")
    # Who holds a lock changes from run to run.
    message = re.sub(
        r"pid \d+ on host .+? holds", "pid PID on host HOST, started TIME: COMMAND holds", message
    )
    return f"`{type(result).__name__}`: {message}"


Outcomes = list[tuple[Probe, str | BaseException, Path]]
"""Each probe, what its run returned or raised, and its temporary directory."""


def render(outcomes: Outcomes) -> str:
    lines = [
        "# Bad inputs and what they get",
        "",
        "Generated from the probes of `tests/integration/test_bad_inputs.py`, each a test (`DIR`:",
        "the run's directory). Edit the probes, not this file.",
        "",
        "| where | bad input | what it gets |",
        "| --- | --- | --- |",
    ]
    for probe, result, tmp in outcomes:
        lines.append(f"| {probe.where} | {probe.bad_input} | {describe(result, tmp)} |")
    return "\n".join(lines) + "\n"


def run_probes(root: Path) -> Outcomes:
    results: Outcomes = []
    for number, probe in enumerate(PROBES):
        tmp = root / f"probe{number:02d}"
        tmp.mkdir()
        try:
            results.append((probe, probe.run(tmp), tmp))
        except Exception as error:  # the outcome to check and to document
            results.append((probe, error, tmp))
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    return run_probes(tmp_path_factory.mktemp("probes"))


@pytest.mark.parametrize("number", range(len(PROBES)), ids=[p.bad_input for p in PROBES])
def test_probe(outcomes: Outcomes, number: int) -> None:
    probe, result, _ = outcomes[number]
    if probe.error is None:
        assert isinstance(result, str), result  # an error where a result was due
        return
    assert isinstance(result, probe.error), result
    assert re.search(probe.match, str(result)), str(result)


def test_errors_doc_is_up_to_date(outcomes: Outcomes) -> None:
    assert DOC.read_text() == render(outcomes), (
        "docs/errors.md is stale: python -m tests.integration.test_bad_inputs"
    )


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        DOC.write_text(render(run_probes(Path(root))))
    print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
