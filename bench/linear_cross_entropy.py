"""Masked-only fused LM head vs. the dense head + cross-entropy: time, peak memory, graphs.

    python bench/linear_cross_entropy.py --shapes geneformer --dtypes fp32 --no-recipe
        # the issue-21 targets at the Geneformer-like shape, with verdicts (~25 min here)
    python bench/linear_cross_entropy.py            # every shape, fp32 and bf16 (long on CPU)
    python bench/linear_cross_entropy.py --quick    # the ESM-2 shape in fp32 and the recipe step

Every variant runs the forward and backward of the output layer and the loss: from hidden
states ``[s, b, h]`` and an output weight ``[v, h]`` (both requiring grad) to the summed
cross-entropy over the masked positions (15% by default) and the gradients w.r.t. both.

* ``megatron`` (the anchor): ``F.linear`` to full ``[s, b, v]`` logits, then Megatron-Core's
  ``vocab_parallel_cross_entropy`` on every position, then the mask (BioNeMo's path).
* ``F.linear+F.cross_entropy``: full logits, ``F.cross_entropy`` in fp32, then the mask.
* ``sparse rows (MosaicBERT)``: the masked rows gathered first (their count read from the
  data pipeline's CPU count), then ``F.linear`` and ``F.cross_entropy`` on them alone:
  MosaicBERT's and NVIDIA BERT's ``masked_lm_positions``, unchunked.
* ``bert_reduce CE on logits``: full logits, then
  :func:`bert_reduce.cross_entropy_loss_sum` with the pipeline's count (``num_scored``).
* ``head: plain call``: ``linear_cross_entropy_token_losses(hidden, weight, labels, mask)`` as its
  docstring shows it, no count (it counts the scored rows: one host sync on a GPU, free
  here); ``head[num_scored]``: with the pipeline's count; ``head[0.2]``: a static capacity
  of 20% of the positions. All three return per-token losses, so their backward recomputes
  the logits (four products).
* ``weighted sum[num_scored]``: :func:`bert_reduce.linear_cross_entropy_weighted_sum`
  with the count: gradients accumulated in the forward (three products).
* ``loss class, no count``: ``BERTMLMLossWithReduction()`` fed ``hidden_states`` and
  ``output_weight``, its batch ``labels`` and ``loss_mask`` only (what a NeMo or BioNeMo
  collator gives); ``loss class[num_scored]``: the batch also carries the count. Both run the
  weighted sum.
* ``cut-cross-entropy``: Apple's Cut Cross-Entropy (``cut-cross-entropy``, the ``bench``
  extra) with ``impl="torch_compile"``, which selects the scored rows (``targets != -100``,
  a ``nonzero``) and runs ``F.linear`` and ``F.cross_entropy`` on them in a
  ``torch.compile(dynamic=True)`` graph (inductor): the closest peer that runs on a CPU. Its
  default ``impl="cce"`` is Triton GPU kernels. Skipped, with the reason, when not
  importable.

Time: median (and minimum) over ``--repeats`` repeats interleaved across variants, in this
process; ratios are of medians against ``megatron`` measured in the same run. Peak memory:
one fresh subprocess per variant runs one forward+backward per configuration (after one at
the same shape for compiled variants); peak extra = high-water RSS during the step
(``VmHWM``, reset through ``/proc/self/clear_refs``) minus the RSS before it (glibc returns
freed blocks >= 64 KiB, so RSS tracks live tensors), reported as a fraction of the full
logits' size, in total and beyond the gradients of the hidden states and the weight (which
every variant must return). Linux only (``/proc``). ``graphs``: how many graphs
``torch.compile`` built for the variant during the run.

``--compile`` (on by default at the Geneformer-like shape) then runs ``torch.compile`` of
the loss class (``fullgraph=True``, ``--compile-backend``, the count as a Python ``int``)
over 10 micro-batches masked at 9% to 21%: the graphs it builds, its result against eager
mode, and its time per micro-batch after compiling.

The last table is the recipe's whole training step (:class:`bert_reduce.recipe.ESM2Model`,
``BERTMLMLossWithReduction``, AdamW; 4 micro-batches of 8 sequences of 128 tokens) with the
fused head (the default) and with full logits (``model.fused_head=false``).

The verdict lines check issue 21's targets at the Geneformer-like shape in fp32: the plain
call and the loss class without a count <= 0.25x Megatron's time and <= 0.05x the logits'
bytes of extra memory beyond the gradients; the loss class with the count no slower than
Cut Cross-Entropy at <= 0.05x; the compiled loss class in <= 4 graphs, equal to eager.
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_reduce import cross_entropy_loss_sum, linear_cross_entropy_token_losses
from bert_reduce.linear_cross_entropy import linear_cross_entropy_weighted_sum

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
    "head: plain call",
    "head[num_scored]",
    "head[0.2]",
    "weighted sum[num_scored]",
    "loss class, no count",
    "loss class[num_scored]",
    "cut-cross-entropy",
]
COMPILED = {"cut-cross-entropy"}
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
    """``None`` when Cut Cross-Entropy's ``torch_compile`` implementation runs here, else why."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError as error:
        return f"not run: {error} (pip install -c requirements/constraints-cpu.txt '.[bench]')"
    try:
        hidden = torch.randn(4, 2, 8, requires_grad=True)
        linear_cross_entropy(hidden, torch.randn(5, 8), torch.zeros(4, 2, dtype=torch.long),
                             impl="torch_compile").backward()  # fmt: skip
    except Exception as error:  # a missing compiler, say: report it, run the rest
        return f"not run: impl='torch_compile' fails here: {type(error).__name__}: {error}"
    return None


def _loss_class(with_count: bool) -> LossFn:
    from bert_reduce import BERTMLMLossWithReduction

    def loss_class(hidden, weight, labels, mask, num_scored):
        loss_fn = BERTMLMLossWithReduction()
        batch = {"labels": labels, "loss_mask": mask}
        if with_count:
            batch["num_scored"] = num_scored
        loss_fn.setup(batch)
        return loss_fn({"hidden_states": hidden, "output_weight": weight})[0]

    return loss_class


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
            return cross_entropy_loss_sum(logits, labels, mask, num_scored=num_scored)[0]

        return on_logits
    if variant.startswith("head"):
        rows: dict[str, Any] = {
            "head: plain call": {},
            "head[num_scored]": {"num_scored": None},
            "head[0.2]": {"capacity": 0.2},
        }[variant]

        def head(hidden, weight, labels, mask, num_scored):
            kwargs = {k: num_scored if v is None else v for k, v in rows.items()}
            return linear_cross_entropy_token_losses(hidden, weight, labels, mask, **kwargs).sum()

        return head
    if variant == "weighted sum[num_scored]":

        def weighted(hidden, weight, labels, mask, num_scored):
            weights = mask.to(torch.float32)
            return linear_cross_entropy_weighted_sum(
                hidden, weight, labels, weights, num_scored=num_scored
            )

        return weighted
    if variant.startswith("loss class"):
        return _loss_class(with_count=variant == "loss class[num_scored]")
    if variant == "cut-cross-entropy":
        from cut_cross_entropy import linear_cross_entropy

        def cce(hidden, weight, labels, mask, num_scored):
            targets = torch.where(mask, labels, -100).t()
            return linear_cross_entropy(
                hidden, weight, targets, reduction="sum", impl="torch_compile"
            )

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
        if variant in COMPILED:
            step(fn, inputs)  # compiling is not the step's memory
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


def unique_graphs() -> int:
    """How many graphs ``torch.compile`` has built in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def time_variants(
    variants: list[str], inputs: Inputs, repeats: int
) -> tuple[dict[str, list[float]], dict[str, float], dict[str, int]]:
    """Seconds per forward+backward of every repeat, each variant's loss and graphs built."""
    fns = {variant: loss_fn(variant) for variant in variants}
    small = make_inputs(16, 2, 8, inputs[1].size(0), inputs[0].dtype, 0.15)
    graphs = dict.fromkeys(variants, 0)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    losses: dict[str, float] = {}
    for warm_up in (small, inputs):
        for variant, fn in fns.items():
            before = unique_graphs()
            step(fn, warm_up)
            graphs[variant] += unique_graphs() - before
    for _ in range(repeats):
        for variant, fn in fns.items():
            before = unique_graphs()
            start = time.perf_counter()
            losses[variant] = step(fn, inputs)
            times[variant].append(time.perf_counter() - start)
            graphs[variant] += unique_graphs() - before
    return times, losses, graphs


class CompileResult(NamedTuple):
    """The compiled loss class over micro-batches of different counts."""

    counts: list[int]
    graphs: int
    max_rel_diff: float
    compiled_s: float
    eager_s: float


def compiled_loss_class(
    shape: tuple[int, int, int, int], dtype: torch.dtype, backend: str, repeats: int
) -> CompileResult:
    """``torch.compile(BERTMLMLossWithReduction(), fullgraph=True)`` on hidden states over 10
    micro-batches masked at 9% to 21% (the count as a Python ``int``): graphs built, the
    largest relative difference to eager mode (loss and gradients), and the median seconds
    per micro-batch once compiled, against eager, over ``repeats`` interleaved passes."""
    from bert_reduce import BERTMLMLossWithReduction

    s, b, h, v = shape
    hidden, weight, labels, _, _ = make_inputs(s, b, h, v, dtype, 0.15)
    graphs: list[Any] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    loss_fn = BERTMLMLossWithReduction()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=counting)
    counts = [round(float(f) * b * s) for f in torch.linspace(0.09, 0.21, 10)]
    batches = []
    for seed, count in enumerate(counts):
        gen = torch.Generator().manual_seed(seed)
        mask = torch.zeros(b * s, dtype=torch.bool)
        mask[torch.randperm(b * s, generator=gen)[:count]] = True
        batches.append({"labels": labels, "loss_mask": mask.view(b, s), "num_scored": count})

    def run(call: Callable[..., Any], batch: dict[str, Any]) -> tuple[float, list[Tensor]]:
        """Seconds of one forward+backward, and the loss and gradients it gave."""
        leaves = [hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)]
        loss_fn.setup(batch)
        start = time.perf_counter()
        loss = call({"hidden_states": leaves[0], "output_weight": leaves[1]})[0]
        loss.backward()
        seconds = time.perf_counter() - start
        return seconds, [loss.detach(), leaves[0].grad, leaves[1].grad]

    worst = 0.0
    for batch in batches:  # compiles, and compares with eager mode
        got, want = run(compiled, batch)[1], run(loss_fn, batch)[1]
        for g, w in zip(got, want, strict=True):
            worst = max(worst, float((g - w).abs().max() / w.abs().max()))
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    for _ in range(repeats):
        for batch in batches:
            times["compiled"].append(run(compiled, batch)[0])
            times["eager"].append(run(loss_fn, batch)[0])
    med = {k: statistics.median(t) for k, t in times.items()}
    return CompileResult(counts, len(graphs), worst, med["compiled"], med["eager"])


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[dict[str, Tensor]],
    fused: bool,
) -> None:
    """One optimizer step over the micro-batches, with the fused head or full logits."""
    from bert_reduce import BERTMLMLossWithReduction

    model.fused_head = fused
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


TARGET = ("geneformer", "fp32")
"""The configuration issue 21's targets are stated at."""


class Row(NamedTuple):
    """One variant's figures at one configuration."""

    time_ratio: float  # median time / megatron's median time
    seconds: float  # median time
    extra: float  # peak extra memory beyond the gradients / the logits' bytes
    times: list[float]  # every repeat's time, in the order run (repeat r of each variant
    # ran within the same pass over the variants)


def verdicts(rows: dict[str, Row], compile_result: CompileResult | None) -> list[str]:
    """One line per issue-21 target at the Geneformer-like shape in fp32."""

    def check(ok: bool, text: str) -> str:
        return f"{'MET    ' if ok else 'NOT MET'} {text}"

    lines = []
    for variant in ("head: plain call", "loss class, no count"):
        if variant in rows:
            row = rows[variant]
            lines.append(check(
                row.time_ratio <= 0.25 and row.extra <= 0.05,
                f"{variant}: {row.time_ratio:.3f}x Megatron's time (<= 0.25x), "
                f"{row.extra:.3f}x the logits' bytes beyond the gradients (<= 0.05x)",
            ))  # fmt: skip
    counted, cce = rows.get("loss class[num_scored]"), rows.get("cut-cross-entropy")
    if counted is not None and cce is not None:
        paired = statistics.median(a / b for a, b in zip(counted.times, cce.times, strict=True))
        lines.append(check(
            counted.seconds <= cce.seconds and counted.extra <= 0.05,
            f"loss class[num_scored]: {counted.seconds / cce.seconds:.3f}x Cut Cross-Entropy's "
            f"time (<= 1x; median of the per-pass ratios {paired:.3f}x; CCE "
            f"{cce.time_ratio:.3f}x Megatron's), {counted.extra:.3f}x the logits' bytes beyond "
            f"the gradients (<= 0.05x; CCE {cce.extra:.3f}x)",
        ))  # fmt: skip
    elif counted is not None:
        lines.append("CANNOT CHECK loss class[num_scored] vs Cut Cross-Entropy: CCE not run")
    if compile_result is not None:
        lines.append(check(
            compile_result.graphs <= 4 and compile_result.max_rel_diff <= 1e-5,
            f"compiled loss class: {len(compile_result.counts)} micro-batches with counts "
            f"{min(compile_result.counts)}..{max(compile_result.counts)} in "
            f"{compile_result.graphs} graphs (<= 4), fullgraph, max relative difference to "
            f"eager {compile_result.max_rel_diff:.1e} (fp32 rounding: <= 1e-5)",
        ))  # fmt: skip
    return lines


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
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the loss class over 10 micro-batches (default: at the geneformer shape)",
    )
    parser.add_argument("--compile-backend", default="inductor")
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
    if args.compile is None:
        args.compile = TARGET[0] in args.shapes

    torch.set_num_threads(args.threads)
    _init_megatron()
    cce_missing = cut_cross_entropy_runs()
    chosen = {"megatron", "F.linear+F.cross_entropy", *args.variants}
    if cce_missing is not None:
        chosen.discard("cut-cross-entropy")
    variants = [v for v in VARIANTS if v in chosen]
    configs = [[*SHAPES[shape], dtype] for shape in args.shapes for dtype in args.dtypes]
    peaks = {v: peak_memory(v, configs, args.mask_prob, args.threads) for v in variants}

    with open("/proc/loadavg") as loadavg:
        print(f"torch {torch.__version__}, {args.threads} threads, {args.mask_prob:.0%} masked, "
              f"/proc/loadavg at start: {loadavg.read().strip()}")  # fmt: skip
    print("time: median (min) ms of interleaved repeats; ratio of medians to megatron's;")
    print("memory: peak extra over the logits' bytes, in total and beyond the two gradients;")
    print("graphs: built by torch.compile during the run")
    header = (
        f"{'shape':<11} {'dtype':<5} {'variant':<26} {'ms':>17} {'vs megatron':>12} "
        f"{'peak/logits':>12} {'excl. grads':>12} {'graphs':>7} {'loss rel.err':>12}"
    )
    print(header)
    print("-" * len(header))
    names = [shape for shape in args.shapes for _ in args.dtypes]
    target_rows: dict[str, Row] = {}
    for index, (shape, (s, b, h, v, dtype)) in enumerate(zip(names, configs, strict=True)):
        inputs = make_inputs(s, b, h, v, DTYPES[dtype], args.mask_prob)
        times, losses, graphs = time_variants(variants, inputs, args.repeats)
        med = {variant: statistics.median(t) for variant, t in times.items()}
        itemsize = DTYPES[dtype].itemsize
        logits_bytes = s * b * v * itemsize
        grad_bytes = (s * b * h + v * h) * itemsize
        reference = losses["F.linear+F.cross_entropy"]
        for variant in variants:
            ms = f"{med[variant] * 1e3:.4g} ({min(times[variant]) * 1e3:.4g})"
            peak = peaks[variant][index]
            row = Row(
                med[variant] / med["megatron"],
                med[variant],
                (peak - grad_bytes) / logits_bytes,
                times[variant],
            )
            if (shape, dtype) == TARGET:
                target_rows[variant] = row
            print(
                f"{shape:<11} {dtype:<5} {variant:<26} {ms:>17} {row.time_ratio:>11.3f}x "
                f"{peak / logits_bytes:>11.3f}x {row.extra:>11.3f}x {graphs[variant]:>7} "
                f"{abs(losses[variant] - reference) / abs(reference):>12.1e}",
                flush=True,
            )
    if cce_missing is not None:
        print(f"cut-cross-entropy: {cce_missing}")

    compile_result = None
    if args.compile:
        shape = TARGET[0] if TARGET[0] in args.shapes else args.shapes[0]
        dtype = TARGET[1] if TARGET[1] in args.dtypes else args.dtypes[0]
        compile_result = compiled_loss_class(
            SHAPES[shape], DTYPES[dtype], args.compile_backend, args.repeats
        )
        print(
            f"\ntorch.compile(BERTMLMLossWithReduction(), fullgraph=True, "
            f"backend={args.compile_backend!r}) on hidden states, {shape} {dtype}, the count as "
            f"an int:\n  counts {compile_result.counts}\n  {compile_result.graphs} graphs, max "
            f"relative difference to eager {compile_result.max_rel_diff:.1e}; once compiled "
            f"{compile_result.compiled_s * 1e3:.4g} ms per micro-batch against "
            f"{compile_result.eager_s * 1e3:.4g} ms eager (median of {args.repeats} passes)",
            flush=True,
        )
        if (shape, dtype) != TARGET:
            compile_result = None

    if target_rows:
        print(f"\nissue 21 targets ({' '.join(TARGET)}, ratios measured in this run):")
        for line in verdicts(target_rows, compile_result):
            print("  " + line)
    sizes = {"esm2_tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_size": 256}}
    if not args.quick:
        sizes["esm2_8m"] = {"hidden_size": 320, "num_layers": 6, "num_heads": 20, "ffn_size": 1280}
    if not args.no_recipe:
        recipe_step_times(args.repeats, sizes)
    with open("/proc/loadavg") as loadavg:
        print(f"/proc/loadavg at the end: {loadavg.read().strip()}")
        print("(2 cores here: a load above ~2 means other jobs shared the cores; ratios are "
              "within one run, absolute times are not comparable across runs)")  # fmt: skip


if __name__ == "__main__":
    main()
