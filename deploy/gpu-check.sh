#!/usr/bin/env bash
# Check the megatron backend on a CUDA machine and print its figures.
#
#   deploy/gpu-check.sh                 # from the repository root, with .venv or PYTHON set
#
# 1. environment: GPUs, torch / megatron-core versions, Transformer Engine / Apex presence;
# 2. parity on GPU, fp32, unfused: the CPU test suite's megatron tests (HF vs megatron logits,
#    torch vs megatron training steps, export → engine reload, resume, bad input), and with
#    2+ GPUs the TP=2 / DP=2 / PP=2 parity tests (NCCL instead of gloo);
# 3. a short bf16 training run with megatron's fused paths on (SwiGLU / bias-dropout-add jit
#    fusions, fused causal softmax when its extension is installed) on a ~5M-parameter random
#    model and on MODEL if set: loss, grad norm and tokens/s per step, and export time.
#
# Nothing here has run on a GPU yet (written on a CPU-only machine): read its output closely
# the first time. Set STEPS, SAMPLES, SEQ, NPROC, MODEL to change the training run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
STEPS=${STEPS:-10}
SAMPLES=${SAMPLES:-32}
SEQ=${SEQ:-512}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
NPROC=${NPROC:-$GPUS}
OUT=${OUT:-$(mktemp -d -t clawrl-gpu-check-XXXX)}

echo "== environment"
nvidia-smi -L || { echo "gpu-check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 1; }
"$PYTHON" - <<'PY'
import importlib.util, torch
import megatron.core as mc
print(f"torch {torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()} "
      f"devices {torch.cuda.device_count()}")
print(f"megatron-core {mc.__version__}")
for mod in ("transformer_engine", "apex", "scaled_upper_triang_masked_softmax_cuda"):
    print(f"{mod}: {'yes' if importlib.util.find_spec(mod) else 'no'}")
if not torch.cuda.is_available():
    raise SystemExit("gpu-check: torch has no CUDA")
PY

echo "== parity (fp32, unfused)"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/trainer/test_megatron.py
if [ "$GPUS" -ge 2 ]; then
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/trainer/test_megatron_parallel.py
else
    echo "(one GPU: skipping the TP=2 / DP=2 / PP=2 parity tests)"
fi

run_check() {  # name, model dir, extra args...
    local name=$1 model=$2; shift 2
    echo "== bf16 fused training: $name on $NPROC GPU(s), $SAMPLES×$SEQ tokens, $STEPS steps"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        -m trainer.backends.megatron_run check --model "$model" --dtype bfloat16 \
        --samples "$SAMPLES" --seq "$SEQ" --steps "$STEPS" --export "$OUT/$name-export" \
        --out "$OUT/$name.json" "$@"
    "$PYTHON" - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    raise SystemExit(f"gpu-check: {r['error']}")
print(f"load {r['load_s']:.1f} s, export {r['export_s']:.2f} s; "
      f"final loss {r['steps'][-1]['loss']:.4f}, tp {r['tp']} pp {r['pp']} world {r['world']}")
PY
}

"$PYTHON" - "$OUT/random-model" <<'PY'
import sys
from pathlib import Path
from trainer.backends.megatron_bench import random_model
random_model(Path(sys.argv[1]))
PY
run_check random "$OUT/random-model"
if [ -n "${MODEL:-}" ]; then
    run_check model "$MODEL" --tp "${TP:-1}" --pp "${PP:-1}"
fi
echo "gpu-check: done (results in $OUT)"
