# shellcheck shell=bash
# jobscripts/lib/common.sh: helpers shared by the pjsub and Slurm job scripts of fugu.
#
# Sourced, never run. The job scripts find this file, in this order, at:
#   1. $FUGU_HOME/jobscripts/lib/common.sh   (FUGU_HOME = the fugu checkout or install dir;
#      set it when submitting, e.g. `pjsub -x FUGU_HOME=/vol0004/.../fugu` or
#      `FUGU_HOME=... sbatch ...`);
#   2. ../lib/common.sh next to the running script (when it runs in place: local-pjsub.sh,
#      plain bash, or a scheduler that does not copy the script);
#   3. under Slurm, ../lib/common.sh next to the script as it was submitted (from the job's
#      `Command=` in `scontrol show job`; slurmd runs a copy in its spool directory);
#   4. ./jobscripts/lib/common.sh below the submission directory
#      ($SLURM_SUBMIT_DIR, $PJM_O_WORKDIR or the current directory).
# The job scripts set FUGU_COMMON to the file they sourced; everything else comes from here.

# ------------------------------------------------------------------------------ basics

# Where the fugu checkout (or install) is: the folder that holds jobscripts/.
FUGU_HOME=$(cd "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)
FUGU_JOBSCRIPTS=$FUGU_HOME/jobscripts
export FUGU_HOME FUGU_JOBSCRIPTS

# Exit codes of `fugu train` that the job scripts act on (docs/JOBS.md lists all of them).
FUGU_EXIT_NONFINITE=3            # the loss or the gradients were not finite
FUGU_EXIT_CHECKPOINTED=4         # checkpointed before the time limit: resubmit to continue

fugu_log() { printf '[fugu-job %s] %s\n' "$(date '+%F %T')" "$*" >&2; }
fugu_die() { printf '[fugu-job] ERROR: %s\n' "$*" >&2; exit 2; }

# fugu_require_uint VAR...: each named variable holds a non-negative integer.
fugu_require_uint() {
  local v
  for v in "$@"; do
    case "${!v:-}" in
      '' | *[!0-9]*) fugu_die "$v must be a non-negative integer (got '${!v:-}')" ;;
    esac
  done
}

# fugu_require_bin: FUGU_BIN names an executable file.
fugu_require_bin() {
  [ -n "${FUGU_BIN:-}" ] || fugu_die "FUGU_BIN is empty: set it to the fugu binary (cargo build --release --features mpi)"
  [ -e "$FUGU_BIN" ] || fugu_die "FUGU_BIN=$FUGU_BIN does not exist: build it (cargo build --release --features mpi) or set FUGU_BIN"
  if [ ! -f "$FUGU_BIN" ] || [ ! -x "$FUGU_BIN" ]; then
    fugu_die "FUGU_BIN=$FUGU_BIN is not an executable file"
  fi
  FUGU_BIN=$(cd "$(dirname -- "$FUGU_BIN")" && pwd)/$(basename -- "$FUGU_BIN")
}

# fugu_abs PATH: PATH made absolute against FUGU_WORKDIR (the submission directory).
fugu_abs() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$FUGU_WORKDIR/$1" ;;
  esac
}

# fugu_sanitize STRING: a file-name-safe version (config paths become their stem).
fugu_sanitize() {
  local s
  s=$(basename -- "$1")
  s=${s%.toml}
  printf '%s\n' "${s//[^A-Za-z0-9._-]/_}"
}

# ------------------------------------------------------------------------------ time

# fugu_parse_elapse LIMIT: seconds in a pjsub/Slurm time limit: S, M:S, H:M:S, D-H, D-H:M,
# D-H:M:S. (pjsub's elapse is [[H:]M:]S; a bare number is seconds there but minutes in Slurm:
# pass a second argument "minutes" for Slurm's meaning.)
fugu_parse_elapse() {
  local t=$1 unit=${2:-seconds} d=0 h=0 m=0 s=0 rest
  [ -n "$t" ] || return 1
  case "$t" in
    *-*) d=${t%%-*}; rest=${t#*-}
         case "$rest" in
           *:*:*) IFS=: read -r h m s <<<"$rest" ;;
           *:*) IFS=: read -r h m <<<"$rest" ;;
           *) h=$rest ;;
         esac ;;
    *:*:*) IFS=: read -r h m s <<<"$t" ;;
    *:*) IFS=: read -r m s <<<"$t" ;;
    *) if [ "$unit" = minutes ]; then m=$t; else s=$t; fi ;;
  esac
  local x
  for x in "$d" "$h" "$m" "$s"; do
    case "$x" in '' | *[!0-9]*) return 1 ;; esac
  done
  echo $(( ((10#$d * 24 + 10#$h) * 60 + 10#$m) * 60 + 10#$s ))
}

# fugu_rfc3339 EPOCH: the UTC time as RFC 3339 (what --deadline reads unambiguously).
fugu_rfc3339() { date -u -d "@$1" '+%Y-%m-%dT%H:%M:%SZ'; }

# ------------------------------------------------------------------------------ run setup

# fugu_setup_train: checks the common settings of the training scripts and sets FUGU_RUN_NAME,
# FUGU_OUT (absolute) and FUGU_DATA (staged). Needs FUGU_RANKS (total MPI ranks).
fugu_setup_train() {
  fugu_require_bin
  fugu_require_uint FUGU_TP FUGU_PP FUGU_ZERO FUGU_THREADS FUGU_RANKS FUGU_AUTO_RESUBMIT FUGU_RESUBMIT_MAX FUGU_RESUBMIT_COUNT
  [ -n "$FUGU_CONFIG" ] || fugu_die "FUGU_CONFIG is empty: set it to a built-in config name (gpt2-tiny, gpt2-124m, ...) or a TOML file"
  [ "$FUGU_TP" -ge 1 ] || fugu_die "FUGU_TP must be at least 1"
  [ "$FUGU_PP" -ge 1 ] || fugu_die "FUGU_PP must be at least 1"
  [ "$FUGU_THREADS" -ge 1 ] || fugu_die "FUGU_THREADS must be at least 1"
  [ "$FUGU_RANKS" -ge 1 ] || fugu_die "the job has no MPI ranks (FUGU_RANKS=$FUGU_RANKS)"
  [ $(( FUGU_RANKS % (FUGU_TP * FUGU_PP) )) -eq 0 ] ||
    fugu_die "FUGU_TP=$FUGU_TP x FUGU_PP=$FUGU_PP does not divide the $FUGU_RANKS ranks of this job"
  case "$FUGU_ZERO" in 0 | 1) ;; *) fugu_die "FUGU_ZERO must be 0 or 1 (got $FUGU_ZERO)" ;; esac
  case "${FUGU_PRECISION:-}" in '' | fp32 | bf16 | fp16) ;; *) fugu_die "FUGU_PRECISION must be fp32, bf16 or fp16 (got $FUGU_PRECISION)" ;; esac
  case "${FUGU_RECOMPUTE:-}" in '' | none | attention | full) ;; *) fugu_die "FUGU_RECOMPUTE must be none, attention or full (got $FUGU_RECOMPUTE)" ;; esac
  [ -z "${FUGU_MICRO_BATCHES:-}" ] || fugu_require_uint FUGU_MICRO_BATCHES
  if [ -n "${FUGU_LOSS_CHUNK:-}" ]; then
    fugu_require_uint FUGU_LOSS_CHUNK
    [ "$FUGU_LOSS_CHUNK" -ge 1 ] || fugu_die "FUGU_LOSS_CHUNK must be at least 1 (rows per chunk)"
  fi
  case "${FUGU_PP_LAYERS:-}" in '' | [0-9]*) ;; *) fugu_die "FUGU_PP_LAYERS must be block counts per stage, like 5,5,4 (got $FUGU_PP_LAYERS)" ;; esac
  # A config given as a file: make it absolute, the ranks may start elsewhere.
  if [ -f "$FUGU_CONFIG" ] || [ -f "$FUGU_WORKDIR/$FUGU_CONFIG" ]; then
    case "$FUGU_CONFIG" in *.toml | */*) FUGU_CONFIG=$(fugu_abs "$FUGU_CONFIG") ;; esac
  fi
  # The run directory must not change between a job and its resubmission: no job id in it.
  FUGU_RUN_NAME=${FUGU_RUN_NAME:-$(fugu_sanitize "$FUGU_CONFIG")-n${FUGU_RANKS}-tp${FUGU_TP}$(fugu_pp_suffix)}
  FUGU_OUT=$(fugu_abs "${FUGU_OUT:-runs/$FUGU_RUN_NAME}")
  mkdir -p "$FUGU_OUT" || fugu_die "cannot create FUGU_OUT=$FUGU_OUT"
  fugu_stage_data
}

# fugu_pp_suffix: "-ppP" in default run directory names when FUGU_PP is above 1 (none
# otherwise, so the names of runs without pipeline parallelism do not change).
fugu_pp_suffix() {
  [ "${FUGU_PP:-1}" = 1 ] || printf -- '-pp%s' "$FUGU_PP"
}

# fugu_stage_data: with FUGU_DATA empty, tokenise the bundled corpus once, here in the batch
# shell, instead of letting every rank race to do it; FUGU_DATA then names its manifest.
fugu_stage_data() {
  if [ -n "${FUGU_DATA:-}" ]; then
    case "$FUGU_DATA" in
      /* | *'{'*) ;;                           # absolute, or a brace pattern: as given
      *) FUGU_DATA=$(fugu_abs "$FUGU_DATA") ;;
    esac
    return 0
  fi
  local dir
  dir=$(fugu_abs "${FUGU_BUNDLED_DATA_DIR:-data/shakespeare}")
  if [ ! -f "$dir/manifest.json" ]; then
    # Several jobs of a sweep may start at once: prepare into a private folder, then rename it
    # into place (atomic; the loser of a race throws its copy away).
    local tmp
    tmp=$dir.tmp-${HOSTNAME:-host}-$$
    fugu_log "FUGU_DATA is empty: tokenising the bundled corpus into $dir"
    mkdir -p "$(dirname -- "$dir")"
    "$FUGU_BIN" prepare --out "$tmp" --quiet ||
      fugu_die "'$FUGU_BIN prepare --out $tmp' failed (set FUGU_DATA to prepared data instead)"
    mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"
    [ -f "$dir/manifest.json" ] || fugu_die "no $dir/manifest.json after preparing the bundled corpus"
  fi
  FUGU_DATA=$dir/manifest.json
}

# fugu_train_args: the `fugu train ...` argument list, in the array FUGU_TRAIN_ARGS.
# Options left empty are not passed (the config's value or the trainer's default applies).
fugu_train_args() {
  FUGU_TRAIN_ARGS=(train --config "$FUGU_CONFIG" --data "$FUGU_DATA" --out "$FUGU_OUT"
    --resume auto --threads "$FUGU_THREADS")
  # --tp/--zero only when not the trainer's default, so that a binary without them still runs
  # plain data-parallel jobs.
  [ "$FUGU_TP" = 1 ] || FUGU_TRAIN_ARGS+=(--tp "$FUGU_TP")
  [ "${FUGU_PP:-1}" = 1 ] || FUGU_TRAIN_ARGS+=(--pp "$FUGU_PP")
  [ -z "${FUGU_PP_LAYERS:-}" ] || FUGU_TRAIN_ARGS+=(--pp-layers "$FUGU_PP_LAYERS")
  [ "$FUGU_ZERO" = 0 ] || FUGU_TRAIN_ARGS+=(--zero "$FUGU_ZERO")
  [ -z "${FUGU_STEPS:-}" ] || FUGU_TRAIN_ARGS+=(--steps "$FUGU_STEPS")
  [ -z "${FUGU_BATCH_SIZE:-}" ] || FUGU_TRAIN_ARGS+=(--batch-size "$FUGU_BATCH_SIZE")
  [ -z "${FUGU_SEQ_LEN:-}" ] || FUGU_TRAIN_ARGS+=(--seq-len "$FUGU_SEQ_LEN")
  [ -z "${FUGU_CKPT_EVERY:-}" ] || FUGU_TRAIN_ARGS+=(--ckpt-every "$FUGU_CKPT_EVERY")
  [ -z "${FUGU_EVAL_EVERY:-}" ] || FUGU_TRAIN_ARGS+=(--eval-every "$FUGU_EVAL_EVERY")
  [ -z "${FUGU_LOG_EVERY:-}" ] || FUGU_TRAIN_ARGS+=(--log-every "$FUGU_LOG_EVERY")
  [ -z "${FUGU_PRECISION:-}" ] || FUGU_TRAIN_ARGS+=(--precision "$FUGU_PRECISION")
  [ -z "${FUGU_MICRO_BATCHES:-}" ] || FUGU_TRAIN_ARGS+=(--micro-batches "$FUGU_MICRO_BATCHES")
  [ -z "${FUGU_RECOMPUTE:-}" ] || FUGU_TRAIN_ARGS+=(--recompute "$FUGU_RECOMPUTE")
  [ -z "${FUGU_LOSS_CHUNK:-}" ] || FUGU_TRAIN_ARGS+=(--loss-chunk "$FUGU_LOSS_CHUNK")
  [ -z "${FUGU_TIMERS:-}" ] || FUGU_TRAIN_ARGS+=(--timers "$FUGU_TIMERS")
  [ -z "${FUGU_DEADLINE:-}" ] || FUGU_TRAIN_ARGS+=(--deadline "$FUGU_DEADLINE")
  local extra=()
  # FUGU_EXTRA_ARGS is split on white space (no quoting inside it).
  read -r -a extra <<<"${FUGU_EXTRA_ARGS:-}"
  FUGU_TRAIN_ARGS+=("${extra[@]}")
}

# fugu_job_record TEXT: one line in $FUGU_OUT/jobs.log (which jobs ran this run, how they ended).
fugu_job_record() {
  printf '%s %s\n' "$(date -u '+%Y-%m-%dT%H:%M:%SZ')" "$*" >>"$FUGU_OUT/jobs.log" || true
}

# ------------------------------------------------------------------------------ launching

# fugu_run_forwarding CMD...: runs CMD (the MPI launcher) in the background and waits for it.
# SIGUSR1, SIGUSR2, SIGTERM and SIGINT sent to this batch shell are passed on to CMD (mpirun,
# mpiexec and srun all forward them to every rank): the trainer checkpoints and exits with 4.
# Open MPI's mpirun is sent SIGUSR1 for SIGTERM and SIGINT: it forwards SIGUSR1 and waits for
# the ranks, while on SIGTERM/SIGINT it ends the job itself (exit 1, the ranks' last messages
# lost, the checkpoint at the mercy of its kill timeout; measured with Open MPI 4.1).
# The launcher's exit status ends up in FUGU_RC. FUGU_SIGNAL_FORWARD_CMD, when set, is run
# instead of `kill -SIG PID` (its first argument is the signal name).
fugu_run_forwarding() {
  FUGU_RC=0
  command -v "$1" >/dev/null 2>&1 || fugu_die "$1 not found in PATH (the MPI launcher of this job)"
  FUGU_LAUNCHER_NAME=$(basename -- "$1")
  "$@" &
  FUGU_LAUNCHER_PID=$!
  local sig
  for sig in USR1 USR2 TERM INT; do
    # shellcheck disable=SC2064  # expand $sig now, once per trap
    trap "fugu_forward_signal $sig" "$sig"
  done
  while :; do
    FUGU_RC=0
    wait "$FUGU_LAUNCHER_PID" || FUGU_RC=$?
    # > 128 either means "killed by a signal" or "wait was interrupted by a trapped signal";
    # the launcher is alive (or not yet reaped) only in the second case.
    if [ "$FUGU_RC" -gt 128 ] && kill -0 "$FUGU_LAUNCHER_PID" 2>/dev/null; then
      continue
    fi
    break
  done
  trap - USR1 USR2 TERM INT
}

fugu_forward_signal() {
  local sig=$1
  if [ "${FUGU_LAUNCHER_NAME:-}" = mpirun ] && { [ "$sig" = TERM ] || [ "$sig" = INT ]; }; then
    sig=USR1
    fugu_log "batch shell got SIG$1: sending SIGUSR1 to mpirun (pid $FUGU_LAUNCHER_PID), which passes it to the ranks (on SIG$1 it would end the job itself)"
  else
    fugu_log "batch shell got SIG$1: forwarding it to the launcher (pid $FUGU_LAUNCHER_PID)"
  fi
  if [ -n "${FUGU_SIGNAL_FORWARD_CMD:-}" ]; then
    local cmd=()
    read -r -a cmd <<<"$FUGU_SIGNAL_FORWARD_CMD"
    "${cmd[@]}" "$sig" || fugu_log "'$FUGU_SIGNAL_FORWARD_CMD $sig' failed"
  else
    kill -s "$sig" "$FUGU_LAUNCHER_PID" 2>/dev/null || fugu_log "the launcher is already gone"
  fi
}

# fugu_explain_exit RC: one line on what the trainer's exit status means.
fugu_explain_exit() {
  case "$1" in
    0) fugu_log "training finished (exit 0); run directory: $FUGU_OUT" ;;
    "$FUGU_EXIT_NONFINITE") fugu_log "training stopped on a non-finite loss or gradient (exit 3); see the log, lower the learning rate or pass --skip-nonfinite" ;;
    "$FUGU_EXIT_CHECKPOINTED") fugu_log "training checkpointed before the time limit (exit 4); submit the same job again to continue from $FUGU_OUT (or set FUGU_AUTO_RESUBMIT=1)" ;;
    *) if [ "$1" -gt 128 ]; then
         fugu_log "the launcher ended on signal $(( $1 - 128 )) (exit $1); --resume auto continues from the last complete checkpoint in $FUGU_OUT"
       else
         fugu_log "training failed (exit $1); see the log above and the rank outputs"
       fi ;;
  esac
}

# ------------------------------------------------------------------------------ Slurm

# fugu_slurm_job_field NAME: a field of `scontrol show job $SLURM_JOB_ID` (empty if unknown).
fugu_slurm_job_field() {
  scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1
}

# fugu_slurm_resubmit: submits this job's script again, with this job's geometry, to start when
# this job has ended; the new job finds the checkpoint through --resume auto.
fugu_slurm_resubmit() {
  local script timelimit stdout partition account jid
  script=$(fugu_slurm_job_field Command)
  if [ -z "$script" ] || [ ! -f "$script" ]; then script=${FUGU_JOBSCRIPT:-}; fi
  if [ -z "$script" ] || [ ! -f "$script" ]; then
    fugu_log "cannot resubmit: the submitted script is unknown (set FUGU_JOBSCRIPT)"
    return 0
  fi
  local args=(--parsable --dependency="afterany:$SLURM_JOB_ID" --nodes="${SLURM_JOB_NUM_NODES:-1}"
    --ntasks="${SLURM_NTASKS:-1}")
  [ -z "${SLURM_NTASKS_PER_NODE:-}" ] || args+=(--ntasks-per-node="${SLURM_NTASKS_PER_NODE%%(*}")
  [ -z "${SLURM_CPUS_PER_TASK:-}" ] || args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
  timelimit=$(fugu_slurm_job_field TimeLimit)
  case "$timelimit" in '' | UNLIMITED | Partition_Limit) ;; *) args+=(--time="$timelimit") ;; esac
  partition=$(fugu_slurm_job_field Partition)
  [ -z "$partition" ] || args+=(--partition="$partition")
  account=$(fugu_slurm_job_field Account)
  case "$account" in '' | '(null)') ;; *) args+=(--account="$account") ;; esac
  stdout=$(fugu_slurm_job_field StdOut)
  # The log pattern: the job id in the file name becomes %j again (only in the file name: the
  # directory may contain the same digits).
  if [ -n "$stdout" ]; then
    local base=${stdout##*/}
    args+=(--output="${stdout%/*}/${base//$SLURM_JOB_ID/%j}")
  fi
  local extra=()
  read -r -a extra <<<"${FUGU_SBATCH_ARGS:-}"
  args+=("${extra[@]}")
  # The continuation must train into the same run directory, on the same data.
  export FUGU_OUT FUGU_DATA FUGU_CONFIG FUGU_RESUBMIT_COUNT=$(( FUGU_RESUBMIT_COUNT + 1 ))
  if jid=$(sbatch "${args[@]}" "$script"); then
    fugu_log "resubmitted as job $jid (continuation $FUGU_RESUBMIT_COUNT of at most $FUGU_RESUBMIT_MAX)"
    fugu_job_record "slurm job $SLURM_JOB_ID resubmitted as job $jid"
  else
    fugu_log "resubmission failed: sbatch ${args[*]} $script"
  fi
}

# ------------------------------------------------------------------------------ GEMM benchmark

# fugu_cpulist_expand LIST: "12-23,30" -> one CPU id per line.
fugu_cpulist_expand() {
  local part a b
  local IFS=,
  for part in $1; do
    case "$part" in
      *-*) a=${part%-*}; b=${part#*-}; seq "$a" "$b" ;;
      ?*) echo "$part" ;;
    esac
  done
}

# fugu_numa_domains: the NUMA nodes this process may run on, one id per line: FUGU_NUMA_NODES
# (comma- or space-separated) if set, else every node of /sys/devices/system/node whose CPUs
# meet our affinity mask (on a Fugaku compute node: 4 5 6 7, the CMGs of the job's cores).
fugu_numa_domains() {
  if [ -n "${FUGU_NUMA_NODES:-}" ]; then
    tr ',' ' ' <<<"$FUGU_NUMA_NODES" | tr -s ' ' '\n' | sed '/^$/d'
    return 0
  fi
  local allowed n f cpus
  allowed=$(sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' /proc/self/status 2>/dev/null)
  allowed=$(fugu_cpulist_expand "$allowed" | sort -u)
  for f in /sys/devices/system/node/node[0-9]*/cpulist; do
    [ -r "$f" ] || continue
    n=${f%/cpulist}; n=${n##*/node}
    cpus=$(fugu_cpulist_expand "$(cat "$f")" | sort -u)
    [ -n "$cpus" ] || continue
    if [ -z "$allowed" ] || [ -n "$(comm -12 <(echo "$cpus") <(echo "$allowed"))" ]; then
      echo "$n"
    fi
  done | sort -n
}

# fugu_bench_gemm_runs: runs `fugu bench gemm` once per entry of FUGU_BENCH_RUNS
# ("THREADS:CMGS ..."), each into $FUGU_OUT/gemm-tTHREADS-cCMGS.jsonl. A run on fewer CMGs than
# the process sees is bound to the first CMGS NUMA nodes with numactl; without numactl, or on a
# machine with fewer NUMA nodes, the layout is simulated with FUGU_CMGS=CMGSx(THREADS/CMGS).
fugu_bench_gemm_runs() {
  local domains ndom spec t c file bind layout sets=() extra=() failed=0
  mapfile -t domains < <(fugu_numa_domains)
  ndom=${#domains[@]}
  [ "$ndom" -ge 1 ] || ndom=1
  [ -z "$FUGU_BENCH_SETS" ] || sets=(--set "$FUGU_BENCH_SETS")
  read -r -a extra <<<"${FUGU_BENCH_ARGS:-}"
  [ -n "$FUGU_BENCH_RUNS" ] || fugu_die "FUGU_BENCH_RUNS is empty: give THREADS:CMGS entries, e.g. '1:1 12:1 48:4'"
  fugu_log "NUMA nodes available: ${domains[*]:-unknown}"
  for spec in $FUGU_BENCH_RUNS; do
    t=${spec%%:*}
    c=1
    case "$spec" in *:*) c=${spec#*:} ;; esac
    case "$t$c" in *[!0-9]*) fugu_die "FUGU_BENCH_RUNS entry '$spec' is not THREADS:CMGS" ;; esac
    if [ "$t" -lt 1 ] || [ "$c" -lt 1 ]; then
      fugu_die "FUGU_BENCH_RUNS entry '$spec': threads and CMGs must be at least 1"
    fi
    file=$FUGU_OUT/gemm-t$t-c$c.jsonl
    bind=()
    layout=
    if [ "$c" -lt "$ndom" ] && command -v numactl >/dev/null 2>&1; then
      local nodes
      nodes=$(printf '%s\n' "${domains[@]:0:$c}" | paste -sd, -)
      bind=(numactl --cpunodebind="$nodes" --membind="$nodes")
    elif [ "$c" -ne "$ndom" ]; then
      [ $(( t % c )) -eq 0 ] || fugu_die "FUGU_BENCH_RUNS entry '$spec': $t threads do not split over $c CMGs"
      layout=${c}x$(( t / c ))
      fugu_log "$c CMG(s) requested, $ndom NUMA node(s) here$(command -v numactl >/dev/null || echo ', no numactl'): simulating FUGU_CMGS=$layout"
    fi
    fugu_log "GEMM benchmark: $t thread(s) on $c CMG(s) -> $file"
    if ! env FUGU_NUM_THREADS="$t" OMP_NUM_THREADS="$t" ${layout:+FUGU_CMGS=$layout} \
      "${bind[@]}" "$FUGU_BIN" bench gemm "${sets[@]}" --threads "$t" --format json "${extra[@]}" >"$file"; then
      fugu_log "GEMM benchmark $spec failed"
      failed=1
    fi
  done
  return "$failed"
}

# ------------------------------------------------------------------------------ comm benchmark

# fugu_comm_publish TMP FILE: renames TMP, rank 0's `fugu bench comm --format json` output, to
# FILE when it holds one complete comm document (first line "{", last line "}", a "benchmark":
# "comm" field), so that FILE is never half-written; otherwise removes TMP, logs why, and fails.
fugu_comm_publish() {
  local tmp=$1 file=$2
  if [ ! -s "$tmp" ]; then
    fugu_log "no output from rank 0 (nothing on its stdout: an output option in FUGU_MPIEXEC_ARGS or FUGU_SRUN_ARGS?)"
  elif [ "$(head -n 1 -- "$tmp")" != '{' ] || [ "$(tail -n 1 -- "$tmp")" != '}' ] ||
    ! grep -q '^ *"benchmark": *"comm"' -- "$tmp"; then
    fugu_log "rank 0's output is not one fugu bench comm JSON document; it begins: $(head -c 300 -- "$tmp" | tr '\n' ' ')"
  elif mv -f -- "$tmp" "$file"; then
    return 0
  fi
  rm -f -- "$tmp"
  return 1
}

# ------------------------------------------------------------------------------ sweep report

# fugu_sweep_report DIR: `fugu report` over DIR/runs/* and DIR/gemm/*.jsonl into DIR/report.
fugu_sweep_report() {
  local dir=$1 runs=() gemm=() f
  for f in "$dir"/runs/*/; do
    [ -d "$f" ] && runs+=("${f%/}")
  done
  for f in "$dir"/gemm/*.jsonl; do
    [ -f "$f" ] && gemm+=(--gemm "$f")
  done
  [ ${#runs[@]} -gt 0 ] || [ ${#gemm[@]} -gt 0 ] || fugu_die "nothing to report in $dir (no runs/*/, no gemm/*.jsonl)"
  fugu_log "fugu report: ${#runs[@]} run(s), $(( ${#gemm[@]} / 2 )) GEMM file(s) -> $dir/report"
  "$FUGU_BIN" report "${runs[@]}" --out "$dir/report" "${gemm[@]}"
  [ -f "$dir/report/REPORT.md" ] || fugu_die "fugu report wrote no $dir/report/REPORT.md"
  fugu_log "wrote $dir/report/REPORT.md"
}

# ------------------------------------------------------------------------------ pjsub (Fugaku)

# Settings a pjsub job hands to its continuation (pjsub does not pass the submitting
# environment on; the continuation reads them from FUGU_ENV_FILE). FUGU_DEADLINE is not among
# them: it is computed again from each job's own start.
# shellcheck disable=SC2034  # used by the pjsub scripts
FUGU_PJSUB_SETTINGS=(FUGU_HOME FUGU_BIN FUGU_CONFIG FUGU_DATA FUGU_STEPS FUGU_BATCH_SIZE FUGU_SEQ_LEN
  FUGU_TP FUGU_ZERO FUGU_THREADS FUGU_WORKDIR FUGU_OUT FUGU_CKPT_EVERY FUGU_EVAL_EVERY FUGU_LOG_EVERY
  FUGU_TIMERS FUGU_EXTRA_ARGS FUGU_RANKS_PER_NODE FUGU_ELAPSE FUGU_DEADLINE_MARGIN FUGU_LLIO_TRANSFER
  FUGU_MPIEXEC_ARGS FUGU_GROUP FUGU_RSCGRP FUGU_PJSUB_ARGS FUGU_AUTO_RESUBMIT FUGU_RESUBMIT_MAX
  FUGU_RESUBMIT_COUNT FUGU_BUNDLED_DATA_DIR FUGU_ECO_STATE FUGU_LLIO_SHAREDTMP FUGU_PJSTAT
  FUGU_PRECISION FUGU_MICRO_BATCHES FUGU_RECOMPUTE FUGU_LOSS_CHUNK FUGU_PP FUGU_PP_LAYERS)

# fugu_write_env FILE VAR...: `export VAR=value` lines (shell-quoted) for the variables that are
# set (an empty value is kept: FUGU_BENCH_SETS= means "no shape sets").
fugu_write_env() {
  local file=$1 v
  shift
  mkdir -p "$(dirname -- "$file")"
  {
    echo "# written by fugu's job scripts on $(date -u '+%Y-%m-%dT%H:%M:%SZ'); sourced through FUGU_ENV_FILE"
    for v in "$@"; do
      if [ -n "${!v+x}" ]; then printf 'export %s=%q\n' "$v" "${!v}"; fi
    done
  } >"$file"
}

# fugu_pjm_directive_elapse SCRIPT: the elapse= value of SCRIPT's `#PJM -L` lines (the last one).
fugu_pjm_directive_elapse() {
  [ -r "$1" ] || return 0
  grep -E '^#PJM[[:space:]]+(-L|--rsc-list)[[:space:]]' "$1" | tr -d '"'"'" | tr ',' '\n' | tr ' ' '\n' |
    sed -n 's/^elapse=//p' | tail -n 1
}

# fugu_pjstat_column COLUMN JOBID: the value in column COLUMN (a header name of `pjstat`'s job
# list, e.g. ELAPSE_LIM) of the row of job JOBID, from `pjstat` output on stdin; empty if absent.
# The header names one column START_DATE, but the rows print the date as two fields
# ("11/17 09:01:41", "(03/12 11:05)<" for an estimated start, or "-" before the start), so the
# row is walked field by field: a *_DATE column whose field looks like MM/DD takes two fields.
# Lines before the header (pjstat's summary table) are ignored.
fugu_pjstat_column() {
  awk -v want="$1" -v id="$2" '
    $1 == "JOB_ID" { n = NF; for (i = 1; i <= NF; i++) h[i] = $i; next }
    n && $1 == id {
      j = 1
      for (i = 1; i <= n; i++) {
        if (h[i] == want) { print $j; exit }
        if (h[i] ~ /_DATE$/ && $j ~ /^[(]?[0-9]+[/][0-9]+$/ && $(j + 1) ~ /^[0-9]+:[0-9]+(:[0-9]+)?[)]?<?$/) j += 2
        else j += 1
      }
    }'
}

# fugu_pjstat_elapse: this job's ELAPSE_LIM from `pjstat $PJM_JOBID` (run with LC_ALL=C, for the
# English layout), or nothing: not in a PJM job, no pjstat, FUGU_PJSTAT=0, or no H:M:S value.
fugu_pjstat_elapse() {
  [ "${FUGU_PJSTAT:-1}" = 1 ] && [ -n "${PJM_JOBID:-}" ] || return 0
  command -v pjstat >/dev/null 2>&1 || return 0
  local v
  v=$(LC_ALL=C LANG=C timeout 30 pjstat "$PJM_JOBID" 2>/dev/null | fugu_pjstat_column ELAPSE_LIM "$PJM_JOBID") || v=
  case "$v" in
    *[0-9]:[0-9]*:[0-9]*) fugu_parse_elapse "$v" >/dev/null 2>&1 && printf '%s\n' "$v" ;;
  esac
  return 0
}

# fugu_pjm_elapse SCRIPT: sets FUGU_ELAPSE_S (seconds, empty if unknown) and FUGU_ELAPSE_SRC.
# In order:
#   1. FUGU_ELAPSE (the documented way: pass -x FUGU_ELAPSE= with the same value as -L elapse=;
#      chain.sh and scaling-sweep.sh always do);
#   2. PJM_ELAPSE_LIMIT, only as an optional override: no public source shows PJM setting it,
#      but a site or a user may;
#   3. SCRIPT's own `#PJM -L elapse=` line, checked against `pjstat`'s ELAPSE_LIM for this job:
#      the smaller one wins (an elapse given on the pjsub command line is only seen by pjstat;
#      a shorter one must not put the deadline after the kill, a longer one is only used when
#      passed as FUGU_ELAPSE, since pjstat on a compute node is not confirmed);
#   4. pjstat alone, when SCRIPT has no elapse line.
fugu_pjm_elapse() {
  local script=$1 v='' line='' stat='' line_s='' stat_s=''
  FUGU_ELAPSE_S=
  FUGU_ELAPSE_SRC=
  if [ -n "${FUGU_ELAPSE:-}" ]; then
    v=$FUGU_ELAPSE; FUGU_ELAPSE_SRC="FUGU_ELAPSE=$v"
  elif [ -n "${PJM_ELAPSE_LIMIT:-}" ]; then
    v=$PJM_ELAPSE_LIMIT; FUGU_ELAPSE_SRC="PJM_ELAPSE_LIMIT=$v"
  else
    line=$(fugu_pjm_directive_elapse "$script")
    stat=$(fugu_pjstat_elapse)
    [ -z "$line" ] || line_s=$(fugu_parse_elapse "$line") ||
      fugu_die "cannot read '#PJM -L elapse=$line' in $script; set FUGU_ELAPSE=H:MM:SS"
    [ -z "$stat" ] || stat_s=$(fugu_parse_elapse "$stat")
    if [ -n "$line_s" ] && [ -n "$stat_s" ] && [ "$stat_s" -lt "$line_s" ]; then
      v=$stat; FUGU_ELAPSE_SRC="pjstat ELAPSE_LIM=$stat, shorter than #PJM -L elapse=$line in $script"
    elif [ -n "$line_s" ]; then
      v=$line; FUGU_ELAPSE_SRC="#PJM -L elapse=$line in $script"
      if [ -n "$stat_s" ] && [ "$stat_s" -gt "$line_s" ]; then
        fugu_log "pjstat reports a longer elapse limit ($stat) than the script's #PJM line ($line): the deadline uses the shorter; pass -x FUGU_ELAPSE=$stat to use it all"
      fi
    elif [ -n "$stat_s" ]; then
      v=$stat; FUGU_ELAPSE_SRC="pjstat ELAPSE_LIM=$stat"
    fi
  fi
  [ -n "$v" ] || return 0
  # shellcheck disable=SC2034  # read by the pjsub scripts
  FUGU_ELAPSE_S=$(fugu_parse_elapse "$v") || fugu_die "cannot read the elapse limit '$v' ($FUGU_ELAPSE_SRC); set FUGU_ELAPSE=H:MM:SS"
}

# fugu_llio_transfer FILE...: cache read-only files in LLIO for all nodes of the job (Fugaku),
# so that thousands of ranks do not all read them from the global file system. Call it before
# anything opens or stats FILE (the R-CCS guide's advice); the transfer needs shared temporary
# space, which the scripts request with `#PJM --llio sharedtmp-size=...` (FUGU_LLIO_SHAREDTMP
# in chain.sh and scaling-sweep.sh). A failed transfer is not fatal: the nodes then read the
# files from where they are.
fugu_llio_transfer() {
  [ "${FUGU_LLIO_TRANSFER:-1}" = 1 ] || return 0
  if ! command -v llio_transfer >/dev/null 2>&1; then
    fugu_log "llio_transfer not found (not on Fugaku?): files are read from where they are"
    return 0
  fi
  if llio_transfer "$@"; then
    fugu_log "llio_transfer: $*"
  else
    fugu_log "llio_transfer $* failed: continuing without the LLIO cache (LLIO 2450 'Not enough disk space' means the job's --llio sharedtmp-size is too small for these files)"
  fi
}

fugu_llio_purge() {
  [ "${FUGU_LLIO_TRANSFER:-1}" = 1 ] && command -v llio_transfer >/dev/null 2>&1 || return 0
  llio_transfer --purge "$@" || true
}

# fugu_abs_bin: FUGU_BIN made absolute (against the current directory) without opening or
# stat'ing the file itself, so that it can be llio_transfer'ed first.
fugu_abs_bin() {
  [ -n "${FUGU_BIN:-}" ] || fugu_die "FUGU_BIN is empty: set it to the fugu binary (cargo build --release --features mpi)"
  case "$FUGU_BIN" in
    /*) ;;
    *) FUGU_BIN=$PWD/$FUGU_BIN ;;
  esac
}

# fugu_config_is_file CONFIG: whether CONFIG names a file (a .toml or a path) rather than a
# built-in config, judged by its name only (no stat before llio_transfer).
fugu_config_is_file() {
  case "$1" in *.toml | */*) return 0 ;; *) return 1 ;; esac
}

# fugu_pjsub_jid TEXT: the job id in pjsub's answer: "1234" from "[INFO] PJM 0000 pjsub Job 1234
# submitted.", "1234_0" for a step job, or the bare id that `pjsub -z jid` prints.
fugu_pjsub_jid() {
  local jid
  jid=$(sed -n 's/.*Job \([0-9][0-9_]*\) submitted.*/\1/p' <<<"$1" | head -n 1)
  if [ -z "$jid" ]; then
    jid=$(sed -n 's/^[[:space:]]*\([0-9][0-9]*\(_[0-9][0-9]*\)\{0,1\}\)[[:space:]]*$/\1/p' <<<"$1" | head -n 1)
  fi
  printf '%s\n' "$jid"
}

# fugu_pjsub SUBMIT_ARGS...: runs pjsub and prints the job id (see fugu_pjsub_jid).
fugu_pjsub() {
  local out jid
  out=$(pjsub "$@") || fugu_die "pjsub $* failed: $out"
  printf '%s\n' "$out" >&2
  jid=$(fugu_pjsub_jid "$out")
  [ -n "$jid" ] || fugu_die "no job id in pjsub's answer: $out"
  echo "$jid"
}

# fugu_pjm_power_args: the pjsub options for the power knobs: boost clock and FUGU_ECO_STATE
# (0 = both FP pipelines; Fugaku's default, 2, uses only FLA, one of the two).
fugu_pjm_power_args() {
  case "${FUGU_ECO_STATE:-0}" in 0 | 1 | 2) ;; *) fugu_die "FUGU_ECO_STATE must be 0, 1 or 2 (got '$FUGU_ECO_STATE')" ;; esac
  # shellcheck disable=SC2034  # read by the pjsub scripts
  FUGU_PJM_POWER_ARGS=(-L "freq=2200,eco_state=${FUGU_ECO_STATE:-0}")
}

# fugu_pjm_llio_args: --llio sharedtmp-size=FUGU_LLIO_SHAREDTMP (per node, e.g. 512Mi, 1Gi).
fugu_pjm_llio_args() {
  case "${FUGU_LLIO_SHAREDTMP:-1Gi}" in
    *[0-9]Mi | *[0-9]Gi) ;;
    *) fugu_die "FUGU_LLIO_SHAREDTMP must be a size like 512Mi or 1Gi (got '$FUGU_LLIO_SHAREDTMP')" ;;
  esac
  # shellcheck disable=SC2034  # read by the pjsub scripts
  FUGU_PJM_LLIO_ARGS=(--llio "sharedtmp-size=${FUGU_LLIO_SHAREDTMP:-1Gi}")
}

# fugu_size_mib SIZE: 512Mi -> 512, 2Gi -> 2048.
fugu_size_mib() {
  case "$1" in
    *Gi) echo $(( ${1%Gi} * 1024 )) ;;
    *Mi) echo "${1%Mi}" ;;
  esac
}

# fugu_check_llio_fits FILE...: on the login node, fails when the files to llio_transfer do not
# fit in FUGU_LLIO_SHAREDTMP (with room to spare: they must take at most half of it).
fugu_check_llio_fits() {
  [ "${FUGU_LLIO_TRANSFER:-1}" = 1 ] || return 0
  local bytes=0 f sz mib
  for f in "$@"; do
    [ -f "$f" ] || continue
    sz=$(stat -c %s -- "$f" 2>/dev/null) || continue
    bytes=$(( bytes + sz ))
  done
  mib=$(fugu_size_mib "${FUGU_LLIO_SHAREDTMP:-1Gi}")
  if [ $(( bytes * 2 )) -gt $(( mib * 1024 * 1024 )) ]; then
    fugu_die "FUGU_LLIO_SHAREDTMP=${FUGU_LLIO_SHAREDTMP:-1Gi} is too small for llio_transfer of $(( bytes / 1048576 )) MiB ($*): set it to at least $(( (bytes * 2 + 1048575) / 1048576 ))Mi"
  fi
}

# fugu_metrics_mark RUN_DIR: the size of RUN_DIR/metrics.jsonl now (0 if none).
fugu_metrics_mark() {
  stat -c %s -- "$1/metrics.jsonl" 2>/dev/null || echo 0
}

# fugu_reconcile_exit RC RUN_DIR MARK: the exit status to report for a launcher status RC.
# Whether Fujitsu mpiexec passes a rank's exit code 4 on is not confirmed: when RC is neither 0
# nor 4 but rank 0 wrote a "stopped" event (a complete checkpoint before the limit) into
# RUN_DIR/metrics.jsonl after byte MARK (that is, in this job) and no "end" event, the job
# reports 4, so that chains and step jobs continue.
fugu_reconcile_exit() {
  local rc=$1 run=$2 mark=$3 tail_text
  if [ "$rc" = 0 ] || [ "$rc" = "$FUGU_EXIT_CHECKPOINTED" ] || [ ! -f "$run/metrics.jsonl" ]; then
    echo "$rc"
    return 0
  fi
  tail_text=$(tail -c +"$(( mark + 1 ))" -- "$run/metrics.jsonl" 2>/dev/null) || tail_text=
  if grep -q '"kind":"stopped"' <<<"$tail_text" && ! grep -q '"kind":"end"' <<<"$tail_text"; then
    fugu_log "the launcher returned $rc, but rank 0 recorded a checkpointed stop in $run/metrics.jsonl: reporting exit $FUGU_EXIT_CHECKPOINTED"
    echo "$FUGU_EXIT_CHECKPOINTED"
  else
    echo "$rc"
  fi
}
