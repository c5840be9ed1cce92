"""examples/slurm_requeue.sh on one machine: 2 nodes' worth of torchrun, SIGKILL, requeue.

The script runs as SLURM runs it, with stand-ins for ``srun`` and ``scontrol`` (:data:`SRUN`,
:data:`SCONTROL`). The two ``torchrun`` agents meet through the c10d rendezvous on localhost and
start one CPU process each (ranks 0 and 1 of a 2-node DDP run over gloo). Once 7 of 20 steps are
logged, every process of the job is killed with ``SIGKILL`` (a preemption without grace period,
a lost allocation); the same script is then run again, as a requeued job is, and ``metrics.csv``
must equal an uninterrupted 2-process run (the default dropout, so every rank's generators must
be restored): every step once.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers.dist_utils import HANG_GUARD_S, free_port
from tests.helpers.recipe_runs import (
    CHECKPOINTED,
    ENV,
    ROOT,
    run_train_py,
    training_steps,
    wait_until,
)

pytestmark = pytest.mark.slow

OVERRIDES = [*CHECKPOINTED, "data.micro_batch_size=4", "trainer.max_steps=20"]
SRUN = """#!{python}
# srun stand-in: the command once per node, with SLURM's per-task variables; ends them all as
# soon as one fails (--kill-on-bad-exit), and exits with the first failure's status.
import os, signal, subprocess, sys, time
command = sys.argv[1:]
while command[0].startswith("--"):
    command.pop(0)
tasks = [
    subprocess.Popen(command, env={{**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)}})
    for n in range(int(os.environ["SLURM_NNODES"]))
]
while any(task.poll() is None for task in tasks):
    if any(task.poll() not in (None, 0) for task in tasks):
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signal.SIGTERM)
    time.sleep(0.2)
sys.exit(next((task.returncode for task in tasks if task.returncode), 0))
"""
SCONTROL = """#!/bin/sh
# scontrol stand-in: 'scontrol show hostnames <list>' names this machine.
echo localhost
"""


def kill_job(process: subprocess.Popen[str]) -> None:
    """SIGKILL the job's whole process tree at once, as SLURM ends an allocation: every
    process below it, whatever session torchrun put it in."""
    job = psutil.Process(process.pid)
    stopped: set[int] = set()
    while True:  # freeze the tree first, so that no process starts another in between
        tree = {job.pid, *(child.pid for child in job.children(recursive=True))} - stopped
        if not tree:
            break
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)
        stopped |= tree
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=HANG_GUARD_S)


@pytest.fixture
def slurm_env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {
        **ENV,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "GPUS_PER_NODE": "1",
        "RUN_DIR": str(tmp_path / "runs" / "4242"),
    }


def sbatch(env: dict[str, str]) -> subprocess.Popen[str]:
    # A requeued job may start on other nodes: a fresh rendezvous port each time.
    return subprocess.Popen(
        ["bash", "examples/slurm_requeue.sh", *OVERRIDES],
        cwd=ROOT,
        env={**env, "RDZV_PORT": str(free_port())},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_requeued_job_finishes_the_run_once(slurm_env: dict[str, str], tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    run_train_py(*OVERRIDES, "trainer.devices=2", f"hydra.run.dir={reference}", env=slurm_env)
    run_dir = Path(slurm_env["RUN_DIR"])
    job = sbatch(slurm_env)
    wait_until(lambda: len(training_steps(run_dir)) >= 7, job)
    kill_job(job)
    killed_at = len(training_steps(run_dir))
    assert killed_at < 20

    requeued = sbatch(slurm_env)
    output, _ = requeued.communicate(timeout=HANG_GUARD_S)
    assert requeued.returncode == 0, output[-5000:]
    resumed = [line for line in output.splitlines() if "resume=auto: resuming from" in line]
    assert resumed, output[-5000:]
    print(f"\nkilled after {killed_at} logged steps; {resumed[0]}")
    assert training_steps(run_dir) == list(range(1, 21))
    assert (run_dir / "metrics.csv").read_text() == (reference / "metrics.csv").read_text()
