"""bert_reduce.distributed in one process: which groups, the one all-reduce, the device.

Without Megatron-Core's parallel state the groups fall back to the default process group (or
none); with it, they are Megatron's. A real one-rank gloo group stands for "initialized"; the
multi-rank sums are in tests/integration/test_reduction_distributed.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bert_reduce import distributed
from tests.helpers.megatron_cpu import single_process_megatron
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

_PARALLEL_STATE = "megatron.core.parallel_state"


@pytest.fixture
def gloo_world_of_one(tmp_path: Path) -> Iterator[None]:
    """A real default process group of one rank, torn down afterwards."""
    init_method = f"file://{tmp_path / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def assert_single_process_layout(tensor_parallel_group: dist.ProcessGroup | None = None) -> None:
    """TP = CP = 1; without Megatron (no group given), no tensor-parallel group either."""
    assert distributed.megatron_is_initialized() == (tensor_parallel_group is not None)
    assert distributed.tensor_parallel_group() is tensor_parallel_group
    assert distributed.tensor_parallel_world_size() == 1
    assert distributed.context_parallel_world_size() == 1
    assert distributed.context_parallel_rank() == 0


def assert_sum_is_a_no_op(group: dist.ProcessGroup | None) -> None:
    """``all_reduce_sum_`` returns its tensor unchanged, with no collective and no host sync."""
    tensor = torch.tensor([1.5, -2.0], dtype=torch.float64)
    with forbid_host_syncs(), count_collectives() as calls:
        out = distributed.all_reduce_sum_(tensor, group)
    assert out is tensor
    assert torch.equal(tensor, torch.tensor([1.5, -2.0], dtype=torch.float64))
    assert not calls, dict(calls)


@pytest.mark.parametrize("megatron", ["absent", "imported, not initialized"])
def test_one_process_without_any_group_reduces_nothing(megatron, monkeypatch) -> None:
    if megatron == "absent":
        # The module looks Megatron up in sys.modules: without it there, nothing imports it.
        monkeypatch.delitem(sys.modules, _PARALLEL_STATE, raising=False)
    else:
        from megatron.core import parallel_state

        assert not parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()
    assert_single_process_layout()
    assert distributed.loss_reduction_group() is None
    assert_sum_is_a_no_op(None)
    assert (_PARALLEL_STATE in sys.modules) == (megatron != "absent")


def test_default_process_group_without_megatron(gloo_world_of_one: None) -> None:
    assert_single_process_layout()
    assert distributed.loss_reduction_group() is dist.group.WORLD
    # A group of one rank: nothing to sum with, so no collective is issued.
    assert_sum_is_a_no_op(dist.group.WORLD)
    # No group means no reduction, even with the default group initialized.
    assert_sum_is_a_no_op(None)


def test_megatron_parallel_state_gives_its_groups() -> None:
    with single_process_megatron():
        from megatron.core import parallel_state as ps

        assert_single_process_layout(ps.get_tensor_model_parallel_group())
        group = distributed.loss_reduction_group()
        # Megatron's data x context parallel group, not the default group it was built from.
        assert group is ps.get_data_parallel_group(with_context_parallel=True)
        assert group is not dist.group.WORLD
        assert_sum_is_a_no_op(group)
    # Torn down: back to no Megatron and no group.
    assert_single_process_layout()
    assert distributed.loss_reduction_group() is None


def test_default_device_is_the_current_accelerator_else_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    assert distributed.default_device() == torch.device("cpu")
    # As on a machine whose current device is cuda:1: the device keeps the index (a tensor
    # made on cuda:0 would belong to another rank's GPU).
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    assert distributed.default_device() == torch.device("cuda", 1)
