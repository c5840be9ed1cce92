"""Geneformer-style pretraining with ``transformers.Trainer`` and the exact masked-LM loss.

Geneformer is a ``BertForMaskedLM`` over *rank-value encoded* cells: each cell is the list of
its expressed genes, one token per gene, ordered by expression normalized by the gene's median
over the corpus (highest first), up to 2048 tokens, from a vocabulary of ~25k gene tokens. Its
pretraining is a ``Trainer`` subclass with length-grouped sampling; here the subclass derives
from ``ExactMLMTrainer`` instead (the two lines marked ``# <- bert_reduce``), so that every
optimizer step is that of the mean over every masked gene of the global batch and
``evaluate()`` reports the exact ``eval_loss`` and ``eval_perplexity`` (docs/hf_trainer.md).

    python examples/hf_trainer_geneformer.py          # Geneformer V1's shape; a few CPU minutes
    python examples/hf_trainer_geneformer.py --hidden-size 64 --num-layers 2 --max-length 512 \\
        --max-steps 5                                  # a small CPU run: seconds
    torchrun --nproc-per-node 2 examples/hf_trainer_geneformer.py   # DDP

The cells are synthetic (nothing is downloaded): a few cell types, each with its own log-normal
expression profile over the genes, sampled and rank-value encoded as Geneformer's tokenizer
does. The masked-only fused head is on (``--dense-head`` turns it off): with 25k tokens and
2048-token cells, the ``[b, s, v]`` logits of a micro-batch of 4 would take 0.8 GB in fp32.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from transformers import BertConfig, BertForMaskedLM, TrainingArguments

from bert_reduce.hf import ExactMLMTrainer  # <- bert_reduce

PAD_ID, MASK_ID = 0, 1  # Geneformer's token dictionary: <pad>, <mask>, then the genes
SPECIAL_TOKENS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--genes", type=int, default=25424, help="gene tokens (V1: 25,424)")
    parser.add_argument("--max-length", type=int, default=2048, help="genes per cell at most")
    parser.add_argument("--hidden-size", type=int, default=256, help="Geneformer V1: 256")
    parser.add_argument("--num-layers", type=int, default=6, help="Geneformer V1: 6")
    parser.add_argument("--num-heads", type=int, default=4, help="Geneformer V1: 4")
    parser.add_argument("--train-cells", type=int, default=64)
    parser.add_argument("--eval-cells", type=int, default=16)
    parser.add_argument("--cell-types", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4, help="per process and micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--eval-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dense-head", action="store_true", help="form the [b, s, v] logits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="new or empty; a temporary one if unset")
    return parser.parse_args(argv)


def rank_value_cells(args: argparse.Namespace, num_cells: int, seed: int) -> list[list[int]]:
    """Synthetic cells, rank-value encoded: gene tokens by normalized expression, highest first.

    Every cell type expresses its own subset of genes with log-normal means; a cell samples
    Poisson counts from its type's profile (scaled by a sequencing depth), divides them by
    each gene's median expression over the types that express it (Geneformer normalizes by
    the gene's median over the corpus, which lifts rarely but specifically expressed genes),
    and keeps the detected genes in decreasing order, up to ``max_length``.
    """
    profile_rng = np.random.default_rng([args.seed, 7])  # the same genes for every split
    genes = args.genes
    expressed = profile_rng.random((args.cell_types, genes)) < 0.1
    means = np.exp(profile_rng.normal(0.0, 1.5, (args.cell_types, genes))) * expressed
    gene_median = np.ma.median(np.ma.masked_array(means, ~expressed), axis=0).filled(1.0)
    rng = np.random.default_rng([args.seed, seed])
    cells = []
    for cell_type in rng.integers(0, args.cell_types, num_cells):
        depth = rng.lognormal(0.0, 0.5)  # sequencing depth: how many genes are detected
        counts = rng.poisson(means[cell_type] * depth)
        detected = np.flatnonzero(counts)
        order = np.argsort(-(counts[detected] / gene_median[detected]), kind="stable")
        cells.append((detected[order][: args.max_length] + SPECIAL_TOKENS).tolist())
    return cells


class GeneMaskingCollator:
    """Pads a micro-batch of cells and masks 15% of the genes (80% ``<mask>``, 10% random)."""

    def __init__(self, vocab_size: int, probability: float = 0.15) -> None:
        self.vocab_size = vocab_size
        self.probability = probability

    def __call__(self, cells: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(cell["input_ids"]) for cell in cells)
        tokens = torch.full((len(cells), length), PAD_ID)
        for row, cell in enumerate(cells):
            tokens[row, : len(cell["input_ids"])] = torch.tensor(cell["input_ids"])
        real = tokens != PAD_ID
        masked = real & (torch.rand(tokens.shape) < self.probability)
        draw = torch.rand(tokens.shape)
        random_genes = torch.randint(SPECIAL_TOKENS, self.vocab_size, tokens.shape)
        inputs = torch.where(masked & (draw < 0.8), MASK_ID, tokens)
        inputs = torch.where(masked & (draw >= 0.8) & (draw < 0.9), random_genes, inputs)
        return {
            "input_ids": inputs,
            "attention_mask": real.long(),
            "labels": torch.where(masked, tokens, -100),
        }


class GeneformerPretrainer(ExactMLMTrainer):  # <- bert_reduce (was: Trainer)
    """Where Geneformer's own Trainer subclass (length-grouped sampling, ...) would go."""


def output_directory(args: argparse.Namespace) -> str:
    """``--output-dir`` if new or empty (nothing of an earlier run is overwritten)."""
    if args.output_dir is None:
        return tempfile.mkdtemp(prefix="hf_trainer_geneformer_")
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir):
        raise FileExistsError(f"--output-dir {args.output_dir} is not empty; choose a new one.")
    return args.output_dir


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    output_dir = output_directory(args)
    vocab_size = args.genes + SPECIAL_TOKENS
    config = BertConfig(  # Geneformer V1's architecture (10M parameters at the defaults)
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=2 * args.hidden_size,
        hidden_act="relu",
        max_position_embeddings=args.max_length,
        pad_token_id=PAD_ID,
        hidden_dropout_prob=0.02,
        attention_probs_dropout_prob=0.02,
    )
    torch.manual_seed(args.seed)
    model = BertForMaskedLM(config)
    train = [{"input_ids": cell} for cell in rank_value_cells(args, args.train_cells, seed=1)]
    evals = [{"input_ids": cell} for cell in rank_value_cells(args, args.eval_cells, seed=2)]
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        train_sampling_strategy="group_by_length",  # Geneformer's length-grouped batches
        learning_rate=args.lr,
        warmup_steps=max(1, args.max_steps // 10),
        weight_decay=0.001,
        max_steps=args.max_steps,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=torch.accelerator.current_accelerator() is None,
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = GeneformerPretrainer(
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=GeneMaskingCollator(vocab_size),
        fused_head=not args.dense_head,
    )
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(
            f"eval_loss {metrics['eval_loss']:.6f} eval_perplexity "
            f"{metrics['eval_perplexity']:.2f} (output: {output_dir})",
            flush=True,
        )
    return metrics


if __name__ == "__main__":
    main()
