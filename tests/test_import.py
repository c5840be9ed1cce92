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
