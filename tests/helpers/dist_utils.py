"""Run a test body in real processes: gloo on CPU, Megatron-Core's parallel state on top.

Deterministic on a busy machine (the cores shared with other jobs):

* A hang fails where it happens: the rendezvous, every collective and the final barrier wait
  at most :data:`HANG_TIMEOUT` for the other ranks, however slow the steps between them.
* Teardown cannot fail a rank that is still working. A rank that destroys its process group
  closes its gloo connections, and a slower rank still inside the last collective can then
  fail with "Connection closed by peer" (``pytorch/gloo#155``). So the ranks first meet in a
  barrier on the rendezvous store (a file, not a gloo connection).
* One thread per process (``torch.set_num_threads(1)``): ``world_size`` processes on 2 cores.

Ranks are forked from one ``forkserver`` process that imported :data:`PRELOADED` once per test
session: a rank starts in a fraction of a second instead of importing them afresh. The server
starts clean (not a fork of pytest) and reads its environment once: a body gets what it needs
as arguments, not through ``os.environ`` set by the test.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

HANG_TIMEOUT = timedelta(minutes=4)
"""The longest one rank waits for the others (rendezvous, a collective, the final barrier)."""

HANG_GUARD_S = 540
"""The longest a test waits for a subprocess (``train.py``, ``torchrun``), in seconds: below
pytest-timeout's 600, so that the subprocess's own output is what the failure shows."""


PRELOADED = [
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "lightning.pytorch",
    "transformers.models.bert.modeling_bert",
    "transformers.models.esm.modeling_esm",
    "transformers.trainer",
    "nemo.lightning",  # in the NeMo environment only
    "nemo.collections.llm",
]
"""What the forkserver imports before forking any rank (one missing is skipped)."""

_START_METHOD = "forkserver"
multiprocessing.set_forkserver_preload(PRELOADED)


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
    # If the body raises, this process ends with the error and mp.spawn ends the others (they
    # may be waiting for this one in a collective): no teardown to wait for.
    with megatron_parallel_state(tp, cp) if megatron else contextlib.nullcontext():
        body(*args)
        store.set(f"finished/{rank}", "1")
        store.wait([f"finished/{other}" for other in range(world_size)])
    dist.destroy_process_group()


@contextlib.contextmanager
def megatron_parallel_state(tp: int = 1, cp: int = 1) -> Iterator[None]:
    """Megatron-Core's parallel state at TP = ``tp`` and CP = ``cp`` (DP: the rest), then none.

    Needs the default process group; a body can go through several layouts in one spawn.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def run_distributed(
    body: Callable[..., None],
    world_size: int,
    *args: Any,
    tp: int = 1,
    cp: int = 1,
    megatron: bool = True,
) -> None:
    """Run ``body(*args)`` on ``world_size`` gloo processes; a failure on any rank fails the test.

    With ``megatron=True``, inside :func:`megatron_parallel_state` at ``tp`` and ``cp``.
    ``body`` must be a module-level function (it is pickled into the workers).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _worker,
            args=(world_size, init_file, tp, cp, megatron, body, args),
            nprocs=world_size,
            join=True,
            start_method=_START_METHOD,
        )


def _launched_worker(
    rank: int, world_size: int, port: int, body: Callable[..., None], args: tuple[Any, ...]
) -> None:
    # What a launcher (torchrun, SLURM) sets; Lightning then starts no processes itself.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    body(*args)


def run_launched(body: Callable[..., None], world_size: int, *args: Any) -> None:
    """``body(*args)`` on ``world_size`` processes set up as torchrun would, for Lightning/NeMo.

    The body (its trainer) creates the process group from the environment.
    """
    mp.start_processes(
        _launched_worker,
        args=(world_size, free_port(), body, args),
        nprocs=world_size,
        start_method=_START_METHOD,
    )


def join_existing_group() -> None:
    """Set what torchrun sets, from the group ``run_distributed`` made: Lightning and accelerate
    then take the processes for launched ones and keep the group."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, NODE_RANK="0"
    )


def sync_on_last(model: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Gradients synced on the last micro-batch only: DDP's ``no_sync``, FSDP2's flag."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)  # type: ignore[operator]
    return contextlib.nullcontext()


def full(tensor: Any) -> Any:
    """``tensor`` whole: an FSDP2 shard (``DTensor``) gathered."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole gradient by name: FSDP2's shards gathered, DDP's wrapper dropped."""
    module = getattr(model, "module", model)  # DistributedDataParallel's wrapped model
    return {name: full(param.grad) for name, param in module.named_parameters()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_rank_results(out_dir: str | os.PathLike[str], world_size: int) -> list[Any]:
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world_size)]
