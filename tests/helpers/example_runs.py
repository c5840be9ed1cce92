"""Several runs of the examples' ``train(args)`` in one ``torchrun`` launch (the examples' tests).

    torchrun --nproc-per-node N -m tests.helpers.example_runs "EXAMPLE ARGS" ["EXAMPLE ARGS" ...]

Before each run rank 0 prints ``run <i>``, then the example's own lines; after it,
``reference val_loss <L>``: the trained model's Hugging Face ``outputs.loss`` over the whole
validation set as one batch, an independent reference for the last ``val_loss``.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def main() -> None:
    dist.init_process_group("gloo")
    for index, run in enumerate(sys.argv[1:]):
        if dist.get_rank() == 0:
            print(f"run {index}", flush=True)
        name, *argv = shlex.split(run)
        example = importlib.import_module(name)
        args = example.parse_args(argv)
        model = example.train(args)
        whole = default_collate(example.validation_set(args))
        model.eval()
        with torch.no_grad():
            loss = model(**whole).loss
        if dist.get_rank() == 0:
            print(f"reference val_loss {loss:.10f}", flush=True)
    dist.destroy_process_group()
    # Exit as multiprocessing's workers do, without the interpreter's shutdown: it can abort the
    # process at random once every number is printed (examples/torch_fsdp2_loop.py says why).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
