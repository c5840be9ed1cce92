"""Masked-only fused LM head vs. the dense head + cross-entropy: time and peak memory.

    python bench/linear_cross_entropy.py            # every shape, fp32 and bf16 (long on CPU)
    python bench/linear_cross_entropy.py --quick    # the ESM-2 shape in fp32 and the recipe step

Every variant runs the forward and backward of the output layer and the loss: from hidden
states ``[s, b, h]`` and an output weight ``[v, h]`` (both requiring grad) to the summed
cross-entropy over the masked positions (15% by default) and the gradients w.r.t. both.

* ``megatron``: ``F.linear`` to full ``[s, b, v]`` logits, then Megatron-Core's
  ``vocab_parallel_cross_entropy`` on every position, then the mask (BioNeMo's path).
* ``F.linear+F.cross_entropy``: full logits, ``F.cross_entropy`` in fp32, then the mask.
* ``sparse rows (MosaicBERT)``: the masked rows gathered first (their count read from the
  data pipeline's CPU count), then ``F.linear`` and ``F.cross_entropy`` on them alone:
  MosaicBERT's and NVIDIA BERT's ``masked_lm_positions``, unchunked.
* ``bert_reduce CE on logits``: full logits, then
  :func:`bert_reduce.masked_cross_entropy` with the pipeline's count (``num_scored``).
* ``fused[num_scored]``: :func:`bert_reduce.linear_masked_token_losses` with the pipeline's
  count (what the recipe's collators provide); ``fused[0.2]``: with a static capacity of 20%
  of the positions (no count needed, exact up to 20% masked).
* Cut Cross-Entropy (``cut-cross-entropy``): run only when it is importable and CUDA is
  available (its kernels are Triton GPU kernels; on Linux it cannot even be imported without
  Triton); otherwise a line says it was not run.

Time: median (and minimum) over ``--repeats`` repeats interleaved across variants, in this
process; ratios are of medians against ``megatron`` measured in the same run. Peak memory:
one fresh subprocess per variant runs one forward+backward per configuration; peak extra =
high-water RSS during the step (``VmHWM``, reset through ``/proc/self/clear_refs``) minus the
RSS before it (glibc returns freed blocks >= 64 KiB, so RSS tracks live tensors), reported
as a fraction of the full logits' size, in total and beyond the gradients of the hidden
states and the weight (which every variant must return). Linux only (``/proc``).

The last table is the recipe's whole training step (:class:`bert_reduce.recipe.ESM2Model`,
``BERTMLMLossWithReduction``, AdamW; 4 micro-batches of 8 sequences of 128 tokens) with the
fused head (the default) and with full logits (``model.fused_lm_head=false``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_reduce import linear_masked_token_losses, masked_cross_entropy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cross_entropy import _init_megatron, _rss_kib

SHAPES = {
    "geneformer": (2048, 4, 512, 25_600),
    "bert": (512, 8, 1024, 30_528),
    "esm2-650m": (1024, 8, 1280, 33),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = [
    "megatron",
    "F.linear+F.cross_entropy",
    "sparse rows (MosaicBERT)",
    "bert_reduce CE on logits",
    "fused[num_scored]",
    "fused[0.2]",
    "cut-cross-entropy",
]
Inputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def make_inputs(s: int, b: int, h: int, v: int, dtype: torch.dtype, mask_prob: float) -> Inputs:
    """``[s, b, h]`` hidden, ``[v, h]`` weight, ``[b, s]`` labels and mask, CPU count ``[b]``."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, b, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (b, s), generator=gen)
    mask = torch.rand(b, s, generator=gen) < mask_prob
    return hidden, weight, labels, mask, mask.sum(dim=1)


def cut_cross_entropy_runs() -> str | None:
    """``None`` when Cut Cross-Entropy can run here, else why not."""
    if not torch.cuda.is_available():
        return "not run: its kernels are Triton GPU kernels and this machine has no GPU"
    try:
        import cut_cross_entropy  # noqa: F401
    except ImportError as error:
        return f"not run: {error}"
    return None


def loss_fn(variant: str) -> LossFn:
    """``f(hidden, weight, labels, mask, num_scored) -> summed masked loss`` of a variant."""
    if variant == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def megatron(hidden, weight, labels, mask, num_scored):
            loss = vocab_parallel_cross_entropy(F.linear(hidden, weight), labels.t().contiguous())
            return (loss * mask.t()).sum()

        return megatron
    if variant == "F.linear+F.cross_entropy":

        def dense(hidden, weight, labels, mask, num_scored):
            logits = F.linear(hidden, weight).float()
            loss = F.cross_entropy(
                logits.reshape(-1, weight.size(0)), labels.t().reshape(-1), reduction="none"
            )
            return (loss * mask.t().reshape(-1)).sum()

        return dense
    if variant == "sparse rows (MosaicBERT)":

        def sparse(hidden, weight, labels, mask, num_scored):
            # The pipeline's count gives the static number of rows (no host sync); a stable
            # sort puts the masked positions first.
            scored = mask.t().reshape(-1)
            count = int(num_scored.sum())
            rows = torch.sort(scored.to(torch.uint8), descending=True, stable=True).indices
            rows = rows[:count]
            logits = F.linear(hidden.reshape(-1, hidden.size(-1))[rows], weight).float()
            return F.cross_entropy(logits, labels.t().reshape(-1)[rows], reduction="sum")

        return sparse
    if variant == "bert_reduce CE on logits":

        def on_logits(hidden, weight, labels, mask, num_scored):
            logits = F.linear(hidden, weight)
            return masked_cross_entropy(logits, labels, mask, num_scored=num_scored)[0]

        return on_logits
    if variant.startswith("fused"):
        static = variant == "fused[0.2]"

        def fused(hidden, weight, labels, mask, num_scored):
            rows: dict[str, Any] = {"capacity": 0.2} if static else {"num_scored": num_scored}
            return linear_masked_token_losses(hidden, weight, labels, mask, **rows).sum()

        return fused
    if variant == "cut-cross-entropy":
        from cut_cross_entropy import linear_cross_entropy

        def cce(hidden, weight, labels, mask, num_scored):
            targets = torch.where(mask, labels, -100).t()
            return linear_cross_entropy(hidden, weight, targets, reduction="sum")

        return cce
    raise ValueError(variant)


def step(fn: LossFn, inputs: Inputs) -> float:
    """One forward+backward from fresh leaves; returns the loss."""
    hidden, weight, labels, mask, num_scored = inputs
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    loss = fn(hidden, weight, labels, mask, num_scored)
    loss.backward()
    return float(loss.detach())


def child(variant: str, configs: list[list[Any]], mask_prob: float, threads: int) -> None:
    """Print, as JSON, the peak extra memory in bytes of one forward+backward per config."""
    torch.set_num_threads(threads)
    if variant == "megatron":
        _init_megatron()
    fn = loss_fn(variant)
    peaks = []
    for *shape, dtype in configs:
        step(fn, make_inputs(16, 2, 8, shape[3], DTYPES[dtype], mask_prob))  # lazy set-up
        inputs = make_inputs(*shape, DTYPES[dtype], mask_prob)
        hidden, weight = (t.detach().requires_grad_(True) for t in inputs[:2])
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        before = _rss_kib("VmRSS")
        fn(hidden, weight, *inputs[2:]).backward()
        peaks.append((_rss_kib("VmHWM") - before) * 1024)
        del hidden, weight, inputs
    print(json.dumps(peaks))


def peak_memory(
    variant: str, configs: list[list[Any]], mask_prob: float, threads: int
) -> list[int]:
    """One fresh process for ``variant`` measures every config in turn."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--child", variant, "--mask-prob", str(mask_prob)]
    command += ["--configs", json.dumps(configs), "--threads", str(threads)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def time_variants(
    variants: list[str], inputs: Inputs, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per forward+backward of every repeat, and each variant's loss, interleaved."""
    fns = {variant: loss_fn(variant) for variant in variants}
    small = make_inputs(16, 2, 8, inputs[1].size(0), inputs[0].dtype, 0.15)
    for fn in fns.values():
        step(fn, small)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    losses: dict[str, float] = {}
    for _ in range(repeats):
        for variant, fn in fns.items():
            start = time.perf_counter()
            losses[variant] = step(fn, inputs)
            times[variant].append(time.perf_counter() - start)
    return times, losses


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, Tensor]],
    fused: bool,
) -> None:
    """One optimizer step over the micro-batches, with the fused head or full logits."""
    from bert_reduce import BERTMLMLossWithReduction

    model.fused_lm_head = fused
    for micro_batch in micro_batches:
        loss_fn = BERTMLMLossWithReduction()
        loss_fn.setup(micro_batch)
        out = model(micro_batch["input_ids"], micro_batch["attention_mask"])
        loss_fn(out)[0].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def recipe_step_times(repeats: int, model_sizes: dict[str, dict[str, int]]) -> None:
    """The recipe's training step with and without the fused head, interleaved."""
    from bert_reduce.recipe.data import MLMCollator, MLMDataset, synthetic_proteins
    from bert_reduce.recipe.model import ESM2Model

    dataset = MLMDataset(synthetic_proteins(32, seed=1), max_length=128)
    batch = MLMCollator()([dataset[i] for i in range(32)])
    micro_batches = [{k: v[i : i + 8] for k, v in batch.items()} for i in range(0, 32, 8)]
    print("\nrecipe training step (32 sequences x 128 tokens, 4 micro-batches, AdamW)")
    print(f"{'model':<11} {'head':<12} {'ms':>15} {'vs full logits':>15}")
    for name, sizes in model_sizes.items():
        torch.manual_seed(0)
        model = ESM2Model(**sizes, dropout=0.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        times: dict[bool, list[float]] = {True: [], False: []}
        for fused in (True, False):
            train_step(model, optimizer, micro_batches, fused)
        for _ in range(repeats):
            for fused in (True, False):
                start = time.perf_counter()
                train_step(model, optimizer, micro_batches, fused)
                times[fused].append(time.perf_counter() - start)
        med = {fused: statistics.median(t) for fused, t in times.items()}
        for fused, label in ((True, "fused"), (False, "full logits")):
            ms = f"{med[fused] * 1e3:.4g} ({min(times[fused]) * 1e3:.4g})"
            print(f"{name:<11} {label:<12} {ms:>15} {med[fused] / med[False]:>14.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="ESM-2 shape, fp32, recipe step")
    parser.add_argument("--no-recipe", action="store_true", help="skip the recipe's step")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask-prob", type=float, default=0.15)
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="megatron is always run"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="1 by default: stable on a shared machine"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of >= 5).")
    if args.child:
        child(args.child, json.loads(args.configs), args.mask_prob, args.threads)
        return
    if args.quick:
        args.shapes, args.dtypes = ["esm2-650m"], ["fp32"]

    torch.set_num_threads(args.threads)
    _init_megatron()
    cce_missing = cut_cross_entropy_runs()
    chosen = {"megatron", "F.linear+F.cross_entropy", *args.variants}
    if cce_missing is not None:
        chosen.discard("cut-cross-entropy")
    variants = [v for v in VARIANTS if v in chosen]
    configs = [[*SHAPES[shape], dtype] for shape in args.shapes for dtype in args.dtypes]
    peaks = {v: peak_memory(v, configs, args.mask_prob, args.threads) for v in variants}

    load = os.getloadavg()
    print(f"torch {torch.__version__}, {args.threads} threads, {args.mask_prob:.0%} masked, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at start")  # fmt: skip
    print("time: median (min) ms of interleaved repeats; ratio of medians to megatron's")
    header = (
        f"{'shape':<11} {'dtype':<5} {'variant':<26} {'ms':>17} {'vs megatron':>12} "
        f"{'peak/logits':>12} {'excl. grads':>12} {'loss rel.err':>12}"
    )
    print(header)
    print("-" * len(header))
    names = [shape for shape in args.shapes for _ in args.dtypes]
    for index, (shape, (s, b, h, v, dtype)) in enumerate(zip(names, configs, strict=True)):
        inputs = make_inputs(s, b, h, v, DTYPES[dtype], args.mask_prob)
        times, losses = time_variants(variants, inputs, args.repeats)
        med = {variant: statistics.median(t) for variant, t in times.items()}
        itemsize = DTYPES[dtype].itemsize
        logits_bytes = s * b * v * itemsize
        grad_bytes = (s * b * h + v * h) * itemsize
        reference = losses["F.linear+F.cross_entropy"]
        for variant in variants:
            ms = f"{med[variant] * 1e3:.4g} ({min(times[variant]) * 1e3:.4g})"
            peak = peaks[variant][index]
            print(
                f"{shape:<11} {dtype:<5} {variant:<26} {ms:>17} "
                f"{med[variant] / med['megatron']:>11.3f}x "
                f"{peak / logits_bytes:>11.3f}x {(peak - grad_bytes) / logits_bytes:>11.3f}x "
                f"{abs(losses[variant] - reference) / abs(reference):>12.1e}",
                flush=True,
            )
    if cce_missing is not None:
        print(f"cut-cross-entropy: {cce_missing}")
    sizes = {"esm2_tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_size": 256}}
    if not args.quick:
        sizes["esm2_8m"] = {"hidden_size": 320, "num_layers": 6, "num_heads": 20, "ffn_size": 1280}
    if not args.no_recipe:
        recipe_step_times(args.repeats, sizes)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")


if __name__ == "__main__":
    main()
