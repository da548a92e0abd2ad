#!/usr/bin/env bash
# local-slurm.sh - a real Slurm cluster on localhost for tests/CI.
#
# fugu's copy of local-slurm.sh, taken unchanged (apart from this paragraph) from
# the workspace's shared test tools (shared/slurm/local-slurm.sh, which users do
# not have).  It carries no separate license: it is distributed with fugu under
# fugu's license (MIT OR Apache-2.0).  tests/jobscripts.rs and scripts/test.sh
# use it to submit the jobscripts/slurm/ scripts to a real Slurm; see
# docs/JOBS.md.
#
# Debian 12 (bookworm) packages: slurmctld/slurmd/slurm-client 22.05, munge,
# and (optionally) Open MPI 4.1.  Runs as root, needs no systemd and no TTY.
# Daemons run in foreground mode (-D/-F) as background processes with stdio
# sent to log files; their PIDs are kept in the state dir so `stop` only ever
# kills what `start` began.  One node by default ("localhost"); with
# LOCAL_SLURM_NODES=N it runs N slurmd's (nodes n1..nN, all on this host).
#
# Usage:
#   local-slurm.sh start      install if missing, write config, start munged +
#                             slurmctld + slurmd(s), wait until idle, print
#                             `export ...` lines on stdout (eval them)
#   local-slurm.sh stop [--purge]
#                             cancel jobs, stop the daemons it started; with
#                             --purge also delete the state dir
#   local-slurm.sh status     daemons, `scontrol ping`, sinfo, squeue
#                             (exit 0 = up and usable, 3 = not running,
#                              1 = degraded)
#   local-slurm.sh env        print the `export ...` lines again
#   local-slurm.sh wait JOBID [TIMEOUT_S]
#                             poll until the job ends; prints "ID STATE EXIT:SIG",
#                             exits with the job's exit code (124 = timeout)
#   local-slurm.sh selftest [--signal]
#                             sbatch/srun/mpirun smoke tests (+ a <=1 min
#                             --time=1 --signal=B:USR1@10 test)
#   local-slurm.sh restart    stop + start
#
#   eval "$(local-slurm.sh start)"   # progress goes to stderr, env to stdout
#
# Environment knobs (all optional; read by `start`, remembered in the state dir):
#   LOCAL_SLURM_DIR          state dir               [/tmp/local-slurm]
#   LOCAL_SLURM_NODES        number of slurmd's      [1]
#   LOCAL_SLURM_CPUS         CPUs per node           [detected by slurmd -C]
#                            (may exceed the real count: config_overrides)
#   LOCAL_SLURM_MEM_MB       RealMemory per node     [90% of detected]
#   LOCAL_SLURM_CTLD_PORT    slurmctld port          [6817]
#   LOCAL_SLURM_D_PORT       first slurmd port       [6818]
#   LOCAL_SLURM_AUTH         munge | none            [munge]
#   LOCAL_SLURM_MPI_DEFAULT  MpiDefault              [pmix if usable, else none]
#   LOCAL_SLURM_TIMEOUT      seconds to wait for each daemon / the nodes [60]
#   LOCAL_SLURM_INSTALL      1 = apt-get install missing packages, 0 = never [1]
#   LOCAL_SLURM_INSTALL_MPI  1 = also install openmpi-bin libopenmpi-dev gcc [1]
#   LOCAL_SLURM_LINK_ETC     1 = symlink /etc/slurm/slurm.conf to our config
#                            when that path is free (plain `sinfo` then works
#                            without SLURM_CONF) [1]
set -euo pipefail

PROG=local-slurm
D=${LOCAL_SLURM_DIR:-/tmp/local-slurm}
D=${D%/}
CTLD_PORT=${LOCAL_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${LOCAL_SLURM_D_PORT:-6818}
NODES=${LOCAL_SLURM_NODES:-1}
AUTH=${LOCAL_SLURM_AUTH:-munge}
TIMEOUT=${LOCAL_SLURM_TIMEOUT:-60}
DO_INSTALL=${LOCAL_SLURM_INSTALL:-1}
INSTALL_MPI=${LOCAL_SLURM_INSTALL_MPI:-1}
LINK_ETC=${LOCAL_SLURM_LINK_ETC:-1}
CONF=$D/slurm.conf
ETC_CONF=/etc/slurm/slurm.conf
MARKER=$D/.local-slurm-state-dir
LOCK=$D.lock

export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"

log()  { printf '[%s] %s\n' "$PROG" "$*" >&2; }
die()  { printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }
now()  { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (daemons run as root; apt-get needs root)"
}

is_uint() { case "$1" in ''|*[!0-9]*) return 1 ;; esac; }

# serialise start/stop/restart of the same state dir (parallel test runners)
take_lock() {
  command -v flock >/dev/null 2>&1 || return 0
  mkdir -p "$(dirname "$LOCK")"
  exec 9>"$LOCK"
  flock -w 300 9 || die "could not lock $LOCK within 300s"
}

# ---------------------------------------------------------------- bookkeeping
# Daemon "instances": munged, slurmctld, slurmd-<node>.
node_list() {  # nodes of the running/last-started cluster
  if [ -f "$D/run/nodes" ]; then cat "$D/run/nodes"; return; fi
  if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'n%g' 1 "$NODES"; fi
}
node_count() { node_list | wc -l | tr -d ' '; }

pidfile() { echo "$D/run/$1.launcher.pid"; }

inst_pattern() {  # the command line that identifies an instance we started
  case "$1" in
    munged)    echo "munged -F --socket=$D/run/munge.socket.2" ;;
    slurmctld) echo "slurmctld -D -i -f $CONF" ;;
    slurmd-*)  echo "slurmd -D -N ${1#slurmd-} -f $CONF" ;;
    *)         return 1 ;;
  esac
}

is_ours() {  # is_ours INSTANCE PID
  local pat cmd
  [ -n "$2" ] && [ -r "/proc/$2/cmdline" ] || return 1
  pat=$(inst_pattern "$1") || return 1
  cmd=$(tr '\0' ' ' <"/proc/$2/cmdline" 2>/dev/null) || return 1
  case "$cmd" in *"$pat"*) return 0 ;; esac
  return 1
}

daemon_pid() {  # prints the pid if the instance we started is alive
  local f pid; f=$(pidfile "$1")
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null || true)
  is_ours "$1" "$pid" || return 1
  echo "$pid"
}

auth_in_use() {
  if [ -f "$CONF" ] && grep -q '^AuthType=auth/none' "$CONF"; then echo none; else echo munge; fi
}

# ---------------------------------------------------------------- install
have_all() {
  local c
  for c in "$@"; do command -v "$c" >/dev/null 2>&1 || return 1; done
}

# Slurm's mpi/pmix plugin dlopen()s the unversioned libpmix.so, which Debian
# ships in libpmix-dev (pulled in by libopenmpi-dev).
pmix_usable() {
  compgen -G '/usr/lib/*/slurm-wlm/mpi_pmix*.so' >/dev/null &&
  compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null
}

install_packages() {
  local pkgs=()
  have_all slurmctld slurmd slurmstepd sbatch srun sinfo squeue scontrol scancel ||
    pkgs+=(slurmctld slurmd slurm-client)
  if [ "$AUTH" = munge ]; then have_all munged munge unmunge || pkgs+=(munge); fi
  have_all pgrep || pkgs+=(procps)   # minbase images lack it; stop needs it
  if [ "$INSTALL_MPI" = 1 ]; then
    have_all mpirun mpicc || pkgs+=(openmpi-bin libopenmpi-dev)
    compgen -G '/usr/lib/*/pmix2/lib/libpmix.so' >/dev/null || pkgs+=(libpmix-dev)
    # mpicc is only a wrapper: it needs gcc, and gcc needs libc6-dev
    have_all gcc || pkgs+=(gcc libc6-dev)
  fi
  [ ${#pkgs[@]} -eq 0 ] && return 0
  [ "$DO_INSTALL" = 1 ] || die "missing packages (${pkgs[*]}) and LOCAL_SLURM_INSTALL=0"
  command -v apt-get >/dev/null || die "apt-get not found; install ${pkgs[*]} by hand"
  local t0; t0=$(now)
  log "installing: ${pkgs[*]} (log: $D/log/apt.log)"
  # The packages ship init.d scripts: keep invoke-rc.d from starting the
  # system munge/slurm daemons (we run our own).  Only if no policy exists.
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  local aptopts=(-y -q -o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get "${aptopts[@]}" install --no-install-recommends "${pkgs[@]}" ||
    { echo "== first attempt failed; apt-get update and retry"
      DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300 update &&
      DEBIAN_FRONTEND=noninteractive apt-get "${aptopts[@]}" install --no-install-recommends "${pkgs[@]}"; }
  } >"$D/log/apt.log" 2>&1 9>&- || rc=$?
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  if [ $rc -ne 0 ]; then
    tail -n 30 "$D/log/apt.log" >&2 || true
    die "apt-get install failed (rc=$rc); full log: $D/log/apt.log"
  fi
  log "installed in $(since "$t0")s"
}

# ---------------------------------------------------------------- config
port_in_use() {
  if command -v ss >/dev/null 2>&1; then
    [ -n "$(ss -Hltn "sport = :$1" 2>/dev/null)" ]
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

write_config() {
  local hw cpus sockets cores threads mem
  hw=$(slurmd -C 2>/dev/null | head -n1) || true
  [ -n "$hw" ] || die "'slurmd -C' failed; is slurmd installed?"
  cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
  sockets=$(sed -n 's/.* SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw")
  cores=$(sed -n 's/.* CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$hw")
  threads=$(sed -n 's/.* ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$hw")
  mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
  [ -n "$cpus" ] && [ -n "$mem" ] || die "cannot parse 'slurmd -C' output: $hw"

  local node_hw overrides=""
  if [ -n "${LOCAL_SLURM_CPUS:-}" ] && [ "$LOCAL_SLURM_CPUS" != "$cpus" ]; then
    is_uint "$LOCAL_SLURM_CPUS" || die "LOCAL_SLURM_CPUS must be a number"
    node_hw="CPUs=$LOCAL_SLURM_CPUS"
    overrides="SlurmdParameters=config_overrides"
  else
    node_hw="CPUs=$cpus Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads"
  fi
  local realmem=${LOCAL_SLURM_MEM_MB:-$(( mem * 9 / 10 ))}
  is_uint "$realmem" || die "LOCAL_SLURM_MEM_MB must be a number"
  [ "$realmem" -ge 1 ] || realmem=1

  local mpidef=${LOCAL_SLURM_MPI_DEFAULT:-}
  if [ -z "$mpidef" ]; then
    if pmix_usable; then mpidef=pmix; else mpidef=none; fi
  fi

  local authlines
  case "$AUTH" in
    munge) authlines="AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/run/munge.socket.2" ;;
    none)  authlines="AuthType=auth/none
CredType=cred/none" ;;
    *) die "LOCAL_SLURM_AUTH must be munge or none (got '$AUTH')" ;;
  esac

  local nodeline
  if [ "$NODES" = 1 ]; then
    nodeline="NodeName=localhost NodeAddr=127.0.0.1 Port=$SLURMD_PORT"
  else
    nodeline="NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT-$(( SLURMD_PORT + NODES - 1 ))]"
  fi

  cat >"$CONF" <<EOF
# Generated by local-slurm.sh - test cluster on localhost, not for production.
ClusterName=local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
$authlines
StateSaveLocation=$D/spool/ctld
# %n = node name (several slurmd's may share this host)
SlurmdSpoolDir=$D/spool/%n
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmdLogFile=$D/log/slurmd-%n.log
TmpFS=$D/tmp/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.log
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=$mpidef
SwitchType=switch/none
$overrides
SlurmctldTimeout=60
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=600
KillWait=5
OverTimeLimit=0
Waittime=0
$nodeline $node_hw RealMemory=$realmem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # slurmd 22.05 always initialises a cgroup plugin, even with
  # proctrack/linuxproc + task/none; without systemd/dbus the cgroup/v2
  # plugin needs IgnoreSystemd=yes.  (CgroupPlugin=disabled is 23.02+.)
  cat >"$D/cgroup.conf" <<EOF
CgroupPlugin=autodetect
IgnoreSystemd=yes
EOF
  log "config: $CONF ($(node_count) node(s) x $node_hw RealMemory=$realmem, MpiDefault=$mpidef, auth=$AUTH)"
}

# ---------------------------------------------------------------- daemons
# launch INSTANCE OUTFILE CMD...: background process, stdio detached from caller
launch() {
  local inst=$1 out=$2; shift 2
  nohup "$@" </dev/null >>"$out" 2>&1 9>&- &   # 9 = our lock fd: don't leak it
  echo $! >"$(pidfile "$inst")"
}

fail_with_log() {  # INSTANCE MESSAGE
  local inst=$1; shift
  log "$*"
  local f
  for f in "$D/log/$inst.out" "$D/log/$inst.log" "$D/log/slurmctld.log"; do
    [ -s "$f" ] && { log "---- tail of $f ----"; tail -n 25 "$f" >&2; }
  done
  log "stopping what was started; logs stay in $D/log"
  do_stop >/dev/null 2>&1 || true
  exit 1
}

# wait_for INSTANCE DESCRIPTION CMD...: poll CMD until success, death or timeout
wait_for() {
  local inst=$1 what=$2; shift 2
  local deadline=$(( $(date +%s) + TIMEOUT ))
  while :; do
    if "$@" >/dev/null 2>&1; then return 0; fi
    daemon_pid "$inst" >/dev/null || fail_with_log "$inst" "$inst exited while waiting for $what"
    [ "$(date +%s)" -lt "$deadline" ] || fail_with_log "$inst" "timed out after ${TIMEOUT}s waiting for $what"
    sleep 0.3
  done
}

munge_ok() {
  munge -n -S "$D/run/munge.socket.2" | unmunge -S "$D/run/munge.socket.2"
}

node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }

nodes_usable() {  # every node of ours is idle/mixed/allocated/completing
  local states n
  states=$(node_states) || return 1
  for n in $(node_list); do
    case "$(awk -v n="$n" '$1==n{print $2}' <<<"$states")" in
      idle|mixed|allocated|completing) ;;
      *) return 1 ;;
    esac
  done
}

print_env() {
  cat <<EOF
export SLURM_CONF=$CONF
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_tcp_if_include=lo
export OMPI_MCA_oob_tcp_if_include=lo
EOF
  # emulated nodes share one host: Open MPI's shared-memory BTL (vader)
  # would collide between "nodes", so use TCP over loopback only
  if [ "$(node_count)" -gt 1 ]; then echo "export OMPI_MCA_btl=self,tcp"; fi
}

do_start() {
  need_root
  is_uint "$NODES" && [ "$NODES" -ge 1 ] || die "LOCAL_SLURM_NODES must be >= 1"
  take_lock
  local t0; t0=$(now)
  local params="nodes=$NODES cpus=${LOCAL_SLURM_CPUS:-} mem=${LOCAL_SLURM_MEM_MB:-} auth=$AUTH mpi=${LOCAL_SLURM_MPI_DEFAULT:-} ports=$CTLD_PORT/$SLURMD_PORT"
  if [ -f "$MARKER" ] && daemon_pid slurmctld >/dev/null; then
    export SLURM_CONF=$CONF
    local n all=1
    for n in $(node_list); do daemon_pid "slurmd-$n" >/dev/null || all=0; done
    if [ "$(cat "$D/run/params" 2>/dev/null)" != "$params" ]; then
      all=0; log "running cluster in $D has other settings; restarting it"
    fi
    if [ "$all" = 1 ] && nodes_usable; then
      log "already running (state dir $D): $(node_states | tr '\n' ' ')"
      print_env
      return 0
    fi
    log "cluster in $D is not healthy; restarting it"
  fi
  if [ -f "$MARKER" ]; then do_stop >/dev/null 2>&1 || true; fi

  # a fresh state every start: a test cluster must not inherit old jobs
  if [ -e "$D" ]; then
    if [ -f "$MARKER" ]; then
      rm -rf "$D"
    elif [ -n "$(ls -A "$D" 2>/dev/null)" ]; then
      die "$D exists, is not empty and is not a local-slurm state dir; set LOCAL_SLURM_DIR"
    fi
  fi
  mkdir -p "$D/run" "$D/log" "$D/spool/ctld" "$D/munge" "$D/jobs" "$D/tmp"
  touch "$MARKER"
  echo "$params" >"$D/run/params"
  chmod 755 "$D" "$D/run" "$D/log" "$D/spool" "$D/jobs"
  chmod 1777 "$D/tmp"
  chmod 700 "$D/munge"
  if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'n%g' 1 "$NODES"; fi >"$D/run/nodes"
  local n
  for n in $(node_list); do
    mkdir -p "$D/spool/$n" "$D/tmp/$n"; chmod 1777 "$D/tmp/$n"
  done

  install_packages

  getent hosts localhost >/dev/null || die "'localhost' does not resolve (check /etc/hosts)"
  local p
  for p in "$CTLD_PORT" $(seq "$SLURMD_PORT" $(( SLURMD_PORT + NODES - 1 ))); do
    if port_in_use "$p"; then
      die "TCP port $p is already in use (another slurmctld/slurmd?); set LOCAL_SLURM_CTLD_PORT / LOCAL_SLURM_D_PORT"
    fi
  done

  write_config
  export SLURM_CONF=$CONF

  if [ "$AUTH" = munge ]; then
    head -c 1024 /dev/urandom >"$D/munge/munge.key"
    chmod 400 "$D/munge/munge.key"
    launch munged "$D/log/munged.log" munged -F \
      --socket="$D/run/munge.socket.2" --key-file="$D/munge/munge.key" \
      --pid-file="$D/run/munged.pid" --seed-file="$D/munge/munged.seed" \
      --log-file="$D/log/munged.log" --num-threads=2
    wait_for munged "munged to answer" munge_ok
    log "munged up (pid $(daemon_pid munged))"
  fi

  launch slurmctld "$D/log/slurmctld.out" slurmctld -D -i -f "$CONF"
  wait_for slurmctld "slurmctld to answer 'scontrol ping'" scontrol ping
  log "slurmctld up (pid $(daemon_pid slurmctld))"

  for n in $(node_list); do
    launch "slurmd-$n" "$D/log/slurmd-$n.out" slurmd -D -N "$n" -f "$CONF"
  done
  for n in $(node_list); do
    wait_for "slurmd-$n" "node $n to become idle" nodes_usable
  done
  log "slurmd up: $(node_states | tr '\n' ' ')"

  if [ "$LINK_ETC" = 1 ]; then
    if [ ! -e "$ETC_CONF" ] && [ ! -L "$ETC_CONF" ]; then
      mkdir -p "$(dirname "$ETC_CONF")" && ln -s "$CONF" "$ETC_CONF" && touch "$D/run/etc-link"
      log "linked $ETC_CONF -> $CONF"
    elif [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ]; then
      touch "$D/run/etc-link"
    else
      log "note: $ETC_CONF exists and is not ours; export SLURM_CONF=$CONF"
    fi
  fi
  print_env >"$D/env.sh"
  log "ready in $(since "$t0")s; env also in $D/env.sh"
  print_env
}

# stop_daemon INSTANCE: TERM, wait up to 15 s, KILL
stop_daemon() {
  local inst=$1 pid
  pid=$(daemon_pid "$inst") || { rm -f "$(pidfile "$inst")"; return 0; }
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 75); do
    is_ours "$inst" "$pid" || break
    sleep 0.2
  done
  if is_ours "$inst" "$pid"; then
    log "$inst (pid $pid) ignored SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
  wait "$pid" 2>/dev/null || true
  rm -f "$(pidfile "$inst")"
  log "stopped $inst (pid $pid)"
}

# slurmstepd processes of our slurmd's keep $D/log/slurmd-*.log open (their
# environ is overwritten by the process title, so look at their fds)
our_stepds() {
  local p f
  for p in $(pgrep -x slurmstepd 2>/dev/null || true); do
    for f in /proc/"$p"/fd/*; do
      case "$(readlink "$f" 2>/dev/null)" in
        "$D/"*) echo "$p"; break ;;
      esac
    done
  done
}

do_stop() {
  need_root
  take_lock
  if [ ! -f "$MARKER" ]; then
    log "nothing to stop ($D is not a local-slurm state dir)"
    return 0
  fi
  export SLURM_CONF=$CONF
  if daemon_pid slurmctld >/dev/null; then
    local jobs
    jobs=$(squeue -h -o '%A' 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      log "cancelling jobs: $(echo $jobs)"
      scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 60); do
        [ -z "$(squeue -h -o '%A' 2>/dev/null)" ] && break
        sleep 0.3
      done
    fi
  fi
  local f inst
  for f in "$D"/run/slurmd-*.launcher.pid; do
    [ -e "$f" ] || continue
    inst=$(basename "$f" .launcher.pid)
    stop_daemon "$inst"
  done
  stop_daemon slurmctld
  stop_daemon munged
  local left
  left=$(our_stepds)
  if [ -n "$left" ]; then
    log "killing leftover slurmstepd: $(echo $left)"
    kill -TERM $left 2>/dev/null || true
    sleep 1
    left=$(our_stepds)
    if [ -n "$left" ]; then kill -KILL $left 2>/dev/null || true; fi
  fi
  if [ -f "$D/run/etc-link" ]; then
    if [ -L "$ETC_CONF" ] && [ "$(readlink "$ETC_CONF")" = "$CONF" ]; then rm -f "$ETC_CONF"; fi
    rm -f "$D/run/etc-link"
  fi
  if [ "${1:-}" = --purge ]; then
    rm -rf "$D"
    log "removed $D"
  else
    log "stopped; logs kept in $D/log (use 'stop --purge' to delete $D)"
  fi
}

do_status() {
  local rc=0 inst pid running=0 n=0 insts
  if [ ! -f "$MARKER" ]; then echo "no local-slurm state dir at $D (not started)"; return 3; fi
  insts="slurmctld"
  [ "$(auth_in_use)" = munge ] && insts="munged $insts"
  for n in $(node_list); do insts="$insts slurmd-$n"; done
  n=0
  for inst in $insts; do
    n=$((n+1))
    if pid=$(daemon_pid "$inst"); then
      echo "$inst: running (pid $pid)"; running=$((running+1))
    else
      echo "$inst: not running"
    fi
  done
  if [ "$running" -eq 0 ]; then echo "state dir: $D (cluster not running)"; return 3; fi
  export SLURM_CONF=$CONF
  echo "SLURM_CONF=$CONF"
  scontrol ping 2>&1 || rc=1
  sinfo -N -o '%N %T %c %m %E' 2>&1 || rc=1
  squeue 2>&1 || rc=1
  [ "$running" -eq "$n" ] || rc=1
  nodes_usable || rc=1
  return $rc
}

# ---------------------------------------------------------------- wait
# wait_job JOBID [TIMEOUT_S]: poll (0.25 s) until the job has finished; print
# "JOBID STATE EXIT:SIG" and return the job's exit code (1 if it failed without
# one, 124 on timeout).  Much faster than `sbatch --wait`, which polls after
# 2 s, then 8 s, then every 32 s.
wait_job() {
  local jid=${1:-} limit=${2:-600} line state ec t0 rc
  [ -n "$jid" ] || die "usage: $0 wait JOBID [TIMEOUT_S]"
  export SLURM_CONF=$CONF
  t0=$(date +%s)
  while :; do
    line=$(scontrol -o show job "$jid" 2>/dev/null || true)
    [ -n "$line" ] || { echo "$jid UNKNOWN -"; return 1; }
    state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$line")
    case "$state" in
      PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED|REQUEUED|RESIZING|SIGNALING|STAGE_OUT|"") ;;
      *) break ;;
    esac
    if [ $(( $(date +%s) - t0 )) -ge "$limit" ]; then echo "$jid $state timeout"; return 124; fi
    sleep 0.25
  done
  ec=$(sed -n 's/.* ExitCode=\([0-9]*:[0-9]*\).*/\1/p' <<<"$line")
  echo "$jid $state ${ec:-?}"
  rc=${ec%%:*}
  if [ "$state" = COMPLETED ]; then return "${rc:-0}"; fi
  if [ -n "$rc" ] && [ "$rc" != 0 ]; then return "$rc"; fi
  return 1
}

# ---------------------------------------------------------------- selftest
do_selftest() {
  export SLURM_CONF=$CONF
  eval "$(print_env)"
  nodes_usable || die "cluster not up (run: $0 start)"
  local J=$D/jobs ok=0 bad=0 out jid nn np cpn
  nn=$(node_count)
  cpn=$(sinfo -h -N -o '%c' 2>/dev/null | sort -n | head -n1)
  if [ "${cpn:-1}" -ge 2 ]; then np=$(( 2 * nn )); else np=$nn; fi
  mkdir -p "$J"
  check() {  # check NAME CMD...
    local name=$1 t0; shift
    t0=$(now)
    if out=$("$@" 2>&1); then
      ok=$((ok+1)); log "PASS $name ($(since "$t0")s)"
    else
      bad=$((bad+1)); log "FAIL $name ($(since "$t0")s)"; printf '%s\n' "$out" | tail -n 25 >&2
    fi
  }
  t_wrap() {
    jid=$(sbatch --parsable -o "$J/wrap-%j.out" --wrap 'hostname; echo ok-$SLURM_JOB_ID') || return 1
    wait_job "$jid" 60 && grep -qx "ok-$jid" "$J/wrap-$jid.out"
  }
  t_srun() {
    local o want; o=$(timeout 60 srun -N "$nn" -n "$np" bash -c 'echo task-$SLURM_PROCID') || return 1
    want=$(seq -f 'task-%g' 0 $(( np - 1 )) | sort | tr '\n' ' ')
    [ "$(printf '%s\n' "$o" | sort | tr '\n' ' ')" = "$want" ] || { echo "got: $o"; return 1; }
  }
  t_mpirun() {
    cat >"$J/mpi.sbatch" <<EOF
#!/bin/bash
#SBATCH -N $nn
#SBATCH -n $np
#SBATCH -o $J/mpi-%j.out
mpirun -np $np $J/hello
EOF
    jid=$(sbatch --parsable "$J/mpi.sbatch") || return 1
    wait_job "$jid" 120 || { cat "$J/mpi-$jid.out" 2>/dev/null; return 1; }
    [ "$(grep -c "allreduce=$np" "$J/mpi-$jid.out")" = "$np" ] || { cat "$J/mpi-$jid.out"; return 1; }
  }
  t_srun_pmix() {
    local o; o=$(timeout 60 srun --mpi=pmix -N "$nn" -n "$np" "$J/hello") || { echo "$o"; return 1; }
    [ "$(printf '%s\n' "$o" | grep -c "allreduce=$np")" = "$np" ] || { echo "$o"; return 1; }
  }
  t_signal() {
    cat >"$J/sig.sbatch" <<'EOF'
#!/bin/bash
start=$(date +%s)
trap 'echo "USR1 +$(( $(date +%s) - start ))s"; exit 0' USR1
while :; do sleep 1 & wait $!; done
EOF
    jid=$(sbatch --parsable --time=1 --signal=B:USR1@10 -o "$J/sig-%j.out" "$J/sig.sbatch") || return 1
    wait_job "$jid" 150 || { cat "$J/sig-$jid.out"; return 1; }
    cat "$J/sig-$jid.out"; grep -q '^USR1 ' "$J/sig-$jid.out"
  }

  check "sbatch --wrap writes its output file" t_wrap
  check "srun -N $nn -n $np" t_srun
  if command -v mpicc >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1; then
    cat >"$J/hello.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
  int rank, size, one = 1, sum = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  printf("rank %d/%d allreduce=%d\n", rank, size, sum);
  MPI_Finalize();
  return sum == size ? 0 : 1;
}
EOF
    check "mpicc hello.c" mpicc -O1 -o "$J/hello" "$J/hello.c"
    check "mpirun -np $np inside sbatch -N $nn" t_mpirun
    if pmix_usable; then check "srun --mpi=pmix -N $nn -n $np (Open MPI app)" t_srun_pmix; fi
  else
    log "SKIP MPI checks (mpicc or gcc not installed)"
  fi
  if [ "${1:-}" = --signal ]; then
    check "sbatch --time=1 --signal=B:USR1@10 reaches the batch script" t_signal
  fi
  log "selftest: $ok ok, $bad bad"
  [ "$bad" -eq 0 ]
}

case "${1:-}" in
  start)    do_start ;;
  stop)     do_stop "${2:-}" ;;
  restart)  do_stop; do_start ;;
  status)   do_status ;;
  env)      [ -f "$MARKER" ] || die "not started (no state dir $D)"; print_env ;;
  wait)     shift; wait_job "$@" ;;
  selftest) do_selftest "${2:-}" ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2 ;;
esac
