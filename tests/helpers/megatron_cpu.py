"""Run Megatron-Core's real pipeline schedules and ``finalize_model_grads`` on CPU, in tests.

Small shims, nothing in Megatron is modified:

* ``schedule_counter_on_cpu()``: ``forward_backward_no_pipelining`` allocates its token
  counter once as ``torch.zeros([], dtype=torch.int, device="cuda")``. Inside the context,
  the ``torch`` name *of the schedules module only* is a proxy whose ``zeros`` turns
  ``device="cuda"`` into ``device="cpu"``; every other attribute is the real ``torch``.
* ``GradSyncShell``: ``finalize_model_grads`` calls two methods that Megatron's
  ``DistributedDataParallel`` provides (and which allocates CUDA buffers). The shell provides
  them as DDP does for a model without gradient buffers: ``finish_grad_sync`` sums the
  gradients over the data x context parallel group, after multiplying them by ``1 / dp_cp``
  unless ``calculate_per_token_loss`` (DDP's ``gradient_scaling_factor``), and
  ``scale_gradients`` multiplies them in place, as ``grad_data *= scaling_factor`` does.
* ``single_process_megatron()``: a one-rank gloo group with Megatron's parallel state in the
  test process itself, torn down afterwards (no spawn).
* ``sequence_parallel_mappings_on_cpu()``: Megatron's sequence-parallel all-gather and
  reduce-scatter allocate their outputs on ``torch.cuda.current_device()``; inside the
  context, that name of the mappings module only gives the CPU.
* ``megatron_model_on_cpu()``: the forward of Megatron's own transformer layers (local spec):
  attention's buffer and RNG fork, see its docstring.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn


class _TorchWithCpuZeros(ModuleType):
    """``torch``, except that ``zeros(..., device="cuda")`` allocates on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def schedule_counter_on_cpu() -> Iterator[None]:
    """Within the context, Megatron's schedules allocate their token counter on the CPU."""
    from megatron.core.pipeline_parallel import schedules

    with mock.patch.object(schedules, "torch", _TorchWithCpuZeros()):
        yield


class GradSyncShell(nn.Module):
    """Wraps a model with the two gradient methods ``finalize_model_grads`` calls.

    ``config`` and ``model_type`` are found on the wrapped module, through ``.module``, as
    Megatron's ``get_attr_wrapped_model`` looks for them.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        size = dist.get_world_size(group)
        for param in self.parameters():
            if param.grad is None:
                continue
            if not self.module.config.calculate_per_token_loss:
                param.grad /= size
            if size > 1:
                dist.all_reduce(param.grad, group=group)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        for param in self.parameters():
            if param.grad is not None:
                param.grad *= scaling_factor


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A one-rank gloo group with Megatron's parallel state (TP = PP = CP = DP = 1)."""
    from megatron.core import parallel_state

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1
        )
        try:
            parallel_state.initialize_model_parallel()
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


class _TorchWithCpuCurrentDevice(ModuleType):
    """``torch``, except that ``torch.cuda.current_device()`` names the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = SimpleNamespace(current_device=lambda: "cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def sequence_parallel_mappings_on_cpu() -> Iterator[None]:
    """Megatron-Core's sequence-parallel all-gather and reduce-scatter, on CPU tensors.

    Test-only shim: ``megatron/core/tensor_parallel/mappings.py`` allocates their outputs with
    ``torch.empty(..., device=torch.cuda.current_device())`` (``_gather_along_first_dim``,
    line 141, and ``_reduce_scatter_along_first_dim``, line 181, in megatron-core 0.16.1), and
    so does ``ColumnParallelLinear``'s backward when it all-gathers its sequence-parallel input
    again (``megatron/core/tensor_parallel/layers.py:552``). Within the context, the ``torch``
    name of those two modules only is a proxy whose ``cuda.current_device()`` is ``"cpu"``;
    the collectives themselves are gloo's, unchanged.
    """
    from megatron.core.tensor_parallel import layers, mappings

    with (
        mock.patch.object(mappings, "torch", _TorchWithCpuCurrentDevice()),
        mock.patch.object(layers, "torch", _TorchWithCpuCurrentDevice()),
    ):
        yield


@contextlib.contextmanager
def megatron_model_on_cpu() -> Iterator[None]:
    """Megatron-Core's transformer layers (local layer spec) run forward and backward on CPU.

    Test-only shims, nothing else replaced (line numbers of megatron-core 0.16.1):

    * ``megatron/core/utils.py:631`` (``GlobalMemoryBuffer.get_tensor``) allocates attention's
      score buffer on ``torch.cuda.current_device()``: within the context, the ``torch`` name
      of that module only is the proxy whose ``cuda.current_device()`` is ``"cpu"``;
    * ``megatron/core/transformer/dot_product_attention.py:217`` forks the CUDA RNG tracker
      around attention dropout (even at probability 0): Megatron's own inference tracker
      (``tensor_parallel/random.py``, ``initialize_rng_tracker(inference_rng_tracker=True)``)
      forks no CUDA state. The CUDA tracker is restored afterwards.
    """
    from megatron.core import utils
    from megatron.core.tensor_parallel import random

    with mock.patch.object(utils, "torch", _TorchWithCpuCurrentDevice()):
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield
        finally:
            random.initialize_rng_tracker(force_reset=True)
