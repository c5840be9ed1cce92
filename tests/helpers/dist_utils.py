"""Run a test body in real processes: gloo on CPU, Megatron-Core's parallel state on top.

Deterministic on a busy machine (the cores shared with other jobs):

* No wall-clock limit on the whole test decides its outcome. A busy machine stretches a
  multi-process test many times over (``test_fsdp2_step_equals_one_process``: 27 s for its
  2- and 4-rank cases on an idle machine; the 4-rank case alone 38 to 99 s with the load
  average at 6 to 14, and 134 s on one core shared with 6 CPU-bound processes), so a fixed
  limit on the test (``pytest.mark.timeout(300)``) fails it under enough load. A hang is
  caught where it happens instead: every collective, the rendezvous and the final barrier
  wait at most :data:`HANG_TIMEOUT` for the other ranks (gloo's and the store's own
  timeouts), however slow the steps between them are. :data:`HANG_GUARD_S` bounds a whole
  test only as a last resort, far above any run on a loaded machine.
* Teardown cannot fail a rank that is still working. A rank that leaves the body's last
  collective and destroys its process group closes its gloo connections; a slower rank still
  inside that collective can then fail with "Connection closed by peer" (gloo's own
  ``pytorch/gloo#155``: "Barrier followed by context destruction causes some participants to
  fail"), and the slower a rank is scheduled, the wider that window. So the ranks first meet
  in a barrier on the rendezvous store (a file, not a gloo connection): once every rank has
  arrived there, no rank has a gloo operation left, and closing connections is safe.
* One thread per process (``torch.set_num_threads(1)``): ``world_size`` processes on 2 cores.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HANG_TIMEOUT = timedelta(minutes=10)
"""The longest one rank waits for the others (rendezvous, a collective, the final barrier)."""

HANG_GUARD_S = 1800
"""Last-resort limit for a whole multi-process test (``pytest.mark.timeout``), in seconds."""


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    tp: int,
    cp: int,
    megatron: bool,
    body: Callable[..., None],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(init_file, world_size)
    store.set_timeout(HANG_TIMEOUT)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=HANG_TIMEOUT
    )
    if megatron:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp
        )
    # If the body raises, this process ends with the error and mp.spawn ends the others (they
    # may be waiting for this one in a collective): no teardown to wait for.
    body(*args)
    store.set(f"finished/{rank}", "1")
    store.wait([f"finished/{other}" for other in range(world_size)])
    if megatron:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def run_distributed(
    body: Callable[..., None],
    world_size: int,
    *args: Any,
    tp: int = 1,
    cp: int = 1,
    megatron: bool = True,
) -> None:
    """Run ``body(*args)`` on ``world_size`` gloo processes; a failure on any rank fails the test.

    With ``megatron=True`` each process first initializes Megatron-Core's parallel state with
    the given tensor- and context-parallel sizes (DP is what remains). ``body`` must be a
    module-level function so that it can be pickled into the workers.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(
            _worker,
            args=(world_size, init_file, tp, cp, megatron, body, args),
            nprocs=world_size,
            join=True,
        )
