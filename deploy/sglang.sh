#!/usr/bin/env bash
# Serve the policy with SGLang (GPU machine) so clawrl's proxy, judge and trainer can use it.
# The trainer publishes new weights with /update_weights_from_disk, or a LoRA adapter with
# /load_lora_adapter, so the checkpoint folder (CLAWRL_STATE_DIR/weights) must be visible to
# this server at the same path.
#
# Whoever reaches this port can generate unlogged and load their own weights, so:
# - it listens on 127.0.0.1 unless HOST says otherwise;
# - CLAWRL_ENGINE__API_KEY (the key the proxy, judge and trainer send) is passed as SGLang's
#   --api-key, which guards every route but health, control routes included;
# - on any other address it refuses to start without that key.
#
#   MODEL=/models/qwen CLAWRL_ENGINE__API_KEY=$(openssl rand -hex 32) deploy/sglang.sh
#   HOST=0.0.0.0 MODEL=... CLAWRL_ENGINE__API_KEY=... deploy/sglang.sh   # other machines
set -euo pipefail
MODEL=${MODEL:?set MODEL to a Hugging Face model directory}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
KEY=${CLAWRL_ENGINE__API_KEY:-}
key_args=()
if [[ -n "$KEY" ]]; then
    key_args=(--api-key "$KEY")
elif [[ "$HOST" != "127.0.0.1" && "$HOST" != "localhost" && "$HOST" != "::1" ]]; then
    echo "sglang.sh: HOST=$HOST without CLAWRL_ENGINE__API_KEY would let anyone who reaches" \
         "port $PORT load weights; set CLAWRL_ENGINE__API_KEY" >&2
    exit 1
fi
# The SGLang release clawrl is tested against (tests/sglang/): the one pin, in
# deploy/sglang-contract.txt. Install it on the GPU machine with: pip install "sglang==$want".
want=$(sed -n 's/^sglang==//p' "$(dirname "$0")/sglang-contract.txt")
have=$(python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)
if [[ "$have" != "$want" && -z "${SGLANG_ANY_VERSION:-}" ]]; then
    echo "sglang.sh: SGLang ${have:-is not installed}; clawrl is tested with $want" \
         "(pip install sglang==$want, or SGLANG_ANY_VERSION=1 to go on)" >&2
    exit 1
fi
# Tool-call and reasoning parsers by model family (SGLang 0.5.23 names; TOOL_CALL_PARSER and
# REASONING_PARSER override). Qwen3 thinks in <think>; Qwen2.5 and Llama do not.
family=$(python -c 'import json,sys; c=json.load(open(sys.argv[1]+"/config.json")); print(c.get("model_type",""))' "$MODEL" 2>/dev/null || true)
case "$family" in
    qwen3|qwen3_moe) tool=qwen; reasoning=qwen3 ;;
    qwen2|qwen2_moe) tool=qwen; reasoning= ;;
    llama) tool=llama3; reasoning= ;;
    mistral|mixtral) tool=mistral; reasoning= ;;
    deepseek_v3) tool=deepseekv3; reasoning=deepseek-r1 ;;
    *) tool=; reasoning= ;;
esac
tool=${TOOL_CALL_PARSER:-$tool}
reasoning=${REASONING_PARSER:-$reasoning}
parser_args=()
[[ -n "$tool" ]] && parser_args+=(--tool-call-parser "$tool")
[[ -n "$reasoning" ]] && parser_args+=(--reasoning-parser "$reasoning")
# The model's sampling defaults (generation_config.json) as --preferred-sampling-params:
# SGLang reports them in /model_info, where the proxy reads them, so it can send every
# sampling parameter explicitly and store the distribution each reply was drawn from
# (proxy/sampling.py). Without them the proxy serves the neutral values (temperature 1).
preferred=$(python -c 'import json,sys; c=json.load(open(sys.argv[1]+"/generation_config.json")); p={k:c[k] for k in ("temperature","top_p","top_k","min_p") if isinstance(c.get(k),(int,float))}; print(json.dumps(p) if p else "")' "$MODEL" 2>/dev/null || true)
sampling_args=()
[[ -n "$preferred" ]] && sampling_args+=(--preferred-sampling-params "$preferred")
# LoRA adapters: the shared model's versions (a real model learns as an adapter) and personal
# adapters are loaded with /load_lora_adapter, which SGLang refuses unless it starts with LoRA
# on and the largest rank and target modules it must hold (clawrl trains rank 16 on every
# projection: CLAWRL_TRAINER__LORA__R). LORA=0 leaves it off (full-weight training).
lora_args=()
if [[ "${LORA:-1}" != "0" ]]; then
    lora_args=(--enable-lora --max-lora-rank "${LORA_RANK:-${CLAWRL_TRAINER__LORA__R:-16}}"
               --lora-target-modules all)
fi
exec python -m sglang.launch_server \
    --model-path "$MODEL" \
    --host "$HOST" --port "$PORT" \
    --weight-version 0 \
    "${parser_args[@]}" \
    "${sampling_args[@]}" \
    "${lora_args[@]}" \
    "${key_args[@]}" \
    "$@"
