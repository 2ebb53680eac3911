#!/bin/bash
#SBATCH --job-name=gpt2-zero-8g-paper-s1234
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --output=/scratch/repro/runs/gpt2-zero-8g-paper-s1234-20260101T000000000000/slurm-%j.out
#SBATCH --signal=USR1@120
set -euo pipefail

# compute nodes are offline: libraries must not try the network; data is pre-staged
export HF_DATASETS_OFFLINE=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export REPRO_DATA=/scratch/repro/data
export MLFLOW_TRACKING_URI=http://mlflow.cluster:5000

# the c10d rendezvous is hosted by the first node, at its address as Slurm knows it (node names
# need not resolve), on a port derived from the job id
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
head_addr=$(sinfo --noheader --Node --nodes="$head_node" --format=%o | head -n1)
rdzv_port=$((20000 + SLURM_JOB_ID % 20000))

# the follower (in the batch step's place, so a cancelled job leaves it time to record the end)
# starts the job steps and records the run in MLflow (only it logs)
exec /opt/repro/.venv/bin/python -m repro.cli attach /scratch/repro/runs/gpt2-zero-8g-paper-s1234-20260101T000000000000 -- \
    srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=4 --kill-on-bad-exit=1 \
    /opt/repro/.venv/bin/python -m torch.distributed.run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "$head_addr:$rdzv_port" --rdzv-id "$SLURM_JOB_ID" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --max-restarts 0 --tee 3 --log-dir /scratch/repro/runs/gpt2-zero-8g-paper-s1234-20260101T000000000000/ranks -m repro.loop /scratch/repro/runs/gpt2-zero-8g-paper-s1234-20260101T000000000000
