#!/usr/bin/env bash
# local-pjsub.sh: a small local stand-in for Fujitsu's pjsub (Fugaku's job scheduler, which has
# no open-source equivalent), to run fugu's jobscripts/pjsub/ scripts on any Linux machine with
# Open MPI. It is a test tool, not a scheduler: the job runs at once, in the foreground.
#
#   local-pjsub.sh [pjsub options] SCRIPT
#   local-pjsub.sh --install-shims     # create the shims, print their folder (put it in PATH to
#                                      # run a script that calls pjsub, e.g. scaling-sweep.sh,
#                                      # chain.sh)
#
# What it does, like pjsub as far as public documentation tells (docs/JOBS.md):
#   * reads the `#PJM` lines at the top of SCRIPT, then the command-line options (which win);
#     it knows -L (node, rscgrp, elapse, freq, eco_state, ...), --mpi (proc, max-proc-per-node,
#     ...), -g, -x VAR=value, -X, -j, -s, -S, --name/-N, -o, -e, --spath, --step, --sparam
#     (jid=, sn=, sd=), --llio (sharedtmp-size=, localtmp-size=, ...), -z jid, -m, --mail-list,
#     and rejects anything else and malformed values;
#   * prints "[INFO] PJM 0000 pjsub Job ID submitted." (ID_STEP for --step jobs), or only the
#     id with -z jid;
#   * step jobs: `--step` starts one (ID_0, or ID_SN with --sparam sn=SN), `--step --sparam
#     "jid=ID[,sn=SN][,sd=FORM:TYPE[:STEPNO]]"` adds a sub-job. FORM is ec or pc (exit code, PJM
#     code) with ==, !=, <, >, <=, >= and a number; it is tested on sub-job STEPNO (default: the
#     previous one). When it holds the new sub-job is deleted instead of run, and with TYPE
#     `after` or `all` every later sub-job of the step job too (TYPE `one`: only this one). Since
#     the stand-in runs each job at once, the earlier sub-jobs have always ended by then;
#   * runs a copy of SCRIPT (as PJM does) with bash, in the current directory, in a clean
#     environment: PATH, HOME, USER, LANG, TMPDIR, the OMPI_* variables (site settings), the
#     -x variables (everything with -X), and PJM_JOBID, PJM_JOBNAME, PJM_O_WORKDIR, PJM_MPI_PROC,
#     PJM_NODE, PJM_PROC_BY_NODE, PJM_RSCGRP, PJM_LOCALTMP and PJM_SHAREDTMP. PJM_ELAPSE_LIMIT
#     is not set (no public source shows PJM setting it) unless LOCAL_PJSUB_ELAPSE_VAR=1;
#   * puts a shim folder first in PATH: `mpiexec` (-> `mpirun -np N`; -ofout/-stdout FILE puts
#     the ranks' stdout in FILE, other Fugaku-only output options such as -of/-std-proc are
#     dropped), `llio_transfer` (checks the files exist and fit in the job's --llio
#     sharedtmp-size x nodes, else fails with "LLIO 2450 Not enough disk space"; caches
#     nothing), `pjstat` (the English job list, START_DATE in two fields, for the running
#     jobs), `pjwait` (returns at once: the job has already ended) and `pjsub` (this
#     script, for jobs and login-node scripts that submit jobs);
#   * writes stdout to NAME.ID.out (stderr to NAME.ID.err unless -j) and, with -s/-S, a small
#     NAME.ID.stats with the PJM code (0, or 11 when the elapse limit was exceeded), the exit
#     code and the power knobs (freq, eco_state) the job asked for;
#   * kills the job at its elapse limit (SIGTERM, SIGKILL 10 s later), as PJM does.
#
# Exit status: the job script's exit status (124 when the elapse limit killed it). When called
# as `pjsub` from inside a job (LOCAL_PJSUB_EXIT=submit) it returns 0 once the job has run, as a
# real submission does.
#
# Environment: LOCAL_PJSUB_DIR (state: job-id counter, script copies, shims; default
# /tmp/local-pjsub), LOCAL_PJSUB_MPIRUN_ARGS (extra mpirun options; default --oversubscribe),
# LOCAL_PJSUB_COPY (1 = run a copy of the script, as PJM does; 0 = run it in place).
set -euo pipefail

PROG=local-pjsub
SELF=$(cd "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)/$(basename -- "${BASH_SOURCE[0]}")
D=${LOCAL_PJSUB_DIR:-/tmp/local-pjsub}
die() { printf '[%s] ERROR: %s\n' "$PROG" "$*" >&2; exit 2; }
note() { printf '[%s] %s\n' "$PROG" "$*" >&2; }

is_uint() { case "$1" in '' | *[!0-9]*) return 1 ;; esac; }

# pjsub's elapse: [[H:]M:]S (also "unlimited" is refused here)
elapse_seconds() {
  local t=$1 h=0 m=0 s=0
  case "$t" in
    *:*:*) IFS=: read -r h m s <<<"$t" ;;
    *:*) IFS=: read -r m s <<<"$t" ;;
    *) s=$t ;;
  esac
  is_uint "$h" && is_uint "$m" && is_uint "$s" || return 1
  echo $(( (10#$h * 60 + 10#$m) * 60 + 10#$s ))
}

# ------------------------------------------------------------------------------ shims
make_shims() {  # the shim folder put first in the job's PATH
  local shim=$D/shim
  mkdir -p "$shim"
  cat >"$shim/mpiexec" <<'EOF'
#!/usr/bin/env bash
# local-pjsub shim: Fujitsu mpiexec -> Open MPI mpirun
set -euo pipefail
np=${PJM_MPI_PROC:-1}
out=
while [ $# -gt 0 ]; do
  case "$1" in
    -n | -np) np=$2; shift 2 ;;
    # -ofout FILE: the standard output of all ranks in FILE, as Fujitsu mpiexec does
    -ofout | -stdout) out=$2; shift 2 ;;
    -of | -of-proc | -std | -std-proc | -stdout-proc | -stderr | -stderr-proc | \
    -ofout-proc | -oferr | -oferr-proc | -stdin | -vcoordfile | -mca)
      echo "[local-pjsub mpiexec] dropping Fugaku option $1 $2" >&2; shift 2 ;;
    --) shift; break ;;
    -*) echo "[local-pjsub mpiexec] unknown mpiexec option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
read -r -a extra <<<"${LOCAL_PJSUB_MPIRUN_ARGS---oversubscribe}"
if [ -n "$out" ]; then exec mpirun -np "$np" "${extra[@]}" "$@" >"$out"; fi
exec mpirun -np "$np" "${extra[@]}" "$@"
EOF
  cat >"$shim/llio_transfer" <<'EOF'
#!/usr/bin/env bash
# local-pjsub shim: llio_transfer caches nothing here, but fails like the real one on a
# missing file
purge=0
[ "${1:-}" = --purge ] && { purge=1; shift; }
bytes=0
for f in "$@"; do
  [ -e "$f" ] || { echo "llio_transfer: $f: No such file or directory" >&2; exit 1; }
  bytes=$(( bytes + $(stat -c %s -- "$f") ))
done
room=$(( ${LOCAL_PJSUB_SHAREDTMP_BYTES:-0} * ${PJM_NODE:-1} ))
if [ $purge = 0 ] && [ "$bytes" -gt "$room" ]; then
  echo "[ERR.] LLIO 2450 Not enough disk space ($bytes bytes to transfer, --llio sharedtmp-size gives $room; local-pjsub model)" >&2
  exit 1
fi
if [ $purge = 1 ]; then what=purged; else what=transferred; fi
echo "[local-pjsub llio_transfer] $what (nothing cached locally): $*" >&2
EOF
  cat >"$shim/pjstat" <<EOF
#!/usr/bin/env bash
# local-pjsub shim: pjstat [JOBID...], the English job list of the running stand-in jobs, with
# START_DATE printed as two fields (MM/DD HH:MM:SS) under one header name, like PJM's pjstat
D=$(printf %q "$D")
EOF
  cat >>"$shim/pjstat" <<'EOF'
echo "  ACCEPT QUEUED  STGIN  READY RUNING RUNOUT STGOUT   HOLD  ERROR   TOTAL"
echo
printf '%-10s %-10s %-2s %-3s %-8s %-15s %-10s %s\n' JOB_ID JOB_NAME MD ST USER START_DATE ELAPSE_LIM NODE_REQUIRE
for f in "$D"/jobs/*/running; do
  [ -f "$f" ] || continue
  read -r id name start elapse nodes <"$f"
  if [ $# -gt 0 ]; then
    case " $* " in *" $id "*) ;; *) continue ;; esac
  fi
  lim=$(printf '%04d:%02d:%02d' $(( elapse / 3600 )) $(( elapse % 3600 / 60 )) $(( elapse % 60 )))
  printf '%-10s %-10s %-2s %-3s %-8s %-15s %-10s %s\n' "$id" "${name:0:10}" NM RUN "${USER:-user}" \
    "$(date -d "@$start" '+%m/%d %H:%M:%S')" "$lim" "$nodes"
done
EOF
  cat >"$shim/pjwait" <<EOF
#!/usr/bin/env bash
# local-pjsub shim: pjwait JOBID... returns at once (the stand-in has already run the job)
D=$(printf %q "$D")
EOF
  cat >>"$shim/pjwait" <<'EOF'
[ $# -ge 1 ] || { echo "usage: pjwait JOBID..." >&2; exit 2; }
for j in "$@"; do
  [ -d "$D/jobs/$j" ] || { echo "pjwait: job $j is unknown" >&2; exit 1; }
done
echo "[local-pjsub pjwait] $* ended" >&2
EOF
  printf '#!/usr/bin/env bash\nLOCAL_PJSUB_EXIT=submit exec %q "$@"\n' "$SELF" >"$shim/pjsub"
  chmod 755 "$shim/mpiexec" "$shim/llio_transfer" "$shim/pjsub" "$shim/pjstat" "$shim/pjwait"
}

if [ "${1:-}" = --install-shims ]; then
  make_shims
  echo "$D/shim"
  exit 0
fi

# ------------------------------------------------------------------------------ options
node=1 node_shape=1 proc='' mppn='' elapse='' rscgrp='' group='' name='' merge=0 stats=0 export_all=0
out='' err='' spath='' step=0 sparam='' zjid=0 freq='' eco_state='' sharedtmp_bytes=0
pos_int() { is_uint "$1" && [ "$1" -ge 1 ]; }
has_arg() { [ $# -ge 2 ] && [ -n "$2" ]; }
xvars=()

set_rsc() {  # -L key=value[,key=value...]
  local item key val
  local IFS=,
  for item in $1; do
    item=${item# }
    key=${item%%=*}
    val=${item#*=}
    [ "$key" != "$item" ] || die "-L $1: '$item' is not key=value"
    case "$key" in
      node)
        # N, AxB, AxBxC, optionally :torus/:mesh/:noncont
        node_shape=${val%%:*}
        case "${val#"$node_shape"}" in '' | :torus | :mesh | :noncont) ;; *) die "-L node=$val: bad allocation mode" ;; esac
        node=1
        local dim
        for dim in ${node_shape//x/,}; do
          pos_int "$dim" || die "-L node=$val: not a node count or shape"
          node=$(( node * dim ))
        done ;;
      elapse) elapse_seconds "$val" >/dev/null || die "-L elapse=$val: expected [[H:]M:]S"; elapse=$val ;;
      rscgrp) [ -n "$val" ] || die "-L rscgrp= is empty"; rscgrp=$val ;;
      freq) case "$val" in 2000 | 2200) freq=$val ;; *) die "-L freq=$val: expected MHz (2000, 2200)" ;; esac ;;
      eco_state) case "$val" in 0 | 1 | 2) eco_state=$val ;; *) die "-L eco_state=$val: expected 0, 1 or 2" ;; esac ;;
      rscunit | proc-core | jobenv | retention_state) ;;
      *) die "-L $key: unknown resource" ;;
    esac
  done
}

set_mpi() {  # --mpi key[=value][,...]
  local item key val
  local IFS=,
  for item in $1; do
    item=${item# }
    key=${item%%=*}
    val=${item#*=}
    case "$key" in
      proc) pos_int "$val" || die "--mpi proc=$val: expected a positive number"; proc=$val ;;
      max-proc-per-node) pos_int "$val" || die "--mpi max-proc-per-node=$val: expected a positive number"; mppn=$val ;;
      shape | rank-map-bynode | rank-map-bychip | rank-map-hostfile | assign-online-node) ;;
      *) die "--mpi $key: unknown MPI option" ;;
    esac
  done
}

size_bytes() {  # 512Mi, 1Gi, 1024 (MiB) -> bytes
  local v=${1%B}
  case "$v" in
    *Ki) is_uint "${v%Ki}" && echo $(( ${v%Ki} * 1024 )) ;;
    *Mi) is_uint "${v%Mi}" && echo $(( ${v%Mi} * 1048576 )) ;;
    *Gi) is_uint "${v%Gi}" && echo $(( ${v%Gi} * 1073741824 )) ;;
    *Ti) is_uint "${v%Ti}" && echo $(( ${v%Ti} * 1099511627776 )) ;;
    *) is_uint "$v" && echo $(( v * 1048576 )) ;;
  esac
}

set_llio() {  # --llio key=value[,...]
  local item key val
  local IFS=,
  for item in $1; do
    item=${item# }
    key=${item%%=*}
    val=${item#*=}
    [ "$key" != "$item" ] || die "--llio $1: '$item' is not key=value"
    case "$key" in
      sharedtmp-size) sharedtmp_bytes=$(size_bytes "$val") || die "--llio sharedtmp-size=$val: expected a size such as 512Mi or 1Gi" ;;
      localtmp-size) size_bytes "$val" >/dev/null || die "--llio localtmp-size=$val: expected a size such as 512Mi or 1Gi" ;;
      sio-read-cache | stripe-count | stripe-size | async-close | auto-readahead | cn-cache-size | cn-read-cache | cn-cached-write-size | perf | perf-path | uncompleted-fileclose | sio-write-cache) ;;
      *) die "--llio $key: unknown LLIO option" ;;
    esac
  done
}

parse_opt() {  # parse_opt OPTION [ARG]: returns how many words it used in OPT_USED
  local o=$1
  OPT_USED=2
  case "$o" in
    -L | --rsc-list) [ $# -ge 2 ] || die "$o needs an argument"; set_rsc "$2" ;;
    --mpi) [ $# -ge 2 ] || die "$o needs an argument"; set_mpi "$2" ;;
    -g) has_arg "$@" || die "-g needs a group"; group=$2 ;;
    -x)
      [ $# -ge 2 ] || die "-x needs VAR=value"
      local item
      local IFS=,
      for item in $2; do
        case "$item" in
          [A-Za-z_]*=*) ;;
          *) die "-x $2: '$item' is not VAR=value" ;;
        esac
        xvars+=("$item")
      done ;;
    -X) export_all=1; OPT_USED=1 ;;
    -j) merge=1; OPT_USED=1 ;;
    -s) stats=1; OPT_USED=1 ;;
    -S) stats=2; OPT_USED=1 ;;
    --name | -N) has_arg "$@" || die "$o needs a name"; [ ${#2} -le 63 ] || die "job name longer than 63 bytes"; name=$2 ;;
    -o) [ $# -ge 2 ] || die "-o needs a file"; out=$2 ;;
    -e) [ $# -ge 2 ] || die "-e needs a file"; err=$2 ;;
    --spath) [ $# -ge 2 ] || die "--spath needs a file"; spath=$2 ;;
    --step) step=1; OPT_USED=1 ;;
    --sparam) [ $# -ge 2 ] || die "--sparam needs an argument"; sparam=$2 ;;
    --llio) [ $# -ge 2 ] || die "--llio needs an argument"; set_llio "$2" ;;
    -z) [ $# -ge 2 ] || die "-z needs an argument (jid)"; [ "$2" = jid ] || die "-z $2: only '-z jid' is supported"; zjid=1 ;;
    -m | --mail-list) [ $# -ge 2 ] || die "$o needs an argument" ;;
    *) die "unsupported pjsub option '$o'" ;;
  esac
}

# The script is the first argument that is not an option or an option's argument.
args=("$@")
script=
i=0
cli=()
while [ $i -lt ${#args[@]} ]; do
  a=${args[$i]}
  case "$a" in
    -X | -j | -s | -S | --step) cli+=("$a"); i=$((i + 1)) ;;
    -*) [ $((i + 1)) -lt ${#args[@]} ] || die "$a needs an argument"
        cli+=("$a" "${args[$((i + 1))]}"); i=$((i + 2)) ;;
    *) script=$a; i=$((i + 1)); break ;;
  esac
done
[ -n "$script" ] || die "usage: $0 [pjsub options] SCRIPT"
[ $i -eq ${#args[@]} ] || die "arguments after the script are not supported: ${args[*]:$i}"
[ -f "$script" ] || die "$script: no such file"

# Directives: the #PJM lines of the leading comment block.
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in
    '#PJM'[[:space:]]*)
      rest=${line#'#PJM'}
      # shell-like word splitting with quotes, without evaluating anything
      mapfile -t words < <(xargs -n 1 printf '%s\n' <<<"$rest") || die "cannot parse '$line'"
      j=0
      while [ $j -lt ${#words[@]} ]; do
        if [ $((j + 1)) -lt ${#words[@]} ]; then
          parse_opt "${words[$j]}" "${words[$((j + 1))]}"
        else
          parse_opt "${words[$j]}"
        fi
        j=$((j + OPT_USED))
      done ;;
    '#'* | '') ;;
    *) break ;;
  esac
done <"$script"

j=0
while [ $j -lt ${#cli[@]} ]; do
  if [ $((j + 1)) -lt ${#cli[@]} ]; then parse_opt "${cli[$j]}" "${cli[$((j + 1))]}"; else parse_opt "${cli[$j]}"; fi
  j=$((j + OPT_USED))
done

# Consistency, as PJM would check it.
[ -n "$mppn" ] || mppn=${proc:+$(( (proc + node - 1) / node ))}
[ -n "$mppn" ] || mppn=1
[ -n "$proc" ] || proc=$(( node * mppn ))
[ "$mppn" -le 48 ] || die "--mpi max-proc-per-node=$mppn: an A64FX node has 48 cores"
[ "$proc" -le $(( node * mppn )) ] || die "--mpi proc=$proc does not fit node=$node x max-proc-per-node=$mppn"
[ -n "$elapse" ] || die "no elapse limit (-L elapse=...)"
elapse_s=$(elapse_seconds "$elapse")
[ -n "$group" ] || note "no -g group: pjsub on Fugaku refuses jobs without one"

# ------------------------------------------------------------------------------ job id, shims
mkdir -p "$D/jobs" "$D/shim"
exec 8>"$D/lock"
flock 8
id=$(( $(cat "$D/next-id" 2>/dev/null || echo 1000) + 1 ))
echo "$id" >"$D/next-id"
flock -u 8
exec 8>&-
jid=$id
deleted=''
[ -z "$sparam" ] || [ "$step" = 1 ] || die "--sparam needs --step"
if [ "$step" = 1 ]; then
  sp_jid='' sp_sn='' sp_sd=''
  IFS=, read -r -a items <<<"$sparam"
  for item in "${items[@]}"; do
    item=${item// /}
    case "$item" in
      jid=*) sp_jid=${item#jid=}; is_uint "$sp_jid" || die "--sparam jid=$sp_jid: not a job id" ;;
      sn=*) sp_sn=${item#sn=}; is_uint "$sp_sn" || die "--sparam sn=$sp_sn: not a step number" ;;
      sd=*) sp_sd=${item#sd=} ;;
      '') ;;
      *) die "--sparam: unknown item '$item' (jid=, sn=, sd=)" ;;
    esac
  done
  if [ -z "$sp_jid" ]; then
    # a new step job: sub-job SN (default 0)
    [ -z "$sp_sd" ] || die "--sparam sd= needs jid= (the first sub-job has nothing to depend on)"
    parent=$id
  else
    parent=$sp_jid
    [ -d "$D/jobs/step-$parent" ] || die "--sparam jid=$parent: no such step job"
  fi
  sdir=$D/jobs/step-$parent
  mkdir -p "$sdir"
  last=$(cat "$sdir/last" 2>/dev/null || echo -1)
  sn=${sp_sn:-$(( last + 1 ))}
  [ "$sn" -gt "$last" ] || die "--sparam sn=$sn: step numbers must grow (the last one is $last)"
  jid=${parent}_$sn
  if [ -n "$sp_sd" ]; then
    # sd=FORM:TYPE[:STEPNO], checked at submission
    IFS=: read -r form dtype dstep <<<"$sp_sd"
    case "$dtype" in one | after | all) ;; *) die "--sparam sd=$sp_sd: the deletion type must be one, after or all" ;; esac
    [ -n "$dstep" ] || dstep=$last
    is_uint "$dstep" || die "--sparam sd=$sp_sd: '$dstep' is not a step number"
    [[ "$form" =~ ^(ec|pc)(==|!=|<=|>=|<|>)([0-9]+)$ ]] || die "--sparam sd=$sp_sd: expected ec or pc, an operator (== != < > <= >=) and a number"
    what=${BASH_REMATCH[1]} op=${BASH_REMATCH[2]} want=${BASH_REMATCH[3]}
  fi
  echo "$sn" >"$sdir/last"
  if [ -f "$sdir/deleted" ]; then
    deleted="every later sub-job was deleted after $(cat "$sdir/deleted")"
  elif [ -n "$sp_sd" ]; then
    [ -f "$sdir/$what.$dstep" ] || die "--sparam sd=$sp_sd: sub-job ${parent}_$dstep has not run in this stand-in"
    got=$(cat "$sdir/$what.$dstep")
    holds=0
    if [ "$got" = deleted ]; then
      holds=1
    else
      case "$op" in
        '==') [ "$got" -eq "$want" ] && holds=1 ;;
        '!=') [ "$got" -ne "$want" ] && holds=1 ;;
        '<') [ "$got" -lt "$want" ] && holds=1 ;;
        '>') [ "$got" -gt "$want" ] && holds=1 ;;
        '<=') [ "$got" -le "$want" ] && holds=1 ;;
        '>=') [ "$got" -ge "$want" ] && holds=1 ;;
      esac
    fi
    if [ "$holds" = 1 ]; then
      deleted="sd=$sp_sd holds ($what of ${parent}_$dstep is $got)"
      [ "$dtype" = one ] || echo "$jid" >"$sdir/deleted"
    fi
  fi
fi
if [ "$zjid" = 1 ]; then
  echo "$jid"
else
  echo "[INFO] PJM 0000 pjsub Job $jid submitted."
fi
[ -n "$name" ] || name=$(basename -- "$script")
if [ -n "$deleted" ]; then
  echo deleted >"$sdir/ec.$sn"
  echo deleted >"$sdir/pc.$sn"
  mkdir -p "$D/jobs/$jid"
  note "sub-job $jid deleted without running: $deleted"
  if [ "$stats" != 0 ]; then
    [ -n "$spath" ] || spath=$name.$jid.stats
    printf 'JOB ID            : %s\nJOB NAME          : %s\nPJM CODE          : -\nEXIT CODE         : -\nDELETED           : %s\n(written by local-pjsub.sh, a local stand-in for pjsub)\n' \
      "$jid" "$name" "$deleted" >"$spath"
  fi
  exit 0
fi

make_shims
shim=$D/shim

# ------------------------------------------------------------------------------ environment
workdir=$PWD
jobdir=$D/jobs/$jid
mkdir -p "$jobdir/localtmp" "$jobdir/sharedtmp"
if [ "${LOCAL_PJSUB_COPY:-1}" = 1 ]; then
  cp "$script" "$jobdir/$(basename -- "$script")"
  run_script=$jobdir/$(basename -- "$script")
else
  run_script=$(cd "$(dirname -- "$script")" && pwd)/$(basename -- "$script")
fi

envs=()
if [ "$export_all" = 1 ]; then
  while IFS= read -r -d '' kv; do envs+=("$kv"); done < <(env -0)
else
  for v in HOME USER LOGNAME LANG LC_ALL TMPDIR TERM SHELL; do
    [ -z "${!v:-}" ] || envs+=("$v=${!v}")
  done
  while IFS= read -r -d '' kv; do
    case "$kv" in OMPI_* | PMIX_MCA_* | LOCAL_PJSUB_*) envs+=("$kv") ;; esac
  done < <(env -0)
fi
envs+=("PATH=$shim:${PATH}" "${xvars[@]}"
  "PJM_JOBID=$jid" "PJM_JOBNAME=$name" "PJM_O_WORKDIR=$workdir" "PJM_MPI_PROC=$proc"
  "PJM_NODE=$node" "PJM_PROC_BY_NODE=$mppn" "PJM_RSCGRP=${rscgrp:-small}"
  "PJM_LOCALTMP=$jobdir/localtmp" "PJM_SHAREDTMP=$jobdir/sharedtmp"
  "LOCAL_PJSUB_SHAREDTMP_BYTES=$sharedtmp_bytes")
[ "${LOCAL_PJSUB_ELAPSE_VAR:-0}" != 1 ] || envs+=("PJM_ELAPSE_LIMIT=$elapse_s")

[ -n "$out" ] || out=$name.$jid.out
[ -n "$err" ] || err=$name.$jid.err
[ "$merge" = 0 ] || err=$out
[ -n "$spath" ] || spath=$name.$jid.stats

note "job $jid ($name): node=$node proc=$proc max-proc-per-node=$mppn elapse=${elapse_s}s rscgrp=${rscgrp:-small}${group:+ group=$group} freq=${freq:-default} eco_state=${eco_state:-default} sharedtmp=${sharedtmp_bytes}B -> $out"
start=$(date +%s)
echo "$jid $name $start $elapse_s $node" >"$jobdir/running"
rc=0
if [ "$merge" = 1 ]; then
  env -i "${envs[@]}" timeout -s TERM -k 10 "$elapse_s" bash "$run_script" >"$out" 2>&1 </dev/null || rc=$?
else
  env -i "${envs[@]}" timeout -s TERM -k 10 "$elapse_s" bash "$run_script" >"$out" 2>"$err" </dev/null || rc=$?
fi
elapsed=$(( $(date +%s) - start ))
rm -f "$jobdir/running"
pjm_code=0
if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ "$elapsed" -ge "$elapse_s" ]; }; then
  pjm_code=11
  rc=124
  note "job $jid exceeded its elapse limit (${elapse_s}s): PJM CODE 11"
fi
if [ "$stats" != 0 ]; then
  cat >"$spath" <<EOF
JOB ID            : $jid
JOB NAME          : $name
PJM CODE          : $pjm_code
EXIT CODE         : $rc
ELAPSE TIME (USE) : $elapsed
NODE NUM (REQUIRE): $node
MPI PROC          : $proc
FREQ              : ${freq:-default}
ECO STATE         : ${eco_state:-default}
(written by local-pjsub.sh, a local stand-in for pjsub)
EOF
fi
note "job $jid ended: exit $rc after ${elapsed}s"
if [ "$step" = 1 ]; then
  echo "$rc" >"$sdir/ec.$sn"
  echo "$pjm_code" >"$sdir/pc.$sn"
fi
if [ "${LOCAL_PJSUB_EXIT:-job}" = submit ]; then exit 0; fi
exit "$rc"
