#!/usr/bin/env bash
# Emulated cluster network on one machine: N network namespaces (one per Horovod rank), each
# joined to a bridge in the root namespace by a veth pair whose two ends are rate-limited with
# tc (tbf), so every rank has a full-duplex link of the chosen speed to a "switch". Traffic stays
# on this machine.
#
#   scripts/netns.sh up N [RATE] [DELAY]   create (or adjust) namespaces 0..N-1; RATE e.g. 1gbit,
#                                          100mbit, 10gbit or "none" (unshaped); DELAY e.g. 1ms
#                                          (needs sch_netem in the kernel; refused otherwise)
#   scripts/netns.sh down                  remove everything this script could have created
#   scripts/netns.sh status                list what exists, with the qdiscs
#   scripts/netns.sh env RANK              print the rank's namespace, address and interface
#
# Every name starts with $HVDS_NETNS_PREFIX (default "hvds"): namespaces PREFIX0.., bridge
# PREFIXbr, host-side veths PREFIXh0.., the namespace side is called PREFIXeth inside each
# namespace (so HOROVOD_GLOO_IFACE is the same on every rank). Addresses: $HVDS_NETNS_SUBNET.1
# (default 10.231.0.1) on the bridge, .10+RANK in namespace RANK.
#
# Horovod 0.28.1 honours HOROVOD_GLOO_IFACE only for its first Gloo contexts; the contexts of
# process sets (the global one included, which every collective uses) bind to whatever the
# machine's host name resolves to. So each namespace also gets /etc/netns/NS/hosts (which
# "ip netns exec" mounts over /etc/hosts) mapping the host name to the namespace's address.
#
# "up" is idempotent (existing objects are kept and re-configured) and, if interrupted or failing
# half-way, removes everything it could have created; "down" is idempotent too. Root only.
# HVDS_NETNS_SLOW=SECONDS pauses after each namespace, saying so on stderr (for the test that
# interrupts "up" there).
set -euo pipefail

PREFIX=${HVDS_NETNS_PREFIX:-hvds}
SUBNET=${HVDS_NETNS_SUBNET:-10.231.0}
BRIDGE=${PREFIX}br
NS_IFACE=${PREFIX}eth
MAX_RANKS=64

die() { echo "netns.sh: $*" >&2; exit 2; }

[[ $PREFIX =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "HVDS_NETNS_PREFIX must be 1-8 lowercase letters/digits, starting with a letter"
[[ $SUBNET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "HVDS_NETNS_SUBNET must look like 10.231.0"

need_root() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces, veth and tc need CAP_NET_ADMIN)"
    command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
}

# Namespaces and root-namespace links this script owns, found by name (so "down" also cleans up
# after a run that died before it could record anything).
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true; }
our_links() {
    ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
        | grep -E "^(${PREFIX}h[0-9]+|${BRIDGE})$" || true
}

down() {
    local ns link
    for ns in $(our_namespaces); do
        ip netns del "$ns" 2>/dev/null || true      # deletes the veth end inside, hence the pair
    done
    for link in $(our_links); do
        ip link del "$link" 2>/dev/null || true
    done
    rm -rf /etc/netns/"${PREFIX}"[0-9]*
    rmdir /etc/netns 2>/dev/null || true     # only if nothing else lives there
}

# /etc/hosts for namespace $1 with address $2: the host name (and nothing else) moved to $2.
write_hosts() {
    local dir=/etc/netns/$1 name
    name=$(hostname)
    mkdir -p "$dir"
    {
        echo "$2 $name"
        awk -v name="$name" '/^[[:space:]]*#/ || NF == 0 { print; next }
            { line = $1; kept = 0
              for (i = 2; i <= NF; i++) if ($i != name) { line = line " " $i; kept++ }
              if (kept) print line }' /etc/hosts
    } > "$dir/hosts.tmp"
    mv "$dir/hosts.tmp" "$dir/hosts"
}

# tbf's burst must hold a whole GSO packet (64 KiB on veth) and about 4 ms of traffic at the rate
# (less makes 10 Gbit/s CPU-bound on a small machine; the rate over a step is unaffected);
# its queue limit (latency) is generous so that TCP, not tail drops, sets the pace.
shape() {  # shape DEVICE RATE [DELAY] [NETNS]
    local dev=$1 rate=$2 delay=${3:-} ns=${4:-}
    local run=()
    [[ -n $ns ]] && run=(ip netns exec "$ns")
    "${run[@]}" tc qdisc del dev "$dev" root 2>/dev/null || true
    if [[ $rate == none && -z $delay ]]; then
        return
    fi
    local parent=root
    if [[ -n $delay ]]; then
        "${run[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" \
            || die "tc netem failed (no sch_netem in this kernel, CONFIG_NET_SCH_NETEM, or a bad DELAY)"
        parent="parent 1:"
    fi
    if [[ $rate != none ]]; then
        local bits burst
        bits=$(rate_bits "$rate")
        burst=$(( bits / 8 / 250 ))
        (( burst < 131072 )) && burst=131072
        # shellcheck disable=SC2086
        "${run[@]}" tc qdisc add dev "$dev" $parent handle 2: tbf rate "$rate" burst "$burst" latency 100ms
    fi
}

rate_bits() {  # 1gbit -> 1000000000 (tc's units: kbit, mbit, gbit, or a plain bit/s number)
    local r=${1,,}
    case $r in
        *gbit) echo $(( ${r%gbit} * 1000000000 )) ;;
        *mbit) echo $(( ${r%mbit} * 1000000 )) ;;
        *kbit) echo $(( ${r%kbit} * 1000 )) ;;
        *bit) echo "${r%bit}" ;;
        *[!0-9]*|'') die "rate '$1' not understood: use e.g. 10gbit, 1gbit, 100mbit or none" ;;
        *) echo "$r" ;;
    esac
}

up() {
    local n=${1:-} rate=${2:-none} delay=${3:-}
    [[ $n =~ ^[0-9]+$ ]] && (( n >= 1 && n <= MAX_RANKS )) || die "usage: netns.sh up N [RATE] [DELAY] (1 <= N <= $MAX_RANKS)"
    [[ $rate == none ]] || rate_bits "$rate" >/dev/null
    # An interrupted or failed "up" leaves nothing behind (set -e turns any failure into an exit).
    trap 'exit 130' INT TERM
    trap 'rc=$?; trap - EXIT; if (( rc != 0 )); then
              echo "netns.sh: up failed or interrupted (exit $rc), removing everything" >&2; down
          fi; exit $rc' EXIT

    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "${SUBNET}.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up

    local i ns host
    for (( i = 0; i < n; i++ )); do
        ns=${PREFIX}${i}
        host=${PREFIX}h${i}
        ip netns list | awk '{print $1}' | grep -qx "$ns" || ip netns add "$ns"
        if ! ip netns exec "$ns" ip link show "$NS_IFACE" >/dev/null 2>&1; then
            ip link del "$host" 2>/dev/null || true          # a stale half of a pair
            ip link add "$host" type veth peer name "${PREFIX}p${i}"
            ip link set "${PREFIX}p${i}" netns "$ns"
            ip netns exec "$ns" ip link set "${PREFIX}p${i}" name "$NS_IFACE"
        fi
        ip link set "$host" master "$BRIDGE"
        ip link set "$host" up
        write_hosts "$ns" "${SUBNET}.$(( 10 + i ))"
        ip netns exec "$ns" ip addr replace "${SUBNET}.$(( 10 + i ))/24" dev "$NS_IFACE"
        ip netns exec "$ns" ip link set "$NS_IFACE" up
        ip netns exec "$ns" ip link set lo up
        shape "$host" "$rate" "$delay"                    # the rank's download
        shape "$NS_IFACE" "$rate" "$delay" "$ns"          # the rank's upload
        if [[ -n ${HVDS_NETNS_SLOW:-} ]]; then            # tests interrupt "up" half-way, here
            echo "netns.sh: pausing after $ns" >&2
            sleep "$HVDS_NETNS_SLOW"
        fi
    done
    # Namespaces beyond N from an earlier, larger "up" are removed.
    for ns in $(our_namespaces); do
        i=${ns#"$PREFIX"}
        if (( i >= n )); then
            ip netns del "$ns"
            ip link del "${PREFIX}h${i}" 2>/dev/null || true
            rm -rf "/etc/netns/$ns"
        fi
    done
    trap - INT TERM EXIT
    echo "netns.sh: $n namespaces ${PREFIX}0..${PREFIX}$(( n - 1 )), bridge $BRIDGE ${SUBNET}.1, rate $rate${delay:+, delay $delay}"
}

status() {
    local ns link
    echo "bridge:"
    ip -br addr show "$BRIDGE" 2>/dev/null || echo "  (none)"
    for link in $(our_links); do
        [[ $link == "$BRIDGE" ]] && continue
        echo "$link: $(tc qdisc show dev "$link" | grep -E 'tbf|netem' | tr '\n' ' ')"
    done
    for ns in $(our_namespaces); do
        echo "$ns: $(ip netns exec "$ns" ip -br -4 addr show "$NS_IFACE" 2>/dev/null | awk '{print $3}')" \
             "$(ip netns exec "$ns" tc qdisc show dev "$NS_IFACE" 2>/dev/null | grep -E 'tbf|netem' | tr '\n' ' ')"
    done
}

case ${1:-} in
    up) need_root; shift; up "$@" ;;
    down) need_root; down; echo "netns.sh: removed every ${PREFIX}* namespace and link" ;;
    status) need_root; status ;;
    env)
        [[ ${2:-} =~ ^[0-9]+$ ]] || die "usage: netns.sh env RANK"
        echo "NETNS=${PREFIX}$2 ADDR=${SUBNET}.$(( 10 + $2 )) IFACE=$NS_IFACE SERVER=${SUBNET}.1" ;;
    *) die "usage: netns.sh up N [RATE] [DELAY] | down | status | env RANK" ;;
esac
