"""ExactMLMModule on 2 gloo processes, under Lightning DDP and ModelParallelStrategy (FSDP2).

After every step the parameters and logged losses equal those of one process training on the
whole global batch (tests/helpers/exact_training.py's reference; one process:
tests/lightning/) whatever the micro-batch size, with micro-batches holding no masked token and
a rank holding none. DDP: SGD and AdamW, clipping of the exact global gradient, per-token and
per-sequence; each step reduces each gradient bucket once and all-reduces the sums once; an
uneven validation set's reports sum to the loss of the whole set; Lightning's own accumulation
(a mean of means) visibly differs. FSDP2: per-token and per-sequence. Under both, every
micro-batch's loss gets its own count of scored positions as an int (``NumScoredCollator``).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers import exact_training as et
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.slow

VAL_SIZE = 7  # split 3 + 4 over two ranks, in batches of 2: ranks run 2 and 2 uneven batches


def _train(strategy: str, micro_batch_size: int, optimizer=None, clip=None, **kwargs) -> et.Run:
    if strategy == "fsdp2":
        # ModelParallelStrategy refuses "64-true"; "32-true" leaves the fp64 model as is.
        kwargs.update(precision="32-true", model_dtype=torch.float64)
    return et.lightning_train(
        micro_batch_size=micro_batch_size,
        optimizer=optimizer or et.sgd(),
        clip=clip,
        strategy=et.existing_group(strategy),
        devices=torch.distributed.get_world_size(),
        **kwargs,
    )


def _assert_trains_as_reference(run: et.Run, mode: str = "per_token") -> None:
    expected, expected_losses = et.reference_train(et.sgd(), clip=None, mode=mode)
    et.assert_params_close(run.params, expected)
    torch.testing.assert_close(run.losses, expected_losses, rtol=1e-12, atol=0)


def _ddp_checks() -> None:
    # One micro-batch per rank here; 2 and 1 samples per micro-batch in the runs below.
    _assert_trains_as_reference(_train("ddp", et.GLOBAL_BATCH // 2))
    expected_adam, _ = et.reference_train(et.adamw(), clip=None)
    et.assert_params_close(_train("ddp", 2, et.adamw()).params, expected_adam)

    # Clipping of the exact global gradient; counted collectives and no host sync in the step
    # (SGD: Adam's own step reads its step count on the host); an uneven validation set whose
    # reports sum to the loss of the whole set; the count of each micro-batch.
    expected, _ = et.reference_train(et.sgd(), clip=None)
    expected_clipped, _ = et.reference_train(et.sgd(), clip=0.05)
    et.GRADIENT_BUCKETS_REDUCED.clear()
    et.InstrumentedModule.collectives_per_step = []
    run = _train(
        "ddp", 1, clip=0.05, module_cls=et.InstrumentedModule, val_size=VAL_SIZE, count_scored=True
    )
    et.assert_each_loss_got_its_micro_batch_count()
    et.assert_params_close(run.params, expected_clipped)
    assert et.max_param_difference(expected_clipped, expected) > 1e-3  # the clip is active
    num_buckets = len(et.GRADIENT_BUCKETS_REDUCED) // et.STEPS
    # One DDP gradient reduction per step (each bucket once) although each rank ran
    # 8 / world_size micro-batches, ...
    assert num_buckets >= 1
    assert et.GRADIENT_BUCKETS_REDUCED == list(range(num_buckets)) * et.STEPS
    # ... and one all-reduce of the sums; the hook's all-reduces of
    # the gradient buckets go through torch.distributed.all_reduce too.
    per_step = et.InstrumentedModule.collectives_per_step
    assert per_step == [{"all_reduce": num_buckets + 1}] * et.STEPS, per_step
    val_totals = run.val_totals.clone()
    torch.distributed.all_reduce(val_totals)
    torch.testing.assert_close(
        val_totals, et.reference_val_totals(expected_clipped, VAL_SIZE), rtol=1e-10, atol=0
    )

    _assert_trains_as_reference(_train("ddp", 1, mode="per_sequence"), "per_sequence")
    # Lightning's own accumulation + DDP averaging: a mean of means, visibly different.
    assert et.max_param_difference(_train("ddp", 2, stock=True).params, expected) > 1e-3


def _fsdp2_checks() -> None:
    for mode, micro_batch_size in (("per_token", 1), ("per_token", 2), ("per_sequence", 2)):
        count_scored = micro_batch_size == 1
        run = _train("fsdp2", micro_batch_size, mode=mode, count_scored=count_scored)
        if count_scored:
            et.assert_each_loss_got_its_micro_batch_count()
        assert any(isinstance(p, DTensor) for p in run.module.parameters())
        _assert_trains_as_reference(run, mode)


def _body() -> None:
    _ddp_checks()
    _fsdp2_checks()


def test_ddp_and_fsdp2_training_equal_one_process_on_the_global_batch() -> None:
    run_distributed(_body, 2, megatron=False)
