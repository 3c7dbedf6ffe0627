# The rehearsal's "hosts": one network namespace each, joined by veth pairs to one bridge.
# Sourced by rehearsal.sh. Addresses live only inside the namespaces (10.77.0.0/24 by
# default); the bridge in the machine's own namespace has none, so nothing is routed in or
# out of the machine. Every name starts with $PREFIX, so `net_down` removes exactly these.

PREFIX=${REHEARSAL_PREFIX:-crl}
SUBNET=${REHEARSAL_SUBNET:-10.77.0}
BRIDGE=${PREFIX}-br
IP=${IP:-/usr/sbin/ip}

# host name -> last octet. Roles (rehearsal.sh start_all): db = Postgres + the load balancer,
# px1/px2 = proxies, jw = judge workers + SGLang's router, je1/je2 = judge engines,
# pol = the policy engine, tr0/tr1 = the two torchrun nodes, cli = where clients run.
declare -A HOSTS=([db]=1 [px1]=2 [px2]=3 [jw]=4 [je1]=5 [je2]=6 [pol]=7 [tr0]=8 [tr1]=9
                  [cli]=10)

ns_of() { echo "${PREFIX}-$1"; }
addr_of() { echo "${SUBNET}.${HOSTS[$1]:?unknown host $1}"; }
# The host-side end of a host's veth pair (interface names stop at 15 characters).
link_of() { echo "${PREFIX}-v-$1"; }

net_up() {
    "$IP" link add "$BRIDGE" type bridge
    "$IP" link set "$BRIDGE" up
    local host ns
    for host in "${!HOSTS[@]}"; do
        ns=$(ns_of "$host")
        "$IP" netns add "$ns"
        "$IP" link add "$(link_of "$host")" type veth peer name eth0 netns "$ns"
        "$IP" link set "$(link_of "$host")" master "$BRIDGE" up
        "$IP" -n "$ns" addr add "$(addr_of "$host")/24" dev eth0
        "$IP" -n "$ns" link set eth0 up
        "$IP" -n "$ns" link set lo up
    done
}

# Stop every process inside our namespaces (by the ids `ip netns pids` names), then remove
# the namespaces, their links and the bridge. Safe to run twice.
net_down() {
    local ns pids
    for ns in $("$IP" netns list | awk '{print $1}' | grep "^${PREFIX}-" || true); do
        pids=$("$IP" netns pids "$ns" 2>/dev/null || true)
        [[ -n "$pids" ]] && kill -TERM $pids 2>/dev/null || true
    done
    local waited=0
    while (( waited < 30 )); do
        pids=""
        for ns in $("$IP" netns list | awk '{print $1}' | grep "^${PREFIX}-" || true); do
            pids+=" $("$IP" netns pids "$ns" 2>/dev/null || true)"
        done
        [[ -z "${pids// }" ]] && break
        sleep 1
        waited=$((waited + 1))
    done
    [[ -n "${pids// }" ]] && kill -KILL $pids 2>/dev/null || true
    for ns in $("$IP" netns list | awk '{print $1}' | grep "^${PREFIX}-" || true); do
        "$IP" netns del "$ns"
    done
    local link
    for link in $("$IP" -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 \
                  | grep "^${PREFIX}-" || true); do
        "$IP" link del "$link" 2>/dev/null || true
    done
}

# A host's link to the bridge cut (its processes keep running, unreachable) and restored.
net_cut() { "$IP" link set "$(link_of "$1")" down; }
net_heal() { "$IP" link set "$(link_of "$1")" up; }

in_host() {
    local host=$1
    shift
    "$IP" netns exec "$(ns_of "$host")" "$@"
}
