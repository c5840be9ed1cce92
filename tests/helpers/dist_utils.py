"""Run a test body in real processes: gloo on CPU, Megatron-Core's parallel state on top."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        if megatron:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=tp, context_parallel_size=cp
            )
        body(*args)
    finally:
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
