"""What the losses read from a model's output: the forward-output keys, by layout.

A model hands the loss one mapping (``forward_out``); its key (:data:`FORWARD_OUT_LAYOUTS`; who
emits which: ``docs/nemo.md``), never its shape, says what a tensor is, so a ``[b, s, v]``
tensor with ``b == s`` is not read as ``[s, b, v]``. The fused masked-only head's keys are
``hidden_states`` with ``output_weight`` (``[v, h]``) and optionally ``output_bias`` (``[v]``);
``hidden_layout`` (``"sb"``: ``[s, b, h]``, ``"bs"``: ``[b, s, h]``) says their layout.

A bare tensor is read as logits in the integration's layout (its ``layout`` argument;
:class:`bert_reduce.hf.ExactMLMTrainer`: ``"bs"``), as are hidden states without a
``hidden_layout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, get_args

from torch import Tensor, nn

# The fused head's keys (module docstring).
HIDDEN_STATES_KEY = "hidden_states"
OUTPUT_WEIGHT_KEY = "output_weight"
OUTPUT_BIAS_KEY = "output_bias"
HIDDEN_LAYOUT_KEY = "hidden_layout"

Layout = Literal["bs", "sb"]
"""``"bs"``: batch first (``[b, s, v]`` logits, ``[b, s, h]`` hidden states; Hugging Face);
``"sb"``: sequence first (``[s, b, v]``, ``[s, b, h]``; Megatron)."""
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

FORWARD_OUT_LAYOUTS: dict[str, str] = {
    "token_logits": "[s, b, v] logits",
    "logits": "[b, s, v] logits",
    "lm_loss": "[b, s] per-token losses",
    HIDDEN_STATES_KEY: "hidden states and output_weight, for the fused masked-only head",
}
"""The keys a loss reads, with what each holds (the first three are scored as they are)."""

ForwardOutKey = Literal[tuple(FORWARD_OUT_LAYOUTS)]  # type: ignore[valid-type]
"""The keys of :data:`FORWARD_OUT_LAYOUTS`, as a type."""

_SCORED_AS_GIVEN = tuple(key for key in FORWARD_OUT_LAYOUTS if key != HIDDEN_STATES_KEY)


def check_layout(layout: object, name: str = "layout") -> Layout:
    """``layout`` if it is ``"bs"`` or ``"sb"``; else ``ValueError`` naming ``name``."""
    if layout not in LAYOUTS:
        raise ValueError(
            f"{name} must be 'bs' ([b, s, ...], Hugging Face) or 'sb' ([s, b, ...], Megatron), "
            f"got {layout!r}."
        )
    return layout  # type: ignore[return-value]


def forward_out_key(forward_out: Mapping[str, Any], key: str | None = None) -> ForwardOutKey:
    """Which entry of ``forward_out`` to score: ``key``, else the one present.

    Raises:
        ValueError: On a ``key`` that is not one of :data:`FORWARD_OUT_LAYOUTS`.
        KeyError: If ``forward_out`` holds several of ``token_logits``, ``logits``,
            ``lm_loss`` (or none of them and no ``hidden_states``) and no ``key`` says which.
    """
    if key is not None:
        if key not in FORWARD_OUT_LAYOUTS:
            raise ValueError(
                f"forward_out_key must be one of {sorted(FORWARD_OUT_LAYOUTS)}, got {key!r}."
            )
        return key  # type: ignore[return-value]
    present = [name for name in _SCORED_AS_GIVEN if name in forward_out]
    if len(present) == 1:
        return present[0]  # type: ignore[return-value]
    if not present and HIDDEN_STATES_KEY in forward_out:
        return HIDDEN_STATES_KEY
    raise KeyError(
        f"forward_out must hold exactly one of {list(_SCORED_AS_GIVEN)} "
        f"({', '.join(FORWARD_OUT_LAYOUTS[name] for name in _SCORED_AS_GIVEN)}), or "
        f"{HIDDEN_STATES_KEY!r} with {OUTPUT_WEIGHT_KEY!r}; it has {sorted(forward_out)}. "
        "Pass forward_out_key= to say which one to use."
    )


def as_forward_out(forward_out: Tensor | Mapping[str, Any], layout: Layout) -> Mapping[str, Any]:
    """``forward_out`` as a mapping: a bare tensor is the logits, in the integration's ``layout``.

    Raises:
        TypeError: On a ``forward_out`` that is neither a tensor nor a mapping.
    """
    if isinstance(forward_out, Tensor):
        return {"logits" if layout == "bs" else "token_logits": forward_out}
    if not isinstance(forward_out, Mapping):
        raise TypeError(
            "forward_out must be a logits tensor or a mapping of the keys in "
            f"bert_reduce.forward_output.FORWARD_OUT_LAYOUTS, got {type(forward_out).__name__}."
        )
    return forward_out


@contextlib.contextmanager
def shadowed_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, ``module(...)`` runs ``forward``: how the integrations stop a head.

    An instance attribute shadows the class's ``forward`` for this call only; the module's
    hooks (FSDP2's all-gather, DDP's) still run around it.
    """
    module.forward = forward
    try:
        yield
    finally:
        del module.forward
