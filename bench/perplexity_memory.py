"""Extra memory of ``TokenPerplexity.update_from_logits``, against its previous path.

    python bench/perplexity_memory.py                       # [512, 8, 32000], fp32 and bf16
    python bench/perplexity_memory.py --shape 512 8 33      # another shape

Peak bytes the call holds beyond what existed before it, from PyTorch's CPU allocator events
(``tests.helpers.memory.peak_allocated_bytes``: a count of bytes, not a timing, so a loaded
machine does not move it), over the logits' bytes. ``before`` is the metric's former path: a
log-softmax of every row in fp32 (the accumulation dtype), then the scored
tokens' sum. Both sums are printed to show they agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The repository root, for the tests' allocator helper.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bert_reduce import TokenPerplexity
from tests.helpers.memory import peak_allocated_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(
    shape: tuple[int, int, int], dtype: torch.dtype, mask_prob: float
) -> list[tuple[str, float, float]]:
    """``(path, peak extra / logits bytes, loss sum)`` of the metric and of its previous path."""
    seq_len, batch_size, vocab = shape
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(seq_len, batch_size, vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    mask = torch.rand(batch_size, seq_len, generator=gen) < mask_prob
    logits_bytes = logits.numel() * logits.element_size()
    metric = TokenPerplexity()
    now = peak_allocated_bytes(lambda: metric.update_from_logits(logits, labels, mask))
    sums = {}

    def before() -> None:
        log_probs = torch.log_softmax(logits.to(torch.float32), dim=-1).transpose(0, 1)
        sums["before"] = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)[mask].sum()

    then = peak_allocated_bytes(before)
    return [
        ("update_from_logits", now / logits_bytes, float(metric.loss_sum)),
        ("before: fp32 log-softmax", then / logits_bytes, float(sums["before"])),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(512, 8, 32000), metavar="S B V")
    parser.add_argument("--mask-prob", type=float, default=0.15)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, logits {list(args.shape)}, {args.mask_prob:.0%} scored")
    print(f"{'dtype':<6} {'path':<26} {'peak extra / logits':>20} {'loss sum':>16}")
    for name, dtype in DTYPES.items():
        for path, ratio, loss_sum in measure(tuple(args.shape), dtype, args.mask_prob):
            print(f"{name:<6} {path:<26} {ratio:>19.3f}x {loss_sum:>16.6f}")


if __name__ == "__main__":
    main()
