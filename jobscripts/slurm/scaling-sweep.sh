#!/bin/bash
# fugu: a scaling sweep under Slurm: the same training at several node (or rank) counts, an
# optional GEMM benchmark, and a `fugu report` job that runs when they have finished.
#
# Run it on the login node (it calls sbatch; it is not itself a batch job):
#   FUGU_CONFIG=gpt2-124m FUGU_STEPS=200 FUGU_SWEEP="1 2 4 8" jobscripts/slurm/scaling-sweep.sh
#   FUGU_SWEEP="1x1 1x2 1x4" jobscripts/slurm/scaling-sweep.sh    # 1, 2, 4 ranks on one node
# The training settings of jobscripts/slurm/train.sh (FUGU_CONFIG, FUGU_STEPS, FUGU_TP, ...) are
# passed on to every training job. Everything lands in FUGU_SWEEP_DIR: runs/, gemm/, logs/,
# jobs.txt (the job ids) and report/REPORT.md. See docs/JOBS.md.
#
# The #SBATCH lines below are for the report job, which is this script again with
# FUGU_SWEEP_MODE=report.
#SBATCH --job-name=fugu-report
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=4
#SBATCH --time=00:30:00
set -euo pipefail

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary; empty: $FUGU_HOME/target/release/fugu
: "${FUGU_CONFIG:=gpt2-124m}"    # model config for every run (see train.sh for the other FUGU_* settings)
: "${FUGU_SWEEP:=1 2 4 8}"       # node counts, or NODESxRANKS_PER_NODE entries
: "${FUGU_RANKS_PER_NODE:=4}"    # ranks per node for plain node-count entries (4 = one per A64FX CMG)
: "${FUGU_THREADS:=12}"          # threads (= --cpus-per-task) per rank
: "${FUGU_TIME:=01:00:00}"       # time limit of each training job
: "${FUGU_SWEEP_GEMM:=1}"        # 1: also submit bench-gemm.sh and chart its results in the report
: "${FUGU_BENCH_TIME:=01:00:00}" # time limit of the GEMM benchmark job
: "${FUGU_BENCH_CPUS:=48}"       # CPUs of the GEMM benchmark job (at least the most threads in FUGU_BENCH_RUNS)
: "${FUGU_REPORT_DEPENDENCY:=afterok}"  # afterok: report only if every job succeeded; afterany: always
: "${FUGU_SBATCH_ARGS:=}"        # extra sbatch options for every job, e.g. "--partition=a64fx --account=proj"
: "${FUGU_WORKDIR:=${SLURM_SUBMIT_DIR:-$PWD}}"  # base of relative paths
: "${FUGU_SWEEP_DIR:=}"          # output folder; empty: runs/sweep-CONFIG-DATE
: "${FUGU_SWEEP_MODE:=submit}"   # submit (on the login node) | report (inside the report job)

# ----------------------------------------------------------------------------- common code
for d in "${FUGU_HOME:+$FUGU_HOME/jobscripts}" "$(dirname -- "$0")/.." scontrol "${SLURM_SUBMIT_DIR:-$PWD}/jobscripts"; do
  if [ "$d" = scontrol ]; then  # the submitted script's folder, asked only when needed
    d=$([ -z "${SLURM_JOB_ID:-}" ] || scontrol show job "$SLURM_JOB_ID" 2>/dev/null |
      sed -n 's|^ *Command=\(.*\)/[^/]*/[^/ ]*$|\1|p') || d=
  fi
  if [ -n "$d" ] && [ -f "$d/lib/common.sh" ]; then FUGU_COMMON=$d/lib/common.sh; break; fi
done
[ -n "${FUGU_COMMON:-}" ] || { echo "fugu: cannot find jobscripts/lib/common.sh; set FUGU_HOME to the fugu checkout" >&2; exit 2; }
# shellcheck source=jobscripts/lib/common.sh
. "$FUGU_COMMON"

: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
fugu_require_bin
export FUGU_BIN

# ----------------------------------------------------------------------------- report job
if [ "$FUGU_SWEEP_MODE" = report ]; then
  [ -n "$FUGU_SWEEP_DIR" ] || fugu_die "FUGU_SWEEP_DIR is empty in report mode"
  fugu_sweep_report "$FUGU_SWEEP_DIR"
  exit 0
fi
[ "$FUGU_SWEEP_MODE" = submit ] || fugu_die "FUGU_SWEEP_MODE must be submit or report (got '$FUGU_SWEEP_MODE')"

# ----------------------------------------------------------------------------- submission
command -v sbatch >/dev/null || fugu_die "sbatch not found: run this on a Slurm login node"
fugu_require_uint FUGU_RANKS_PER_NODE FUGU_THREADS FUGU_SWEEP_GEMM FUGU_BENCH_CPUS
FUGU_SWEEP_DIR=$(fugu_abs "${FUGU_SWEEP_DIR:-runs/sweep-$(fugu_sanitize "$FUGU_CONFIG")-$(date +%Y%m%d-%H%M%S)}")
case "$FUGU_SWEEP_DIR" in *,*) fugu_die "FUGU_SWEEP_DIR must not contain a comma (sbatch --export)" ;; esac
mkdir -p "$FUGU_SWEEP_DIR/runs" "$FUGU_SWEEP_DIR/logs"
read -r -a common_args <<<"$FUGU_SBATCH_ARGS"
export FUGU_CONFIG FUGU_THREADS
deps=()

submit() {  # submit KIND NAME SBATCH_ARGS... : sbatch, record the id in jobs.txt
  local kind=$1 name=$2 jid
  shift 2
  jid=$(sbatch --parsable "${common_args[@]}" "$@") || fugu_die "sbatch failed for $kind $name"
  jid=${jid%%;*}
  echo "$kind $name $jid" >>"$FUGU_SWEEP_DIR/jobs.txt"
  fugu_log "submitted $kind $name: job $jid"
  deps+=("$jid")
}

for entry in $FUGU_SWEEP; do
  nodes=${entry%%x*}
  rpn=$FUGU_RANKS_PER_NODE
  case "$entry" in *x*) rpn=${entry#*x} ;; esac
  case "$nodes$rpn" in '' | *[!0-9]*) fugu_die "FUGU_SWEEP entry '$entry' is not NODES or NODESxRANKS_PER_NODE" ;; esac
  name=N$nodes-n$(( nodes * rpn ))
  submit train "$name" --export="ALL,FUGU_OUT=$FUGU_SWEEP_DIR/runs/$name,FUGU_AUTO_RESUBMIT=0" \
    --job-name="fugu-$name" --nodes="$nodes" --ntasks-per-node="$rpn" \
    --cpus-per-task="$FUGU_THREADS" --time="$FUGU_TIME" --output="$FUGU_SWEEP_DIR/logs/%x-%j.out" \
    "$FUGU_JOBSCRIPTS/slurm/train.sh"
done

if [ "$FUGU_SWEEP_GEMM" = 1 ]; then
  submit gemm bench --export="ALL,FUGU_OUT=$FUGU_SWEEP_DIR/gemm" \
    --job-name=fugu-bench-gemm --time="$FUGU_BENCH_TIME" --cpus-per-task="$FUGU_BENCH_CPUS" \
    --output="$FUGU_SWEEP_DIR/logs/%x-%j.out" "$FUGU_JOBSCRIPTS/slurm/bench-gemm.sh"
fi

dep=$FUGU_REPORT_DEPENDENCY:$(IFS=:; echo "${deps[*]}")
submit report report --export="ALL,FUGU_SWEEP_MODE=report,FUGU_SWEEP_DIR=$FUGU_SWEEP_DIR" \
  --dependency="$dep" --output="$FUGU_SWEEP_DIR/logs/%x-%j.out" \
  "$FUGU_JOBSCRIPTS/slurm/scaling-sweep.sh"
fugu_log "sweep folder $FUGU_SWEEP_DIR; the report will be $FUGU_SWEEP_DIR/report/REPORT.md"
