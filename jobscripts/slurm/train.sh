#!/bin/bash
# fugu: train a GPT under Slurm, one MPI rank per CMG (NUMA domain) with FUGU_THREADS threads.
#
#   sbatch jobscripts/slurm/train.sh                                # gpt2-124m, 1 node x 4 ranks
#   FUGU_CONFIG=gpt2-350m FUGU_STEPS=2000 sbatch -N 8 jobscripts/slurm/train.sh
#
# Every FUGU_* setting below may be set in the environment at submission (sbatch exports the
# submitting environment by default). Options given to sbatch override the #SBATCH lines.
# The job always passes --resume auto: submitting it again with the same settings continues the
# run in FUGU_OUT. Before the time limit Slurm sends SIGUSR1 to this batch shell (--signal
# below); it is forwarded to the ranks, which write a checkpoint and exit with code 4. With
# FUGU_AUTO_RESUBMIT=1 the job then submits its own continuation. See docs/JOBS.md.
#
#SBATCH --job-name=fugu-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=12
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --output=fugu-train-%j.out
set -euo pipefail

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary (built with --features mpi); empty: $FUGU_HOME/target/release/fugu
: "${FUGU_CONFIG:=gpt2-124m}"    # built-in config name or a TOML file
: "${FUGU_DATA:=}"               # training data (manifest, shard pattern, .bin); empty: the bundled corpus
: "${FUGU_STEPS:=}"              # total optimizer steps; empty: the config's
: "${FUGU_BATCH_SIZE:=}"         # --batch-size; empty: the config's
: "${FUGU_SEQ_LEN:=}"            # --seq-len; empty: the config's
: "${FUGU_TP:=1}"                # tensor-parallel degree (divides the rank count)
: "${FUGU_PP:=1}"                # pipeline stages (FUGU_TP x FUGU_PP divides the rank count)
: "${FUGU_PP_LAYERS:=}"          # --pp-layers: blocks per stage (e.g. 5,5,4; `fugu predict` prints them); empty: balanced
: "${FUGU_ZERO:=0}"              # 1: shard the optimizer state over data-parallel ranks (ZeRO-1)
: "${FUGU_PRECISION:=}"          # fp32 | bf16 | fp16 (mixed precision); empty: the config's
: "${FUGU_MICRO_BATCHES:=}"      # --micro-batches (gradient accumulation); empty: 1
: "${FUGU_RECOMPUTE:=}"          # none | attention | full (activation recomputation); empty: none
: "${FUGU_LOSS_CHUNK:=}"         # --loss-chunk ROWS (the LM head and loss in chunks); empty: whole
: "${FUGU_THREADS:=${SLURM_CPUS_PER_TASK:-12}}"  # compute threads per rank (12 = one A64FX CMG)
: "${FUGU_WORKDIR:=${SLURM_SUBMIT_DIR:-$PWD}}"  # base of the relative paths below
: "${FUGU_OUT:=}"                # run directory; empty: runs/CONFIG-nRANKS-tpTP (stable across resubmits)
: "${FUGU_CKPT_EVERY:=}"         # checkpoint every N steps; empty: the config's
: "${FUGU_EVAL_EVERY:=}"         # evaluate every N steps; empty: the config's
: "${FUGU_LOG_EVERY:=}"          # progress line every N steps; empty: the trainer's default
: "${FUGU_TIMERS:=}"             # off | coarse | fine; empty: the trainer's default
: "${FUGU_DEADLINE:=}"           # extra --deadline (seconds or RFC 3339); empty: the trainer reads the job's end time
: "${FUGU_EXTRA_ARGS:=}"         # more `fugu train` arguments (split on spaces)
: "${FUGU_LAUNCHER:=srun}"       # srun | mpirun
: "${FUGU_SRUN_ARGS:=--cpu-bind=cores}"   # extra srun options (e.g. --mpi=pmix)
: "${FUGU_MPIRUN_ARGS:=}"        # mpirun placement; empty: --map-by ppr:R:node:pe=THREADS --bind-to core
: "${FUGU_AUTO_RESUBMIT:=0}"     # 1: after exit 4 (checkpointed before the limit) submit the continuation
: "${FUGU_RESUBMIT_MAX:=20}"     # stop resubmitting after this many continuations
: "${FUGU_RESUBMIT_COUNT:=0}"    # continuations so far (set by the resubmission itself)
: "${FUGU_SBATCH_ARGS:=}"        # extra sbatch options for the resubmission (split on spaces)

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
FUGU_RANKS=${SLURM_NTASKS:-1}
nodes=${SLURM_JOB_NUM_NODES:-1}
ranks_per_node=$(( (FUGU_RANKS + nodes - 1) / nodes ))
fugu_setup_train
fugu_train_args

# Fujitsu's large-page runtime (A64FX): allocate pages on first touch, so that each CMG's
# threads get their own HBM. Ignored where that runtime is absent.
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}
export OMP_NUM_THREADS=$FUGU_THREADS

case "$FUGU_LAUNCHER" in
  srun)
    read -r -a launcher_args <<<"$FUGU_SRUN_ARGS"
    # srun does not inherit --cpus-per-task from sbatch since Slurm 22.05: pass it.
    launcher=(srun --ntasks="$FUGU_RANKS" --cpus-per-task="$FUGU_THREADS" "${launcher_args[@]}") ;;
  mpirun)
    if [ -n "$FUGU_MPIRUN_ARGS" ]; then
      read -r -a launcher_args <<<"$FUGU_MPIRUN_ARGS"
    else
      launcher_args=(--map-by "ppr:$ranks_per_node:node:pe=$FUGU_THREADS" --bind-to core)
    fi
    launcher=(mpirun -np "$FUGU_RANKS" "${launcher_args[@]}") ;;
  *) fugu_die "FUGU_LAUNCHER must be srun or mpirun (got '$FUGU_LAUNCHER')" ;;
esac

fugu_log "job $SLURM_JOB_ID: $nodes node(s) x $ranks_per_node rank(s) x $FUGU_THREADS thread(s), tp=$FUGU_TP pp=$FUGU_PP zero=$FUGU_ZERO, continuation $FUGU_RESUBMIT_COUNT"
fugu_log "run directory $FUGU_OUT"
fugu_log "${launcher[*]} $FUGU_BIN ${FUGU_TRAIN_ARGS[*]}"
fugu_job_record "slurm job $SLURM_JOB_ID start ($FUGU_RANKS rank(s) on $nodes node(s))"
fugu_run_forwarding "${launcher[@]}" "$FUGU_BIN" "${FUGU_TRAIN_ARGS[@]}"
rc=$FUGU_RC
fugu_job_record "slurm job $SLURM_JOB_ID exit $rc"
fugu_explain_exit "$rc"

if [ "$rc" = "$FUGU_EXIT_CHECKPOINTED" ] && [ "$FUGU_AUTO_RESUBMIT" = 1 ]; then
  if [ "$FUGU_RESUBMIT_COUNT" -ge "$FUGU_RESUBMIT_MAX" ]; then
    fugu_log "not resubmitting: FUGU_RESUBMIT_MAX=$FUGU_RESUBMIT_MAX continuations reached"
  else
    fugu_slurm_resubmit
  fi
fi
exit "$rc"
