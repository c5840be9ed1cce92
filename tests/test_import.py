from __future__ import annotations

import subprocess
import sys


def test_import_is_light_and_needs_no_nemo() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); import bert_reduce; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} "
        "& {'torch', 'megatron', 'lightning', 'nemo', 'torchmetrics', 'hydra'}); "
        "print(heavy, time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    heavy, seconds = out.stdout.rsplit(" ", 1)
    assert heavy == "[]", out.stdout
    assert float(seconds) < 5.0
