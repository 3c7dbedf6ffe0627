#!/usr/bin/env bash
# Run the clawrl trainer with the megatron backend on several GPUs / nodes under torchrun.
#
# Every process runs `python -m trainer.backends.megatron_run`; rank 0 runs the ordinary
# trainer loop (claims samples from Postgres, exports, publishes to the engine), the other
# ranks follow it and take part in every forward/backward, export and checkpoint. The world
# size must be a multiple of TP × PP; the rest is data parallel (DP = world / (TP·PP)).
#
# One node, 8 GPUs, tensor parallel 4 × data parallel 2:
#   NPROC=8 TP=4 deploy/torchrun.sh --model /models/Qwen2.5-7B-Instruct
#
# Two nodes × 8 GPUs (run the same command on both; NODE_RANK 0 and 1; MASTER_ADDR = node 0),
# tensor parallel 8 within a node × pipeline parallel 2 across nodes:
#   node0$ NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=8 TP=8 PP=2 deploy/torchrun.sh --model M
#   node1$ NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 NPROC=8 TP=8 PP=2 deploy/torchrun.sh --model M
#
# Requirements: CLAWRL_STATE_DIR (weights/ and the distributed optimizer checkpoints) on a
# filesystem shared by all nodes and visible to the engine at the same path; the database and
# engine settings (CLAWRL_DATABASE__URL, CLAWRL_ENGINE__URL; see env.example) on rank 0's node.
# Use CLAWRL_TRAINER__DTYPE=bfloat16 on GPUs (turns on megatron's fused paths).
#
# Without GPUs the same command runs on CPU processes with gloo (NPROC=2 TP=2 works on a laptop).
# Extra arguments go to `clawrl train` (--once, --max-steps N, --method rl|opd|combine, ...).
set -euo pipefail
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
PP=${PP:-1}
PYTHON=${PYTHON:-python}

# CPU ranks share the cores; one thread each keeps them from oversubscribing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m trainer.backends.megatron_run --backend megatron --tp "$TP" --pp "$PP" "$@"
