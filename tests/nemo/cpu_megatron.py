"""Test helpers that let NeMo 2's MegatronParallel run Megatron-Core's schedule on CPU.

Each one works around one CUDA-only detail of the libraries without patching their files:

* :func:`megatron_step_on_cpu`: Megatron-Core's schedules allocate their token counter with
  ``torch.zeros([], dtype=torch.int, device="cuda")``; the core suite's
  ``tests.megatron_cpu.schedule_counter_on_cpu`` puts it on the CPU. It also answers NeMo's
  ``MegatronStep.adjust_tensor_shapes_fn`` with ``None``, what NeMo's own function returns
  without pipeline parallelism, instead of importing the heavy ``nemo.collections.llm``
  (distillation only) to find that out.
* :class:`CPUGradSync`: Megatron's ``finalize_model_grads`` expects each model chunk wrapped
  in Megatron's DDP, whose grad buffers and streams are CUDA-only. The mixin provides the two
  methods it calls, as Megatron's DDP does them with ``calculate_per_token_loss=True``: a sum
  (not a mean) over the data x context group, then a scale by ``1 / global token count``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from nemo.lightning.megatron_parallel import MegatronStep

from tests.helpers.megatron_cpu import schedule_counter_on_cpu

__all__ = ["CPUGradSync", "megatron_step_on_cpu"]


@contextlib.contextmanager
def megatron_step_on_cpu() -> Iterator[None]:
    """Run ``MegatronParallel`` steps on CPU (see the module docstring)."""
    original = MegatronStep.adjust_tensor_shapes_fn
    MegatronStep.adjust_tensor_shapes_fn = property(lambda step: None)  # type: ignore[assignment]
    try:
        with schedule_counter_on_cpu():
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
