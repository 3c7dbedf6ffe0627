#!/usr/bin/env bash
# Check clawrl on a CUDA machine: real SGLang and the megatron backend, one PASS/FAIL line per
# step, a summary, exit 1 if any step failed.
#
#   deploy/gpu-check.sh                 # from the repository root, with .venv or PYTHON set
#
# Steps (GPU 0 unless GPU=N; the SmolLM2-135M checkpoint from `clawrl models pull`):
#   environment     GPUs, torch / megatron-core / SGLang versions
#   pull            clawrl models pull smollm2-135m
#   sglang-start    deploy/sglang.sh on one GPU (the pinned SGLang, its API key, a third of the
#                   GPU's memory so megatron fits beside it), healthy within 10 minutes
#   engine-check    proxy/engine_check: what the proxy, judge and trainer ask at start
#   proxy-chat      `clawrl proxy` in front of it (Postgres: CLAWRL_DATABASE__URL, else an
#                   embedded one under $OUT/state/pg shared by the processes that use it):
#                   one chat with a new user's key, stored with prompt ids, response ids and
#                   weight version
#   publish         a version folder published with the trainer's own publish_version:
#                   SGLang serves weight_version 1 and says so on the next answer
#   megatron-parity megatron_run check --parity on GPU, fp32 unfused: HF vs megatron logits on
#                   SmolLM2's real weights, then 2 training steps and an export
#   megatron-publish that export published to SGLang as version 2
#   megatron-tests  the CPU suite's megatron tests on GPU (2+ GPUs: TP=2 / DP=2 / PP=2 too)
#   megatron-bf16   a short bf16 run with megatron's fused paths (random ~5M model; MODEL too
#                   if set, with TP/PP): loss, grad norm, tokens/s, export time
#
# Written on a CPU-only machine (bash -n checked); read its output closely the first time.
# STEPS, SAMPLES, SEQ, NPROC, MODEL, TP, PP change the bf16 run; OUT keeps the results.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$ROOT/.venv/bin/python" || echo python )}
STEPS=${STEPS:-10}
SAMPLES=${SAMPLES:-32}
SEQ=${SEQ:-512}
GPU=${GPU:-0}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
NPROC=${NPROC:-$GPUS}
OUT=${OUT:-$(mktemp -d -t clawrl-gpu-check-XXXX)}
# deploy/sglang.sh runs `python`: the one that has SGLang, beside $PYTHON.
[[ "$PYTHON" == */* ]] && export PATH="$(dirname "$PYTHON"):$PATH"
SGLANG_PORT=${SGLANG_PORT:-31000}
PROXY_PORT=${PROXY_PORT:-18000}
SMOLLM2=$OUT/smollm2-135m
ENGINE_URL=http://127.0.0.1:$SGLANG_PORT
export CLAWRL_ENGINE__API_KEY=${CLAWRL_ENGINE__API_KEY:-ck-engine-gpu-check-$RANDOM$RANDOM}
export CLAWRL_STATE_DIR=$OUT/state CLAWRL_STATE_FILE=$OUT/stack.json
export CLAWRL_ENGINE__URL=$ENGINE_URL CLAWRL_ENGINE__READ_TIMEOUT_S=120
mkdir -p "$OUT/state"

declare -a RESULTS=()
FAILED=0
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    wait 2>/dev/null
}
trap cleanup EXIT

step() {  # name, command...: run it, log to $OUT/NAME.log (also shown), PASS/FAIL line
    local name=$1; shift
    echo "== $name"
    # Not `| tee`: a pipe would run the step in a subshell and lose the PIDs it records.
    if "$@" > >(tee "$OUT/$name.log") 2>&1; then
        RESULTS+=("PASS $name"); echo "PASS $name"
    else
        RESULTS+=("FAIL $name (see $OUT/$name.log)"); echo "FAIL $name"; FAILED=1
    fi
}

wait_http() {  # url, seconds, pid: until it answers 200, or the process dies
    local url=$1 secs=$2 pid=$3 i
    for ((i = 0; i < secs; i++)); do
        curl -sf -o /dev/null "$url" && return 0
        kill -0 "$pid" 2>/dev/null || { echo "process $pid exited"; return 1; }
        sleep 1
    done
    echo "$url not healthy after $secs s"; return 1
}

environment() {
    nvidia-smi -L || { echo "no NVIDIA GPU visible (nvidia-smi failed)"; return 1; }
    "$PYTHON" - <<'PY'
import importlib.metadata as md, importlib.util, torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} available {torch.cuda.is_available()} "
      f"devices {torch.cuda.device_count()}")
for pkg in ("megatron-core", "sglang", "sgl-kernel", "flashinfer-python", "transformers"):
    try:
        print(f"{pkg} {md.version(pkg)}")
    except md.PackageNotFoundError:
        print(f"{pkg}: not installed")
for mod in ("transformer_engine", "apex", "scaled_upper_triang_masked_softmax_cuda"):
    print(f"{mod}: {'yes' if importlib.util.find_spec(mod) else 'no'}")
if not torch.cuda.is_available():
    raise SystemExit("torch has no CUDA")
PY
}

pull() {
    "$PYTHON" -m clawrl.cli.main models pull smollm2-135m --out "$SMOLLM2"
}

sglang_start() {
    CUDA_VISIBLE_DEVICES=$GPU MODEL=$SMOLLM2 PORT=$SGLANG_PORT \
        "$ROOT/deploy/sglang.sh" --mem-fraction-static 0.3 >"$OUT/sglang-server.log" 2>&1 &
    SGLANG_PID=$!
    PIDS+=("$SGLANG_PID")
    wait_http "$ENGINE_URL/health" 600 "$SGLANG_PID" || { tail -30 "$OUT/sglang-server.log"; return 1; }
    curl -s -H "Authorization: Bearer $CLAWRL_ENGINE__API_KEY" "$ENGINE_URL/model_info"; echo
}

engine_check() {
    "$PYTHON" - "$ENGINE_URL" <<'PY'
import os, sys
from clawrl.base.engine_check import JUDGE_NEEDS, PROXY_NEEDS, TRAINER_NEEDS, check_at_start
problem = check_at_start(sys.argv[1], (*PROXY_NEEDS, *JUDGE_NEEDS, *TRAINER_NEEDS),
                         api_key=os.environ["CLAWRL_ENGINE__API_KEY"], timeout=120)
print(problem or "chat ids, streamed ids, weight version, teacher logprobs: all there")
sys.exit(1 if problem else 0)
PY
}

proxy_chat() {
    "$PYTHON" -m clawrl.cli.main db upgrade || return 1
    local key
    key=$("$PYTHON" -m clawrl.cli.main users create "gpucheck$RANDOM" | grep -o 'ck-[^ ]*' | tail -1)
    [[ -n "$key" ]] || { echo "no API key from clawrl users create"; return 1; }
    CLAWRL_PROXY__PORT=$PROXY_PORT "$PYTHON" -m clawrl.cli.main proxy >"$OUT/proxy-server.log" 2>&1 &
    local pid=$!
    PIDS+=("$pid")
    wait_http "http://127.0.0.1:$PROXY_PORT/readyz" 120 "$pid" || { tail -30 "$OUT/proxy-server.log"; return 1; }
    "$PYTHON" - "http://127.0.0.1:$PROXY_PORT/v1" "$key" <<'PY'
import sys, time
import httpx
base, key = sys.argv[1], sys.argv[2]
r = httpx.post(base + "/chat/completions", headers={"Authorization": f"Bearer {key}"},
               timeout=120, json={"model": "default", "temperature": 0, "max_tokens": 20,
                                  "messages": [{"role": "user",
                                                "content": "What is the capital of France?"}]})
print(r.status_code, r.text[:300])
r.raise_for_status()
answer = r.json()["choices"][0]["message"]["content"]
if "Paris" not in answer:
    raise SystemExit(f"unexpected answer: {answer!r}")
from sqlalchemy import text
from clawrl.base.dbcli import resolve_url
from clawrl.base.db import create_engine
from clawrl.base.settings import load_settings
db = create_engine(resolve_url(load_settings()))
for _ in range(60):  # the proxy stores turns in the background
    with db.connect() as conn:
        row = conn.execute(text("SELECT status, cardinality(prompt_ids), "
                                "cardinality(response_ids), weight_version FROM turns "
                                "ORDER BY id DESC LIMIT 1")).first()
    if row is not None:
        break
    time.sleep(0.5)
print("stored turn:", row)
if row is None or row[0] != "ok" or not row[1] or not row[2] or row[3] is None:
    raise SystemExit("the turn was not stored with ids and a weight version")
PY
}

publish() {  # version, model folder to publish
    "$PYTHON" - "$1" "$2" "$SMOLLM2" "$OUT/weights" <<'PY'
import shutil, sys
from pathlib import Path
import httpx
from clawrl.base.settings import EngineSettings, load_settings
from trainer.export import write_version
from trainer.publish import publish_version
version, src, base, weights = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
def copy(out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and (f.suffix == ".safetensors" or f.name == "config.json"):
            shutil.copy2(f, out / f.name)
path = write_version(weights, version, copy, base)
engine: EngineSettings = load_settings().engine
info = publish_version(engine, path, version, attempts=2, backoff_s=2)
print("published:", info)
key = engine.api_key.get_secret_value() if engine.api_key else ""
r = httpx.post(engine.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
               timeout=120, json={"model": "default", "max_tokens": 5,
                                  "messages": [{"role": "user", "content": "hi"}]})
print(r.status_code, r.text[:300])
served = r.json().get("metadata", {}).get("weight_version")
if served != str(version):
    raise SystemExit(f"the engine answers with weight_version {served!r}, not {version}")
PY
}

megatron_parity() {
    local batch=$OUT/parity-batch.pt
    "$PYTHON" - "$SMOLLM2" "$batch" <<'PY'
import sys, torch
from transformers import AutoTokenizer
from trainer.data import SampleRow, collate
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = []
for i, (q, a) in enumerate([("What is the capital of France?", "Paris is the capital."),
                            ("Name three colours.", "Red, green and blue.")]):
    prompt = tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    response = tok.encode(a + "<|im_end|>", add_special_tokens=False)
    rows.append(SampleRow(i, prompt, response, [-1.0] * len(response), None, (1, -1)[i], 0))
torch.save({"batch": collate(rows, 0), "settings": {"kl_coef": 0.0, "lr": 1e-5}}, sys.argv[2])
PY
    CUDA_VISIBLE_DEVICES=$GPU "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m trainer.backends.megatron_run check --model "$SMOLLM2" --batch "$batch" --parity \
        --steps 2 --export "$OUT/megatron-export" --out "$OUT/megatron-parity.json" || return 1
    "$PYTHON" - "$OUT/megatron-parity.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    raise SystemExit(r["error"])
print(f"max |logit diff| {r['logits_max_abs_diff']:.3g} (largest |logit| "
      f"{r['logits_max_abs']:.3g}), argmax agree {r['argmax_agree']:.4f}; load {r['load_s']:.1f} s, "
      f"export {r['export_s']:.2f} s; losses {[round(s['loss'], 4) for s in r['steps']]}")
# CPU float32 gives 8e-5 on these weights; a GPU's float32 kernels sum in another order.
if r["logits_max_abs_diff"] > 1e-2 or r["argmax_agree"] < 0.99:
    raise SystemExit("megatron and Hugging Face disagree on SmolLM2's logits")
PY
}

megatron_tests() {
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/trainer/test_megatron.py || return 1
    if [ "$GPUS" -ge 2 ]; then
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/trainer/test_megatron_parallel.py
    else
        echo "(one GPU: skipping the TP=2 / DP=2 / PP=2 parity tests)"
    fi
}

run_check() {  # name, model dir, extra args...
    local name=$1 model=$2; shift 2
    echo "bf16 fused training: $name on $NPROC GPU(s), $SAMPLES×$SEQ tokens, $STEPS steps"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        -m trainer.backends.megatron_run check --model "$model" --dtype bfloat16 \
        --samples "$SAMPLES" --seq "$SEQ" --steps "$STEPS" --export "$OUT/$name-export" \
        --out "$OUT/$name.json" "$@" || return 1
    "$PYTHON" - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
if "error" in r:
    raise SystemExit(r["error"])
print(f"load {r['load_s']:.1f} s, export {r['export_s']:.2f} s; "
      f"final loss {r['steps'][-1]['loss']:.4f}, tp {r['tp']} pp {r['pp']} world {r['world']}")
PY
}

megatron_bf16() {
    "$PYTHON" - "$OUT/random-model" <<'PY' || return 1
import sys
from pathlib import Path
from clawrl.bench.megatron import random_model
random_model(Path(sys.argv[1]))
PY
    run_check random "$OUT/random-model" || return 1
    if [ -n "${MODEL:-}" ]; then
        run_check model "$MODEL" --tp "${TP:-1}" --pp "${PP:-1}"
    fi
}

step environment environment
if [[ $FAILED == 1 ]]; then
    echo "gpu-check: no usable GPU; nothing else to check"; exit 1
fi
step pull pull
if [[ -f "$SMOLLM2/config.json" ]]; then
    step sglang-start sglang_start
    if [[ ${RESULTS[-1]} == PASS* ]]; then
        step engine-check engine_check
        step proxy-chat proxy_chat
        step publish publish 1 "$SMOLLM2"
    fi
    step megatron-parity megatron_parity
    if [[ -f "$OUT/megatron-export/config.json" && ${SGLANG_PID:-} ]]; then
        step megatron-publish publish 2 "$OUT/megatron-export"
    fi
fi
cleanup
PIDS=()
step megatron-tests megatron_tests
step megatron-bf16 megatron_bf16

echo
echo "== gpu-check summary (logs and results in $OUT)"
printf '%s\n' "${RESULTS[@]}"
exit "$FAILED"
