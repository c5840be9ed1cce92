from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import bert_reduce


def test_import_loads_no_framework_and_the_core_needs_torch_alone() -> None:
    # Quick import is a property of what gets imported, not a timing: torch, Megatron, NeMo,
    # Lightning and friends must all wait until a public name is first used. Then the core
    # (an extra-free install is torch only: the maths, the report format, the Megatron
    # loss-reduction class and the PyTorch-loop loss) must work without Megatron, Lightning,
    # torchmetrics, Hydra or transformers. One fresh interpreter checks both, in that order.
    code = (
        "import sys; import bert_reduce; "
        "frameworks = {'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra', 'transformers'}; "
        "loaded = lambda: sorted({m.split('.')[0] for m in sys.modules} & frameworks); "
        "print(loaded(), 'torch' in sys.modules); "
        "import torch; "
        "from bert_reduce import BERTMLMLossWithReduction, cross_entropy_loss_sum, pack_batch; "
        "import bert_reduce.context_parallel, bert_reduce.reports, bert_reduce.normalization; "
        "import bert_reduce.num_scored, bert_reduce.sampling, bert_reduce.evaluation; "
        "import bert_reduce.accumulation; "
        "from bert_reduce import GlobalBatchLoss; "
        "mb = {'labels': torch.tensor([[1, -100]])}; g = GlobalBatchLoss(); g.begin([mb]); "
        "g(torch.zeros(1, 2, 3), mb); assert abs(float(g.end()) - 1.0986122886681098) < 1e-6; "
        "loss = BERTMLMLossWithReduction(); "
        "loss.setup({'labels': torch.tensor([[1, 2]]), "
        "'loss_mask': torch.tensor([[True, False]])}); "
        "_, _, report = loss({'token_logits': torch.zeros(2, 1, 3)}); "
        "assert abs(float(loss.reduce([report])) - float(torch.log(torch.tensor(3.0)))) < 1e-6; "
        "print(loaded())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[] False", "[]"], out.stdout


@pytest.mark.parametrize(
    ("module", "old"),
    [
        ("bert_reduce", "masked_cross_entropy"),
        ("bert_reduce.cross_entropy", "select_rows"),
        ("bert_reduce.linear_cross_entropy", "HIDDEN_STATES_KEY"),
        ("bert_reduce.functional", "masked_weighted_sum"),
        ("bert_reduce.metrics", "token_loss_sums"),
    ],
)
def test_no_old_name_resolves(module, old) -> None:
    assert not hasattr(importlib.import_module(module), old)


def test_nemo_and_bionemo_names_need_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from bert_reduce import masked_token_loss, unreduced_token_loss_fn
    assert masked_token_loss is bert_reduce.token_loss_sum
    assert unreduced_token_loss_fn.__module__ == "bert_reduce.cross_entropy"
