"""Masked cross-entropy: bert_reduce vs Megatron-Core vs F.cross_entropy, time and peak memory.

    python bench/cross_entropy.py               # the full table, ~4-5 min on 2 CPU cores
    python bench/cross_entropy.py --quick       # vocab 33 only, about a minute

For each logits shape ``[s, b, v]`` and dtype, every variant computes the loss sum over the
masked tokens (15% by default) and its gradient w.r.t. the logits:

* ``megatron``: Megatron-Core's ``vocab_parallel_cross_entropy`` on every position, then the
  mask (BioNeMo's reference path; it overwrites fp32 logits in place).
* ``F.cross_entropy``: ``F.cross_entropy(reduction="none")`` in fp32, then the mask.
* ``floor: zero gradient``: no loss at all, a backward that returns ``torch.zeros`` of the
  logits' shape: what merely materializing a fresh gradient costs (on CPU mostly page faults).
* ``bert_reduce[...]``: :func:`bert_reduce.cross_entropy.cross_entropy_loss_sum` with
  ``capacity="all"`` (the default: exact for any mask, sync-free), ``capacity=0.2`` (static:
  exact up to 20% masked, sync-free), ``capacity="nonzero"`` (exact, one host sync on a GPU),
  and ``capacity=0.2, in_place=True``.

The logits come out of a stand-in "model" (an autograd Function with a free backward), so the
gradient w.r.t. the logits is materialized, consumed, and not copied anywhere: what is timed
is the loss's forward and backward alone, as inside a training step.

Time: median and minimum over repeats interleaved across variants, in this process (the
minimum is the least disturbed by other load on the machine). Peak memory: one fresh subprocess per
variant runs one forward+backward; peak extra = high-water RSS during the step (the kernel's
``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS before it, with glibc told to
return every freed block of 64 KiB or more to the system so that RSS tracks live tensors.
Numbers are ratios against Megatron-Core and F.cross_entropy measured in the same run, and
peak extra memory over the size of the logits. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_reduce.cross_entropy import cross_entropy_loss_sum

VARIANTS: dict[str, dict[str, Any] | None] = {
    "megatron": None,
    "F.cross_entropy": None,
    "floor: zero gradient": None,
    "bert_reduce[all]": {"capacity": "all"},
    "bert_reduce[0.2]": {"capacity": 0.2},
    "bert_reduce[nonzero]": {"capacity": "nonzero"},
    "bert_reduce[0.2,in-place]": {"capacity": 0.2, "in_place": True},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Model(torch.autograd.Function):
    """Hands out prepared logits as if a model computed them, and drops their gradient."""

    @staticmethod
    def forward(ctx: Any, token: Tensor, box: list[Tensor]) -> Tensor:
        # Boxed, so that autograd sees a fresh output rather than an input returned as-is.
        return box.pop()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return torch.zeros(()), None


class _ZeroGradient(torch.autograd.Function):
    """Computes nothing and returns a zero gradient: the cost of the gradient buffer alone."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.zeros(ctx.shape, dtype=ctx.dtype)


def _init_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        rendezvous = tempfile.mktemp(prefix="bench_ce_")
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def make_inputs(
    seq_len: int, batch_size: int, vocab: int, dtype: torch.dtype, mask_prob: float
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(seq_len, batch_size, vocab, generator=gen, dtype=dtype)
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    mask = torch.rand(batch_size, seq_len, generator=gen) < mask_prob
    return logits, labels, mask


def loss_fn(variant: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """``f(logits [s, b, v], labels [b, s], mask [b, s]) -> loss sum`` for one variant."""
    if variant == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def megatron(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
            loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous())
            return (loss * mask.t()).sum()

        return megatron
    if variant == "F.cross_entropy":

        def dense(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
            vocab = logits.size(-1)
            loss = F.cross_entropy(
                logits.float().reshape(-1, vocab), labels.t().reshape(-1), reduction="none"
            )
            return (loss * mask.t().reshape(-1)).sum()

        return dense
    if variant == "floor: zero gradient":
        return lambda logits, labels, mask: _ZeroGradient.apply(logits)
    options = VARIANTS[variant]
    assert options is not None

    def ours(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
        return cross_entropy_loss_sum(logits, labels, mask, **options)[0]

    return ours


def step(fn: Callable[..., Tensor], prepared: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
    """One forward+backward; ``prepared`` may be overwritten (Megatron, in-place).

    The caller must hold no other reference to ``prepared`` for the in-place variants to
    reuse its memory, as in a model whose logits only feed the loss.
    """
    token = torch.zeros((), requires_grad=True)
    loss = fn(_Model.apply(token, [prepared]), labels, mask)
    loss.backward()
    return loss.detach()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, configs: list[tuple[int, int, int, str]], mask_prob: float) -> None:
    """Print, as JSON, the peak extra memory in bytes of one forward+backward per config."""
    torch.set_num_threads(2)
    if variant == "megatron":
        _init_megatron()
    fn = loss_fn(variant)
    peaks = []
    for *shape, dtype in configs:
        small = make_inputs(16, 2, shape[2], DTYPES[dtype], mask_prob)
        step(fn, *small)  # first-call set-up (thread pools, lazy imports) is not the loss's
        logits, labels, mask = make_inputs(*shape, DTYPES[dtype], mask_prob)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        before = _rss_kib("VmRSS")
        step(fn, logits, labels, mask)
        peaks.append((_rss_kib("VmHWM") - before) * 1024)
        del logits
    print(json.dumps(peaks))


def peak_memory(
    variant: str, configs: list[tuple[int, int, int, str]], mask_prob: float
) -> list[int]:
    """One fresh process for ``variant`` measures every config in turn."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--child", variant, "--mask-prob", str(mask_prob)]
    command += ["--configs", json.dumps(configs)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def time_variants(
    shape: tuple[int, int, int], dtype: str, mask_prob: float, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per forward+backward of every repeat, and each variant's loss, interleaved."""
    logits, labels, mask = make_inputs(*shape, DTYPES[dtype], mask_prob)
    fns = {variant: loss_fn(variant) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    losses: dict[str, float] = {}
    for fn in fns.values():
        step(fn, *make_inputs(16, 2, shape[2], DTYPES[dtype], mask_prob))
    for _ in range(repeats):
        for variant, fn in fns.items():
            prepared = logits.clone()
            start = time.perf_counter()
            loss = step(fn, prepared, labels, mask)
            times[variant].append(time.perf_counter() - start)
            losses[variant] = float(loss)
            del prepared
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vocab 33 only")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("S", "B", "V"))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--mask-prob", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, [tuple(c) for c in json.loads(args.configs)], args.mask_prob)
        return

    torch.set_num_threads(args.threads)
    _init_megatron()
    if args.shape:
        shapes = [tuple(args.shape)]
    else:
        vocabs = [33] if args.quick else [33, 25_000, 32_000]
        shapes = [(512, 8, vocab) for vocab in vocabs]
    configs = [(*shape, dtype) for shape in shapes for dtype in args.dtypes]
    peaks = {variant: peak_memory(variant, configs, args.mask_prob) for variant in VARIANTS}

    print(f"torch {torch.__version__}, {args.threads} threads, {args.mask_prob:.0%} masked")
    print("time: median (min) ms of interleaved repeats; ratios of medians (of minima)")
    header = (
        f"{'shape':<13} {'dtype':<5} {'variant':<26} {'ms':>15} {'vs Megatron':>15} "
        f"{'vs F.ce':>15} {'peak extra/logits':>18} {'loss rel.err':>12}"
    )
    print(header)
    print("-" * len(header))
    for i, (*shape, dtype) in enumerate(configs):
        repeats = 9 if shape[2] < 1000 else 3
        times, losses = time_variants(tuple(shape), dtype, args.mask_prob, repeats)
        med = {variant: statistics.median(t) for variant, t in times.items()}
        low = {variant: min(t) for variant, t in times.items()}
        logits_bytes = shape[0] * shape[1] * shape[2] * DTYPES[dtype].itemsize
        losses["floor: zero gradient"] = losses["F.cross_entropy"]
        reference = losses["F.cross_entropy"]
        for variant in VARIANTS:
            ratios = [
                f"{med[variant] / med[anchor]:.2f}x ({low[variant] / low[anchor]:.2f}x)"
                for anchor in ("megatron", "F.cross_entropy")
            ]
            print(
                f"{'x'.join(map(str, shape)):<13} {dtype:<5} {variant:<26} "
                f"{f'{med[variant] * 1e3:.3g} ({low[variant] * 1e3:.3g})':>15} "
                f"{ratios[0]:>15} {ratios[1]:>15} "
                f"{peaks[variant][i] / logits_bytes:>17.2f}x "
                f"{abs(losses[variant] - reference) / abs(reference):>12.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
