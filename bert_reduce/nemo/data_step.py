"""A NeMo data step that hands the loss this rank's ``num_scored``, counted on the host."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor

from bert_reduce import distributed
from bert_reduce.context_parallel import get_batch_on_this_cp_rank, get_packed_batch_on_this_cp_rank
from bert_reduce.num_scored import NUM_SCORED_KEY, count_scored, scored_count

DataStep = Callable[[Iterator[Any]], Mapping[str, Any]]
"""NeMo's data step: takes the data iterator, returns one micro-batch, ready for the model."""


def _this_rank_count(batch: Mapping[str, Any]) -> int | None:
    """This context-parallel rank's count of scored positions, read on the host, or ``None``.

    Counted on this rank's shard of the host ``loss_mask`` (else ``labels``); where those are
    already on a device, the batch's own host count (the whole micro-batch's: an upper bound
    under context parallelism), else ``None`` (the loss then counts: one sync).
    """
    probe = {key: batch[key] for key in ("loss_mask", "labels") if key in batch}
    scored = probe.get("loss_mask", probe.get("labels"))
    if not isinstance(scored, Tensor) or scored.device.type != "cpu":
        given = batch.get(NUM_SCORED_KEY)
        return None if given is None else scored_count(given)
    if distributed.context_parallel_world_size() > 1:
        if "cu_seqlens_padded" in batch and scored.size(0) == 1:
            probe["cu_seqlens_padded"] = batch["cu_seqlens_padded"]
            probe = get_packed_batch_on_this_cp_rank(probe)
        else:
            probe = get_batch_on_this_cp_rank(probe)
    return count_scored(probe)


def num_scored_data_step(data_step: DataStep) -> DataStep:
    """``data_step``, with ``num_scored`` added to the micro-batch it returns.

    For BioNeMo (``biobert_lightning_module(config, data_step=num_scored_data_step(
    biobert_data_step), ...)``), NeMo's data steps, or a module's own; what it counts, and
    why: ``docs/nemo.md``, "The count of scored positions". A ``num_scored`` the collator
    added is used where the mask is not on the host; the wrapped step never sees it.

    Args:
        data_step: NeMo's data step: the data iterator in, one micro-batch (a mapping) out.
            It receives an iterator over the one micro-batch taken here, in the form the
            loader gave it (NeMo's ``(batch, batch_idx, dataloader_idx)`` tuple included).

    Returns:
        A data step returning ``data_step``'s micro-batch plus ``num_scored``.

    Raises:
        TypeError: If the loader's batch or ``data_step``'s result is not a mapping.
    """

    def step(dataloader_iter: Iterator[Any]) -> dict[str, Any]:
        item = next(dataloader_iter)
        # NeMo may wrap the loader's batch as (batch, batch_idx, dataloader_idx).
        wrapped = isinstance(item, tuple) and len(item) == 3
        batch = item[0] if wrapped else item
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"num_scored_data_step needs batches that are dicts, got {type(batch).__name__}."
            )
        count = _this_rank_count(batch)
        batch = {key: value for key, value in batch.items() if key != NUM_SCORED_KEY}
        out = data_step(iter([(batch, *item[1:]) if wrapped else batch]))
        if not isinstance(out, Mapping):
            raise TypeError(
                f"The wrapped data step returned {type(out).__name__}, not a dict; "
                "num_scored_data_step adds num_scored to a dict."
            )
        out = dict(out)
        if count is not None:
            out[NUM_SCORED_KEY] = count
        return out

    return step
