#!/bin/bash
# fugu: train a GPT on Fugaku (pjsub): 4 MPI ranks per node, one per CMG, 12 threads each.
#
#   pjsub -g YOURGROUP -x FUGU_HOME=$PWD jobscripts/pjsub/train.sh
#   pjsub -g YOURGROUP -L node=8 --mpi proc=32 -L elapse=6:00:00 -x FUGU_ELAPSE=6:00:00 \
#         -x FUGU_HOME=$PWD -x FUGU_CONFIG=gpt2-350m -x FUGU_STEPS=20000 jobscripts/pjsub/train.sh
#
# pjsub does not pass the submitting environment to the job: give settings with `-x VAR=value`
# (or, for many of them, write `export VAR=value` lines to a file and pass -x FUGU_ENV_FILE=FILE).
# Options on the pjsub command line override the #PJM lines. Replace GROUP below with your
# project group, or pass -g. When you change elapse on the command line, also pass
# -x FUGU_ELAPSE=... (the trainer's deadline comes from it).
#
# pjsub sends no signal before the elapse limit, so the job gives the trainer a deadline
# (--deadline = job start + elapse - FUGU_DEADLINE_MARGIN). There it writes a checkpoint on all
# ranks and exits with code 4; the next submission (--resume auto, always passed) continues.
# To chain jobs until the run is done, submit with jobscripts/pjsub/chain.sh from the login
# node (a step job: exit 4 continues, anything else deletes the rest). See docs/JOBS.md.
#
# Power knobs: freq=2200 (boost) and eco_state=0, both FP pipelines; Fugaku's default
# eco_state=2 uses only one of the two and halves the FP peak (-L eco_state=2 to save power).
# --llio sharedtmp-size: room for llio_transfer of the binary (per node; see FUGU_LLIO_SHAREDTMP).
#
#PJM -L "node=1"
#PJM -L "rscgrp=small"
#PJM -L "elapse=01:00:00"
#PJM -L "freq=2200,eco_state=0"
#PJM --llio "sharedtmp-size=1Gi"
#PJM --mpi "proc=4"
#PJM --mpi "max-proc-per-node=4"
#PJM -g GROUP
#PJM -x PJM_LLIO_GFSCACHE=/vol0004
#PJM -j
#PJM -S
#PJM --name fugu-train
set -euo pipefail
FUGU_JOB_START=$(date +%s)
if [ -n "${FUGU_ENV_FILE:-}" ]; then
  # shellcheck source=/dev/null
  . "$FUGU_ENV_FILE"
fi

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
: "${FUGU_THREADS:=12}"          # compute threads per rank (12 = the cores of one CMG)
: "${FUGU_RANKS_PER_NODE:=4}"    # ranks per node (keep equal to --mpi max-proc-per-node)
: "${FUGU_WORKDIR:=${PJM_O_WORKDIR:-$PWD}}"  # base of the relative paths below
: "${FUGU_OUT:=}"                # run directory; empty: runs/CONFIG-nRANKS-tpTP (stable across resubmits)
: "${FUGU_CKPT_EVERY:=}"         # checkpoint every N steps; empty: the config's
: "${FUGU_EVAL_EVERY:=}"         # evaluate every N steps; empty: the config's
: "${FUGU_LOG_EVERY:=}"          # progress line every N steps; empty: the trainer's default
: "${FUGU_TIMERS:=}"             # off | coarse | fine; empty: the trainer's default
: "${FUGU_EXTRA_ARGS:=}"         # more `fugu train` arguments (split on spaces)
: "${FUGU_ELAPSE:=}"             # this job's elapse limit (pass it with -L elapse=); empty: the #PJM line, or pjstat's if shorter
: "${FUGU_PJSTAT:=1}"            # 1: check the #PJM elapse line against pjstat's ELAPSE_LIM (0: do not call pjstat)
: "${FUGU_DEADLINE_MARGIN:=}"    # seconds before the elapse limit for the checkpoint; empty: 300, at most elapse/5
: "${FUGU_DEADLINE:=}"           # explicit --deadline (seconds or RFC 3339); empty: start + elapse - margin; off: none
: "${FUGU_LLIO_TRANSFER:=1}"     # 1: llio_transfer the binary (and a config file) to the nodes' cache
: "${FUGU_LLIO_SHAREDTMP:=1Gi}"  # --llio sharedtmp-size of the continuations this job submits (this job's: #PJM --llio)
: "${FUGU_ECO_STATE:=0}"         # eco_state of the continuations this job submits (this job's: #PJM -L eco_state)
: "${FUGU_MPIEXEC_ARGS:=}"       # extra mpiexec options, e.g. "-of-proc out/rank" (split on spaces)
: "${FUGU_AUTO_RESUBMIT:=0}"     # 1: after exit 4, call pjsub inside the job for the continuation (unverified on Fugaku; prefer chain.sh)
: "${FUGU_RESUBMIT_MAX:=20}"     # stop resubmitting after this many continuations
: "${FUGU_RESUBMIT_COUNT:=0}"    # continuations so far (set by the resubmission itself)
: "${FUGU_GROUP:=}"              # -g for the resubmission; empty: the #PJM -g line of the script
: "${FUGU_RSCGRP:=}"             # -L rscgrp= for the resubmission; empty: the script's
: "${FUGU_PJSUB_ARGS:=}"         # extra pjsub options for the resubmission (split on spaces)
: "${FUGU_JOBSCRIPT:=}"          # script to resubmit; empty: $FUGU_HOME/jobscripts/pjsub/train.sh

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
: "${FUGU_JOBSCRIPT:=$FUGU_JOBSCRIPTS/pjsub/train.sh}"
FUGU_RANKS=${FUGU_RANKS:-${PJM_MPI_PROC:-}}
[ -n "$FUGU_RANKS" ] || fugu_die "PJM_MPI_PROC is unset: submit with pjsub and --mpi \"proc=N\" (or set FUGU_RANKS)"
fugu_require_uint FUGU_RANKS_PER_NODE
[ -z "$FUGU_DEADLINE_MARGIN" ] || fugu_require_uint FUGU_DEADLINE_MARGIN
[ "$FUGU_RANKS_PER_NODE" -ge 1 ] || fugu_die "FUGU_RANKS_PER_NODE must be at least 1"
nodes=$(( (FUGU_RANKS + FUGU_RANKS_PER_NODE - 1) / FUGU_RANKS_PER_NODE ))

# LLIO first: nothing may open or stat the binary (or a config file) before llio_transfer.
fugu_abs_bin
cache=("$FUGU_BIN")
if fugu_config_is_file "$FUGU_CONFIG"; then
  FUGU_CONFIG=$(fugu_abs "$FUGU_CONFIG")
  cache+=("$FUGU_CONFIG")
fi
fugu_llio_transfer "${cache[@]}"
fugu_setup_train

# The trainer's deadline: pjsub has no pre-timeout signal.
fugu_pjm_elapse "$0"
if [ -z "$FUGU_DEADLINE" ]; then
  if [ -n "$FUGU_ELAPSE_S" ]; then
    margin=$FUGU_DEADLINE_MARGIN
    if [ -z "$margin" ]; then
      margin=$(( FUGU_ELAPSE_S / 5 ))
      [ "$margin" -le 300 ] || margin=300
    fi
    [ "$margin" -lt "$FUGU_ELAPSE_S" ] ||
      fugu_die "FUGU_DEADLINE_MARGIN=$margin s is not less than the elapse limit ($FUGU_ELAPSE_S s, $FUGU_ELAPSE_SRC)"
    FUGU_DEADLINE=$(fugu_rfc3339 $(( FUGU_JOB_START + FUGU_ELAPSE_S - margin )))
    fugu_log "elapse limit ${FUGU_ELAPSE_S} s ($FUGU_ELAPSE_SRC), margin $margin s: deadline $FUGU_DEADLINE"
  else
    fugu_log "WARNING: elapse limit unknown (set FUGU_ELAPSE): the trainer gets no deadline and cannot checkpoint before it"
  fi
fi
[ "$FUGU_DEADLINE" != off ] || FUGU_DEADLINE=
fugu_train_args

# Fujitsu's large-page runtime: allocate on first touch, so that each CMG's threads get their
# own HBM (the default prepage policy puts every page on CMG 0).
export XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}
# No empty per-rank stdout/stderr files from mpiexec.
export PLE_MPI_STD_EMPTYFILE=${PLE_MPI_STD_EMPTYFILE:-off}
export OMP_NUM_THREADS=$FUGU_THREADS

read -r -a mpiexec_args <<<"$FUGU_MPIEXEC_ARGS"
jobid=${PJM_JOBID:-unknown}
fugu_log "job $jobid: $FUGU_RANKS rank(s) on $nodes node(s) (at most $FUGU_RANKS_PER_NODE per node) x $FUGU_THREADS thread(s), tp=$FUGU_TP pp=$FUGU_PP zero=$FUGU_ZERO, continuation $FUGU_RESUBMIT_COUNT"
fugu_log "run directory $FUGU_OUT"
fugu_log "mpiexec -n $FUGU_RANKS ${mpiexec_args[*]} $FUGU_BIN ${FUGU_TRAIN_ARGS[*]}"
fugu_job_record "pjsub job $jobid start ($FUGU_RANKS rank(s) on $nodes node(s), deadline ${FUGU_DEADLINE:-none})"
mark=$(fugu_metrics_mark "$FUGU_OUT")
fugu_run_forwarding mpiexec -n "$FUGU_RANKS" "${mpiexec_args[@]}" "$FUGU_BIN" "${FUGU_TRAIN_ARGS[@]}"
rc=$(fugu_reconcile_exit "$FUGU_RC" "$FUGU_OUT" "$mark")
fugu_job_record "pjsub job $jobid exit $rc"
fugu_llio_purge "${cache[@]}"
fugu_explain_exit "$rc"

if [ "$rc" = "$FUGU_EXIT_CHECKPOINTED" ] && [ "$FUGU_AUTO_RESUBMIT" = 1 ]; then
  if [ "$FUGU_RESUBMIT_COUNT" -ge "$FUGU_RESUBMIT_MAX" ]; then
    fugu_log "not resubmitting: FUGU_RESUBMIT_MAX=$FUGU_RESUBMIT_MAX continuations reached"
  else
    FUGU_RESUBMIT_COUNT=$(( FUGU_RESUBMIT_COUNT + 1 ))
    [ -n "$FUGU_ELAPSE" ] || FUGU_ELAPSE=${FUGU_ELAPSE_S:-}
    envfile=$FUGU_OUT/job-env/continuation-$FUGU_RESUBMIT_COUNT.sh
    fugu_write_env "$envfile" "${FUGU_PJSUB_SETTINGS[@]}"
    fugu_log "FUGU_AUTO_RESUBMIT=1: calling pjsub from inside the job (not confirmed to work on Fugaku; jobscripts/pjsub/chain.sh is the supported way)"
    fugu_pjm_power_args
    fugu_pjm_llio_args
    sub=(-L "node=$nodes" --mpi "proc=$FUGU_RANKS" --mpi "max-proc-per-node=$FUGU_RANKS_PER_NODE"
      "${FUGU_PJM_POWER_ARGS[@]}" "${FUGU_PJM_LLIO_ARGS[@]}" -x "FUGU_ENV_FILE=$envfile")
    [ -z "$FUGU_ELAPSE" ] || sub+=(-L "elapse=$FUGU_ELAPSE")
    [ -z "$FUGU_RSCGRP" ] || sub+=(-L "rscgrp=$FUGU_RSCGRP")
    [ -z "$FUGU_GROUP" ] || sub+=(-g "$FUGU_GROUP")
    read -r -a extra <<<"$FUGU_PJSUB_ARGS"
    sub+=("${extra[@]}")
    if next=$(fugu_pjsub "${sub[@]}" "$FUGU_JOBSCRIPT"); then
      fugu_log "resubmitted as job $next (continuation $FUGU_RESUBMIT_COUNT of at most $FUGU_RESUBMIT_MAX)"
      fugu_job_record "pjsub job $jobid resubmitted as job $next"
    fi
  fi
fi
exit "$rc"
