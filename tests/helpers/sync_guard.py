"""Make host-device syncs and collectives visible on CPU.

On a GPU, ``.item()``, ``bool(tensor)``, ``nonzero()`` and friends block until the device
catches up. On CPU they cost nothing, so the tests detect them by design instead: within
``forbid_host_syncs()`` every such call raises. ``count_collectives()`` counts calls into
``torch.distributed``'s collectives.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist

_SYNCING_METHODS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "barrier",
)


class HostSyncError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[None]:
    def _raise(name: str):
        def _method(self, *args, **kwargs):
            raise HostSyncError(f"torch.Tensor.{name} would synchronize with the device")

        return _method

    with contextlib.ExitStack() as stack:
        for name in _SYNCING_METHODS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, _raise(name)))
        yield


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()

    def _wrap(name: str):
        original = getattr(dist, name)

        def _counted(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return _counted

    with contextlib.ExitStack() as stack:
        for name in _COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, _wrap(name)))
        yield counts
