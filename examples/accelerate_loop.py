"""Exact masked-LM loss and validation in a Hugging Face Accelerate loop with an ESM-2 model.

Accelerate's usual loop (``accelerator.prepare``, ``accelerator.accumulate``,
``accelerator.backward``, ``Accelerator(gradient_accumulation_steps=k)``) with ``outputs.loss``
replaced by :class:`bert_reduce.GlobalBatchLoss`: every optimizer step is that of the mean over
every masked token of the global batch, on any number of processes and for any ``k``.
Validation is that of ``examples/torch_fsdp2_loop.py`` (whose model and data this script
shares)::

    torchrun --nproc-per-node 2 examples/accelerate_loop.py --gradient-accumulation-steps 2
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from torch_fsdp2_loop import build_model, global_batch, validate, validation_set

from bert_reduce import GlobalBatchLoss
from bert_reduce.accumulation import accumulation_steps
from bert_reduce.sampling import ShardedEvalBatchSampler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--val-size", type=int, default=13, help="held-out sequences")
    parser.add_argument("--val-batch-size", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=5, help="steps between validations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.set_defaults(model_path=None)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> torch.nn.Module:
    """Train (and validate); return the prepared model."""
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        cpu=not torch.cuda.is_available(),  # under torchrun, gloo processes on CPU
    )
    world, k = accelerator.num_processes, accelerator.gradient_accumulation_steps
    if args.global_batch_size % (world * k):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of the number of "
            f"processes ({world}) times --gradient-accumulation-steps {k}."
        )
    torch.manual_seed(args.seed)
    model = build_model(args).to(getattr(torch, args.dtype))
    model.esm.contact_head.requires_grad_(False)  # not on the masked-LM path
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01
    )
    train_set = [
        {key: value[i] for key, value in global_batch(step, args).items()}
        for step in range(1, args.steps + 1)
        for i in range(args.global_batch_size)
    ]
    # prepare() deals the micro-batches round-robin: each step's k * world of them, the
    # step's global batch, are the k micro-batches of every process.
    train_loader = DataLoader(train_set, batch_size=args.global_batch_size // (world * k))
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    # accelerator.backward divides every loss by k and DDP averages over the processes: the
    # gradient is the mean over world * k shares, which the loss scales up by as much.
    loss_fn = GlobalBatchLoss(gradient_average_size=world * k)
    # Not prepared: prepare() would even out the processes by repeating samples.
    val_sampler = ShardedEvalBatchSampler(args.val_size, args.val_batch_size)
    val_loader = DataLoader(validation_set(args), batch_sampler=val_sampler)

    # Each step's k micro-batches, handed to loss_fn.begin() (one all-reduce) first.
    for step, micro_batches in enumerate(accumulation_steps(train_loader, loss_fn, k), start=1):
        for mb in micro_batches:
            with accelerator.accumulate(model):  # no_sync but for the k-th micro-batch
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"])
                accelerator.backward(loss_fn(logits.logits, mb))
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()  # a no-op but for the k-th micro-batch
                optimizer.zero_grad()
        step_loss = loss_fn.end()  # one all-reduce: the exact loss of the global batch
        if accelerator.is_main_process:
            print(f"step {step} loss {step_loss:.10f} grad_norm {grad_norm:.10f}")
        if step % args.val_every == 0:
            perplexity = validate(model, val_loader, accelerator.device)
            if accelerator.is_main_process:
                print(f"val step {step} val_loss {perplexity.log():.10f} val_ppl {perplexity:.10f}")
    return model


if __name__ == "__main__":
    train(parse_args())
