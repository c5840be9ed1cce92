"""Training curves: plain ``Trainer`` against ``ExactMLMTrainer`` at accumulation 1, 4 and 8.

The same tiny ESM-2-shaped model (fp32, dropout 0), the same data in the same order and the
same global batch of 16 sequences, split into 1, 4 or 8 accumulation micro-batches; AdamW,
warm-up then linear decay, clipping at 1. Plots the logged training loss and the evaluation
perplexity (``exp(eval_loss)`` as each trainer reports it, 96 held-out sequences, eval batch 8)
against the optimizer step, and writes the numbers beside the picture::

    python bench/hf_trainer_curves.py     # docs/images/hf_trainer_curves.{png,csv}

The corpus mixes short low-complexity peptides (10-30 residues repeating a 1-3 residue motif:
few masked tokens, soon easy) with long proteins (100-254 residues of Swiss-Prot's composition:
many masked tokens, hard), as real protein sets mix repetitive fragments with domains. Masks
are drawn once per sequence, so every run sees the same masked tokens. The plain Trainer
weighs each micro-batch's mean equally, so the smaller the micro-batches the more the short
peptides weigh: its curves drift apart with the accumulation; the exact ones coincide.
Refuses to overwrite earlier outputs unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import csv
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import EsmConfig, EsmForMaskedLM, Trainer, TrainingArguments

from bert_reduce.hf import ExactMLMTrainer
from bert_reduce.recipe.data import BACKGROUND_FREQUENCIES
from bert_reduce.recipe.tokenizer import ESMTokenizer

TOKENIZER = ESMTokenizer()
ACCUMULATIONS = (1, 4, 8)
GLOBAL_BATCH = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--train-sequences", type=int, default=1920)
    parser.add_argument("--eval-sequences", type=int, default=96)
    parser.add_argument("--out", default="docs/images/hf_trainer_curves.png")
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_args()


def corpus(num: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Tokenized, statically masked sequences: half short low-complexity, half long."""
    rng = np.random.default_rng([seed, 11])
    residues = list(BACKGROUND_FREQUENCIES)
    probs = np.array(list(BACKGROUND_FREQUENCIES.values()))
    rows = []
    for index in range(num):
        if index % 2 == 0:  # a repeat of a 1-3 residue motif (poly-Q, GPP, GGS linkers...)
            motif = "".join(rng.choice(residues, size=rng.integers(1, 4)))
            sequence = (motif * 30)[: rng.integers(10, 31)]
        else:
            sequence = "".join(
                rng.choice(residues, size=rng.integers(100, 255), p=probs / probs.sum())
            )
        ids = torch.tensor(TOKENIZER.encode(sequence))  # <cls> ... <eos>
        inner = torch.arange(1, len(ids) - 1)
        count = max(1, round(0.15 * len(inner)))
        masked = inner[torch.from_numpy(rng.permutation(len(inner))[:count])]
        labels = torch.full_like(ids, -100)
        labels[masked] = ids[masked]
        inputs = ids.clone()
        inputs[masked] = TOKENIZER.mask_id
        rows.append({"input_ids": inputs, "labels": labels})
    order = rng.permutation(num)  # short and long interleaved at random
    return [rows[i] for i in order]


def pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    length = max(len(row["input_ids"]) for row in rows)
    batch = {
        "input_ids": torch.full((len(rows), length), TOKENIZER.pad_id),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100),
    }
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n], batch["labels"][i, :n] = row["input_ids"], row["labels"]
        batch["attention_mask"][i, :n] = 1
    return batch


def model() -> EsmForMaskedLM:
    torch.manual_seed(0)
    config = EsmConfig(
        vocab_size=len(TOKENIZER.vocab),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=1026,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        pad_token_id=TOKENIZER.pad_id,
        mask_token_id=TOKENIZER.mask_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return EsmForMaskedLM(config)


def run(exact: bool, accumulation: int, train, evals, args, workdir: str) -> dict:
    training_args = TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=GLOBAL_BATCH // accumulation,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=accumulation,
        learning_rate=2e-3,
        warmup_steps=10,
        weight_decay=0.01,
        max_steps=args.steps,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer_class = ExactMLMTrainer if exact else Trainer
    trainer = trainer_class(
        model=model(), args=training_args, train_dataset=train, eval_dataset=evals,
        data_collator=pad,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    final = ExactMLMTrainer(
        model=trainer.model, args=training_args, eval_dataset=evals, data_collator=pad
    ).evaluate()
    return {
        "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
        "eval_perplexity": {
            e["step"]: math.exp(e["eval_loss"]) for e in history if "eval_loss" in e
        },
        "final_exact_perplexity": final["eval_perplexity"],
    }


def _smoothed(values: list[float], keep: float = 0.8) -> list[float]:
    """Exponential moving average (TensorBoard's smoothing), for a readable loss curve."""
    out, average = [], values[0]
    for value in values:
        average = keep * average + (1 - keep) * value
        out.append(average)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {1: "tab:blue", 4: "tab:orange", 8: "tab:red"}
    for (exact, accumulation), result in results.items():
        style = {
            "color": colors[accumulation],
            "linestyle": "-" if exact else "--",
            "linewidth": 2.4 if exact else 1.2,
            "alpha": 0.6 if exact else 0.9,
            "label": f"{'ExactMLMTrainer' if exact else 'Trainer'}, accumulation {accumulation}",
        }
        steps, losses = zip(*sorted(result["loss"].items()), strict=True)
        left.plot(steps, _smoothed(losses), **style)
        steps, ppl = zip(*sorted(result["eval_perplexity"].items()), strict=True)
        right.plot(steps, ppl, marker="o", markersize=3, **style)
    left.set(
        xlabel="optimizer step",
        ylabel="logged loss (moving average, 0.8)",
        title="training loss, as logged",
    )
    right.set(
        xlabel="optimizer step", ylabel="exp(eval_loss)", title="evaluation perplexity, as reported"
    )
    left.legend(fontsize=8)
    fig.suptitle(f"Global batch {GLOBAL_BATCH}, same data and order; tiny ESM-2-shaped model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    table = out.with_suffix(".csv")
    existing = [p for p in (out, table) if p.exists()]
    if existing and not args.overwrite:
        raise FileExistsError(f"{existing} exist; pass --overwrite to replace them.")
    torch.set_num_threads(1)
    start = time.perf_counter()
    train = corpus(args.train_sequences, seed=0)
    evals = corpus(args.eval_sequences, seed=1)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for exact in (False, True):
            for accumulation in ACCUMULATIONS:
                results[(exact, accumulation)] = run(
                    exact, accumulation, train, evals, args, workdir
                )
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, out)
    with open(table, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trainer", "accumulation", "step", "loss", "eval_perplexity"])
        for (exact, accumulation), result in results.items():
            for step, loss in sorted(result["loss"].items()):
                ppl = result["eval_perplexity"].get(step, "")
                name = "ExactMLMTrainer" if exact else "Trainer"
                writer.writerow([name, accumulation, step, loss, ppl])

    print("| trainer | accumulation | final logged loss | final exp(eval_loss) as reported | "
          "final model's exact eval perplexity |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for (exact, accumulation), result in results.items():
        name = "`ExactMLMTrainer`" if exact else "`Trainer`"
        loss = result["loss"][args.steps]
        reported = result["eval_perplexity"][args.steps]
        print(
            f"| {name} | {accumulation} | {loss:.4f} | {reported:.3f} | "
            f"{result['final_exact_perplexity']:.3f} |"
        )
    for exact in (False, True):
        curves = [results[(exact, a)]["loss"] for a in ACCUMULATIONS]
        spread = max(max(c[s] for c in curves) - min(c[s] for c in curves) for s in curves[0])
        name = "ExactMLMTrainer" if exact else "Trainer"
        print(f"{name}: largest spread of the logged loss over accumulation 1/4/8: {spread:.2e}")
    with open("/proc/loadavg") as loadavg:
        load = " ".join(loadavg.read().split()[:3])
    print(f"wrote {out} and {table} in {time.perf_counter() - start:.0f} s; load average {load}")


if __name__ == "__main__":
    main()
