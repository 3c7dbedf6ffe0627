#!/usr/bin/env bash
# Serve the policy with SGLang (GPU machine) so clawrl's proxy, judge and trainer can use it.
# The trainer publishes new weights with /update_weights_from_disk, so the checkpoint folder
# (CLAWRL_STATE_DIR/weights) must be visible to this server at the same path.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a Hugging Face model directory}
PORT=${PORT:-30000}
exec python -m sglang.launch_server \
    --model-path "$MODEL" \
    --host 0.0.0.0 --port "$PORT" \
    --weight-version 0 \
    --tool-call-parser qwen25 \
    "$@"
