#!/bin/bash
# fugu: the GEMM benchmark on one node under Slurm, with 1, 12 and 48 threads on 1 or 4 CMGs.
#
#   sbatch jobscripts/slurm/bench-gemm.sh
#   FUGU_BENCH_RUNS="1:1 12:1 12:4 48:4" FUGU_BENCH_SETS=fugaku sbatch jobscripts/slurm/bench-gemm.sh
#
# Writes FUGU_OUT/gemm-tTHREADS-cCMGS.jsonl (`fugu bench gemm --format json`), one file per
# entry of FUGU_BENCH_RUNS; `fugu report --gemm FILE` charts them. Every FUGU_* setting below
# may be set in the environment at submission. See docs/JOBS.md.
#
#SBATCH --job-name=fugu-bench-gemm
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=48
#SBATCH --time=01:00:00
#SBATCH --output=fugu-bench-gemm-%j.out
set -euo pipefail

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary; empty: $FUGU_HOME/target/release/fugu
: "${FUGU_BENCH_RUNS:=1:1 12:1 48:4}"  # THREADS:CMGS per run (a CMG = a NUMA domain of 12 A64FX cores)
: "${FUGU_BENCH_SETS=square,gpt2,attention,fugaku}"  # shape sets; empty: only the shapes in FUGU_BENCH_ARGS
: "${FUGU_BENCH_ARGS:=}"         # more `fugu bench gemm` arguments, e.g. "--shape 2048x2048x2048 --budget 1"
: "${FUGU_NUMA_NODES:=}"         # NUMA nodes to bind to, in order; empty: those this job may use
: "${FUGU_WORKDIR:=${SLURM_SUBMIT_DIR:-$PWD}}"  # base of relative paths
: "${FUGU_OUT:=}"                # output directory; empty: bench/gemm-JOBID

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

# ----------------------------------------------------------------------------- the job
: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
fugu_require_bin
FUGU_OUT=$(fugu_abs "${FUGU_OUT:-bench/gemm-${SLURM_JOB_ID:-local}}")
mkdir -p "$FUGU_OUT" || fugu_die "cannot create FUGU_OUT=$FUGU_OUT"
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}
fugu_log "job ${SLURM_JOB_ID:-?}: GEMM benchmark runs '$FUGU_BENCH_RUNS' -> $FUGU_OUT"
fugu_bench_gemm_runs
fugu_log "done: $(ls "$FUGU_OUT")"
