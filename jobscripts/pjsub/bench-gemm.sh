#!/bin/bash
# fugu: the GEMM benchmark on one Fugaku node (pjsub): 1, 12 and 48 threads on 1 or 4 CMGs.
#
#   pjsub -g YOURGROUP -x FUGU_HOME=$PWD jobscripts/pjsub/bench-gemm.sh
#   pjsub -g YOURGROUP -x FUGU_HOME=$PWD -x FUGU_BENCH_SETS=fugaku jobscripts/pjsub/bench-gemm.sh
#
# Writes FUGU_OUT/gemm-tTHREADS-cCMGS.jsonl (`fugu bench gemm --format json`), one file per
# entry of FUGU_BENCH_RUNS; `fugu report --gemm FILE` charts them. A run on 1 CMG is bound to
# the first CMG (NUMA node 4 on Fugaku) with numactl. Settings: `-x VAR=value` at submission.
# eco_state=0 keeps both FP pipelines on (Fugaku's default, 2, would halve the measured peak).
#
#PJM -L "node=1"
#PJM -L "rscgrp=small"
#PJM -L "elapse=01:00:00"
#PJM -L "freq=2200,eco_state=0"
#PJM --llio "sharedtmp-size=1Gi"
#PJM --mpi "proc=1"
#PJM --mpi "max-proc-per-node=1"
#PJM -g GROUP
#PJM -x PJM_LLIO_GFSCACHE=/vol0004
#PJM -j
#PJM -S
#PJM --name fugu-bench-gemm
set -euo pipefail
if [ -n "${FUGU_ENV_FILE:-}" ]; then
  # shellcheck source=/dev/null
  . "$FUGU_ENV_FILE"
fi

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary; empty: $FUGU_HOME/target/release/fugu
: "${FUGU_BENCH_RUNS:=1:1 12:1 48:4}"  # THREADS:CMGS per run
: "${FUGU_BENCH_SETS=square,gpt2,attention,fugaku}"  # shape sets; empty: only the shapes in FUGU_BENCH_ARGS
: "${FUGU_BENCH_ARGS:=}"         # more `fugu bench gemm` arguments, e.g. "--shape 2048x2048x2048 --budget 1"
: "${FUGU_NUMA_NODES:=}"         # NUMA nodes to bind to, in order; empty: those of the job's cores (4-7)
: "${FUGU_WORKDIR:=${PJM_O_WORKDIR:-$PWD}}"  # base of relative paths
: "${FUGU_OUT:=}"                # output directory; empty: bench/gemm-JOBID
: "${FUGU_LLIO_TRANSFER:=1}"     # 1: llio_transfer the binary to the node's cache

# ----------------------------------------------------------------------------- common code
for d in "${FUGU_HOME:+$FUGU_HOME/jobscripts}" "$(dirname -- "$0")/.." \
  "${PJM_O_WORKDIR:-$PWD}/jobscripts"; do
  if [ -n "$d" ] && [ -f "$d/lib/common.sh" ]; then FUGU_COMMON=$d/lib/common.sh; break; fi
done
[ -n "${FUGU_COMMON:-}" ] || { echo "fugu: cannot find jobscripts/lib/common.sh; pass -x FUGU_HOME=<the fugu checkout>" >&2; exit 2; }
# shellcheck source=jobscripts/lib/common.sh
. "$FUGU_COMMON"

# ----------------------------------------------------------------------------- the job
: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
# LLIO first: nothing may open or stat the binary before llio_transfer.
fugu_abs_bin
fugu_llio_transfer "$FUGU_BIN"
fugu_require_bin
FUGU_OUT=$(fugu_abs "${FUGU_OUT:-bench/gemm-${PJM_JOBID:-local}}")
mkdir -p "$FUGU_OUT" || fugu_die "cannot create FUGU_OUT=$FUGU_OUT"
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}
export PLE_MPI_STD_EMPTYFILE=${PLE_MPI_STD_EMPTYFILE:-off}
fugu_log "job ${PJM_JOBID:-?}: GEMM benchmark runs '$FUGU_BENCH_RUNS' -> $FUGU_OUT"
rc=0
fugu_bench_gemm_runs || rc=$?
fugu_llio_purge "$FUGU_BIN"
fugu_log "done (exit $rc): $(cd "$FUGU_OUT" && echo ./*)"
exit "$rc"
