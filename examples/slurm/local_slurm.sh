#!/bin/bash
# A SLURM cluster on one machine, its nodes on loopback addresses, to try train_ray.sbatch (and to
# test it: tests/e2e/test_slurm.py). Debian's / Ubuntu's slurm-wlm 22.05+ and munge.
#
#   examples/slurm/local_slurm.sh install                 # apt-get install slurm-wlm munge (as root)
#   examples/slurm/local_slurm.sh start DIR [NODES] [CPUS] # NODES nodes (default 3) n1..nN on 127.0.0.2, .3, ...,
#                                                          # CPUS each (default 2); prints `export SLURM_CONF=...`
#   SLURM_CONF=DIR/slurm.conf sbatch --nodes=3 examples/slurm/train_ray.sbatch CONFIG.yaml
#   examples/slurm/local_slurm.sh stop DIR                 # every daemon started for DIR
#
# Everything lives in DIR (the config, state, logs, pid files) but a munge daemon of its own, whose
# socket, log and pid file are in /tmp/entr-munge.XXXXXX (the munge user must reach them); it uses the
# machine's munge key, /etc/munge/munge.key, which the package made. The daemons run as
# root (SlurmUser=root): start needs root. slurmctld and slurmd listen on every interface (SLURM has
# no bind address); their ports are picked free above 20000. Each slurmd is `slurmd -N nI`, one per
# node, which the Debian build allows. Jobs run as the user who submits them.

set -euo pipefail

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

free_port() {
    python3 - <<'PY'
import random, socket
for _ in range(200):
    port = random.randint(20000, 32000)
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            continue
        print(port)
        break
PY
}

cmd=${1:-}
case "$cmd" in
install)
    [[ $(id -u) -eq 0 ]] || die "install needs root (apt-get install slurm-wlm munge)"
    command -v apt-get >/dev/null || die "install needs apt-get (Debian or Ubuntu); install slurm-wlm and munge yourself"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } \
        || die "apt-get install slurm-wlm munge failed"
    ;;
start)
    dir=${2:?usage: local_slurm.sh start DIR [NODES] [CPUS]}
    nodes=${3:-3}
    cpus=${4:-2}
    [[ $(id -u) -eq 0 ]] || die "start needs root (the daemons run as SlurmUser=root)"
    for tool in munged slurmctld slurmd sbatch; do
        command -v "$tool" >/dev/null || die "no $tool: run 'local_slurm.sh install' (Debian's slurm-wlm and munge)"
    done
    [[ -r /etc/munge/munge.key ]] || die "no /etc/munge/munge.key (the munge package creates it)"
    (( nodes >= 1 && nodes <= 200 )) || die "NODES=$nodes is not valid; must be 1..200"
    mkdir -p "$dir"/{state,spool,log,run}
    dir=$(cd "$dir" && pwd)
    # munged runs as the munge user: its directory must be reachable by it (DIR's parents may not be)
    munge_dir=$(mktemp -d /tmp/entr-munge.XXXXXX)
    chmod 755 "$munge_dir"
    chown munge: "$munge_dir"
    echo "$munge_dir" > "$dir/munge_dir"
    runuser -u munge -- /usr/sbin/munged --socket="$munge_dir/munge.socket" --pid-file="$munge_dir/munged.pid" \
        --log-file="$munge_dir/munged.log" --seed-file="$munge_dir/munged.seed" --key-file=/etc/munge/munge.key \
        || die "munged did not start (see $munge_dir/munged.log)"
    ctld_port=$(free_port)
    {
        echo "ClusterName=loopback"
        echo "SlurmctldHost=$(hostname)(127.0.0.1)"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "SlurmctldPort=$ctld_port"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$munge_dir/munge.socket"
        echo "StateSaveLocation=$dir/state"
        echo "SlurmdSpoolDir=$dir/spool/%n"
        echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
        echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$dir/log/slurmctld.log"
        echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "ReturnToService=2"
        echo "MpiDefault=none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "KillWait=5"
        for (( i = 1; i <= nodes; i++ )); do
            echo "NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.$((i + 1)) Port=$(free_port) CPUs=$cpus RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } > "$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    slurmctld -f "$SLURM_CONF" || die "slurmctld did not start (see $dir/log/slurmctld.log)"
    for (( i = 1; i <= nodes; i++ )); do
        slurmd -f "$SLURM_CONF" -N "n$i" || die "slurmd n$i did not start (see $dir/log/slurmd-n$i.log)"
    done
    for _ in $(seq 60); do
        if [[ $(sinfo -h -o '%T' 2>/dev/null | grep -c idle) -ge 1 ]] \
           && [[ $(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle) -eq $nodes ]]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            exit 0
        fi
        sleep 1
    done
    die "the $nodes nodes did not come up within 60 s: $(sinfo -N 2>&1 | tr '\n' ' ')"
    ;;
stop)
    dir=${2:?usage: local_slurm.sh stop DIR}
    munge_dir=$(cat "$dir/munge_dir" 2>/dev/null || true)
    for pidfile in "$dir"/run/slurmd-*.pid "$dir"/run/slurmctld.pid ${munge_dir:+"$munge_dir/munged.pid"}; do
        [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    [[ -n "$munge_dir" && "$munge_dir" == /tmp/entr-munge.* ]] && sleep 1 && rm -rf "$munge_dir"
    ;;
*)
    echo "usage: local_slurm.sh install | start DIR [NODES] [CPUS] | stop DIR" >&2
    exit 2
    ;;
esac
