#!/usr/bin/env bash
# The multi-node recipe (deploy/multi-gpu/) rehearsed on one machine: ten "hosts" as network
# namespaces on one bridge (net.sh), each role started by deploy/multi-gpu/launch-node.sh with
# the cluster.env this writes, as on a real cluster. Needs root, iproute2, Postgres 15's
# binaries, HAProxy and the sglang-router package (its Python: ROUTER_PYTHON).
#
#   deploy/rehearsal/rehearsal.sh up            # hosts, Postgres, every role; waits until ready
#   deploy/rehearsal/rehearsal.sh down          # every process, namespace and link gone
#   deploy/rehearsal/rehearsal.sh cut HOST      # HOST's link to the bridge down (heal: back up)
#   deploy/rehearsal/rehearsal.sh start HOST ROLE [NAME] | stop HOST NAME
#   deploy/rehearsal/rehearsal.sh exec HOST CMD...   # e.g. exec cli curl http://10.77.0.1:8080/readyz
#   deploy/rehearsal/rehearsal.sh status
#
# Hosts (10.77.0.N): db 1 Postgres + HAProxy :8080, px1 2 / px2 3 proxies :8000, jw 4 two
# judge workers + SGLang's router :30100, je1 5 / je2 6 judge engines :30001, pol 7 the policy
# engine :30000, tr0 8 / tr1 9 the torchrun job's two nodes, cli 10 clients. Engines are
# `clawrl engine` serving the tiny world's CI model (MODEL), so it all runs on CPUs.
# State: REHEARSAL_DIR (default /tmp/clawrl-rehearsal): shared/ (CLAWRL_STATE_DIR, the
# weights every host sees), hosts/HOST.env, logs/HOST-NAME.log, pg/.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DIR=${REHEARSAL_DIR:-/tmp/clawrl-rehearsal}
# shellcheck source=deploy/rehearsal/net.sh
source "$HERE/net.sh"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
ROUTER_PYTHON=${ROUTER_PYTHON:-$PYTHON}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
MODEL=${MODEL:-$ROOT/clawrl/world/prebuilt/tinyworld-ci}
NICE=${REHEARSAL_NICE:-19}
READY_S=${REHEARSAL_READY_S:-300}
LB_URL="http://$(addr_of db):8080"

write_env() {
    local key admin
    key=$(openssl rand -hex 16)
    admin=ck-admin-$(openssl rand -hex 24)
    mkdir -p "$DIR/hosts" "$DIR/shared"
    # The one cluster.env of deploy/multi-gpu/cluster.env.example, filled in for these hosts.
    cat > "$DIR/cluster.env" <<ENV
CLAWRL_STATE_DIR=$DIR/shared
CLAWRL_DATABASE__URL=postgresql://clawrl:secret@$(addr_of db):5432/clawrl
CLAWRL_ENGINE__API_KEY=$key
CLAWRL_PROXY__ADMIN_KEY=$admin
CLAWRL_PROXY__RATE_LIMIT_RPM=0
ENGINE_SERVER=clawrl
POLICY_MODEL=$MODEL
POLICY_PORT=30000
CLAWRL_ENGINE__URL=http://$(addr_of pol):30000
JUDGE_MODEL=$MODEL
JUDGE_PORT=30001
JUDGE_ENGINES="http://$(addr_of je1):30001 http://$(addr_of je2):30001"
ROUTER_HOST=0.0.0.0
ROUTER_PORT=30100
ROUTER_PYTHON=$ROUTER_PYTHON
ROUTER_ARGS="--api-key $key --health-check-interval-secs 2 --health-failure-threshold 2 --request-timeout-secs 60 --log-level warn"
CLAWRL_JUDGE__URL=http://$(addr_of jw):30100
CLAWRL_JUDGE__POLL_INTERVAL_S=0.5
CLAWRL_JUDGE__BACKOFF_BASE_S=0.5
CLAWRL_JUDGE__BACKOFF_MAX_S=5
CLAWRL_JUDGE__LEASE_S=30
CLAWRL_JUDGE__TIMEOUT_S=20
PROXY_HOST=0.0.0.0
PROXY_PORTS=8000
BALANCER_LISTEN=0.0.0.0:8080
BALANCER_CONFIG=$DIR/hosts/db/haproxy.cfg
BALANCER_BACKENDS="$(addr_of px1):8000 $(addr_of px2):8000"
TRAIN_GPUS=
TRAIN_NPROC=1
TRAIN_NNODES=2
TRAIN_MASTER_ADDR=$(addr_of tr0)
TRAIN_IFNAME=eth0
TRAIN_TP=1
TRAIN_PP=1
CLAWRL_TRAINER__DTYPE=float32
CLAWRL_TRAINER__BATCH_SIZE=${TRAIN_BATCH:-4}
CLAWRL_TRAINER__MICRO_BATCH_SIZE=2
CLAWRL_TRAINER__MAX_WAIT_S=5
CLAWRL_TRAINER__PTX_COEF=0
CLAWRL_TRAINER__THREADS=1
ENV
    local host
    for host in "${!HOSTS[@]}"; do
        { cat "$DIR/cluster.env"
          echo "JOURNAL_DIR=$DIR/hosts/$host"
          [[ $host == tr1 ]] && echo "TRAIN_NODE_RANK=1" || echo "TRAIN_NODE_RANK=0"
        } > "$DIR/hosts/$host.env"
        mkdir -p "$DIR/hosts/$host"
    done
}

pg_up() {
    mkdir -p "$DIR/pg"
    chown postgres "$DIR/pg"
    echo secret > "$DIR/pg/pw"
    runuser -u postgres -- "$PG_BIN/initdb" -D "$DIR/pg/data" -U clawrl --pwfile="$DIR/pg/pw" \
        -A scram-sha-256 --auth-local=trust > "$DIR/logs/db-initdb.log"
    echo "host all all ${SUBNET}.0/24 scram-sha-256" >> "$DIR/pg/data/pg_hba.conf"
    in_host db runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -l "$DIR/pg/log" -w \
        -o "-c listen_addresses=$(addr_of db) -c unix_socket_directories=$DIR/pg" start >/dev/null
    in_host db env PGPASSWORD=secret "$PG_BIN/createdb" -h "$(addr_of db)" -U clawrl clawrl
}

pg_down() {
    [[ -f "$DIR/pg/data/postmaster.pid" ]] || return 0
    in_host db runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -m fast stop \
        >/dev/null 2>&1 || true
}

# One role on one host, as a cluster would start it: launch-node.sh with that host's env.
start_role() {
    local host=$1 role=$2 name=${3:-$2}
    in_host "$host" env CLUSTER_ENV="$DIR/hosts/$host.env" PYTHON="$PYTHON" PYTHONPATH="$ROOT" \
        PYTHONUNBUFFERED=1 nice -n "$NICE" setsid "$ROOT/deploy/multi-gpu/launch-node.sh" "$role" \
        >> "$DIR/logs/$host-$name.log" 2>&1 < /dev/null &
    echo $! > "$DIR/pids/$host-$name"
}

stop_role() {
    local file="$DIR/pids/$1-$2" pid
    [[ -f "$file" ]] || return 0
    pid=$(cat "$file")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$file"
}

# Wait until URL answers 2xx from the client host; fail with the log's tail if NAME died.
wait_ready() {
    local url=$1 host=$2 name=$3 deadline=$((SECONDS + READY_S))
    while (( SECONDS < deadline )); do
        if in_host cli curl -sf -o /dev/null --max-time 2 "$url"; then return 0; fi
        if ! kill -0 "$(cat "$DIR/pids/$host-$name")" 2>/dev/null; then
            echo "rehearsal: $host $name exited; $DIR/logs/$host-$name.log:" >&2
            tail -n 20 "$DIR/logs/$host-$name.log" >&2
            return 1
        fi
        sleep 1
    done
    echo "rehearsal: $url not ready after ${READY_S}s" >&2
    return 1
}

up() {
    down_all quiet
    rm -rf "$DIR"
    mkdir -p "$DIR/logs" "$DIR/pids"
    net_up
    echo "hosts up (${SUBNET}.0/24 on $BRIDGE); Postgres on db …"
    pg_up
    write_env
    in_host jw env CLUSTER_ENV="$DIR/hosts/jw.env" PYTHON="$PYTHON" PYTHONPATH="$ROOT" \
        "$ROOT/deploy/multi-gpu/launch-node.sh" prepare > "$DIR/logs/jw-prepare.log" 2>&1
    echo "engines (policy on pol, judge engines on je1 and je2) …"
    start_role pol policy
    start_role je1 judge-engine
    start_role je2 judge-engine
    wait_ready "http://$(addr_of pol):30000/health" pol policy
    wait_ready "http://$(addr_of je1):30001/health" je1 judge-engine
    wait_ready "http://$(addr_of je2):30001/health" je2 judge-engine
    echo "router on jw, proxies on px1 and px2, HAProxy on db …"
    start_role jw router
    start_role px1 proxy-8000
    start_role px2 proxy-8000
    wait_ready "http://$(addr_of jw):30100/health" jw router
    wait_ready "http://$(addr_of px1):8000/readyz" px1 proxy-8000
    wait_ready "http://$(addr_of px2):8000/readyz" px2 proxy-8000
    start_role db balancer
    wait_ready "$LB_URL/readyz" db balancer
    echo "judge workers on jw, trainer on tr0 + tr1 (torchrun, 2 nodes) …"
    start_role jw judge judge-1
    start_role jw judge judge-2
    start_role tr0 trainer
    start_role tr1 trainer
    echo "up: load balancer $LB_URL (reach it from a host: rehearsal.sh exec cli …);" \
         "settings $DIR/cluster.env; logs $DIR/logs"
}

down_all() {
    pg_down
    net_down
    rm -rf "$DIR/pids"
    [[ "${1:-}" == quiet ]] || echo "down: no namespace, link or process of the rehearsal left"
}

status() {
    local file name
    for file in "$DIR"/pids/*; do
        [[ -f "$file" ]] || continue
        name=$(basename "$file")
        if kill -0 "$(cat "$file")" 2>/dev/null; then echo "$name running"; else
            echo "$name exited"; fi
    done
    "$IP" netns list | grep "^${PREFIX}-" || echo "no namespaces"
}

cmd=${1:-}
shift || true
case "$cmd" in
up) up ;;
down) down_all ;;
cut) net_cut "${1:?host}" ;;
heal) net_heal "${1:?host}" ;;
start) start_role "${1:?host}" "${2:?role}" "${3:-$2}" ;;
stop) stop_role "${1:?host}" "${2:?name}" ;;
exec) in_host "${1:?host}" "${@:2}" ;;
status) status ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
