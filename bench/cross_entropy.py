"""Cross-entropy on logits: bert_reduce vs Megatron-Core vs F.cross_entropy, time and memory.

    python bench/cross_entropy.py               # the full table, ~5-8 min on 2 CPU cores
    python bench/cross_entropy.py --quick       # vocab 33 only, about a minute
    python bench/cross_entropy.py --shape 512 8 32000 --dtypes fp32 --threads 1 --runs 4
                                                # four whole runs, one line each

For each logits shape ``[s, b, v]`` and dtype, every variant computes the loss sum over the
masked tokens (15% by default) and its gradient w.r.t. the logits:

* ``megatron``: Megatron-Core's ``vocab_parallel_cross_entropy`` on every position, then the
  mask (BioNeMo's reference path). It overwrites fp32 logits with the softmax and then the
  gradient, so it allocates nothing for them: a caller that reads its logits afterwards
  cannot use it as is.
* ``megatron (copy)``: the same on a private fp32 copy of the logits, as a caller must that
  keeps them, and as ``BERTMLMLossWithReduction(cross_entropy="megatron")`` runs it.
* ``loss class``: ``BERTMLMLossWithReduction()`` on ``token_logits`` (its default masked
  cross-entropy, ``capacity="all"``), forward and backward of its ``loss_sum``: the path NeMo
  and BioNeMo models that return logits run.
* ``loss class + num_scored``: the same with ``batch["num_scored"]``, the count the recipe's
  collators hand over on the host: only the masked rows are computed, without a sync.
* ``F.cross_entropy``: ``F.cross_entropy(reduction="none")`` in fp32, then the mask.
* ``floor: zero gradient``: no loss at all, a backward that returns ``torch.zeros`` of the
  logits' shape: what merely materializing a fresh gradient costs (on CPU mostly page faults).
* ``bert_reduce[...]``: :func:`bert_reduce.cross_entropy_loss_sum` with ``capacity="all"`` (the
  default: exact for any mask, sync-free), ``capacity=0.2`` (static: exact up to 20% masked,
  sync-free), ``capacity="nonzero"`` (exact, one host sync on a GPU), and ``capacity=0.2,
  in_place=True``.

The logits come out of a stand-in "model" (an autograd Function with a free backward), so the
gradient w.r.t. the logits is materialized, consumed, and not copied anywhere: what is timed
is the loss's forward and backward alone, as inside a training step.

Time: repeats interleaved across variants in this process; medians (and minima) of the wall
time, and medians of the CPU time (user + system, which a loaded machine disturbs less: it
does not count the time other processes hold the cores). Peak memory: one fresh subprocess
per variant (with the same thread count) runs one forward+backward; peak extra = high-water
RSS during the step (the kernel's ``VmHWM``, reset through ``/proc/self/clear_refs``) minus
the RSS before it, with glibc told to return every freed block of 64 KiB or more to the
system so that RSS tracks live tensors. Numbers are ratios against the anchors measured in the
same run, and peak extra memory over the size of the logits. ``--runs N`` repeats the whole
measurement N times and ends with one line per run for the loss class (its ratios to both
Megatron anchors, its memory, the load average). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

from bert_reduce import BERTMLMLossWithReduction, cross_entropy_loss_sum

VARIANTS: dict[str, dict[str, Any] | None] = {
    "megatron": None,
    "megatron (copy)": None,
    "loss class": None,
    "loss class + num_scored": None,
    "F.cross_entropy": None,
    "floor: zero gradient": None,
    "bert_reduce[all]": {"capacity": "all"},
    "bert_reduce[0.2]": {"capacity": 0.2},
    "bert_reduce[nonzero]": {"capacity": "nonzero"},
    "bert_reduce[0.2,in-place]": {"capacity": 0.2, "in_place": True},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ANCHORS = ("megatron", "megatron (copy)", "F.cross_entropy")


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
    if variant in ("megatron", "megatron (copy)"):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        copy = variant == "megatron (copy)"

        def megatron(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
            work = logits.to(torch.float32, copy=True) if copy else logits
            loss = vocab_parallel_cross_entropy(work, labels.t().contiguous())
            return (loss * mask.t()).sum()

        return megatron
    if variant in ("loss class", "loss class + num_scored"):
        reduction = BERTMLMLossWithReduction()
        counted = variant == "loss class + num_scored"

        def loss_class(logits: Tensor, labels: Tensor, mask: Tensor) -> Tensor:
            batch = {"labels": labels, "loss_mask": mask}
            if counted:  # the recipe's collators count on the host, before the transfer
                batch["num_scored"] = int(mask.count_nonzero())
            return reduction.forward(batch, {"token_logits": logits})[0]

        return loss_class
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


def child(
    variant: str, configs: list[tuple[int, int, int, str]], mask_prob: float, threads: int
) -> None:
    """Print, as JSON, the peak extra memory in bytes of one forward+backward per config."""
    torch.set_num_threads(threads)
    if variant.startswith("megatron"):
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
    variant: str, configs: list[tuple[int, int, int, str]], mask_prob: float, threads: int
) -> list[int]:
    """One fresh process for ``variant`` measures every config in turn."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--child", variant, "--mask-prob", str(mask_prob)]
    command += ["--configs", json.dumps(configs), "--threads", str(threads)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_variants(
    shape: tuple[int, int, int], dtype: str, mask_prob: float, repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Wall and CPU seconds per forward+backward of every repeat, and each variant's loss."""
    logits, labels, mask = make_inputs(*shape, DTYPES[dtype], mask_prob)
    fns = {variant: loss_fn(variant) for variant in VARIANTS}
    wall: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    cpu: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    losses: dict[str, float] = {}
    for fn in fns.values():
        step(fn, *make_inputs(16, 2, shape[2], DTYPES[dtype], mask_prob))
    for _ in range(repeats):
        for variant, fn in fns.items():
            prepared = logits.clone()
            start, start_cpu = time.perf_counter(), _cpu_seconds()
            loss = step(fn, prepared, labels, mask)
            wall[variant].append(time.perf_counter() - start)
            cpu[variant].append(_cpu_seconds() - start_cpu)
            losses[variant] = float(loss)
            del prepared
    return wall, cpu, losses


def _load() -> str:
    with open("/proc/loadavg") as loadavg:
        return " ".join(loadavg.read().split()[:3])


def measure(
    configs: list[tuple[int, int, int, str]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One whole run: memory in fresh processes, then the interleaved timings; the table."""
    load_before = _load()
    peaks = {
        variant: peak_memory(variant, configs, args.mask_prob, args.threads) for variant in VARIANTS
    }
    print(f"torch {torch.__version__}, {args.threads} threads, {args.mask_prob:.0%} masked")
    print(f"load average before: {load_before}")
    print("time: median (min) ms of interleaved repeats; ratios of medians (of minima); cpu:")
    print("ratio of median CPU times (user + system)")
    header = (
        f"{'shape':<13} {'dtype':<5} {'variant':<27} {'ms':>15} {'vs Megatron':>15} "
        f"{'vs Meg.(copy)':>15} {'vs F.ce':>15} {'cpu/Meg.(copy)':>14} "
        f"{'peak extra/logits':>18} {'loss rel.err':>12}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for i, (*shape, dtype) in enumerate(configs):
        repeats = args.repeats or (9 if shape[2] < 1000 else 5)
        wall, cpu, losses = time_variants(tuple(shape), dtype, args.mask_prob, repeats)
        med = {variant: statistics.median(t) for variant, t in wall.items()}
        low = {variant: min(t) for variant, t in wall.items()}
        med_cpu = {variant: statistics.median(t) for variant, t in cpu.items()}
        logits_bytes = shape[0] * shape[1] * shape[2] * DTYPES[dtype].itemsize
        losses["floor: zero gradient"] = losses["F.cross_entropy"]
        reference = losses["F.cross_entropy"]
        for variant in VARIANTS:
            ratios = [
                f"{med[variant] / med[anchor]:.2f}x ({low[variant] / low[anchor]:.2f}x)"
                for anchor in ANCHORS
            ]
            print(
                f"{'x'.join(map(str, shape)):<13} {dtype:<5} {variant:<27} "
                f"{f'{med[variant] * 1e3:.3g} ({low[variant] * 1e3:.3g})':>15} "
                f"{ratios[0]:>15} {ratios[1]:>15} {ratios[2]:>15} "
                f"{med_cpu[variant] / med_cpu['megatron (copy)']:>13.2f}x "
                f"{peaks[variant][i] / logits_bytes:>17.3f}x "
                f"{abs(losses[variant] - reference) / abs(reference):>12.1e}",
                flush=True,
            )
        rows.append(
            {
                "config": f"{'x'.join(map(str, shape))} {dtype}",
                "load": f"{load_before} -> {_load()}",
                "wall": {a: med["loss class"] / med[a] for a in ANCHORS[:2]},
                "cpu": {a: med_cpu["loss class"] / med_cpu[a] for a in ANCHORS[:2]},
                "memory": peaks["loss class"][i] / logits_bytes,
                "megatron_copy_memory": peaks["megatron (copy)"][i] / logits_bytes,
                "counted_wall": med["loss class + num_scored"] / med["megatron"],
                "counted_memory": peaks["loss class + num_scored"][i] / logits_bytes,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vocab 33 only")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("S", "B", "V"))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--mask-prob", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="timed repeats (default 9 small, 5 large)")
    parser.add_argument("--runs", type=int, default=1, help="whole measurements in a row")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        configs = [tuple(c) for c in json.loads(args.configs)]
        child(args.child, configs, args.mask_prob, args.threads)
        return

    torch.set_num_threads(args.threads)
    _init_megatron()
    if args.shape:
        shapes = [tuple(args.shape)]
    else:
        vocabs = [33] if args.quick else [33, 25_000, 32_000]
        shapes = [(512, 8, vocab) for vocab in vocabs]
    configs = [(*shape, dtype) for shape in shapes for dtype in args.dtypes]
    summary = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\n=== run {run + 1} of {args.runs}")
        summary += [(run, row) for row in measure(configs, args)]
    print("\nloss class (BERTMLMLossWithReduction on token_logits), forward + backward:")
    for run, row in summary:
        print(
            f"run {run + 1} {row['config']}: time {row['wall']['megatron (copy)']:.3f}x "
            f"Megatron (copy), {row['wall']['megatron']:.3f}x Megatron in place; "
            f"cpu {row['cpu']['megatron (copy)']:.3f}x / {row['cpu']['megatron']:.3f}x; "
            f"peak extra {row['memory']:.3f}x the logits (Megatron copy "
            f"{row['megatron_copy_memory']:.3f}x); with num_scored {row['counted_wall']:.3f}x "
            f"Megatron in place, peak extra {row['counted_memory']:.3f}x; load {row['load']}"
        )


if __name__ == "__main__":
    main()
