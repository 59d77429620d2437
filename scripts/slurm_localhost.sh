#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, to run the pipeline through profiles/slurm for real.
#
#   sudo scripts/slurm_localhost.sh [start]   install (Debian packages), configure, start, wait for the node
#   sudo scripts/slurm_localhost.sh status    daemons, sinfo
#   sudo scripts/slurm_localhost.sh stop      stop the daemons this script started (state and database are kept)
#
# After `stop`, each snakemake call waits 10 s for `scontrol` (the SLURM executor plugin asks it at import):
# start the daemons again, or remove the packages, before timing anything.
#
# start is idempotent: packages already installed are not reinstalled, a daemon already running is left alone,
# and the configuration is rewritten only when it changed (the SLURM daemons are then restarted).
#
# What it sets up (Debian 12, slurm-wlm 22.05): munged; MariaDB holding the accounting database; slurmdbd
# (the SLURM plugin checks job status with `sacct`, which needs accounting storage: without slurmdbd, sacct
# answers "accounting storage is disabled"); slurmctld and slurmd with one node sized from `slurmd -C`
# (this machine's CPUs and memory) and the partitions the SLURM profile names (cpu, gpu), both on that node.
# The node has no GPU: jobs that ask for one would stay pending, the micro/mini pipeline asks for none.
# No cgroups (proctrack/linuxproc, task/none), so it runs in a container without systemd.
#
# Settings (environment): SLURM_LOCAL_PARTITIONS (default "cpu gpu", the first is the default partition),
# SLURM_LOCAL_STATE (default /var/lib/slurm-localhost: spool, state, logs, DB password),
# SLURM_LOCAL_USER (the user who submits jobs: given an association in a local "fedprompt" account unless it has
# one already, as root has from slurmdbd; default: $SUDO_USER or root).
set -euo pipefail

CLUSTER=fedprompt-local
ACCOUNT=fedprompt
PARTITIONS=${SLURM_LOCAL_PARTITIONS:-cpu gpu}
STATE=${SLURM_LOCAL_STATE:-/var/lib/slurm-localhost}
JOB_USER=${SLURM_LOCAL_USER:-${SUDO_USER:-root}}
CONF_DIR=/etc/slurm              # Debian's compiled-in location: sinfo, sbatch, sacct find it without SLURM_CONF
RUN_DIR=/run/slurm-localhost
LOG_DIR=$STATE/log
DB_SOCKET=/run/mysqld/mysqld.sock
DB_PID=/run/mysqld/mysqld.pid
MUNGE_PID=/run/munge/munged.pid
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

say() { echo "slurm_localhost: $*"; }
die() { echo "slurm_localhost: error: $*" >&2; exit 1; }

# live_pid PIDFILE NAME: the pid in the file, printed only when that process is alive and is NAME
# (pids wrap around quickly on a busy machine: a stale file may name someone else's process)
live_pid() {
    local pid
    [[ -f $1 ]] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local secs=$1 what=$2
    shift 2
    for ((i = 0; i < secs * 2; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    die "$what not ready after ${secs}s (logs: $LOG_DIR)"
}

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    say "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    # no daemon is started by the packages' scripts here: this script starts them itself
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# install -m MODE file only if its content changed; prints "changed" when it did
put_file() {  # put_file MODE OWNER PATH (content on stdin)
    local tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f $3 ]] && cmp -s "$tmp" "$3"; then
        rm -f "$tmp"
        return 0
    fi
    install -m "$1" -o "$2" -g "$2" "$tmp" "$3"
    rm -f "$tmp"
    echo changed
}

write_config() {
    local node host parts="" first=YES
    host=$(hostname -s)
    # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
    node=$(slurmd -C | head -n 1)
    [[ $node == NodeName=* ]] || die "slurmd -C printed no node line: $node"
    for p in $PARTITIONS; do
        parts+="PartitionName=$p Nodes=$host Default=$first MaxTime=INFINITE State=UP"$'\n'
        first=NO
    done
    local dbpass changed
    dbpass=$(cat "$STATE/dbpass")
    changed=$(
        put_file 0644 root "$CONF_DIR/slurm.conf" <<EOF
# written by scripts/slurm_localhost.sh: a one-node cluster on localhost
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# no cgroups: works in containers without systemd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
# sacct (the executor plugin's status query) reads job states from slurmdbd
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
$node NodeAddr=127.0.0.1 State=UNKNOWN
$parts
EOF
        put_file 0600 slurm "$CONF_DIR/slurmdbd.conf" <<EOF
# written by scripts/slurm_localhost.sh
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=slurm
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
    )
    [[ -n $changed ]]
}

start_munge() {
    [[ -f /etc/munge/munge.key ]] || { mungekey --create --keyfile /etc/munge/munge.key && chown munge:munge /etc/munge/munge.key; }
    if ! live_pid "$MUNGE_PID" munged >/dev/null; then
        install -d -o munge -g munge -m 0755 /run/munge
        runuser -u munge -- /usr/sbin/munged
    fi
    wait_for 20 munged bash -c 'munge -n | unmunge'
}

start_mariadb() {
    if ! mariadb-admin --socket="$DB_SOCKET" ping >/dev/null 2>&1; then
        install -d -o mysql -g mysql -m 0755 /run/mysqld
        setsid /usr/sbin/mariadbd --user=mysql --socket="$DB_SOCKET" --pid-file="$DB_PID" --bind-address=127.0.0.1 \
            >>"$LOG_DIR/mariadb.log" 2>&1 </dev/null &
        wait_for 60 MariaDB mariadb-admin --socket="$DB_SOCKET" ping
    fi
    # root connects through the unix socket; slurmdbd's user gets the accounting database only
    mariadb --socket="$DB_SOCKET" <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$(cat "$STATE/dbpass")';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$(cat "$STATE/dbpass")';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
}

start_slurm_daemon() {  # start_slurm_daemon NAME READY_COMMAND...
    local name=$1
    shift
    if ! live_pid "$RUN_DIR/$name.pid" "$name" >/dev/null; then
        "/usr/sbin/$name"
    fi
    wait_for 60 "$name" "$@"
}

stop_slurm_daemons() {
    local pid
    for name in slurmd slurmctld slurmdbd; do
        if pid=$(live_pid "$RUN_DIR/$name.pid" "$name"); then
            say "stopping $name ($pid)"
            kill "$pid"
            for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
    done
}

add_associations() {
    sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
    sacctmgr -n -P show account format=account | grep -qx "$ACCOUNT" ||
        sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description="fedprompt-repro local runs" >/dev/null
    sacctmgr -n -P show user format=user | grep -qx "$JOB_USER" ||
        sacctmgr -i add user "$JOB_USER" Account="$ACCOUNT" DefaultAccount="$ACCOUNT" Cluster="$CLUSTER" >/dev/null
}

node_idle() { [[ $(sinfo -h -N -o %t | sort -u) == idle ]]; }

cmd_start() {
    [[ $EUID -eq 0 ]] || die "run as root (installs packages and starts system daemons)"
    install_packages
    install -d -m 0755 "$STATE" "$LOG_DIR" "$RUN_DIR"
    install -d -o slurm -g slurm -m 0755 "$STATE/ctld" "$STATE/d"
    chown slurm:slurm "$LOG_DIR" "$RUN_DIR"
    [[ -s $STATE/dbpass ]] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$STATE/dbpass")
    if write_config; then
        say "configuration written to $CONF_DIR"
        stop_slurm_daemons
    fi
    start_munge
    start_mariadb
    start_slurm_daemon slurmdbd sacctmgr -n show cluster
    add_associations
    start_slurm_daemon slurmctld scontrol ping
    start_slurm_daemon slurmd node_idle
    sinfo
}

cmd_stop() {
    [[ $EUID -eq 0 ]] || die "run as root"
    stop_slurm_daemons
    local pid
    if pid=$(live_pid "$DB_PID" mariadbd); then
        say "stopping MariaDB ($pid)"
        mariadb-admin --socket="$DB_SOCKET" shutdown
    fi
    if pid=$(live_pid "$MUNGE_PID" munged); then
        say "stopping munged ($pid)"
        kill "$pid"
    fi
}

cmd_status() {
    local pid
    for name in slurmdbd slurmctld slurmd; do
        if pid=$(live_pid "$RUN_DIR/$name.pid" "$name"); then say "$name running ($pid)"; else say "$name stopped"; fi
    done
    sinfo 2>&1 || true
}

case ${1:-start} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) die "unknown command '$1' (expected start, stop or status)" ;;
esac
