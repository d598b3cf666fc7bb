#!/usr/bin/env bash
# A cluster on one machine: N "hosts", each a network namespace with one
# interface (eth0, 10.77.<net>.<10+k>/24) on a bridge that lives in a
# namespace of its own (nothing is added to the machine's own network).
# Needs root (ip, tc).
#
#   scripts/cluster.sh up N [--rate R] [--burst B] [--delay D] [--loss L] [--cc CC] [--name NAME]
#       makes hosts NAME-h0 .. NAME-h<N-1>; --rate shapes each host's
#       link both ways (tc tbf, e.g. 1gbit; --burst, default 256kb);
#       --cc sets the hosts' TCP congestion control (e.g. cubic, bbr;
#       default: the machine's, which a namespace inherits);
#       --delay D (e.g. 20ms, one way) and --loss L (e.g. 1%) impair every
#       packet between hosts: netem where the kernel has it, otherwise
#       iptables and scripts/link_delay.py (this says which)
#   scripts/cluster.sh run [--name NAME] -- COMMAND [ARGS...]
#       runs COMMAND in every host at once, with CLUSTER_HOSTS (N),
#       CLUSTER_HOST (k), CLUSTER_ADDR (its address) and CLUSTER_MASTER
#       (host 0's address) set, each host's output prefixed [host k];
#       exits with the first failing host's status
#   scripts/cluster.sh exec K [--name NAME] -- COMMAND [ARGS...]
#       runs COMMAND in host K
#   scripts/cluster.sh link K up|down [--name NAME]
#       takes host K's link down or up (a pulled cable)
#   scripts/cluster.sh down [--name NAME]
#       removes every namespace of the cluster (and with them every link)
#   scripts/cluster.sh addr K [--name NAME]
#       prints host K's address
#   scripts/cluster.sh rsh [--name NAME] ADDR COMMAND...
#       an rsh agent for MPI launchers (Open MPI's plm_rsh_agent, Hydra's
#       -launcher-exec): runs COMMAND, a shell command line as ssh would
#       get it, in the host whose address is ADDR (or named NAME-hK),
#       under that host's own hostname (NAME-hK, a UTS namespace: MPI
#       tells hosts apart by hostname and would share memory across them)
#
# NAME defaults to "rdc"; the subnet is derived from it, so clusters with
# different names can exist side by side (parallel tests).
set -eEuo pipefail

die() { echo "cluster.sh: $*" >&2; exit 2; }

name=rdc
cmd=${1:-}; [ -n "$cmd" ] || die "usage: cluster.sh up|run|exec|link|down|addr ... (see the header)"
shift

subnet() {  # a /24 per name: 10.77.<1..250>.0
  local h; h=$(printf '%s' "$name" | cksum | cut -d' ' -f1)
  echo "10.77.$(( h % 250 + 1 ))"
}
hosts() { ip netns list | awk '{print $1}' | grep -E "^${name}-h[0-9]+$" | sort -t h -k2 -n || true; }
count() { hosts | wc -l; }
addr() { echo "$(subnet).$(( 10 + $1 ))"; }

# Delay and loss on host $1's link. netem where the kernel has it (on the
# host's egress); otherwise iptables in the host's INPUT chain: loss with a
# random draw per packet, delay by queueing every packet (NFQUEUE) to
# scripts/link_delay.py, a small netlink program in the host's namespace
# that releases each packet after the delay. Either way each packet
# between hosts meets the loss once and the delay once.
netem_args=()
undo_and_die() { bash "$0" down --name "$name"; die "$@"; }
impair() {
  local h=$1
  if [ -z "${impairment:-}" ]; then
    netem_args=()
    [ -z "$delay" ] || netem_args+=(delay "$delay")
    [ -z "$loss" ] || netem_args+=(loss "$loss")
    local parent=(root)
    if [ -n "$rate" ]; then
      ip netns exec "$h" tc qdisc replace dev eth0 root handle 1: tbf rate "$rate" burst "$burst" latency 50ms
      parent=(parent 1:1)
    fi
    if ip netns exec "$h" tc qdisc add dev eth0 "${parent[@]}" handle 10: netem "${netem_args[@]}" 2>/dev/null; then
      impairment=netem
      return
    fi
    command -v iptables >/dev/null || undo_and_die "this kernel has no netem qdisc and iptables is not installed: --delay and --loss need one of them"
    command -v python3 >/dev/null || undo_and_die "--delay without netem needs python3 (scripts/link_delay.py)"
    impairment=nftables
    echo "cluster.sh: this kernel has no netem; delay and loss by iptables (statistic match; NFQUEUE to scripts/link_delay.py for delay)" >&2
  elif [ "$impairment" = netem ]; then
    local parent=(root)
    if [ -n "$rate" ]; then
      ip netns exec "$h" tc qdisc replace dev eth0 root handle 1: tbf rate "$rate" burst "$burst" latency 50ms
      parent=(parent 1:1)
    fi
    ip netns exec "$h" tc qdisc add dev eth0 "${parent[@]}" handle 10: netem "${netem_args[@]}"
    return
  fi
  if [ -n "$loss" ]; then
    local p
    p=$(awk -v l="${loss%\%}" 'BEGIN { if (l !~ /^[0-9.]+$/ || l > 100 || l < 0.0001) exit 1; printf "%.8f", l / 100 }') \
      || undo_and_die "--loss wants a percentage from 0.0001% to 100% such as 1% (got $loss)"
    ip netns exec "$h" iptables -A INPUT -i eth0 -m statistic --mode random --probability "$p" -j DROP
  fi
  if [ -n "$delay" ]; then
    local ms
    ms=$(awk -v d="$delay" 'BEGIN {
        if (d ~ /^[0-9.]+ms$/) { sub(/ms$/, "", d); print d }
        else if (d ~ /^[0-9.]+us$/) { sub(/us$/, "", d); print d / 1000 }
        else if (d ~ /^[0-9.]+s$/) { sub(/s$/, "", d); print d * 1000 }
        else if (d ~ /^[0-9.]+$/) print d
        else exit 1 }') || undo_and_die "--delay wants a time such as 20ms (got $delay)"
    local ready="/tmp/rdist-cluster-$h.delay"
    rm -f "$ready"
    # Its own session, so it outlives this script; `down` ends it with
    # every other process of the namespace. Should it die, the host's
    # packets are dropped (no bypass: a link without its delay would pass
    # for one with it); its log says why.
    ip netns exec "$h" setsid python3 "$(dirname "$0")/link_delay.py" --queue 0 \
      --delay-ms "$ms" --ready "$ready" </dev/null >"/tmp/rdist-cluster-$h.delay.log" 2>&1 &
    local i
    for i in $(seq 100); do [ -s "$ready" ] && break; sleep 0.05; done
    [ -s "$ready" ] || undo_and_die "the delay program did not start in host $h"
    rm -f "$ready"
    ip netns exec "$h" iptables -A INPUT -i eth0 -j NFQUEUE --queue-num 0
  fi
}

case "$cmd" in
  up)
    n=${1:-}; [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up needs a host count (1..200)"
    shift
    rate="" burst=256kb delay="" loss="" cc=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --rate) rate=$2; shift 2 ;;
        --cc) cc=$2; shift 2 ;;
        --burst) burst=$2; shift 2 ;;
        --delay) delay=$2; shift 2 ;;
        --loss) loss=$2; shift 2 ;;
        --name) name=$2; shift 2 ;;
        *) die "unknown option $1" ;;
      esac
    done
    [ -z "$(hosts)" ] || die "a cluster named $name exists (cluster.sh down --name $name)"
    if [ -n "$cc" ]; then
      if ! grep -qwF -- "$cc" /proc/sys/net/ipv4/tcp_available_congestion_control; then
        modprobe "tcp_$cc" 2>/dev/null || true
        grep -qwF -- "$cc" /proc/sys/net/ipv4/tcp_available_congestion_control ||
          die "--cc $cc: this kernel offers $(cat /proc/sys/net/ipv4/tcp_available_congestion_control)"
      fi
      # A namespace may only pick what the machine allows.
      grep -qwF -- "$cc" /proc/sys/net/ipv4/tcp_allowed_congestion_control ||
        die "--cc $cc: not in net.ipv4.tcp_allowed_congestion_control ($(cat /proc/sys/net/ipv4/tcp_allowed_congestion_control)); add it there first"
    fi
    # Half a cluster is no cluster: undo it on any failure.
    trap 'bash "$0" down --name "$name"; echo "cluster.sh: up failed; removed what was made" >&2' ERR
    sw="${name}-sw"
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    ip -n "$sw" link set lo up
    for k in $(seq 0 $(( n - 1 ))); do
      h="${name}-h$k"
      ip netns add "$h"
      ip -n "$h" link set lo up
      if [ -n "$cc" ]; then
        ip netns exec "$h" sysctl -qw net.ipv4.tcp_congestion_control="$cc"
      fi
      # The veth is made in the host's namespace, its peer moved to the
      # switch (retried: namespaces made at the same moment by another
      # cluster can make the peer's reference briefly invalid).
      for try in 1 2 3 4 5; do
        ip -n "$h" link add eth0 type veth peer name "p$k" netns "$sw" 2>/dev/null && break
        [ "$try" -lt 5 ] || ip -n "$h" link add eth0 type veth peer name "p$k" netns "$sw"
        sleep 0.2
      done
      ip -n "$sw" link set "p$k" master br0
      ip -n "$sw" link set "p$k" up
      ip -n "$h" addr add "$(addr "$k")/24" dev eth0
      ip -n "$h" link set eth0 up
      if [ -n "$rate" ]; then
        # Egress of the host, and egress of its switch port (the host's ingress).
        ip netns exec "$h" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
        ip netns exec "$sw" tc qdisc add dev "p$k" root tbf rate "$rate" burst "$burst" latency 50ms
      fi
      if [ -n "$delay$loss" ]; then
        impair "$h"
      fi
    done
    echo "cluster $name: $n hosts, $(subnet).10-$(( 9 + n ))${rate:+, links $rate}, TCP $(ip netns exec "${name}-h0" cat /proc/sys/net/ipv4/tcp_congestion_control)"
    ;;
  run)
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case "$1" in --name) name=$2; shift 2 ;; *) die "unknown option $1" ;; esac
    done
    [ "${1:-}" = "--" ] && shift || die "run needs -- COMMAND"
    n=$(count); [ "$n" -ge 1 ] || die "no cluster named $name (cluster.sh up N --name $name)"
    pids=()
    for k in $(seq 0 $(( n - 1 ))); do
      ( ip netns exec "${name}-h$k" env CLUSTER_HOSTS="$n" CLUSTER_HOST="$k" \
          CLUSTER_ADDR="$(addr "$k")" CLUSTER_MASTER="$(addr 0)" "$@" 2>&1 \
          | sed -u "s/^/[host $k] /"; exit "${PIPESTATUS[0]}" ) &
      pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do
      wait "$pid" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
    done
    exit "$status"
    ;;
  exec)
    k=${1:-}; [[ "$k" =~ ^[0-9]+$ ]] || die "exec needs a host index"
    shift
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      case "$1" in --name) name=$2; shift 2 ;; *) die "unknown option $1" ;; esac
    done
    [ "${1:-}" = "--" ] && shift || die "exec needs -- COMMAND"
    exec ip netns exec "${name}-h$k" env CLUSTER_HOSTS="$(count)" CLUSTER_HOST="$k" \
      CLUSTER_ADDR="$(addr "$k")" CLUSTER_MASTER="$(addr 0)" "$@"
    ;;
  link)
    k=${1:-}; state=${2:-}
    [[ "$k" =~ ^[0-9]+$ ]] && [[ "$state" =~ ^(up|down)$ ]] || die "link needs K up|down"
    shift 2
    while [ $# -gt 0 ]; do
      case "$1" in --name) name=$2; shift 2 ;; *) die "unknown option $1" ;; esac
    done
    ip -n "${name}-sw" link set "p$k" "$state"
    ;;
  addr)
    k=${1:-}; [[ "$k" =~ ^[0-9]+$ ]] || die "addr needs a host index"
    shift
    while [ $# -gt 0 ]; do
      case "$1" in --name) name=$2; shift 2 ;; *) die "unknown option $1" ;; esac
    done
    addr "$k"
    ;;
  rsh)
    while [ "${1:-}" = "--name" ]; do name=$2; shift 2; done
    # Launchers pass ssh options before the host (Hydra: -x HOST CMD)
    # or after it (those with a value take the next word); a shell gets
    # the rest.
    skip_opts() {
      n=0
      while :; do
        case "${1:-}" in
          -[bcDEeFIiJLlmOopQRSWw]) shift 2; n=$((n + 2)) ;;
          -*) shift; n=$((n + 1)) ;;
          *) break ;;
        esac
      done
    }
    skip_opts "$@"; shift "$n"
    target=${1:-}; [ -n "$target" ] || die "rsh needs a host address"
    shift
    skip_opts "$@"; shift "$n"
    k=""
    for h in $(hosts); do
      i=${h##*-h}
      if [ "$target" = "$(addr "$i")" ] || [ "$target" = "$h" ]; then k=$i; fi
    done
    [ -n "$k" ] || die "rsh: no host $target in cluster $name"
    exec ip netns exec "${name}-h$k" unshare --uts sh -c "hostname ${name}-h$k; $*"
    ;;
  down)
    while [ $# -gt 0 ]; do
      case "$1" in --name) name=$2; shift 2 ;; *) die "unknown option $1" ;; esac
    done
    for h in $(hosts) "${name}-sw"; do
      # Processes left in a namespace (the delay programs, a stray rank)
      # would keep its network alive after `ip netns del`.
      pids=$(ip netns pids "$h" 2>/dev/null || true)
      [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
      ip netns del "$h" 2>/dev/null || true
      rm -f "/tmp/rdist-cluster-$h.delay.log"
    done
    ;;
  *) die "unknown command $cmd (up, run, exec, link, addr, rsh, down)" ;;
esac
