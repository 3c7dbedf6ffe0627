#!/usr/bin/env bash
# Start one clawrl role on this node, in the foreground (systemd: deploy/systemd/clawrl@.service;
# by hand: one terminal or tmux pane per role). Settings come from cluster.env.
#
#   deploy/multi-gpu/launch-node.sh ROLE      ROLE is one of:
#     prepare       once per cluster: migrate the database, make the judge model
#     policy        the policy engine: SGLang on POLICY_GPUS, TP × DP (+ --nnodes over nodes)
#     judge-engine  one judge engine: SGLang on JUDGE_GPUS serving the frozen judge model
#     router        the SGLang router in front of JUDGE_ENGINES
#     proxy-PORT    one proxy replica on PORT (its own journal: JOURNAL_DIR/journal-PORT)
#     balancer      HAProxy in front of BALANCER_BACKENDS (the proxies), on BALANCER_LISTEN
#     judge         a judge worker (any number, any node)
#     trainer       this node's megatron ranks (torchrun; rank 0 runs the trainer loop)
#
# ENGINE_SERVER=clawrl runs the engines as `clawrl engine` (CPU, or a machine without SGLang;
# what deploy/rehearsal/ uses) instead of SGLang.
#
#   CLUSTER_ENV=/etc/clawrl/cluster.env deploy/multi-gpu/launch-node.sh policy
#
# See deploy/multi-gpu/README.md for the layouts (one node, several nodes).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CLUSTER_ENV=${CLUSTER_ENV:-/etc/clawrl/cluster.env}
[[ -f "$CLUSTER_ENV" ]] || { echo "launch-node.sh: no $CLUSTER_ENV (copy cluster.env.example)" >&2; exit 1; }
set -a
# shellcheck disable=SC1090
source "$CLUSTER_ENV"
set +a
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
CLAWRL=("$PYTHON" -m clawrl.cli.main)
role=${1:?usage: launch-node.sh ROLE (see the header)}
cd "$ROOT"

judge_model() {
    echo "${JUDGE_MODEL:-$CLAWRL_STATE_DIR/models/judge}"
}

# `clawrl engine` in place of SGLang (ENGINE_SERVER=clawrl): the same HTTP API and key.
clawrl_engine() {
    local model=$1 port=$2
    shift 2
    exec "${CLAWRL[@]}" engine --model "$model" --host 0.0.0.0 --port "$port" "$@"
}

# HAProxy in front of the proxies: health-checked on /readyz every second, a request that
# cannot connect to a proxy is sent to another (retries + redispatch), long timeouts for
# streamed replies. Each request opens its own connection to a proxy (http-server-close):
# a request sent down a kept-alive connection to a proxy that has just dropped off the
# network is never retried and waits out `timeout server` (the rehearsal's cut link showed
# it); a fresh connect fails within `timeout connect` and goes to another proxy.
balancer_config() {
    local i=0 backend
    cat <<CFG
global
    maxconn 4096
defaults
    mode http
    option http-server-close
    timeout connect 1s
    timeout client 600s
    timeout server 600s
    retries 2
    option redispatch 1
frontend clawrl
    bind ${BALANCER_LISTEN:-0.0.0.0:8080}
    default_backend proxies
backend proxies
    balance leastconn
    option httpchk GET /readyz
    default-server inter 1s fall 2 rise 1
CFG
    for backend in $BALANCER_BACKENDS; do
        i=$((i + 1))
        echo "    server proxy$i $backend check"
    done
}

case "$role" in
prepare)
    "${CLAWRL[@]}" db upgrade
    # The shipped judge model is SmolLM2-135M + clawrl's adapter; a JUDGE_MODEL of one's own
    # needs neither.
    [[ -n "${JUDGE_MODEL:-}" ]] && exit 0
    "${CLAWRL[@]}" models pull smollm2-135m --state-dir "$CLAWRL_STATE_DIR"
    # The shipped judge adapter merged into <state>/models/judge (once; the embedded engine's
    # `clawrl judge serve` does the same on its first run).
    "$PYTHON" - "$CLAWRL_STATE_DIR" <<'PY'
import sys
from pathlib import Path
from clawrl.judgemodel.model import ADAPTER_DIR, ensure_judge_model
print(ensure_judge_model(Path(sys.argv[1]), ADAPTER_DIR))
PY
    ;;
policy)
    if [[ "${ENGINE_SERVER:-sglang}" == clawrl ]]; then
        clawrl_engine "$POLICY_MODEL" "$POLICY_PORT" --weight-version 0
    fi
    dist=()
    if (( ${POLICY_NNODES:-1} > 1 )); then
        dist=(--nnodes "$POLICY_NNODES" --node-rank "$POLICY_NODE_RANK"
              --dist-init-addr "$POLICY_DIST_INIT")
    fi
    CUDA_VISIBLE_DEVICES=$POLICY_GPUS MODEL=$POLICY_MODEL HOST=0.0.0.0 PORT=$POLICY_PORT \
        exec "$ROOT/deploy/sglang.sh" --tp-size "$POLICY_TP" --dp-size "$POLICY_DP" \
        "${dist[@]}"
    ;;
judge-engine)
    if [[ "${ENGINE_SERVER:-sglang}" == clawrl ]]; then
        clawrl_engine "$(judge_model)" "$JUDGE_PORT" --served-model-name judge
    fi
    # Frozen weights; small model: a modest share of the GPU leaves room for another engine.
    CUDA_VISIBLE_DEVICES=$JUDGE_GPUS MODEL=$(judge_model) HOST=0.0.0.0 PORT=$JUDGE_PORT \
        exec "$ROOT/deploy/sglang.sh" --mem-fraction-static "${JUDGE_MEM_FRACTION:-0.5}"
    ;;
router)
    # Judge traffic only: the judge engines never change weights, so any of them may answer.
    # (The policy engine is one SGLang server with --dp-size: its own DP controller balances
    # it, and one /update_weights_from_disk reaches every replica.)
    # shellcheck disable=SC2086
    exec "${ROUTER_PYTHON:-$PYTHON}" -m sglang_router.launch_router --host "$ROUTER_HOST" --port "$ROUTER_PORT" \
        --worker-urls $JUDGE_ENGINES --policy cache_aware ${ROUTER_ARGS:-}
    ;;
proxy-*)
    port=${role#proxy-}
    CLAWRL_PROXY__HOST=$PROXY_HOST CLAWRL_PROXY__PORT=$port \
    CLAWRL_PROXY__JOURNAL_PATH=${JOURNAL_DIR:-/var/lib/clawrl}/journal-$port \
        exec "${CLAWRL[@]}" proxy
    ;;
balancer)
    config=${BALANCER_CONFIG:-/tmp/clawrl-haproxy.cfg}
    balancer_config > "$config"
    exec "${HAPROXY:-haproxy}" -db -f "$config"
    ;;
judge)
    exec "${CLAWRL[@]}" judge
    ;;
trainer)
    # Over nodes, gloo and NCCL must be told which interface reaches the other nodes: left to
    # themselves they use the address this host's name resolves to, often one the other
    # nodes cannot reach (127.0.1.1 in /etc/hosts, a management network).
    if [[ -n "${TRAIN_IFNAME:-}" ]]; then
        export GLOO_SOCKET_IFNAME=$TRAIN_IFNAME NCCL_SOCKET_IFNAME=$TRAIN_IFNAME
    fi
    CUDA_VISIBLE_DEVICES=$TRAIN_GPUS NPROC=$TRAIN_NPROC NNODES=$TRAIN_NNODES \
    NODE_RANK=$TRAIN_NODE_RANK MASTER_ADDR=$TRAIN_MASTER_ADDR \
    MASTER_PORT=${TRAIN_MASTER_PORT:-29500} TP=$TRAIN_TP PP=$TRAIN_PP \
    PYTHON=$PYTHON exec "$ROOT/deploy/torchrun.sh" --model "$POLICY_MODEL" ${TRAIN_ARGS:-}
    ;;
*)
    echo "launch-node.sh: unknown role $role (prepare, policy, judge-engine, router," \
         "proxy-PORT, balancer, judge, trainer)" >&2
    exit 2
    ;;
esac
