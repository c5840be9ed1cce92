"""The masked-only fused LM head against every peer: time as ratios, extra memory.

    python bench/linear_cross_entropy.py                # the table of docs/performance.md
    python bench/linear_cross_entropy.py --device cuda  # the same rows, plus the GPU-only peers

Every row runs the forward and backward of the output layer and the loss: from hidden states
``[s, b, h]`` and an output weight ``[v, h]`` (and a ``[v]`` bias), all requiring grad, to the
summed cross-entropy over the masked positions (15%) and the gradients w.r.t. all of them.

* ``ours``: :func:`bert_reduce.linear_cross_entropy_loss_sum` with its defaults (it counts the
  scored rows); ``ours[num_scored]``: given the data pipeline's count.
* ``dense``: ``F.linear`` to the full ``[s, b, v]`` logits, ``F.cross_entropy`` in fp32, the mask.
* ``torch chunked``: torch's own ``F.linear_cross_entropy`` (torch >= 2.13) with
  ``options=LinearCrossEntropyOptions()`` on every position, the unscored ones ignored.
* ``gather + torch chunked``: the scored rows gathered (``hidden[mask]``), then torch's
  chunked head.
* ``gather + dense``: the scored rows gathered, then ``F.linear`` and ``F.cross_entropy`` (the
  ModernBERT / MosaicBERT way).
* ``CCE``: Apple's Cut Cross-Entropy, ``impl="torch_compile"`` (``impl="cce"``, its Triton
  kernels, too with ``--device cuda``); it takes no bias, so it has no row with one.
* ``Liger`` (``--device cuda``): Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``.
* ``floor``: the three matrix products on the scored rows alone (``a @ w.T``, ``g @ w``,
  ``g.T @ a``), what any exact head must compute.

CPU: process CPU time on ``--threads`` threads (1), in interleaved rounds (each round runs every
row once, after a warm-up round); a ratio is the median over rounds of the per-round ratio,
which cancels most of a busy machine's drift. The slow rows (``dense``, ``torch chunked``) run in
the first ``--slow-rounds`` rounds only. Extra memory: one fresh process per row measures the
step's high-water RSS beyond the RSS before it and beyond the returned gradients, as a fraction
of the logits' bytes (``b * s * v`` in the input dtype). CUDA: CUDA events, median of
``--rounds`` (50) interleaved runs after warm-up, ``torch.cuda.max_memory_allocated``.
A row whose library is missing is skipped with a note.
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

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_reduce import linear_cross_entropy_loss_sum

SHAPES = {
    "geneformer": (2048, 4, 512, 25_600),
    "bert": (512, 8, 1024, 30_528),
    "esm2-650m": (1024, 8, 1280, 33),
    "geneformer-v2": (4096, 4, 512, 20_275),
}
FULL_SHAPE = "geneformer"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FULL_ROWS = ["ours", "ours[num_scored]", "dense", "torch chunked", "gather + torch chunked",
             "gather + dense", "CCE", "floor"]  # fmt: skip
SHORT_ROWS = ["ours", "CCE", "gather + dense", "floor"]
CUDA_ROWS = ["CCE cce", "Liger"]
SLOW = {"dense", "torch chunked"}
PEERS_EXCLUDED = {"ours", "ours[num_scored]", "floor"}
Batch = dict[str, Tensor | int | None]
Step = Callable[[Batch], Tensor]


def make_batch(shape: tuple[int, ...], dtype: torch.dtype, bias: bool, device: str) -> Batch:
    """``[s, b, h]`` hidden, ``[v, h]`` weight, ``[v]`` bias or ``None``, labels, mask, count."""
    s, b, h, v = shape
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(b, s, generator=gen) < 0.15
    batch: Batch = {
        "hidden": torch.randn(s, b, h, generator=gen),
        "weight": torch.randn(v, h, generator=gen) / h**0.5,
        "bias": torch.randn(v, generator=gen) if bias else None,
        "labels": torch.randint(0, v, (b, s), generator=gen),
        "mask": mask,
    }
    batch = {k: None if t is None else t.to(device) for k, t in batch.items()}
    for key in ("hidden", "weight", "bias"):
        if batch[key] is not None:
            batch[key] = batch[key].to(dtype)
    batch["num_scored"] = int(mask.sum())
    return batch


def _scored_rows(batch: Batch) -> tuple[Tensor, Tensor]:
    """The scored rows' hidden states ``[n, h]`` and targets ``[n]``, in ``[s, b]`` order."""
    hidden, mask = batch["hidden"], batch["mask"].t()
    return hidden[mask], batch["labels"].t()[mask]


def _torch_options() -> object:
    return torch.nn.LinearCrossEntropyOptions()


def row_step(row: str) -> Step:
    """``f(batch) -> loss`` for a row (leaves already requiring grad); ImportError if missing."""
    if row == "ours":
        return lambda b: linear_cross_entropy_loss_sum(
            b["hidden"], b["weight"], b["labels"], b["mask"], bias=b["bias"]
        )[0]
    if row == "ours[num_scored]":
        return lambda b: linear_cross_entropy_loss_sum(
            b["hidden"], b["weight"], b["labels"], b["mask"], bias=b["bias"],
            num_scored=b["num_scored"],
        )[0]  # fmt: skip
    if row == "dense":

        def dense(b: Batch) -> Tensor:
            logits = F.linear(b["hidden"], b["weight"], b["bias"]).float()
            loss = F.cross_entropy(
                logits.flatten(0, 1), b["labels"].t().reshape(-1), reduction="none"
            )
            return (loss * b["mask"].t().reshape(-1)).sum()

        return dense
    if row in ("torch chunked", "gather + torch chunked"):
        if not hasattr(F, "linear_cross_entropy"):
            raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy (2.13+)")

        def torch_chunked(b: Batch) -> Tensor:
            if row == "torch chunked":
                hidden = b["hidden"].flatten(0, 1)
                targets = torch.where(b["mask"], b["labels"], -100).t().reshape(-1)
            else:
                hidden, targets = _scored_rows(b)
            return F.linear_cross_entropy(
                hidden, b["weight"], targets, linear_bias=b["bias"], reduction="sum",
                ignore_index=-100, options=_torch_options(),
            )  # fmt: skip

        return torch_chunked
    if row == "gather + dense":

        def gathered(b: Batch) -> Tensor:
            hidden, targets = _scored_rows(b)
            logits = F.linear(hidden, b["weight"], b["bias"]).float()
            return F.cross_entropy(logits, targets, reduction="sum")

        return gathered
    if row in ("CCE", "CCE cce"):
        from cut_cross_entropy import linear_cross_entropy

        impl = "torch_compile" if row == "CCE" else "cce"

        def cce(b: Batch) -> Tensor:
            targets = torch.where(b["mask"], b["labels"], -100).t()
            return linear_cross_entropy(
                b["hidden"], b["weight"], targets, reduction="sum", impl=impl
            )

        return cce
    if row == "Liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_step(b: Batch) -> Tensor:
            targets = torch.where(b["mask"], b["labels"], -100).t().reshape(-1)
            return liger(b["weight"], b["hidden"].flatten(0, 1), targets, b["bias"])

        return liger_step
    if row == "floor":

        def floor(b: Batch) -> Tensor:
            with torch.no_grad():
                a, _ = _scored_rows(b)
                g = a @ b["weight"].t()
                torch.mm(g, b["weight"]), torch.mm(g.t(), a)
            return torch.zeros((), requires_grad=True)

        return floor
    raise ValueError(row)


def skip_note(row: str, bias: bool, device: str) -> str | None:
    """Why a row does not run in a configuration (``None``: it runs)."""
    if row.startswith("CCE") and bias:
        return "takes no bias"
    if row in CUDA_ROWS and device != "cuda":
        return "GPU only"
    try:
        row_step(row)
    except ImportError as error:
        return f"not installed ({error})"
    return None


def leaves(batch: Batch) -> Batch:
    """Fresh leaves requiring grad, so that every step starts alike."""
    out = dict(batch)
    for key in ("hidden", "weight", "bias"):
        if out[key] is not None:
            out[key] = out[key].detach().requires_grad_(True)
    return out


def run(fn: Step, batch: Batch) -> float:
    loss = fn(leaves(batch))
    loss.backward()
    return float(loss.detach())


def clock(fn: Step, batch: Batch, device: str) -> tuple[float, float]:
    """``(seconds, loss)`` of one forward+backward: process CPU time, or CUDA events."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = run(fn, batch)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000, loss
    start_s = time.process_time()
    loss = run(fn, batch)
    return time.process_time() - start_s, loss


def gradient_bytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for k in ("hidden", "weight", "bias")
               if (t := batch[k]) is not None)  # fmt: skip


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def extra_memory(row: str, shape: tuple[int, ...], dtype: str, bias: bool, device: str) -> int:
    """Bytes of the step's peak beyond the memory before it and the returned gradients."""
    batch = make_batch(shape, DTYPES[dtype], bias, device)
    fn = row_step(row)
    run(fn, make_batch((16, 2, 8, shape[3]), DTYPES[dtype], bias, device))  # lazy set-up
    if row.startswith("CCE"):
        run(fn, batch)  # compiling is not the step's memory
    batch = leaves(batch)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(batch).backward()
        return torch.cuda.max_memory_allocated() - before - gradient_bytes(batch)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    before = _rss_kib("VmRSS")
    fn(batch).backward()
    return (_rss_kib("VmHWM") - before) * 1024 - gradient_bytes(batch)


def memory_in_child(row: str, config: list, threads: int) -> int:
    """:func:`extra_memory` in a fresh process (glibc then returns freed blocks: RSS is live)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--child", json.dumps([row, *config]), "--threads",
               str(threads)]  # fmt: skip
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1])


def paired(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios ``a / b`` over the rounds both ran."""
    return statistics.median(x / y for x, y in zip(a, b, strict=False))


def table(shape_name: str, dtype: str, bias: bool, rows: list[str], args: argparse.Namespace):
    """Time every row in interleaved rounds; print the table; return the rows' results."""
    shape = SHAPES[shape_name]
    if args.quick:
        shape = (shape[0] // 16, *shape[1:])
    batch = make_batch(shape, DTYPES[dtype], bias, args.device)
    notes = {row: skip_note(row, bias, args.device) for row in rows}
    fns = {row: row_step(row) for row in rows if notes[row] is None}
    times: dict[str, list[float]] = {row: [] for row in fns}
    losses: dict[str, float] = {}
    rounds = args.rounds
    for number in range(-1, rounds):
        for row, fn in fns.items():
            if number >= args.slow_rounds and row in SLOW and args.device == "cpu":
                continue
            seconds, losses[row] = clock(fn, batch, args.device)
            if number >= 0:
                times[row].append(seconds)
    config = [list(shape), dtype, bias, args.device]
    memory = {}
    for row in fns:
        if row == "floor":
            continue
        if args.device == "cuda":
            memory[row] = extra_memory(row, shape, dtype, bias, args.device)
        else:
            memory[row] = memory_in_child(row, config, args.threads)
    logits_bytes = shape[0] * shape[1] * shape[3] * DTYPES[dtype].itemsize
    peers = [row for row in fns if row not in PEERS_EXCLUDED]
    fastest = min(peers, key=lambda r: statistics.median(times[r])) if peers else None
    print(f"\n{shape_name} s,b,h,v={shape} {dtype} {'with' if bias else 'no'} bias, "
          f"{batch['num_scored']} scored rows; fastest peer: {fastest}")  # fmt: skip
    print(f"| row | time | vs ours | vs floor | vs {fastest} | extra memory |")
    print("| --- | --- | --- | --- | --- | --- |")
    result = {}
    for row in rows:
        if notes[row] is not None:
            print(f"| {row} | not run: {notes[row]} | | | | |")
            continue
        t = times[row]
        ratios = [paired(t, times[other]) if other in times else float("nan")
                  for other in ("ours", "floor", fastest)]  # fmt: skip
        extra = memory[row] / logits_bytes if row in memory else float("nan")
        result[row] = {"s": statistics.median(t), "ratios": ratios, "extra": extra,
                       "loss": losses[row], "times": t}  # fmt: skip
        mem = "-" if row == "floor" else f"{extra:.3f}x"
        print(f"| {row} | {statistics.median(t):.3f} s | {ratios[0]:.3f}x | {ratios[1]:.3f}x | "
              f"{ratios[2]:.3f}x | {mem} |")  # fmt: skip
    return result


def verdicts(results: dict) -> list[str]:
    """The fused head's targets, each naming what it measures."""
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"{'PASS' if ok else 'FAIL'} {text}")

    fp32, bf16 = results.get(("fp32", False)), results.get(("bf16", False))
    fp32_bias, bf16_bias = results.get(("fp32", True)), results.get(("bf16", True))
    if fp32 and "ours" in fp32:
        ours = fp32["ours"]
        check(ours["ratios"][1] <= 1.05, f"fp32, no bias: ours {ours['ratios'][1]:.3f}x the "
              "three-product floor (<= 1.05x)")  # fmt: skip
        if "CCE" in fp32:
            cce = fp32["CCE"]
            ratio = paired(ours["times"], cce["times"])
            check(ratio <= 1.0, f"fp32, no bias: ours {ratio:.3f}x Cut Cross-Entropy's time by "
                  f"the median per-round ratio (<= 1.00x; {ours['s'] / cce['s']:.3f}x by "
                  f"medians; CCE {cce['ratios'][1]:.3f}x the floor)")  # fmt: skip
        check(ours["extra"] <= 0.05, f"fp32: ours' extra memory {ours['extra']:.3f}x the fp32 "
              "logits' bytes (<= 0.05x)")  # fmt: skip
    if fp32_bias and "ours" in fp32_bias:
        ratio = fp32_bias["ours"]["ratios"][1]
        check(ratio <= 1.07, f"fp32, with bias: ours {ratio:.3f}x the floor (<= 1.07x)")
    for name, res in (("bf16", bf16), ("bf16 with bias", bf16_bias)):
        if res and "ours" in res:
            extra = res["ours"]["extra"]
            check(extra <= 0.10, f"{name}: ours' extra memory {extra:.3f}x the bf16 logits' "
                  "bytes (<= 0.10x)")  # fmt: skip
    if fp32 and bf16 and "ours" in fp32 and "ours" in bf16:
        rel = abs(bf16["ours"]["loss"] - fp32["ours"]["loss"]) / abs(fp32["ours"]["loss"])
        check(rel <= 1e-2, f"bf16 loss within {rel:.1e} relative of the fp32 loss (<= 1e-2)")
        ratio = bf16["ours"]["s"] / fp32["ours"]["s"]
        check(ratio <= 1.0, f"bf16 step {ratio:.3f}x the fp32 step's time (<= 1x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=None, help="default: 7 on CPU, 50 on CUDA")
    parser.add_argument("--slow-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--configs", default="fp32,fp32+bias,bf16,bf16+bias",
                        help=f"the {FULL_SHAPE} tables to run")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 1/16 of each length")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.stdout.reconfigure(line_buffering=True)
    if args.child is not None:
        row, shape, dtype, bias, device = json.loads(args.child)
        print(extra_memory(row, tuple(shape), dtype, bias, device))
        return
    if args.rounds is None:
        args.rounds = 50 if args.device == "cuda" else 7
    extra_rows = CUDA_ROWS if args.device == "cuda" else []
    print(f"torch {torch.__version__}, {args.device}, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds")  # fmt: skip
    start = time.perf_counter()
    results = {}
    for shape_name in args.shapes.split(","):
        if shape_name == FULL_SHAPE:
            for config in args.configs.split(","):
                dtype, bias = config.removesuffix("+bias"), config.endswith("+bias")
                results[dtype, bias] = table(shape_name, dtype, bias, FULL_ROWS + extra_rows, args)
        else:
            table(shape_name, "fp32", False, SHORT_ROWS + extra_rows, args)
    print()
    for line in verdicts(results):
        print(line)
    print(f"whole run: {(time.perf_counter() - start) / 60:.1f} min")


if __name__ == "__main__":
    main()
