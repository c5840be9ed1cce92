from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_copies_files_that_exist() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/pytorch:\S+-py3", dockerfile, re.MULTILINE)
    sources = []
    for line in dockerfile.splitlines():
        if line.startswith("COPY"):
            args = [a for a in line.split()[1:] if not a.startswith("--")]
            sources += args[:-1]
    assert sources, "the Dockerfile copies nothing"
    for source in sources:
        assert (ROOT / source).exists(), source
    assert "train.py" in dockerfile.splitlines()[-1]  # the default command trains
    # ... with what train.py imports: the core install (torch alone) would fail on Hydra.
    assert re.search(r"pip install .*-e \"?\.\[[^\]]*\brecipe\b", dockerfile)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not any(source.rstrip("/") in ignored for source in sources)
