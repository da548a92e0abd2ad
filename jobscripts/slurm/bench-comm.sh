#!/bin/bash
# fugu: the communication benchmark under Slurm: all-reduce, reduce-scatter, all-gather,
# broadcast and send/recv over message sizes, 2 nodes x 4 ranks (one rank per A64FX CMG).
#
#   sbatch jobscripts/slurm/bench-comm.sh
#   FUGU_COMM_ARGS="--max-size 64MiB --op allreduce,allgather" sbatch --nodes=4 jobscripts/slurm/bench-comm.sh
#
# Writes FUGU_OUT/comm-NODESnRANKSr.json (RANKS: all ranks of the job), the JSON document rank 0
# of `fugu bench comm --format json` prints; it is moved into place only when the benchmark
# succeeded. Every FUGU_* setting below may be set in the environment at submission, and sbatch
# options (--nodes, --ntasks-per-node) override the #SBATCH lines. See docs/JOBS.md.
#
#SBATCH --job-name=fugu-bench-comm
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=12
#SBATCH --time=00:30:00
#SBATCH --output=fugu-bench-comm-%j.out
set -euo pipefail

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary (built with --features mpi); empty: $FUGU_HOME/target/release/fugu
: "${FUGU_COMM_ARGS:=}"          # more `fugu bench comm` arguments, e.g. "--max-size 64MiB --repeats 10" (split on spaces)
: "${FUGU_LAUNCHER:=srun}"       # srun | mpirun
: "${FUGU_SRUN_ARGS:=--cpu-bind=cores}"   # extra srun options (e.g. --mpi=pmix)
: "${FUGU_MPIRUN_ARGS:=}"        # mpirun placement; empty: --map-by ppr:R:node:pe=CPUS --bind-to core
: "${FUGU_WORKDIR:=${SLURM_SUBMIT_DIR:-$PWD}}"  # base of relative paths
: "${FUGU_OUT:=}"                # output directory; empty: bench/comm-JOBID

# ----------------------------------------------------------------------------- common code
# Slurm runs a copy of this script from its spool directory: find lib/common.sh through
# FUGU_HOME, next to this file, next to the submitted script (scontrol) or in the submit dir.
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
[ -n "${SLURM_JOB_ID:-}" ] || fugu_die "not inside a Slurm job (SLURM_JOB_ID is unset): submit with sbatch"
: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
fugu_require_bin
ranks=${SLURM_NTASKS:-1}
nodes=${SLURM_JOB_NUM_NODES:-1}
cpus=${SLURM_CPUS_PER_TASK:-1}
fugu_require_uint ranks nodes cpus
[ "$ranks" -ge 2 ] || fugu_die "fugu bench comm measures transfers between ranks: this job has $ranks (submit with --ntasks or --ntasks-per-node of at least 2)"
ranks_per_node=$(( (ranks + nodes - 1) / nodes ))
FUGU_OUT=$(fugu_abs "${FUGU_OUT:-bench/comm-$SLURM_JOB_ID}")
mkdir -p "$FUGU_OUT" || fugu_die "cannot create FUGU_OUT=$FUGU_OUT"
file=$FUGU_OUT/comm-${nodes}n${ranks}r.json
tmp=$file.tmp-$$
trap 'rm -f -- "$tmp"' EXIT

read -r -a comm_args <<<"$FUGU_COMM_ARGS"
comm_args=(bench comm --format json "${comm_args[@]}")
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}

case "$FUGU_LAUNCHER" in
  srun)
    read -r -a launcher_args <<<"$FUGU_SRUN_ARGS"
    # srun does not inherit --cpus-per-task from sbatch since Slurm 22.05: pass it.
    launcher=(srun --ntasks="$ranks" --cpus-per-task="$cpus" "${launcher_args[@]}") ;;
  mpirun)
    if [ -n "$FUGU_MPIRUN_ARGS" ]; then
      read -r -a launcher_args <<<"$FUGU_MPIRUN_ARGS"
    else
      launcher_args=(--map-by "ppr:$ranks_per_node:node:pe=$cpus" --bind-to core)
    fi
    launcher=(mpirun -np "$ranks" "${launcher_args[@]}") ;;
  *) fugu_die "FUGU_LAUNCHER must be srun or mpirun (got '$FUGU_LAUNCHER')" ;;
esac

fugu_log "job $SLURM_JOB_ID: communication benchmark, $nodes node(s) x $ranks_per_node rank(s) ($ranks in all) -> $file"
fugu_log "${launcher[*]} $FUGU_BIN ${comm_args[*]} > $tmp"
fugu_run_forwarding "${launcher[@]}" "$FUGU_BIN" "${comm_args[@]}" >"$tmp"
rc=$FUGU_RC
if [ "$rc" != 0 ]; then
  fugu_log "the benchmark failed (exit $rc); see the log above. No result written."
  exit "$rc"
fi
if ! fugu_comm_publish "$tmp" "$file"; then
  fugu_log "no result written to $file"
  exit 1
fi
fugu_log "wrote $file ($(grep -c '"op":' "$file") rows)"
