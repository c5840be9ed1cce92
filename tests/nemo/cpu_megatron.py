"""Test helpers that let NeMo 2's MegatronParallel run Megatron-Core's schedule on CPU.

Each one works around one CUDA-only detail of the libraries without patching their files:

* :func:`megatron_step_on_cpu`: Megatron-Core's schedules allocate their token counter with
  ``torch.zeros([], dtype=torch.int, device="cuda")``; a ``TorchFunctionMode`` puts tensors
  created for ``"cuda"`` on the CPU while the schedule runs. It also answers NeMo's
  ``MegatronStep.adjust_tensor_shapes_fn`` with ``None``, what NeMo's own function returns
  without pipeline parallelism, instead of importing the heavy ``nemo.collections.llm``
  (distillation only) to find that out.
* :class:`CPUGradSync`: Megatron's ``finalize_model_grads`` expects each model chunk wrapped
  in Megatron's DDP, whose grad buffers and streams are CUDA-only. The mixin provides the two
  methods it calls, as Megatron's DDP does them with ``calculate_per_token_loss=True``: a sum
  (not a mean) over the data x context group, then a scale by ``1 / global token count``.
* :func:`single_process_megatron`: a one-process gloo group with Megatron's parallel state,
  in the test process itself (no spawn, so NeMo is imported once).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from nemo.lightning.megatron_parallel import MegatronStep
from torch.overrides import TorchFunctionMode

__all__ = ["CPUGradSync", "megatron_step_on_cpu", "single_process_megatron"]


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Create on the CPU any tensor asked for on a CUDA device."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_step_on_cpu() -> Iterator[None]:
    """Run ``MegatronParallel`` steps on CPU (see the module docstring)."""
    original = MegatronStep.adjust_tensor_shapes_fn
    MegatronStep.adjust_tensor_shapes_fn = property(lambda step: None)  # type: ignore[assignment]
    try:
        with _CudaAllocationsOnCpu():
            yield
    finally:
        MegatronStep.adjust_tensor_shapes_fn = original  # type: ignore[method-assign]


class CPUGradSync:
    """Megatron DDP's ``finish_grad_sync`` / ``scale_gradients`` for a plain ``nn.Module``.

    Mix in before the module class; ``finalize_model_grads`` then works on it unchanged.
    """

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        for param in self.parameters():  # type: ignore[attr-defined]
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        for param in self.parameters():  # type: ignore[attr-defined]
            if param.grad is not None:
                param.grad.mul_(scaling_factor)


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A world of one gloo process with Megatron's parallel state (TP = PP = CP = DP = 1)."""
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
