#!/bin/bash
# fugu: a scaling sweep on Fugaku (pjsub): the same training at several node counts, a GEMM
# benchmark, and a `fugu report` job after them.
#
# Run it on the login node (it calls pjsub; it is not itself a job):
#   FUGU_GROUP=hp000000 FUGU_CONFIG=gpt2-124m FUGU_STEPS=200 FUGU_SWEEP="1 2 4 8" \
#     jobscripts/pjsub/scaling-sweep.sh
# The training settings of jobscripts/pjsub/train.sh (FUGU_CONFIG, FUGU_STEPS, FUGU_TP, ...) are
# handed to every job through a settings file (FUGU_ENV_FILE). Everything lands in
# FUGU_SWEEP_DIR: runs/, gemm/, env/, jobs.txt (the job ids) and report/REPORT.md.
#
# PJM has no dependencies between independent jobs, so the sweep is one step job (pjsub --step):
# its sub-jobs run one after another, the report last. FUGU_SWEEP_STEP=0 submits the runs as
# independent jobs instead (they may run at the same time) and prints the command for the
# report, to submit when they are done.
#
# The #PJM lines below are for the report job, which is this script again with
# FUGU_SWEEP_MODE=report.
#PJM -L "node=1"
#PJM -L "rscgrp=small"
#PJM -L "elapse=00:30:00"
#PJM --mpi "proc=1"
#PJM --mpi "max-proc-per-node=1"
#PJM -g GROUP
#PJM -x PJM_LLIO_GFSCACHE=/vol0004
#PJM -j
#PJM -S
#PJM --name fugu-report
set -euo pipefail
if [ -n "${FUGU_ENV_FILE:-}" ]; then
  # shellcheck source=/dev/null
  . "$FUGU_ENV_FILE"
fi

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary; empty: $FUGU_HOME/target/release/fugu
: "${FUGU_CONFIG:=gpt2-124m}"    # model config for every run (see train.sh for the other FUGU_* settings)
: "${FUGU_SWEEP:=1 2 4 8}"       # node counts, or NODESxRANKS_PER_NODE entries
: "${FUGU_RANKS_PER_NODE:=4}"    # ranks per node for plain node-count entries (4 = one per CMG)
: "${FUGU_ELAPSE:=01:00:00}"     # elapse limit of each training job
: "${FUGU_SWEEP_GEMM:=1}"        # 1: also run bench-gemm.sh and chart its results in the report
: "${FUGU_BENCH_ELAPSE:=01:00:00}"  # elapse limit of the GEMM benchmark job
: "${FUGU_SWEEP_STEP:=1}"        # 1: one step job (runs in sequence, report last); 0: independent jobs
: "${FUGU_ECO_STATE:=0}"         # power knob eco_state of the training and GEMM jobs: 0 = both FP pipelines
: "${FUGU_LLIO_SHAREDTMP:=1Gi}"  # --llio sharedtmp-size per node, room for llio_transfer of the binary
: "${FUGU_GROUP:=}"              # -g for every job; empty: the #PJM -g lines of the scripts
: "${FUGU_RSCGRP:=}"             # -L rscgrp= for the training jobs; empty: small, or large above 384 nodes
: "${FUGU_PJSUB_ARGS:=}"         # extra pjsub options for every job (split on spaces)
: "${FUGU_WORKDIR:=${PJM_O_WORKDIR:-$PWD}}"  # base of relative paths
: "${FUGU_SWEEP_DIR:=}"          # output folder; empty: runs/sweep-CONFIG-DATE
: "${FUGU_SWEEP_MODE:=submit}"   # submit (on the login node) | report (inside the report job)

# ----------------------------------------------------------------------------- common code
for d in "${FUGU_HOME:+$FUGU_HOME/jobscripts}" "$(dirname -- "$0")/.." \
  "${PJM_O_WORKDIR:-$PWD}/jobscripts"; do
  if [ -n "$d" ] && [ -f "$d/lib/common.sh" ]; then FUGU_COMMON=$d/lib/common.sh; break; fi
done
[ -n "${FUGU_COMMON:-}" ] || { echo "fugu: cannot find jobscripts/lib/common.sh; pass -x FUGU_HOME=<the fugu checkout>" >&2; exit 2; }
# shellcheck source=jobscripts/lib/common.sh
. "$FUGU_COMMON"

: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"

# ----------------------------------------------------------------------------- report job
if [ "$FUGU_SWEEP_MODE" = report ]; then
  [ -n "$FUGU_SWEEP_DIR" ] || fugu_die "FUGU_SWEEP_DIR is empty in report mode"
  fugu_require_bin
  fugu_sweep_report "$FUGU_SWEEP_DIR"
  exit 0
fi
[ "$FUGU_SWEEP_MODE" = submit ] || fugu_die "FUGU_SWEEP_MODE must be submit or report (got '$FUGU_SWEEP_MODE')"

# ----------------------------------------------------------------------------- submission
command -v pjsub >/dev/null || fugu_die "pjsub not found: run this on a Fugaku login node"
# The binary is for A64FX and may not run on the (x86) login node: only check that it is there.
[ -f "$FUGU_BIN" ] || fugu_die "FUGU_BIN=$FUGU_BIN does not exist: build it (docs/JOBS.md) or set FUGU_BIN"
fugu_require_uint FUGU_RANKS_PER_NODE FUGU_SWEEP_GEMM FUGU_SWEEP_STEP
fugu_pjm_power_args
fugu_pjm_llio_args
fugu_check_llio_fits "$FUGU_BIN"
FUGU_SWEEP_DIR=$(fugu_abs "${FUGU_SWEEP_DIR:-runs/sweep-$(fugu_sanitize "$FUGU_CONFIG")-$(date +%Y%m%d-%H%M%S)}")
mkdir -p "$FUGU_SWEEP_DIR/runs" "$FUGU_SWEEP_DIR/env"
read -r -a common_args <<<"$FUGU_PJSUB_ARGS"
[ -z "$FUGU_GROUP" ] || common_args+=(-g "$FUGU_GROUP")
step_jid=

submit() {  # submit KIND NAME ENVFILE PJSUB_ARGS... SCRIPT: pjsub, record the id in jobs.txt
  local kind=$1 name=$2 envfile=$3 jid step=()
  shift 3
  if [ "$FUGU_SWEEP_STEP" = 1 ]; then
    step=(--step)
    [ -z "$step_jid" ] || step+=(--sparam "jid=$step_jid")
  fi
  jid=$(fugu_pjsub "${step[@]}" "${common_args[@]}" -x "FUGU_ENV_FILE=$envfile" "$@")
  [ -n "$step_jid" ] || [ "$FUGU_SWEEP_STEP" != 1 ] || step_jid=${jid%%_*}
  echo "$kind $name $jid" >>"$FUGU_SWEEP_DIR/jobs.txt"
  fugu_log "submitted $kind $name: job $jid"
}

base_vars=("${FUGU_PJSUB_SETTINGS[@]}" FUGU_BENCH_RUNS FUGU_BENCH_SETS FUGU_BENCH_ARGS FUGU_NUMA_NODES)
for entry in $FUGU_SWEEP; do
  nodes=${entry%%x*}
  rpn=$FUGU_RANKS_PER_NODE
  case "$entry" in *x*) rpn=${entry#*x} ;; esac
  case "$nodes$rpn" in '' | *[!0-9]*) fugu_die "FUGU_SWEEP entry '$entry' is not NODES or NODESxRANKS_PER_NODE" ;; esac
  name=N$nodes-n$(( nodes * rpn ))
  rscgrp=$FUGU_RSCGRP
  if [ -z "$rscgrp" ]; then
    if [ "$nodes" -gt 384 ]; then rscgrp=large; else rscgrp=small; fi
  fi
  env_file=$FUGU_SWEEP_DIR/env/$name.sh
  FUGU_OUT=$FUGU_SWEEP_DIR/runs/$name FUGU_RANKS_PER_NODE=$rpn FUGU_AUTO_RESUBMIT=0 \
    fugu_write_env "$env_file" "${base_vars[@]}"
  submit train "$name" "$env_file" -L "node=$nodes" -L "rscgrp=$rscgrp" -L "elapse=$FUGU_ELAPSE" \
    "${FUGU_PJM_POWER_ARGS[@]}" "${FUGU_PJM_LLIO_ARGS[@]}" --mpi "proc=$(( nodes * rpn ))" --mpi "max-proc-per-node=$rpn" --name "fugu-$name" \
    "$FUGU_JOBSCRIPTS/pjsub/train.sh"
done

if [ "$FUGU_SWEEP_GEMM" = 1 ]; then
  env_file=$FUGU_SWEEP_DIR/env/gemm.sh
  FUGU_OUT=$FUGU_SWEEP_DIR/gemm fugu_write_env "$env_file" "${base_vars[@]}"
  submit gemm bench "$env_file" -L "elapse=$FUGU_BENCH_ELAPSE" "${FUGU_PJM_POWER_ARGS[@]}" \
    "${FUGU_PJM_LLIO_ARGS[@]}" "$FUGU_JOBSCRIPTS/pjsub/bench-gemm.sh"
fi

env_file=$FUGU_SWEEP_DIR/env/report.sh
FUGU_SWEEP_MODE=report FUGU_SWEEP_DIR=$FUGU_SWEEP_DIR fugu_write_env "$env_file" "${base_vars[@]}" FUGU_SWEEP_MODE FUGU_SWEEP_DIR
if [ "$FUGU_SWEEP_STEP" = 1 ]; then
  submit report report "$env_file" "$FUGU_JOBSCRIPTS/pjsub/scaling-sweep.sh"
  fugu_log "sweep folder $FUGU_SWEEP_DIR; the report will be $FUGU_SWEEP_DIR/report/REPORT.md"
else
  fugu_log "sweep folder $FUGU_SWEEP_DIR; when the jobs are done, submit the report with:"
  fugu_log "  pjsub ${common_args[*]} -x FUGU_ENV_FILE=$env_file $FUGU_JOBSCRIPTS/pjsub/scaling-sweep.sh"
fi
