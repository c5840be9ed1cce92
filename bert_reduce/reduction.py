"""NeMo 2 / Megatron-Core loss reduction for BERT masked-language modelling.

Each micro-batch reports ``(loss_sum, num_tokens)``; nothing is averaged until the whole step
is in. The schedule (Megatron-Core's ``forward_backward_*`` with
``calculate_per_token_loss=True``) sums the token counts over micro-batches and data x context
ranks and divides the summed gradients once, in ``finalize_model_grads``; ``reduce`` does the
same for the logged value with a single all-reduce.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

import torch
from torch import Tensor, nn

from bert_reduce import distributed
from bert_reduce._deprecation import REMOVED_IN
from bert_reduce.cross_entropy import (
    Capacity,
    cross_entropy_token_losses,
    unreduced_token_loss_fn,
)
from bert_reduce.functional import check_same_shape, validate_masked_labels
from bert_reduce.linear_cross_entropy import (
    HIDDEN_LAYOUT_KEY,
    HIDDEN_STATES_KEY,
    OUTPUT_BIAS_KEY,
    OUTPUT_WEIGHT_KEY,
    head_logits,
    linear_cross_entropy_loss_sum,
)
from bert_reduce.normalization import Normalization, checked_normalization, token_loss_sum
from bert_reduce.num_scored import NUM_SCORED_KEY
from bert_reduce.packing import batch_sequence_normalizers
from bert_reduce.reports import (
    DataParallelGroupLossAndIO,
    LossReport,
    PerTokenLossDict,
    SameSizeLossDict,
    make_report,
    reduce_reports,
)

__all__ = [
    "FORWARD_OUT_LAYOUTS",
    "BERTMLMLossWithReduction",
    "DataParallelGroupLossAndIO",
    "MegatronLossReduction",
    "PerTokenLossDict",
    "SameSizeLossDict",
]


FORWARD_OUT_LAYOUTS: dict[str, str] = {
    "token_logits": "[s, b, v] logits",
    "logits": "[b, s, v] logits",
    "lm_loss": "[b, s] per-token losses",
    HIDDEN_STATES_KEY: "hidden states and output_weight, for the fused masked-only head",
}
"""What :meth:`BERTMLMLossWithReduction.forward` reads from the model's outputs, by key: the
one list of the keys (the first three are scored as they are; the last is the fused head's)."""

ForwardOutKey = Literal[tuple(FORWARD_OUT_LAYOUTS)]  # type: ignore[valid-type]
"""The keys of :data:`FORWARD_OUT_LAYOUTS`, as a type."""

_SCORED_AS_GIVEN = tuple(key for key in FORWARD_OUT_LAYOUTS if key != HIDDEN_STATES_KEY)

CrossEntropy = Literal["masked", "megatron", "megatron_fused"]
"""Which cross-entropy the loss runs on logits; see :class:`BERTMLMLossWithReduction`."""

DataT = TypeVar("DataT")
ReductionT = TypeVar("ReductionT")

try:
    from nemo.lightning.megatron_parallel import MegatronLossReduction
except ImportError:

    class MegatronLossReduction(nn.Module, Generic[DataT, ReductionT]):  # type: ignore[no-redef]
        """NeMo 2's loss-reduction contract, for when NeMo is not installed.

        ``setup(batch)`` stores the micro-batch; calling the module on the model's output then
        reaches ``forward(batch, forward_out)``; ``reduce(reports)`` turns the reports of every
        micro-batch of a step into one scalar. With NeMo installed, this name is NeMo's own
        class, so NeMo's ``isinstance`` checks pass.
        """

        def __init__(self) -> None:
            super().__init__()
            self.batch: DataT | None = None
            self.register_forward_pre_hook(self._pre_forward_hook)

        def setup(self, batch: DataT) -> None:
            """Remember the micro-batch the next call's ``forward`` receives."""
            self.batch = batch

        def _pre_forward_hook(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (self.batch, *args)

        def forward(self, batch: DataT, forward_out: Any) -> tuple[Any, ...]:
            """Loss of one micro-batch and its report."""
            raise NotImplementedError

        def reduce(self, losses_reduced_per_micro_batch: Sequence[ReductionT]) -> Tensor:
            """One scalar from the reports of every micro-batch of a step."""
            raise NotImplementedError


def _require(mapping: Mapping[str, Any], key: str, name: str) -> Tensor:
    if key not in mapping:
        raise KeyError(f"{name} has no {key!r} key; it has {sorted(mapping)}.")
    value = mapping[key]
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}.")
    return value


def _detached(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in mapping.items()}


class BERTMLMLossWithReduction(MegatronLossReduction):
    """Masked-language-model loss over the masked tokens, exact under any split of the batch.

    ``forward(batch, forward_out)`` returns ``(loss_sum, num_tokens, report)``, the three-tuple
    Megatron-Core's ``forward_step_calc_loss`` understands:

    * ``calculate_per_token_loss=True`` (recommended): Megatron back-propagates ``loss_sum``,
      adds up ``num_tokens`` over micro-batches, all-reduces it over data x context ranks and
      divides the summed gradients by it in ``finalize_model_grads``. The gradient is that of
      the exact mean over every masked token of the global batch, however it is split into
      micro-batches, DP ranks or CP shards.
    * ``calculate_per_token_loss=False``: Megatron divides each micro-batch's ``loss_sum`` by
      ``max(num_tokens, 1)`` and by the number of micro-batches, and DDP averages over ranks:
      a mean of micro-batch means (BioNeMo's behaviour), never NaN, but not the global mean.

    ``forward`` runs no collective (except the tensor-parallel ones inside the vocab-parallel
    cross-entropy) and never reads device values on the host, with one documented exception:
    fed hidden states without a ``batch["num_scored"]`` (nor a static ``mask_capacity``), the
    fused head counts the scored rows and reads the count back (one host sync per micro-batch
    on an accelerator; see :mod:`bert_reduce.linear_cross_entropy`). A micro-batch without masked
    tokens contributes 0 to the sum and to the count, and a zero gradient. ``reduce`` returns
    the exact global mean for logging, with one all-reduce, and 0.0 when the whole global batch
    has no masked token. The same holds in validation whether the last partial batch is
    dropped or not: ``val_drop_last`` is accepted for compatibility and changes nothing.

    The module keeps no state between calls: NeMo builds a fresh instance per micro-batch and
    another for ``reduce``.

    Args:
        validation_step: Whether this instance serves validation (selects which
            ``send_*_output`` applies).
        val_drop_last: Accepted for BioNeMo compatibility; the reduction is exact either way.
        send_train_output: In training, also return the detached batch and model outputs.
        send_val_output: In validation, also return the detached batch and model outputs.
            Off by default (it was on before, as in BioNeMo): NeMo keeps every report of a
            validation step until ``reduce``, so each would hold its micro-batch's logits.
            Turn it on for metrics that need them.
        forward_out_key: Which entry of ``forward_out`` to score (see ``forward``); by
            default the one of ``token_logits``, ``logits``, ``lm_loss`` present, else
            ``hidden_states``.
        cross_entropy_loss_fusion: Deprecated (BioNeMo's config field): ``True`` is
            ``cross_entropy="megatron_fused"``, ``False`` changes nothing; warns either way.
        check_labels: Raise ``ValueError`` if a masked label is outside the vocabulary or a
            ``loss_mask`` weight is negative. This reads them on the host (a device sync):
            meant for debugging. Without it, either makes the loss NaN.
        normalization: What the summed loss is divided by: ``"per_token"`` (default),
            ``"per_sequence"`` or ``"constant"``; see :mod:`bert_reduce.normalization`. The
            second output of ``forward`` is that mode's denominator, which Megatron sums
            exactly like a token count.
        constant_per_sequence: The ``"constant"`` mode's denominator per sequence (e.g. the
            maximum sequence length): the global denominator is it times the number of
            sequences in the global batch.
        weight_resolution: For a float ``loss_mask`` in ``"per_token"`` mode, round weights to
            multiples of ``1 / weight_resolution`` so the denominator is an exact integer.
            Needed under Megatron-Core's schedule, whose int32 token counter raises on a
            float denominator; without it the denominator is the fp64 sum of the weights.
        cross_entropy: ``"masked"`` (default): :func:`bert_reduce.cross_entropy_token_losses`
            on logits (and :func:`bert_reduce.linear_cross_entropy_loss_sum` on hidden
            states), which normalize only the rows the mask selects, never copy or modify the
            logits and run one collective under TP; ``"megatron"``: Megatron-Core's
            vocab-parallel cross-entropy on every position (on a private fp32 copy of the
            logits, :func:`bert_reduce.cross_entropy.unreduced_token_loss_fn`);
            ``"megatron_fused"``: its fused kernel (one all-reduce fewer under TP, gradient in
            bf16). Both Megatron kernels need ``[s, b, v]`` logits, which they compute from
            hidden states when given those.
        mask_capacity: Which rows ``"masked"`` computes: ``"all"`` (exact for any mask, no
            host sync), a static row count or fraction of ``b * s`` (faster; exact up to that
            many masked tokens, NaN beyond), or ``"nonzero"`` (exact, one host sync). ``None``
            (default): ``"all"`` on logits, ``"nonzero"`` on hidden states (the fused head
            computes the scored rows only, whose count it reads back: one host sync per
            micro-batch on an accelerator). See :mod:`bert_reduce.cross_entropy`. A
            ``batch["num_scored"]`` (the data pipeline's count: a Python ``int``, a tuple of
            per-sample ints, or a tensor of counts on the CPU) overrides it with the exact
            count, sync-free.

    Per-sequence and constant modes need to know which tokens form a sequence (see
    :func:`bert_reduce.packing.batch_sequence_normalizers`). By default each ``[b, s]`` row is
    one; in a packed ``[1, T]`` row, each segment of ``cu_seqlens_padded``/``cu_seqlens`` or
    Hugging Face's ``cu_seq_lens_q_padded``/``cu_seq_lens_q``/``position_ids``. Under context
    parallelism a shard cannot see whole sequences: the batch must then carry
    ``sequence_weight`` and ``sequence_start`` (``[b, s]``, from
    :func:`bert_reduce.normalization.sequence_normalizers` on the unsliced batch, sliced with
    it; :func:`bert_reduce.pack_batch` adds them to packed batches).
    """

    def __init__(
        self,
        validation_step: bool = False,
        val_drop_last: bool = True,
        send_train_output: bool = False,
        send_val_output: bool = False,
        *,
        forward_out_key: ForwardOutKey | None = None,
        cross_entropy_loss_fusion: bool | None = None,
        check_labels: bool = False,
        normalization: Normalization | str = Normalization.PER_TOKEN,
        constant_per_sequence: int | None = None,
        weight_resolution: int | None = None,
        cross_entropy: CrossEntropy = "masked",
        mask_capacity: Capacity | None = None,
    ) -> None:
        super().__init__()
        self.validation_step = validation_step
        self.val_drop_last = val_drop_last
        self.send_train_output = send_train_output
        self.send_val_output = send_val_output
        if forward_out_key is not None and forward_out_key not in FORWARD_OUT_LAYOUTS:
            raise ValueError(
                f"forward_out_key must be one of {sorted(FORWARD_OUT_LAYOUTS)}, got "
                f"{forward_out_key!r}."
            )
        self.forward_out_key = forward_out_key
        self.check_labels = check_labels
        self.normalization = checked_normalization(normalization, constant_per_sequence)
        self.constant_per_sequence = constant_per_sequence
        self.weight_resolution = weight_resolution
        if cross_entropy not in ("masked", "megatron", "megatron_fused"):
            raise ValueError(
                "cross_entropy must be 'masked', 'megatron' or 'megatron_fused', got "
                f"{cross_entropy!r}."
            )
        if cross_entropy_loss_fusion is not None:
            warnings.warn(
                "BERTMLMLossWithReduction(cross_entropy_loss_fusion=...) is deprecated and will "
                f"be removed in bert_reduce {REMOVED_IN}; use cross_entropy='megatron_fused' "
                "(for True) or leave it out (for False).",
                DeprecationWarning,
                stacklevel=2,
            )
            if cross_entropy_loss_fusion:
                cross_entropy = "megatron_fused"
        self.cross_entropy: CrossEntropy = cross_entropy
        self.mask_capacity = mask_capacity

    def forward(
        self, batch: Mapping[str, Any], forward_out: Mapping[str, Any]
    ) -> tuple[Tensor, Tensor, PerTokenLossDict | DataParallelGroupLossAndIO]:
        """Loss sum and masked-token count of one micro-batch on this rank.

        Args:
            batch: ``labels`` (``[b, s]`` int token ids) and ``loss_mask`` (``[b, s]``,
                non-zero where scored, or float weights); under context parallelism, this
                rank's shard. Optionally ``sequence_weight`` and ``sequence_start`` (``[b, s]``)
                or ``cu_seqlens``/``cu_seqlens_padded`` for the per-sequence and constant modes.
            forward_out: By key (see :data:`FORWARD_OUT_LAYOUTS`; the key, never the shape,
                says the layout, so a ``[b, s, v]`` tensor with ``b == s`` is not read as
                ``[s, b, v]``): ``token_logits`` of shape ``[s, b, v]`` (Megatron, BioNeMo;
                ``v`` sharded under TP); ``logits`` of shape ``[b, s, v]`` (NeMo's BERT);
                ``lm_loss``, per-token losses ``[b, s]`` (Megatron's and NeMo's BERT given
                labels); or, for the fused masked-only head
                (:func:`bert_reduce.linear_cross_entropy_loss_sum` with the
                mode's weights, no ``[s, b, v]`` logits, the gradients accumulated in the
                forward), ``hidden_states`` (``[s, b, h]``, or ``[b, s, h]`` with
                ``hidden_layout="bsh"``), ``output_weight`` (``[v, h]``) and optionally
                ``output_bias`` (``[v]``). A ``batch["num_scored"]`` (the data pipeline's
                count of scored positions, :data:`bert_reduce.num_scored.NumScored`) sets
                how many rows either path computes, with no host sync.

        Returns:
            ``(loss_sum, num_tokens, report)``: the mode's 0-dim numerator in fp32 that carries
            the gradient (fp64 for fp64 logits, unless
            ``cross_entropy="megatron"`` under Megatron), its 0-dim denominator (int64;
            fp64 only for a float mask in per-token mode without ``weight_resolution``), and
            the detached report ``[numerator, denominator]`` for :meth:`reduce`.

        Raises:
            KeyError: If a required key is missing (the message names it), or
                ``forward_out`` holds several of ``token_logits``, ``logits``, ``lm_loss`` (or
                none of them and no ``hidden_states``) and no ``forward_out_key`` says which.
            ValueError: On mismatched shapes or devices (the message names both), or, with
                ``check_labels``, on masked labels outside the vocabulary or negative weights.
        """
        labels = _require(batch, "labels", "batch")
        loss_mask = _require(batch, "loss_mask", "batch")
        check_same_shape(loss_mask, labels, ("loss_mask", "labels"), "[b, s]")
        key = self._forward_out_key(forward_out)
        mode_options = {
            "constant_per_sequence": self.constant_per_sequence,
            "weight_resolution": self.weight_resolution,
            **self._sequence_normalizers(batch, loss_mask),
        }
        if key == HIDDEN_STATES_KEY and self.cross_entropy == "masked":
            loss_sum, num_tokens = self._fused_head_loss(
                batch, forward_out, labels, loss_mask, mode_options
            )
        else:
            per_token_loss = self._per_token_loss(batch, forward_out, key, labels, loss_mask)
            loss_sum, num_tokens = token_loss_sum(
                per_token_loss, loss_mask, self.normalization, **mode_options
            )
        report: PerTokenLossDict | DataParallelGroupLossAndIO = {
            "loss_sum_and_microbatch_size": make_report(loss_sum, num_tokens)
        }
        send_output = self.send_val_output if self.validation_step else self.send_train_output
        if send_output:
            report = DataParallelGroupLossAndIO(
                loss_sum_and_microbatch_size=report["loss_sum_and_microbatch_size"],
                batch=_detached(batch),
                forward_out=_detached(forward_out),
            )
        return loss_sum, num_tokens, report

    def _forward_out_key(self, forward_out: Mapping[str, Any]) -> ForwardOutKey:
        if self.forward_out_key is not None:
            return self.forward_out_key
        present = [key for key in _SCORED_AS_GIVEN if key in forward_out]
        if len(present) == 1:
            return present[0]
        if not present and HIDDEN_STATES_KEY in forward_out:
            return HIDDEN_STATES_KEY
        raise KeyError(
            f"forward_out must hold exactly one of {list(_SCORED_AS_GIVEN)} "
            f"({', '.join(FORWARD_OUT_LAYOUTS[key] for key in _SCORED_AS_GIVEN)}), or "
            f"{HIDDEN_STATES_KEY!r} with {OUTPUT_WEIGHT_KEY!r}; it has {sorted(forward_out)}. "
            "Pass forward_out_key= to say which one to use."
        )

    def _fused_head_loss(
        self,
        batch: Mapping[str, Any],
        forward_out: Mapping[str, Any],
        labels: Tensor,
        loss_mask: Tensor,
        mode_options: dict[str, Any],
    ) -> tuple[Tensor, Tensor]:
        """The mode's ``(numerator, denominator)`` from the output layer's inputs.

        :func:`~bert_reduce.linear_cross_entropy.linear_cross_entropy_loss_sum`: the mode's
        per-token coefficients are known before any loss, so the gradients are accumulated in
        the forward (three products per scored row, none recomputed).
        """
        hidden = _require(forward_out, HIDDEN_STATES_KEY, "forward_out")
        weight = _require(forward_out, OUTPUT_WEIGHT_KEY, "forward_out")
        self._validate_labels(labels, loss_mask, vocab_shard=weight.size(0))
        return linear_cross_entropy_loss_sum(
            hidden,
            weight,
            labels,
            loss_mask,
            self.normalization,
            bias=forward_out.get(OUTPUT_BIAS_KEY),
            capacity="nonzero" if self.mask_capacity is None else self.mask_capacity,
            # An int or a tensor of counts; select_rows checks it and names it in its errors.
            num_scored=batch.get(NUM_SCORED_KEY),
            layout=forward_out.get(HIDDEN_LAYOUT_KEY, "sbh"),
            **mode_options,
        )

    def _per_token_loss(
        self,
        batch: Mapping[str, Any],
        forward_out: Mapping[str, Any],
        key: ForwardOutKey,
        labels: Tensor,
        loss_mask: Tensor,
    ) -> Tensor:
        """``[b, s]`` losses: given (``lm_loss``), of the logits, or Megatron's on hidden states."""
        if key == "lm_loss":
            per_token_loss = _require(forward_out, key, "forward_out")
            check_same_shape(per_token_loss, labels, ("forward_out['lm_loss']", "labels"), "[b, s]")
            return per_token_loss
        if key == HIDDEN_STATES_KEY:
            vocab_shard = _require(forward_out, OUTPUT_WEIGHT_KEY, "forward_out").size(0)
        else:
            logits = _require(forward_out, key, "forward_out")
            vocab_shard = logits.size(-1)
        self._validate_labels(labels, loss_mask, vocab_shard)
        if self.cross_entropy == "masked":
            options = {
                "capacity": "all" if self.mask_capacity is None else self.mask_capacity,
                # An int or a tensor of counts; select_rows checks it and names it in its errors.
                "num_scored": batch.get(NUM_SCORED_KEY),
            }
            if key == "logits":
                # NeMo's BERT layout [b, s, v] is the kernel's [s, b, v] with the roles of b
                # and s swapped: passed as it is (rows read in memory order, the gradient in
                # the logits' own layout), with transposed labels and mask.
                return cross_entropy_token_losses(logits, labels.t(), loss_mask.t(), **options).t()
            return cross_entropy_token_losses(logits, labels, loss_mask, **options)
        if key == HIDDEN_STATES_KEY:
            logits = head_logits(forward_out)
        elif key == "logits":
            logits = logits.transpose(0, 1)
        return unreduced_token_loss_fn(
            logits, labels, cross_entropy_loss_fusion=self.cross_entropy == "megatron_fused"
        )

    def _validate_labels(self, labels: Tensor, loss_mask: Tensor, vocab_shard: int) -> None:
        """With ``check_labels``, raise on a scored label outside the (whole) vocabulary."""
        if self.check_labels:
            vocab_size = vocab_shard * distributed.tensor_parallel_world_size()
            validate_masked_labels(labels, loss_mask, vocab_size)

    def _sequence_normalizers(
        self, batch: Mapping[str, Any], loss_mask: Tensor
    ) -> dict[str, Tensor]:
        if self.normalization is Normalization.PER_TOKEN:
            return {}
        return batch_sequence_normalizers(
            batch, loss_mask, context_parallel_size=distributed.context_parallel_world_size()
        )

    def reduce(self, losses_reduced_per_micro_batch: Sequence[LossReport]) -> Tensor:
        """Exact mean loss over every masked token of the global batch, as a float32 scalar.

        The sums stay fp64 (:func:`bert_reduce.reports.reduce_reports`, over the default
        loss-reduction group); only the quotient is cast. float32 because NeMo broadcasts the
        last pipeline stage's value into a float32 ``torch.tensor(0.0)`` on the other stages
        (``_sync_from_last_pipeline_stage``), and gloo aborts on the size mismatch (8 bytes vs
        4); every stage then logs the same dtype.

        Returns:
            A 0-dim float32 tensor (0.0 when the global batch has no scored token).
        """
        return reduce_reports(losses_reduced_per_micro_batch).to(torch.float32)
