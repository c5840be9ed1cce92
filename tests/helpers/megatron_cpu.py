"""Megatron-Core and NeMo 2 on CPU/gloo, for tests: the one set of CPU stand-ins.

Inside :func:`megatron_on_cpu` Megatron's schedules, DDP grad buffers, optimizer, gradient
clipping, sequence-parallel mappings, transformer layers, distributed checkpointing and NeMo 2's
``MegatronParallel``/``MegatronStrategy`` run as on a GPU; only their CUDA calls are answered
on the CPU. Nothing else is replaced: the models, the losses, the schedules, DDP,
``finalize_model_grads``, the optimizer's and the clipping's maths, NeMo's callbacks, logging,
io context and ``nemo_run``. Lines are those of megatron-core 0.15.3 and nemo-toolkit 2.7.3
(``requirements/constraints-nemo.txt``), or 0.16.1 (``constraints-cpu.txt``) where marked.

1. :class:`_CpuTorch` replaces the ``torch`` name of the modules in ``_MODULES_WITH_CUDA_CALLS``
   only (each with the lines whose calls it answers): CUDA devices become the CPU
   (``zeros``/``empty``/``empty_like``/``tensor`` with ``device="cuda"``,
   ``torch.cuda.current_device()``), ``pin_memory=True`` is dropped and that tensor's
   ``.to("cuda", non_blocking=True)`` stays on the CPU, CUDA streams and ``synchronize`` do
   nothing.
2. ``clip_grad_by_total_norm_fp32`` (``optimizer/clip_grads.py:167``) asserts
   ``param.grad.type() == 'torch.cuda.FloatTensor'``: :func:`_clip_grad_by_total_norm_fp32`
   scales as upstream does (``:173-178``), without the assertion.
3. ``Tensor.cuda`` returns the tensor: the tied output weight of the last pipeline stage
   (``models/common/language_module/language_module.py:233``) and loaded checkpoint shards
   (``exchange_utils.py:339,502``).
4. ``ShardedTensor.init_data("cuda")`` (``exchange_utils.py:101,109``) allocates on the CPU.
5. ``nemo/lightning/io/pl.py:495`` (``_fix_tensors_device``) asserts CUDA is initialized; a CPU
   checkpoint has no CUDA tensor to move.
6. Megatron's inference RNG tracker (``tensor_parallel/random.py:282``, a ``fork`` that switches
   no CUDA state) replaces the CUDA one that attention forks even at dropout 0
   (``transformer/dot_product_attention.py:207``, 0.16.1: ``:217``); restored afterwards.

What only a GPU shows is listed in ``docs/nemo.md``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

# Each module, and the lines of its CUDA calls that _CpuTorch answers.
_MODULES_WITH_CUDA_CALLS = {
    "megatron.core.distributed.param_and_grad_buffer": "702,719,725",
    "megatron.core.distributed.distributed_data_parallel": "251",
    "megatron.core.optimizer.optimizer": "469,477,481,1137",
    "megatron.core.optimizer.clip_grads": "90,103,115,174,206",
    "megatron.core.pipeline_parallel.schedules": "573,963,2114 (the token counter)",
    "megatron.core.pipeline_parallel.p2p_communication": "190-202,242,313,321,398",
    # These two, 0.16.1: the sequence-parallel all-gather and reduce-scatter outputs.
    "megatron.core.tensor_parallel.mappings": "141,181",
    "megatron.core.tensor_parallel.layers": "552",
    "megatron.core.dist_checkpointing.exchange_utils": "107,113,329",
    "megatron.core.dist_checkpointing.strategies.async_utils": "163,210,582",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "230",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "271-281",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "204,252",
    "megatron.core.dist_checkpointing.strategies.torch": "72",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "304",
    "megatron.core.utils": "535 (0.16.1: 631; attention's buffer)",
    "megatron.core.timers": "149,162,286",
    "nemo.lightning.megatron_parallel": "142,348,617,1847,1857",
    "nemo.lightning.pytorch.strategies.megatron_strategy": "801,850,881,888",
    "nemo.lightning.pytorch.plugins.data_sampler": "192,212",
}


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuTensor(torch.Tensor):
    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        plain = self.as_subclass(torch.Tensor)
        if args and isinstance(args[0], str | torch.device | int):
            args = (_cpu(args[0]), *args[1:])
        kwargs.pop("non_blocking", None)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return plain.to(*args, **kwargs)


class _CpuCuda:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    current_device = staticmethod(lambda: torch.device("cpu"))
    Stream = staticmethod(lambda: None)
    stream = staticmethod(lambda stream: contextlib.nullcontext())
    default_stream = staticmethod(lambda: None)
    synchronize = staticmethod(lambda: None)


def _on_cpu(factory: Any) -> Any:
    def allocate(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        return factory(*args, **kwargs)

    return staticmethod(allocate)


class _CpuTorch(ModuleType):
    cuda = _CpuCuda()
    zeros = _on_cpu(torch.zeros)
    empty = _on_cpu(torch.empty)
    empty_like = _on_cpu(torch.empty_like)

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        kwargs.pop("pin_memory", None)
        return torch.tensor(data, *args, **kwargs).as_subclass(_CpuTensor)


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_([grad.detach() for grad in grads], clip_coeff)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Within the context, the stand-ins 1-6 of the module docstring are in place.

    NeMo's modules are patched where NeMo is installed (``.venv-nemo``).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random

    with contextlib.ExitStack() as stack:
        for name in _MODULES_WITH_CUDA_CALLS:
            if importlib.util.find_spec(name.split(".")[0]) is not None:
                module = importlib.import_module(name)
                stack.enter_context(mock.patch.object(module, "torch", _CpuTorch()))
        stack.enter_context(
            mock.patch.object(
                megatron_optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32
            )
        )
        stack.enter_context(mock.patch.object(torch.Tensor, "cuda", lambda tensor, *a, **k: tensor))
        init_data = ShardedTensor.init_data
        stack.enter_context(
            mock.patch.object(
                ShardedTensor,
                "init_data",
                lambda self, device, *a, **k: init_data(self, _cpu(device), *a, **k),
            )
        )
        if importlib.util.find_spec("nemo") is not None:
            from nemo.lightning.io import pl as nemo_io_pl

            stack.enter_context(
                mock.patch.object(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt)
            )
        stack.callback(random.initialize_rng_tracker, force_reset=True)
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        yield


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A one-rank gloo group with Megatron's parallel state (TP = PP = CP = DP = 1)."""
    from tests.helpers.dist_utils import megatron_parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1
        )
        try:
            with megatron_parallel_state():
                yield
        finally:
            dist.destroy_process_group()


class GradSync:
    """Megatron DDP's ``finish_grad_sync`` and ``scale_gradients``, for a module without DDP.

    ``finalize_model_grads`` calls them on each model chunk
    (``megatron/core/distributed/finalize_model_grads.py``); they do what DDP does for a model
    without grad buffers: sum over the data x context group (after ``1 / dp_cp`` unless
    ``calculate_per_token_loss``, DDP's ``gradient_scaling_factor``), then scale in place. The
    config is found as Megatron's ``get_model_config`` finds it (through ``.module``). Mix in
    before the module class, or wrap with :class:`GradSyncShell`.
    """

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        size = dist.get_world_size(group)
        per_token = get_model_config(self).calculate_per_token_loss
        for param in self.parameters():  # type: ignore[attr-defined]
            if param.grad is not None:
                if not per_token:
                    param.grad /= size
                dist.all_reduce(param.grad, group=group)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        for param in self.parameters():  # type: ignore[attr-defined]
            if param.grad is not None:
                param.grad *= scaling_factor


class GradSyncShell(GradSync, nn.Module):
    """Wraps a model with :class:`GradSync`; ``config`` and ``model_type`` found via ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
