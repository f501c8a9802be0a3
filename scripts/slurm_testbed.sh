#!/usr/bin/env bash
# A Slurm cluster on this one machine, for mirage's tests.
#
# It stands in for a real cluster's hosts: mirage's Slurm support is tested against a real
# slurmctld and real slurmd daemons, and the tasks run "on" distinct hosts that each have their
# own network stack, address and hostname, while sharing the filesystem (as a cluster's
# hosts share a home directory over NFS).
#
# What `start N` builds (N defaults to 2; needs root, Linux, iproute2, util-linux):
#   * network namespace mslurm-ctl: a bridge (br0, 10.231.0.1/24) and slurmctld, with the UTS
#     hostname "slurmctl". The bridge lives in this namespace, not the root one, so that the
#     root namespace's firewall (e.g. Docker's FORWARD policy DROP with br_netfilter) never
#     sees host-to-host traffic.
#   * network namespaces mslurm-host0..N-1: host K has eth0 = 10.231.0.(10+K)/24 on the
#     bridge, lo up, the UTS hostname "hostK", and one slurmd (`slurmd -N hostK`), which runs
#     every job step of that node, so a job's tasks live in the host's net and UTS namespaces.
#     The PID namespace is the root one; the mount namespace is the slave copy `ip netns exec`
#     makes (root's mounts propagate in, all files are the same) with three differences: its
#     own /sys, /etc/hosts (below), and an empty tmpfs on /sys/fs/cgroup (Slurm 22.05's slurmd
#     always initialises a cgroup plugin; there it finds "v1, no controllers" and leaves
#     cgroups alone, on cgroup v1 and v2 machines alike).
#   * the root namespace gets mslurm0 = 10.231.0.254/24 (a veth into the bridge), so srun,
#     sbatch, sinfo, scancel, scontrol work from the root namespace with SLURM_CONF set, and
#     a task can reach a server of the test itself at 10.231.0.254.
#   * names: /etc/netns/<ns>/hosts (bind-mounted by `ip netns exec` over /etc/hosts inside
#     the namespaces) lists slurmctl and every hostK; the root namespace's /etc/hosts is not
#     touched (the same list is in $TESTBED/hosts). slurm.conf gives every NodeAddr.
#   * slurm.conf: AuthType=auth/none, CredType=cred/none (no munge), proctrack/linuxproc,
#     task/none (no cgroups), no accounting, select/cons_tres with CR_CPU, CPUs per node
#     $MIRAGE_SLURM_CPUS (default 8: up to 8 tasks per node, above the real cores thanks to
#     SlurmdParameters=config_overrides), partition "test" (default, OverSubscribe=FORCE:4,
#     so jobs share nodes), ReturnToService=2.
#   Everything (configs, state, spools, logs) is under $TESTBED (default /tmp/mirage-slurm-testbed).
#   One testbed per machine: the names (mslurm-*) and the subnet are fixed.
#
# Usage:
#   slurm_testbed.sh start [N]     stop any leftovers, build, wait until sinfo shows N idle nodes
#                                  (about 1 s, plus apt-get the first time); prints
#                                  `export SLURM_CONF=...` on stdout (progress on stderr). On
#                                  failure it prints the logs' tails, removes what it built and
#                                  exits non-zero (MIRAGE_SLURM_KEEP_ON_FAILURE=1 keeps it).
#   slurm_testbed.sh stop          kill daemons and every job process, remove namespaces, veths,
#                                  /etc/netns entries and $TESTBED (safe when nothing runs)
#   slurm_testbed.sh status        sinfo/squeue, or says it is not running (exit 1)
#   slurm_testbed.sh env           prints the export lines again
#   slurm_testbed.sh exec CMD...   runs CMD in the root namespace with SLURM_CONF set
#   slurm_testbed.sh on hostK CMD...  runs CMD inside host K's namespaces (net, uts, mount)
#   slurm_testbed.sh logs          tails of all daemon logs
# Environment: MIRAGE_SLURM_TESTBED (folder), MIRAGE_SLURM_NET (a /24 prefix, default
# 10.231.0), MIRAGE_SLURM_CPUS, MIRAGE_SLURM_START_TIMEOUT (seconds, default 60).
# Missing packages (slurmctld, slurmd, slurm-client, iproute2) are installed with apt-get.
set -euo pipefail

TESTBED=${MIRAGE_SLURM_TESTBED:-/tmp/mirage-slurm-testbed}
NET=${MIRAGE_SLURM_NET:-10.231.0}           # a /24; ctl .1, hostK .(10+K), root ns .254
CPUS=${MIRAGE_SLURM_CPUS:-8}
START_TIMEOUT=${MIRAGE_SLURM_START_TIMEOUT:-60}
PREFIX=mslurm                               # namespaces, veths and /etc/netns entries
CTL_NS=$PREFIX-ctl
ROOT_IF=${PREFIX}0
CONF=$TESTBED/slurm.conf

case "$TESTBED" in /|"") echo "slurm_testbed: refusing TESTBED='$TESTBED'" >&2; exit 2;; esac

log() { echo "slurm_testbed: $*" >&2; }
die() { log "$*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces)"; }

ensure_packages() {
  local missing=()
  command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
  command -v slurmd >/dev/null || [ -x /usr/sbin/slurmd ] || missing+=(slurmd)
  command -v srun >/dev/null || missing+=(slurm-client)
  command -v ip >/dev/null || missing+=(iproute2)
  command -v unshare >/dev/null || missing+=(util-linux)
  command -v nsenter >/dev/null || missing+=(util-linux)
  [ ${#missing[@]} = 0 ] && return 0
  log "installing ${missing[*]} with apt-get"
  # Keep the packages' own services (slurmctld, slurmd, munge) from starting: the testbed runs
  # its own daemons. A policy-rc.d already there is left as it is.
  local policy_added=
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2 ||
    { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >&2; }
  } || rc=$?
  if [ -n "$policy_added" ]; then rm -f /usr/sbin/policy-rc.d; fi
  [ $rc = 0 ] || die "apt-get install ${missing[*]} failed"
}

host_ns() { echo "$PREFIX-host$1"; }

# Our namespaces (from `ip netns list`, so a half-built run is found too).
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(ctl|host[0-9]+)\$" || true; }

kill_pids() {  # kill_pids SIGNAL PID... (never ourselves or our ancestors)
  local sig=$1; shift
  local p keep=" $$ $PPID "
  local a=$$
  while [ "$a" -gt 1 ] 2>/dev/null; do
    keep+="$a "
    a=$(sed 's/.*) //' "/proc/$a/stat" 2>/dev/null | cut -d' ' -f2 || echo 1)
    a=${a:-1}
  done
  for p in "$@"; do
    case "$keep" in *" $p "*) continue;; esac
    kill "-$sig" "$p" 2>/dev/null || true
  done
}

# Every process of the testbed: those in our network namespaces (daemons, slurmstepd, tasks),
# the daemons by pid file, and job tasks that left our namespaces (a task that made a network
# namespace of its own) found by SLURM_JOB_ID plus our SLURM_CONF in their environment.
testbed_pids() {
  local ns f p
  for ns in $(our_namespaces); do ip netns pids "$ns" 2>/dev/null || true; done
  for f in "$TESTBED"/ctl/slurmctld.pid "$TESTBED"/nodes/*/slurmd.pid; do
    if [ -f "$f" ]; then cat "$f" 2>/dev/null || true; fi
  done
  for f in $(grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null || true); do
    if grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null; then p=${f#/proc/}; echo "${p%/environ}"; fi
  done
}

alive() {  # the PIDs among the arguments that still exist, on one line
  local p out=
  for p in "$@"; do if [ -d "/proc/$p" ]; then out+="$p "; fi; done
  echo "$out"
}

do_stop() {
  need_root
  local pids _
  pids=$(testbed_pids | sort -un | tr '\n' ' ')
  if [ -n "${pids// /}" ]; then
    # shellcheck disable=SC2086
    kill_pids TERM $pids
    for _ in $(seq 1 30); do
      # shellcheck disable=SC2086
      pids=$(alive $pids)
      if [ -z "${pids// /}" ]; then break; fi
      sleep 0.1
    done
    # shellcheck disable=SC2086
    if [ -n "${pids// /}" ]; then kill_pids KILL $pids; fi
    # whatever was started meanwhile (a step launching as the daemons went down)
    # shellcheck disable=SC2046
    kill_pids KILL $(testbed_pids)
  fi
  local ns
  for ns in $(our_namespaces); do
    # shellcheck disable=SC2046
    kill_pids KILL $(ip netns pids "$ns" 2>/dev/null) 2>/dev/null || true
    ip netns delete "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -rf /etc/netns/$PREFIX-ctl /etc/netns/$PREFIX-host[0-9]*
  if [ -f "$TESTBED/made-etc-netns" ]; then rmdir /etc/netns 2>/dev/null || true; fi
  ip link delete "$ROOT_IF" 2>/dev/null || true
  rm -rf "$TESTBED"
}

write_conf() {
  local n=$1 k
  mkdir -p "$TESTBED/ctl/state" "$TESTBED/bin"
  cat >"$CONF" <<EOF
# Written by scripts/slurm_testbed.sh: a Slurm test cluster of $n hosts on one machine.
ClusterName=mirage-testbed
SlurmctldHost=slurmctl($NET.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$TESTBED/ctl/state
SlurmctldPidFile=$TESTBED/ctl/slurmctld.pid
SlurmctldLogFile=$TESTBED/ctl/slurmctld.log
SlurmdSpoolDir=$TESTBED/nodes/%n/spool
SlurmdPidFile=$TESTBED/nodes/%n/slurmd.pid
SlurmdLogFile=$TESTBED/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
# A job submitted while the previous one's nodes are still completing is queued; a scheduler
# pass every second (not every 60) starts it within about a second.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=2
MinJobAge=30
UnkillableStepTimeout=30
MailProg=/bin/true
EOF
  printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' >"$TESTBED/cgroup.conf"
  for ((k = 0; k < n; k++)); do
    echo "NodeName=host$k NodeAddr=$NET.$((10 + k)) NodeHostname=host$k CPUs=$CPUS RealMemory=4096 State=UNKNOWN" >>"$CONF"
    mkdir -p "$TESTBED/nodes/host$k/spool"
  done
  echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >>"$CONF"

  { echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$NET.1 slurmctl"
    # and the IPv4-mapped form a dual-stack server (torch's TCPStore) sees clients by, as DNS would
    for ((k = 0; k < n; k++)); do echo "$NET.$((10 + k)) host$k"; echo "::ffff:$NET.$((10 + k)) host$k"; done
  } >"$TESTBED/hosts"
  echo "$n" >"$TESTBED/nhosts"
}

# in_ns NS HOSTNAME CMD...: runs CMD in network namespace NS with a UTS namespace of its own
# whose hostname is HOSTNAME, in the slave mount namespace `ip netns exec` makes (which
# bind-mounts /etc/netns/NS/hosts on /etc/hosts and mounts a fresh /sys). There an empty tmpfs
# goes on /sys/fs/cgroup: Slurm 22.05's slurmd always initialises its cgroup plugin, which
# then sees "cgroup v1 with no controllers" and leaves cgroups alone, the same on any host
# (a cgroup v2 host would need systemd scopes; the fresh /sys has no cgroup mount at all).
in_ns() {
  local ns=$1 name=$2; shift 2
  # shellcheck disable=SC2016
  ip netns exec "$ns" unshare --uts -- sh -c \
    'echo "$0" >/proc/sys/kernel/hostname &&
     mount -t tmpfs -o size=64k,mode=755 mslurm-nocgroup /sys/fs/cgroup && exec "$@"' "$name" "$@"
}

make_netns() {  # make_netns NS VETH_ROOT_SIDE ADDR: namespace with eth0 on the bridge
  local ns=$1 veth=$2 addr=$3
  ip netns add "$ns"
  mkdir -p "/etc/netns/$ns"; cp "$TESTBED/hosts" "/etc/netns/$ns/hosts"
  ip netns exec "$ns" ip link set lo up
  ip link add "$veth" netns "$CTL_NS" type veth peer name eth0 netns "$ns"
  ip -n "$CTL_NS" link set "$veth" master br0 up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}

tails() {
  local f
  for f in "$TESTBED"/ctl/slurmctld.log "$TESTBED"/nodes/*/slurmd.log "$TESTBED"/nodes/*/slurmd.out "$TESTBED"/ctl/slurmctld.out; do
    [ -s "$f" ] || continue
    echo "---- $f (last 25 lines)" >&2
    tail -n 25 "$f" >&2
  done
}

dead_daemons() {  # fails the start when a daemon that wrote its pid file has gone
  local f
  for f in "$TESTBED"/ctl/slurmctld.pid "$TESTBED"/nodes/*/slurmd.pid; do
    [ -s "$f" ] || continue
    [ -d "/proc/$(cat "$f")" ] || die "$(basename "$f" .pid) ($f) exited"
  done
}

start_failed() {
  local rc=$?
  tails
  if [ "${MIRAGE_SLURM_KEEP_ON_FAILURE:-}" = 1 ]; then
    log "start failed; the testbed is left for inspection under $TESTBED (run '$0 stop')"
  else
    log "start failed; removing what it built (MIRAGE_SLURM_KEEP_ON_FAILURE=1 keeps it)"
    do_stop
  fi
  exit $((rc == 0 ? 1 : rc))
}

print_env() {
  echo "export SLURM_CONF=$CONF"
}

do_start() {
  local n=${1:-2}
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]] || [ "$n" -gt 200 ]; then die "start: N must be 1..200, not '$n'"; fi
  need_root
  ensure_packages
  do_stop
  if ip -4 -o addr show | grep -q " inet $NET\."; then
    die "the root namespace already has an address in $NET.0/24; set MIRAGE_SLURM_NET to another /24 (e.g. 10.232.0)"
  fi
  local t0=$SECONDS k
  # A start that fails prints the daemons' logs and removes what it built, unless
  # MIRAGE_SLURM_KEEP_ON_FAILURE=1 (then `stop` removes it).
  trap start_failed EXIT
  write_conf "$n"
  if [ ! -d /etc/netns ]; then mkdir /etc/netns; touch "$TESTBED/made-etc-netns"; fi

  # The controller's namespace, which holds the bridge; the root namespace joins it via mslurm0.
  ip netns add "$CTL_NS"
  mkdir -p "/etc/netns/$CTL_NS"; cp "$TESTBED/hosts" "/etc/netns/$CTL_NS/hosts"
  ip -n "$CTL_NS" link set lo up
  ip -n "$CTL_NS" link add br0 type bridge
  ip -n "$CTL_NS" addr add "$NET.1/24" dev br0
  ip -n "$CTL_NS" link set br0 up
  ip link add "$ROOT_IF" type veth peer name root0 netns "$CTL_NS"
  ip -n "$CTL_NS" link set root0 master br0 up
  ip addr add "$NET.254/24" dev "$ROOT_IF"
  ip link set "$ROOT_IF" up
  for ((k = 0; k < n; k++)); do
    make_netns "$(host_ns $k)" "h$k" "$NET.$((10 + k))"
  done

  export SLURM_CONF=$CONF
  in_ns "$CTL_NS" slurmctl slurmctld -f "$CONF" -i >"$TESTBED/ctl/slurmctld.out" 2>&1 ||
    die "slurmctld did not start"
  for ((k = 0; k < n; k++)); do
    in_ns "$(host_ns $k)" "host$k" slurmd -f "$CONF" -N "host$k" >"$TESTBED/nodes/host$k/slurmd.out" 2>&1 ||
      die "slurmd on host$k did not start"
  done

  local deadline=$((SECONDS + START_TIMEOUT)) states=
  while :; do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
    if [ "$(grep -c ' idle$' <<<"$states" || true)" = "$n" ]; then break; fi
    dead_daemons
    if [ $SECONDS -ge $deadline ]; then
      log "sinfo says: ${states:-<no answer from slurmctld>}"
      die "nodes not all idle after ${START_TIMEOUT}s"
    fi
    sleep 0.2
  done
  trap - EXIT
  log "$n hosts idle after $((SECONDS - t0))s (controller $NET.1; hosts host0..host$((n - 1)) at $NET.10..$NET.$((9 + n)))"
  print_env
}

running() { [ -f "$CONF" ] && ip netns list 2>/dev/null | grep -q "^$CTL_NS\b"; }

case "${1:-}" in
  start) shift; do_start "$@" ;;
  stop) do_stop; log "stopped" ;;
  status)
    running || { echo "slurm testbed: not running"; exit 1; }
    export SLURM_CONF=$CONF
    echo "slurm testbed: $(cat "$TESTBED/nhosts") hosts, SLURM_CONF=$CONF"
    sinfo -N -l; squeue ;;
  env) running || die "not running"; print_env ;;
  exec)
    shift; running || die "not running"
    export SLURM_CONF=$CONF; exec "$@" ;;
  on)
    shift; running || die "not running"
    h=${1:?usage: on hostK CMD...}; shift
    [ -f "$TESTBED/nodes/$h/slurmd.pid" ] || die "no slurmd for '$h'"
    export SLURM_CONF=$CONF
    exec nsenter -t "$(cat "$TESTBED/nodes/$h/slurmd.pid")" --net --uts --mount -- "$@" ;;
  logs) tails ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
