"""bert_reduce.distributed on 2 gloo processes: each group holds the ranks it names.

Plain torch.distributed (the default group), and Megatron-Core with TP = 2 or CP = 2: the
token sums reduce over data x context parallel ranks only, never over tensor-parallel ones
(which hold the same sums), and ``all_reduce_sum_`` issues its one collective only where the
group has more than one rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bert_reduce import distributed
from tests.helpers.dist_utils import megatron_parallel_state, run_distributed
from tests.helpers.sync_guard import count_collectives, forbid_host_syncs

pytestmark = pytest.mark.slow


def _summed(group: dist.ProcessGroup | None) -> tuple[float, int]:
    """This rank's ``rank + 1`` summed by ``all_reduce_sum_``, and the collectives it issued."""
    tensor = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64)
    with forbid_host_syncs(), count_collectives() as calls:
        out = distributed.all_reduce_sum_(tensor, group)
    assert out is tensor
    return float(tensor), sum(calls.values())


def _plain_body() -> None:
    # TP = CP = 1 without Megatron, as in one process (tests/test_distributed.py).
    assert not distributed.megatron_is_initialized()
    group = distributed.loss_reduction_group()
    assert group is dist.group.WORLD
    assert _summed(group) == (1.0 + 2.0, 1)
    assert _summed(None) == (dist.get_rank() + 1.0, 0)


def _megatron_body(tp: int, cp: int) -> None:
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    assert distributed.megatron_is_initialized()
    tp_group = distributed.tensor_parallel_group()
    assert tp_group is ps.get_tensor_model_parallel_group()
    assert distributed.tensor_parallel_world_size() == dist.get_world_size(tp_group) == tp
    assert distributed.context_parallel_world_size() == cp
    assert distributed.context_parallel_rank() == (rank if cp == 2 else 0)
    loss_group = distributed.loss_reduction_group()
    # DP x CP: both ranks when they split the sequence, this rank alone when they split the
    # vocabulary (DP = 1).
    assert dist.get_process_group_ranks(loss_group) == ([0, 1] if cp == 2 else [rank])
    assert _summed(loss_group) == ((3.0, 1) if cp == 2 else (rank + 1.0, 0))
    assert _summed(tp_group) == ((3.0, 1) if tp == 2 else (rank + 1.0, 0))


def _body() -> None:
    _plain_body()
    for tp, cp in ((2, 1), (1, 2)):
        with megatron_parallel_state(tp, cp):
            _megatron_body(tp, cp)


def test_default_and_megatron_groups_reduce_over_the_ranks_they_name() -> None:
    # One spawn: the default group, then Megatron's TP = 2, then its CP = 2.
    run_distributed(_body, 2, megatron=False)
