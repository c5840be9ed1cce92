#!/usr/bin/env bash
# Train on a preemptible SLURM partition: the same job, requeued any number of times,
# finishes the run once. Submit from the repository root:
#
#     sbatch examples/slurm_requeue.sh model=esm2_8m trainer.max_steps=100000
#
# Every start runs the same command. resume=auto continues from the newest intact checkpoint in
# the run directory (runs/<job id>: a requeued job keeps its id), or starts the run when there
# is none; metrics.csv keeps every step's row once. Preemption sends SIGTERM (the run finishes
# its step, checkpoints and exits 143), or kills outright (the run continues from its last
# checkpoint). See docs/recipe.md, "Preemptible clusters".
#
#SBATCH --job-name=esm2-mlm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out
#SBATCH --signal=B:USR1@300
set -euo pipefail

RUN_DIR=${RUN_DIR:-runs/$SLURM_JOB_ID}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}

# Near the time limit (--signal above), requeue the job: SLURM then sends SIGTERM to the
# training processes, which checkpoint and stop; the requeued job resumes from there.
trap 'echo "Time limit near: requeueing job $SLURM_JOB_ID"; scontrol requeue "$SLURM_JOB_ID"' USR1

# One torchrun per node starts that node's ranks; they meet at the first node.
set +e
srun --kill-on-bad-exit=1 \
    torchrun \
    --nnodes="$SLURM_NNODES" \
    --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" \
    train.py \
    trainer.num_nodes="$SLURM_NNODES" \
    trainer.devices="$GPUS_PER_NODE" \
    hydra.run.dir="$RUN_DIR" \
    resume=auto \
    "$@" &
srun_pid=$!
# In the background, so that the USR1 trap runs when the signal arrives; wait returns early
# then, so wait again until the training ends, and exit with its status.
wait "$srun_pid"
status=$?
while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid"
    status=$?
done
exit "$status"
