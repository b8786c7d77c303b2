#!/usr/bin/env bash
# A commlab sweep across nodes with SLURM + torchrun.
#
#   sbatch --nodes=4 --gpus-per-node=8 scripts/slurm_sweep.sh sweeps/bucket_size.yaml \
#          --backend nccl --world-size 8,16,32
#
# One driver per node (srun --ntasks-per-node=1) runs the same grid in the same order and starts
# one torchrun per configuration; the torchruns of all nodes meet at a c10d rendezvous on the
# first node, under the configuration's id. World sizes count processes over all nodes and must
# be multiples of the node count. Node 0 alone writes results/<name>/, which must be on a file
# system every node sees (for --resume). Extra arguments go to `commlab sweep`.
#SBATCH --job-name=commlab-sweep
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=02:00:00
set -euo pipefail

SPEC=${1:?usage: sbatch [--nodes=N] scripts/slurm_sweep.sh SPEC.yaml [commlab sweep options]}
shift
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${COMMLAB_RDZV_PORT:-29500}
NAME=${COMMLAB_SWEEP_NAME:-$(basename "$SPEC" .yaml)-$SLURM_JOB_ID}

srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    commlab sweep "$SPEC" --launcher torchrun --nnodes "$SLURM_NNODES" \
    --rdzv-endpoint "$HEAD:$PORT" --name "$NAME" "$@"
