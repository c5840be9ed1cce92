from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import bert_reduce


def test_import_loads_no_heavy_framework() -> None:
    # Quick import is a property of what gets imported, not a timing: torch, Megatron, NeMo,
    # Lightning and friends must all wait until a public name is first used.
    code = (
        "import sys; import bert_reduce; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'torch', 'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_needs_torch_alone() -> None:
    # The core extra-free install is torch only: the maths, the report format, the Megatron
    # loss-reduction class and the PyTorch-loop loss must work without Megatron, Lightning,
    # torchmetrics, Hydra or transformers.
    code = (
        "import sys, torch; "
        "from bert_reduce import BERTMLMLossWithReduction, cross_entropy_loss_sum, pack_batch; "
        "import bert_reduce.context_parallel, bert_reduce.reports, bert_reduce.normalization; "
        "import bert_reduce.num_scored; "
        "from bert_reduce import GlobalBatchLoss; "
        "mb = {'labels': torch.tensor([[1, -100]])}; g = GlobalBatchLoss(); g.begin([mb]); "
        "g(torch.zeros(1, 2, 3), mb); assert abs(float(g.end()) - 1.0986122886681098) < 1e-6; "
        "loss = BERTMLMLossWithReduction(); "
        "loss.setup({'labels': torch.tensor([[1, 2]]), "
        "'loss_mask': torch.tensor([[True, False]])}); "
        "_, _, report = loss({'token_logits': torch.zeros(2, 1, 3)}); "
        "assert abs(float(loss.reduce([report])) - float(torch.log(torch.tensor(3.0)))) < 1e-6; "
        "print(sorted({m.split('.')[0] for m in sys.modules} "
        "& {'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


RENAMED = {
    "bert_reduce": {
        "masked_cross_entropy": "cross_entropy_loss_sum",
        "masked_token_losses": "cross_entropy_token_losses",
        "linear_masked_token_losses": "linear_cross_entropy_token_losses",
        "linear_weighted_loss_sum": "linear_cross_entropy_weighted_sum",
    },
    "bert_reduce.cross_entropy": {
        "masked_cross_entropy": "cross_entropy_loss_sum",
        "masked_token_losses": "cross_entropy_token_losses",
        "NumScored": "bert_reduce.num_scored.NumScored",
        "scored_count": "bert_reduce.num_scored.scored_count",
        "select_rows": "bert_reduce._vocab_parallel.select_rows",
        "shard_stats": "bert_reduce._vocab_parallel.shard_stats",
        "combine_shard_stats": "bert_reduce._vocab_parallel.combine_shard_stats",
        "scatter_row_losses": "bert_reduce._vocab_parallel.scatter_row_losses",
        "resolve_capacity": "bert_reduce._vocab_parallel.resolve_capacity",
        "RowSelection": "bert_reduce._vocab_parallel.RowSelection",
        "ShardedTargets": "bert_reduce._vocab_parallel.ShardedTargets",
        "shard_targets": "bert_reduce._vocab_parallel.shard_targets",
    },
    "bert_reduce.linear_cross_entropy": {
        "linear_masked_token_losses": "linear_cross_entropy_token_losses",
        "linear_weighted_loss_sum": "linear_cross_entropy_weighted_sum",
    },
    "bert_reduce.functional": {
        "masked_weighted_sum": "token_weighted_sum",
        "masked_loss_sum": "bert_reduce.normalization.token_loss_sum",
        "masked_token_loss": "bert_reduce.normalization.token_loss_sum",
        "unreduced_token_loss_fn": "bert_reduce.cross_entropy.unreduced_token_loss_fn",
    },
    "bert_reduce.normalization": {"normalized_loss_terms": "token_loss_sum"},
}


def _resolve(module: str, target: str) -> object:
    home, _, name = target.rpartition(".")
    return getattr(importlib.import_module(home or module), name)


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [(module, old, new) for module, names in RENAMED.items() for old, new in names.items()],
)
def test_old_names_warn_and_are_the_new_objects(module, old, new) -> None:
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated.*removed"):
        value = getattr(importlib.import_module(module), old)
    assert value is _resolve(module, new)


def test_token_loss_sums_warns_and_still_gives_detached_fp64_sums() -> None:
    from bert_reduce.metrics import token_loss_sums

    logits = torch.randn(5, 2, 7, requires_grad=True)
    labels, mask = torch.randint(0, 7, (2, 5)), torch.rand(2, 5) < 0.5
    with pytest.warns(DeprecationWarning, match="update_from_logits"):
        loss_sum, denominator = token_loss_sums(logits, labels, mask)
    expected, count = bert_reduce.cross_entropy_loss_sum(logits, labels, mask)
    assert loss_sum.dtype == denominator.dtype == torch.float64 and not loss_sum.requires_grad
    torch.testing.assert_close(loss_sum, expected.detach().double())
    assert int(denominator) == int(count)


def test_nemo_and_bionemo_names_need_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from bert_reduce import masked_token_loss, unreduced_token_loss_fn
    assert masked_token_loss is bert_reduce.token_loss_sum
    assert unreduced_token_loss_fn.__module__ == "bert_reduce.cross_entropy"
