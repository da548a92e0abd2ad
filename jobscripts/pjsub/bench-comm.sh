#!/bin/bash
# fugu: the communication benchmark on Fugaku (pjsub): all-reduce, reduce-scatter, all-gather,
# broadcast and send/recv over message sizes, 2 nodes x 4 ranks (one rank per CMG).
#
#   pjsub -g YOURGROUP -x FUGU_HOME=$PWD jobscripts/pjsub/bench-comm.sh
#   echo 'export FUGU_COMM_ARGS="--max-size 64MiB --op allreduce,allgather"' >comm.env
#   pjsub -g YOURGROUP -L node=16 --mpi proc=64 -x FUGU_HOME=$PWD -x FUGU_ENV_FILE=$PWD/comm.env \
#         jobscripts/pjsub/bench-comm.sh
#
# Writes FUGU_OUT/comm-NODESnRANKSr.json (RANKS: all ranks of the job), the JSON document rank 0
# of `fugu bench comm --format json` prints. mpiexec collects the ranks' stdout in a temporary
# file (-ofout; by default Fujitsu mpiexec writes one file per rank under output.JOBID/), which
# is moved into place only when the benchmark succeeded. Settings: `-x VAR=value` at submission,
# or `export` lines in FUGU_ENV_FILE for values with spaces or commas (FUGU_COMM_ARGS). When the
# node count changes, change proc with it: proc = node x 4.
# eco_state=0 keeps both FP pipelines on, as in the training jobs the numbers are meant for.
#
#PJM -L "node=2"
#PJM -L "rscgrp=small"
#PJM -L "elapse=00:30:00"
#PJM -L "freq=2200,eco_state=0"
#PJM --llio "sharedtmp-size=1Gi"
#PJM --mpi "proc=8"
#PJM --mpi "max-proc-per-node=4"
#PJM -g GROUP
#PJM -x PJM_LLIO_GFSCACHE=/vol0004
#PJM -j
#PJM -S
#PJM --name fugu-bench-comm
set -euo pipefail
if [ -n "${FUGU_ENV_FILE:-}" ]; then
  # shellcheck source=/dev/null
  . "$FUGU_ENV_FILE"
fi

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary (built with --features mpi); empty: $FUGU_HOME/target/release/fugu
: "${FUGU_COMM_ARGS:=}"          # more `fugu bench comm` arguments, e.g. "--max-size 64MiB --repeats 10" (split on spaces)
: "${FUGU_RANKS_PER_NODE:=4}"    # ranks per node, for the node count when PJM_NODE is unset (keep equal to --mpi max-proc-per-node)
: "${FUGU_MPIEXEC_ARGS:=}"       # extra mpiexec options (split on spaces; no -of/-std output options: rank 0's stdout is the result)
: "${FUGU_WORKDIR:=${PJM_O_WORKDIR:-$PWD}}"  # base of relative paths
: "${FUGU_OUT:=}"                # output directory; empty: bench/comm-JOBID
: "${FUGU_LLIO_TRANSFER:=1}"     # 1: llio_transfer the binary to the nodes' cache

# ----------------------------------------------------------------------------- common code
# pjsub may run a copy of this script: find lib/common.sh through FUGU_HOME, next to this
# file, or below the submission directory.
for d in "${FUGU_HOME:+$FUGU_HOME/jobscripts}" "$(dirname -- "$0")/.." \
  "${PJM_O_WORKDIR:-$PWD}/jobscripts"; do
  if [ -n "$d" ] && [ -f "$d/lib/common.sh" ]; then FUGU_COMMON=$d/lib/common.sh; break; fi
done
[ -n "${FUGU_COMMON:-}" ] || { echo "fugu: cannot find jobscripts/lib/common.sh; pass -x FUGU_HOME=<the fugu checkout>" >&2; exit 2; }
# shellcheck source=jobscripts/lib/common.sh
. "$FUGU_COMMON"

# ----------------------------------------------------------------------------- the job
: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
ranks=${FUGU_RANKS:-${PJM_MPI_PROC:-}}
[ -n "$ranks" ] || fugu_die "PJM_MPI_PROC is unset: submit with pjsub and --mpi \"proc=N\" (or set FUGU_RANKS)"
fugu_require_uint ranks FUGU_RANKS_PER_NODE
[ "$FUGU_RANKS_PER_NODE" -ge 1 ] || fugu_die "FUGU_RANKS_PER_NODE must be at least 1"
nodes=${PJM_NODE:-}
case "$nodes" in '' | *[!0-9]*) nodes=$(( (ranks + FUGU_RANKS_PER_NODE - 1) / FUGU_RANKS_PER_NODE )) ;; esac

# LLIO first: nothing may open or stat the binary before llio_transfer.
fugu_abs_bin
fugu_llio_transfer "$FUGU_BIN"
fugu_require_bin
[ "$ranks" -ge 2 ] || fugu_die "fugu bench comm measures transfers between ranks: this job has $ranks (submit with --mpi \"proc=N\", N >= 2)"
FUGU_OUT=$(fugu_abs "${FUGU_OUT:-bench/comm-${PJM_JOBID:-local}}")
mkdir -p "$FUGU_OUT" || fugu_die "cannot create FUGU_OUT=$FUGU_OUT"
file=$FUGU_OUT/comm-${nodes}n${ranks}r.json
tmp=$file.tmp-$$
trap 'rm -f -- "$tmp"' EXIT

read -r -a comm_args <<<"$FUGU_COMM_ARGS"
comm_args=(bench comm --format json "${comm_args[@]}")
read -r -a mpiexec_args <<<"$FUGU_MPIEXEC_ARGS"
# Fujitsu's large-page runtime: allocate on first touch (each CMG's buffers in its own HBM).
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}
# No empty per-rank stdout/stderr files from mpiexec.
export PLE_MPI_STD_EMPTYFILE=${PLE_MPI_STD_EMPTYFILE:-off}

jobid=${PJM_JOBID:-unknown}
fugu_log "job $jobid: communication benchmark, $ranks rank(s) on $nodes node(s) (at most $FUGU_RANKS_PER_NODE per node) -> $file"
fugu_log "mpiexec -n $ranks -ofout $tmp ${mpiexec_args[*]} $FUGU_BIN ${comm_args[*]}"
fugu_run_forwarding mpiexec -n "$ranks" -ofout "$tmp" "${mpiexec_args[@]}" "$FUGU_BIN" "${comm_args[@]}"
rc=$FUGU_RC
fugu_llio_purge "$FUGU_BIN"
if [ "$rc" != 0 ]; then
  fugu_log "the benchmark failed (exit $rc); see the log above and the ranks' stderr. No result written."
  exit "$rc"
fi
if ! fugu_comm_publish "$tmp" "$file"; then
  fugu_log "no result written to $file"
  exit 1
fi
fugu_log "wrote $file ($(grep -c '"op":' "$file") rows)"
