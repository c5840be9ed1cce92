"""CPU stand-ins for the CUDA-only plumbing of NeMo 2 and Megatron-Core, for tests only.

With :func:`megatron_on_cpu`, a real ``nl.Trainer(strategy=nl.MegatronStrategy(...)).fit(...)``
runs on CPU/gloo. Nothing else is replaced: the model, the loss reductions, Megatron's
schedules, Megatron's ``DistributedDataParallel`` and its grad buffers,
``finalize_model_grads``, Megatron's optimizer and gradient clipping maths, distributed
checkpointing, NeMo's ``MegatronParallel`` (its ``nemo.collections.llm`` import included),
callbacks, logging, io context and ``nemo_run`` all run as on a GPU. Line numbers are those of
megatron-core 0.15.3 and nemo-toolkit 2.7.3 (``requirements/constraints-nemo.txt``).

1. :class:`_CpuTorch` replaces the ``torch`` name of the modules in
   ``_MODULES_WITH_CUDA_CALLS`` only; it is ``torch`` except that CUDA devices become the CPU
   (``zeros``/``empty``/``empty_like``/``tensor`` with ``device="cuda"``,
   ``torch.cuda.current_device()``), ``pin_memory=True`` is dropped and the resulting tensor's
   ``.to("cuda", non_blocking=True)`` stays on the CPU, and ``torch.cuda.Stream``/``stream``/
   ``default_stream``/``synchronize`` do nothing. The CUDA calls it answers:

   * ``megatron/core/distributed/param_and_grad_buffer.py:702,719,725`` (grad buffers on
     ``torch.cuda.current_device()``), ``distributed_data_parallel.py:251`` (stream);
   * ``megatron/core/optimizer/optimizer.py:469,477,481,1137`` and ``clip_grads.py:90,103,
     115,174,206`` (``device="cuda"`` scalars of the optimizer and the grad norm);
   * ``megatron/core/pipeline_parallel/schedules.py:573,963,2114`` (token counter) and
     ``p2p_communication.py:190-202,242,313,321,398`` (shape exchange, synchronize);
   * ``megatron/core/utils.py:535`` (attention's global memory buffer) and ``timers.py:149,
     162,286``;
   * ``megatron/core/dist_checkpointing/exchange_utils.py:107,113,329``,
     ``strategies/async_utils.py:163,210,582``, ``strategies/filesystem_async.py:230``,
     ``strategies/fully_parallel.py:271-281``, ``strategies/state_dict_saver.py:204,252``,
     ``strategies/torch.py:72``, ``tensor_aware_state_dict.py:304`` (save and load);
   * ``nemo/lightning/megatron_parallel.py:348,617,1847,1857`` (reduced loss of non-last
     stages, CUDA stream around ``init_ddp``), ``pytorch/strategies/megatron_strategy.py:801,
     850,881,888`` and ``pytorch/plugins/data_sampler.py:192,212`` (pinned copies to the GPU
     before logging).

2. ``clip_grad_by_total_norm_fp32`` (``megatron/core/optimizer/clip_grads.py:167``) asserts
   ``param.grad.type() == 'torch.cuda.FloatTensor'``; :func:`_clip_grad_by_total_norm_fp32`
   scales the gradients as upstream does, without the assertion.
3. ``Tensor.cuda`` returns the tensor: the tied output weight of the last pipeline stage is
   moved to the GPU before the all-reduce that copies the embedding into it
   (``megatron/core/models/common/language_module/language_module.py:233``), and loading a
   distributed checkpoint moves shards (``exchange_utils.py:339,502``).
4. ``ShardedTensor.init_data("cuda")`` (``exchange_utils.py:101,109``) allocates on the CPU.
5. ``nemo/lightning/io/pl.py:495`` (``_fix_tensors_device``) asserts CUDA is initialized and
   moves a loaded checkpoint's CUDA tensors to the current GPU; a CPU checkpoint has none.
6. Megatron's inference RNG tracker (``megatron/core/tensor_parallel/random.py:282``, a
   ``fork`` that switches no CUDA RNG state) replaces the CUDA one that attention dropout
   forks (``megatron/core/transformer/dot_product_attention.py:207``); the tests use no
   dropout.

:class:`CPUGradSync` is for the tests that drive ``MegatronParallel`` by hand without
Megatron's DDP. What only a GPU shows is listed in ``docs/nemo.md``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.tensor_parallel import random
from nemo.lightning.io import pl as nemo_io_pl

__all__ = ["CPUGradSync", "megatron_on_cpu"]


def _cpu(device: Any) -> Any:
    """``device`` with CUDA replaced by the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _stay_on_cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.cuda`` on a machine without CUDA: the tensor itself."""
    return tensor


class _CpuTensor(torch.Tensor):
    """A CPU tensor whose ``.to("cuda", ...)`` stays on the CPU (see the module docstring)."""

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        plain = self.as_subclass(torch.Tensor)
        if args and isinstance(args[0], str | torch.device | int):
            args = (_cpu(args[0]), *args[1:])
        kwargs.pop("non_blocking", None)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return plain.to(*args, **kwargs)


class _CpuCuda:
    """``torch.cuda``, except the few functions the listed lines call (no CUDA here)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def Stream() -> None:
        return None

    @staticmethod
    def stream(stream: None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def default_stream() -> None:
        return None

    @staticmethod
    def synchronize() -> None:
        return None


class _CpuTorch(ModuleType):
    """``torch``, with CUDA devices mapped to the CPU in the calls the listed lines make."""

    cuda = _CpuCuda()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        return torch.empty(*args, **kwargs)

    @staticmethod
    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        return torch.empty_like(*args, **kwargs)

    @staticmethod
    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs["device"] = _cpu(kwargs.get("device"))
        kwargs.pop("pin_memory", None)
        return torch.tensor(data, *args, **kwargs).as_subclass(_CpuTensor)


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion.

    The same scale as upstream (``megatron/core/optimizer/clip_grads.py:173-178``): every fp32
    gradient times ``max_norm / (total_norm + 1e-6)`` when that is below 1.
    """
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [
        getattr(param, attribute)
        for param in parameters
        if getattr(param, attribute, None) is not None
    ]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_([grad.detach() for grad in grads], clip_coeff)


_MODULES_WITH_CUDA_CALLS = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.utils",
    "megatron.core.timers",
    "nemo.lightning.megatron_parallel",
    "nemo.lightning.pytorch.strategies.megatron_strategy",
    "nemo.lightning.pytorch.plugins.data_sampler",
    "megatron.core.pipeline_parallel.schedules",
)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Within the context, the stand-ins 1-6 of the module docstring are in place."""
    with contextlib.ExitStack() as stack:
        for name in _MODULES_WITH_CUDA_CALLS:
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "torch", _CpuTorch()))
        stack.enter_context(
            mock.patch.object(
                megatron_optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32
            )
        )
        # Tied embeddings under pipeline parallelism: the last stage's output weight is moved to
        # the GPU before the all-reduce that copies the first stage's embedding into it.
        stack.enter_context(mock.patch.object(torch.Tensor, "cuda", _stay_on_cpu))
        # Loading a distributed checkpoint allocates exchange buffers with
        # ShardedTensor.init_data("cuda") (exchange_utils.py:101, :109).
        original_init_data = ShardedTensor.init_data
        stack.enter_context(
            mock.patch.object(
                ShardedTensor,
                "init_data",
                lambda self, device, *args, **kwargs: original_init_data(
                    self, _cpu(device), *args, **kwargs
                ),
            )
        )
        # nemo/lightning/io/pl.py:495 asserts CUDA is initialized, then moves CUDA tensors of
        # a loaded checkpoint to the current GPU; a CPU checkpoint has none to move.
        stack.enter_context(mock.patch.object(nemo_io_pl, "_fix_tensors_device", lambda ckpt: ckpt))
        stack.callback(random.initialize_rng_tracker, force_reset=True)
        # Megatron's own tracker for inference forks no CUDA RNG state; NeMo's set-up keeps a
        # tracker that is already initialized.
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        yield


class CPUGradSync:
    """Megatron DDP's ``finish_grad_sync`` / ``scale_gradients`` for a plain ``nn.Module``.

    For the tests that drive ``MegatronParallel`` by hand without wrapping the module in
    Megatron's DDP (the real fits use Megatron's DDP itself). ``finalize_model_grads`` calls
    these two methods on each model chunk (``megatron/core/distributed/finalize_model_grads.py``
    ``model_chunk.finish_grad_sync()`` and ``model_chunk.scale_gradients(...)``); they do what
    Megatron's DDP does with ``calculate_per_token_loss=True``: a sum (not a mean) over the
    data x context group, then a scale by ``1 / global token count``. Mix in before the module
    class.
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
