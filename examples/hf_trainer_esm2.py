"""Fine-tune ESM-2 with ``transformers.Trainer`` and the exact masked-LM loss.

A plain Hugging Face masked-LM script (``EsmTokenizer``, ``DataCollatorForLanguageModeling``,
``TrainingArguments``) in which two lines change, marked ``# <- bert_reduce``: the import and
``ExactMLMTrainer`` in place of ``Trainer``. Every optimizer step is then that of the mean over
every masked token of the global batch (accumulation micro-batches x processes), and
``evaluate()`` reports the exact ``eval_loss`` and ``eval_perplexity`` (docs/hf_trainer.md).

    python examples/hf_trainer_esm2.py                        # ESM-2 8M's shape, from scratch
    python examples/hf_trainer_esm2.py --checkpoint DIR       # fine-tune a local checkpoint
    python examples/hf_trainer_esm2.py --hidden-size 64 --num-layers 2 --num-heads 4 \\
        --max-steps 20                                        # a small CPU run: seconds
    torchrun --nproc-per-node 2 examples/hf_trainer_esm2.py   # DDP (gloo on CPU, NCCL on GPUs)

``--checkpoint`` takes a directory written by ``save_pretrained`` (e.g. a copy of
``facebook/esm2_t6_8M_UR50D``); nothing is downloaded. The data are the recipe's synthetic
protein corpus (Swiss-Prot's composition and length distribution; no biology to learn, so the
best perplexity is about 18).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from transformers import (
    DataCollatorForLanguageModeling,
    EsmConfig,
    EsmForMaskedLM,
    EsmTokenizer,
    TrainingArguments,
)

from bert_reduce.hf import ExactMLMTrainer  # <- bert_reduce
from bert_reduce.recipe.data import synthetic_proteins
from bert_reduce.recipe.tokenizer import ESM_ALPHABET


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a local save_pretrained directory")
    parser.add_argument("--hidden-size", type=int, default=320, help="ESM-2 8M: 320")
    parser.add_argument("--num-layers", type=int, default=6, help="ESM-2 8M: 6")
    parser.add_argument("--num-heads", type=int, default=20, help="ESM-2 8M: 20")
    parser.add_argument("--max-length", type=int, default=128, help="tokens, <cls> and <eos> too")
    parser.add_argument("--train-sequences", type=int, default=512)
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per process and micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--eval-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=4e-4)
    parser.add_argument("--fused-head", action="store_true", help="masked-only LM head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="new or empty; a temporary one if unset")
    return parser.parse_args(argv)


def build_tokenizer(args: argparse.Namespace) -> EsmTokenizer:
    """The checkpoint's tokenizer, else ESM-2's 33-token alphabet written to a vocab file."""
    if args.checkpoint is not None and (Path(args.checkpoint) / "vocab.txt").is_file():
        return EsmTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    with tempfile.TemporaryDirectory() as workdir:
        vocab = Path(workdir) / "vocab.txt"
        vocab.write_text("\n".join(ESM_ALPHABET) + "\n")
        return EsmTokenizer(str(vocab))


def build_model(args: argparse.Namespace, tokenizer: EsmTokenizer) -> EsmForMaskedLM:
    if args.checkpoint is not None:
        return EsmForMaskedLM.from_pretrained(args.checkpoint, local_files_only=True)
    config = EsmConfig(  # ESM-2's architecture: rotary, pre-LN, token dropout, tied head
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=1026,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        pad_token_id=tokenizer.pad_token_id,
        mask_token_id=tokenizer.mask_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return EsmForMaskedLM(config)


def tokenized(sequences: list[str], tokenizer: EsmTokenizer, max_length: int) -> list[dict]:
    return [dict(tokenizer(seq, truncation=True, max_length=max_length)) for seq in sequences]


def output_directory(args: argparse.Namespace) -> str:
    """``--output-dir`` if new or empty (nothing of an earlier run is overwritten)."""
    if args.output_dir is None:
        return tempfile.mkdtemp(prefix="hf_trainer_esm2_")
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir):
        raise FileExistsError(f"--output-dir {args.output_dir} is not empty; choose a new one.")
    return args.output_dir


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    output_dir = output_directory(args)
    tokenizer = build_tokenizer(args)
    model = build_model(args, tokenizer)
    corpus = synthetic_proteins(args.train_sequences + args.eval_sequences, seed=args.seed)
    train = tokenized(corpus[: args.train_sequences], tokenizer, args.max_length)
    evals = tokenized(corpus[args.train_sequences :], tokenizer, args.max_length)
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr,
        warmup_steps=max(1, args.max_steps // 10),
        weight_decay=0.01,
        max_steps=args.max_steps,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not _has_accelerator(),
        disable_tqdm=True,
    )
    trainer = ExactMLMTrainer(  # <- bert_reduce (was: Trainer)
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=evals,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
        fused_head=args.fused_head,
    )
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(
            f"eval_loss {metrics['eval_loss']:.6f} eval_perplexity "
            f"{metrics['eval_perplexity']:.4f} (output: {output_dir})",
            flush=True,
        )
    return metrics


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.current_accelerator() is not None


if __name__ == "__main__":
    main()
