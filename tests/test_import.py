from __future__ import annotations

import subprocess
import sys


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
