"""How far a mean of micro-batch means is from the global mean, on the recipe's own data.

BioNeMo's NeMo 2 releases leave Megatron's ``calculate_per_token_loss`` at ``False``: each
micro-batch's loss sum is divided by its own masked-token count ``n_m`` (at least 1) and by the
number of micro-batches ``M`` of the global batch (over every data-parallel rank), so a token
of micro-batch ``m`` weighs ``1 / (M * max(n_m, 1))`` in the gradient instead of ``1 / N``
(``N`` the global count). The gradient of the logits of that token is off by exactly
``N / (M * n_m) - 1``. This prints the largest such error over the first steps of the recipe's
training data (synthetic corpus, 15% masking, global batch 32) for several micro-batch sizes.

    python bench/mean_of_means_error.py [--steps 100]
"""

from __future__ import annotations

import argparse

import torch

from bert_reduce.lightning.exact_module import split_micro_batches
from bert_reduce.recipe.config import DataConfig
from bert_reduce.recipe.datamodule import ESMDataModule


def largest_weight_error(micro_batch_size: int, steps: int, global_batch_size: int) -> float:
    """Largest ``|N / (M * n_m) - 1|`` over the scored tokens of the first ``steps`` batches."""
    datamodule = ESMDataModule(
        DataConfig(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            num_train_sequences=steps * global_batch_size,
        )
    )
    datamodule.setup("fit")
    worst = 0.0
    for step, batch in enumerate(datamodule.train_dataloader()):
        if step == steps:
            break
        micro_batches = split_micro_batches(batch, micro_batch_size)
        counts = torch.stack([mb["loss_mask"].sum() for mb in micro_batches]).double()
        weight_ratio = counts.sum() / (len(counts) * counts.clamp(min=1))
        worst = max(worst, float(((weight_ratio - 1).abs() * (counts > 0)).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch-size", type=int, default=32)
    args = parser.parse_args()
    print(f"global batch {args.global_batch_size}, {args.steps} steps of the recipe's data")
    for micro_batch_size in (8, 4, 2, 1):
        error = largest_weight_error(micro_batch_size, args.steps, args.global_batch_size)
        print(f"micro-batches of {micro_batch_size}: per-token gradient off by up to {error:.0%}")


if __name__ == "__main__":
    main()
