"""Exact masked-LM loss in a plain PyTorch FSDP2 loop with a Hugging Face ESM-2 model.

The shape of a bionemo-recipes training script (argparse, ``torchrun``, FSDP2 with one
``fully_shard`` per transformer layer, gradient accumulation, clipping), with
``outputs.loss`` replaced by :class:`bert_reduce.GlobalBatchLoss`: every optimizer step is
that of the mean over every masked token of the global batch, however it is split over
ranks and micro-batches. The loss takes the output layer's inputs
(:func:`bert_reduce.hf.lm_head_inputs`) and computes the logits of the masked positions only,
as many as each micro-batch's ``num_scored`` (counted on the host: no device sync);
``--head logits`` uses the model's logits instead. Every ``--val-every`` steps it validates
exactly: every held-out sequence on one rank, every rank as many forwards (FSDP2 all-gathers
in each), the token sums added up in :class:`bert_reduce.metrics.TokenPerplexity`. Runs on
CPU (gloo) or GPUs (NCCL)::

    torchrun --nproc-per-node 2 examples/torch_fsdp2_loop.py --steps 20
    torchrun --nproc-per-node 8 examples/torch_fsdp2_loop.py --model-path DIR   # a local checkpoint

The data are random protein-like sequences of varying length, 15% of their tokens masked
(Hugging Face's convention: labels are -100 where nothing is scored); the first of each
global batch scores nothing, as a short sequence may. Each rank takes its contiguous share of
the global batch and cuts it into micro-batches.

On CPU, torch may abort a process at exit once everything is printed ("terminate called without
an active exception"): DTensor's caches keep the gloo group alive past
``destroy_process_group()``, and the interpreter's shutdown races its worker threads
(tests/helpers/example_runs.py exits without that shutdown).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from transformers import EsmConfig, EsmForMaskedLM

from bert_reduce import GlobalBatchLoss
from bert_reduce.evaluation import eval_batches
from bert_reduce.hf import lm_head_inputs
from bert_reduce.metrics import TokenPerplexity
from bert_reduce.num_scored import count_scored
from bert_reduce.sampling import ShardedEvalBatchSampler

PAD_ID, MASK_ID, VOCAB = 1, 32, 33  # the ESM alphabet: residues are ids 4..23


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=12)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--val-size", type=int, default=13, help="held-out sequences")
    parser.add_argument("--val-batch-size", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=5, help="steps between validations")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-path", default=None, help="a local Hugging Face checkpoint")
    parser.add_argument("--hidden-size", type=int, default=32, help="ESM-2 8M: 320")
    parser.add_argument("--num-layers", type=int, default=2, help="ESM-2 8M: 6")
    parser.add_argument("--num-heads", type=int, default=4, help="ESM-2 8M: 20")
    parser.add_argument(
        "--head", choices=("fused", "logits"), default="fused",
        help="fused: logits of the masked positions only; logits: the model's [b, s, v]",
    )  # fmt: skip
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> EsmForMaskedLM:
    if args.model_path is not None:
        return EsmForMaskedLM.from_pretrained(args.model_path, local_files_only=True)
    config = EsmConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        intermediate_size=4 * args.hidden_size,
        max_position_embeddings=args.max_length + 2,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        pad_token_id=PAD_ID,
        mask_token_id=MASK_ID,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return EsmForMaskedLM(config)


def random_batch(seed: int, size: int, length: int) -> dict[str, torch.Tensor]:
    """``size`` random sequences of ``length // 4`` to ``length`` residues, ``[size, length]``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (size,), generator=gen)
    real = torch.arange(length) < lengths[:, None]
    tokens = torch.where(real, torch.randint(4, 24, (size, length), generator=gen), PAD_ID)
    masked = real & (torch.rand(size, length, generator=gen) < 0.15)
    return {
        "input_ids": torch.where(masked, MASK_ID, tokens),
        "attention_mask": real.long(),
        "labels": torch.where(masked, tokens, -100),
    }


def global_batch(step: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The step's whole global batch, the same on every rank (a real loader shards a dataset)."""
    batch = random_batch(args.seed * 100_003 + step, args.global_batch_size, args.max_length)
    batch["labels"][0] = -100  # a sequence scoring nothing: its micro-batch adds 0, not NaN
    return batch


def validation_set(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """``--val-size`` held-out sequences, one mapping each."""
    batch = random_batch(args.seed * 100_003 - 1, args.val_size, args.max_length)
    return [{key: value[i] for key, value in batch.items()} for i in range(args.val_size)]


@torch.no_grad()
def validate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """The perplexity of the whole validation set (0-dim fp64), on every rank."""
    model.eval()
    metric = TokenPerplexity().to(device)
    # This rank's batches, then batches scoring nothing until every rank has run as many.
    for batch in eval_batches(loader):
        batch = {key: value.to(device) for key, value in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        metric.update_from_logits(logits, batch["labels"], layout="bs")  # -100: unscored
    model.train()
    return metric.compute()  # one all-gather of (loss_sum, denominator)


def train(args: argparse.Namespace) -> torch.nn.Module:
    """Train (and validate) in the current process group; return the model."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch_size % (world * args.micro_batch_size):
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} must be a multiple of the number of "
            f"ranks ({world}) times --micro-batch-size {args.micro_batch_size}."
        )
    mesh = init_device_mesh(device.type if cuda else "cpu", (world,), mesh_dim_names=("dp",))

    torch.manual_seed(args.seed)
    model = build_model(args).to(device, getattr(torch, args.dtype))
    model.esm.contact_head.requires_grad_(False)  # not on the masked-LM path
    for layer in model.esm.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01
    )
    # FSDP2 averages gradients over "dp"; its ranks must run as many micro-batches each, which
    # begin() checks (raising, rather than hanging, when they do not).
    loss_fn = GlobalBatchLoss(group=mesh.get_group(), equal_micro_batch_counts=True)
    # Every held-out sequence on exactly one rank (a padding DistributedSampler is refused).
    val_sampler = ShardedEvalBatchSampler(args.val_size, args.val_batch_size)
    val_loader = DataLoader(validation_set(args), batch_sampler=val_sampler)

    share = args.global_batch_size // world
    for step in range(1, args.steps + 1):
        batch = global_batch(step, args)
        micro_batches = []
        for start in range(rank * share, (rank + 1) * share, args.micro_batch_size):
            mb = {k: v[start : start + args.micro_batch_size] for k, v in batch.items()}
            mb["num_scored"] = count_scored(mb)  # on the host, before the batch moves
            micro_batches.append({k: v.to(device) if torch.is_tensor(v) else v
                                  for k, v in mb.items()})  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        loss_fn.begin(micro_batches)  # one all-reduce: the global number of masked tokens
        for index, mb in enumerate(micro_batches):
            # Reduce-scatter gradients once, in the last micro-batch's backward.
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            inputs = {"input_ids": mb["input_ids"], "attention_mask": mb["attention_mask"]}
            if args.head == "fused":  # hidden states [b, s, h] + the decoder's weight and bias
                output = lm_head_inputs(model, **inputs)
            else:
                output = model(**inputs).logits
            loss_fn(output, mb).backward()  # this micro-batch's share of the global mean
        step_loss = loss_fn.end()  # one all-reduce: the exact loss of the global batch
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {step_loss:.10f} grad_norm {grad_norm.full_tensor():.10f}")
        if step % args.val_every == 0:
            perplexity = validate(model, val_loader, device)
            if rank == 0:
                print(f"val step {step} val_loss {perplexity.log():.10f} val_ppl {perplexity:.10f}")
    return model


def main() -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train(parse_args())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
