from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fast_cpu_runs() -> Iterator[None]:
    """Every test here under :func:`tests.helpers.hf_trainer.fast_cpu_runs`."""
    from tests.helpers.hf_trainer import fast_cpu_runs  # needs transformers: imported here

    with fast_cpu_runs():
        yield
