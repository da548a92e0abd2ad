#!/bin/bash
# fugu: one training run as a chain of Fugaku jobs, each continuing from the checkpoint of the
# one before, until the run is done. Run it on the login node (it calls pjsub; it is not a job).
#
#   FUGU_GROUP=hp000000 FUGU_NODES=8 FUGU_ELAPSE=6:00:00 FUGU_CHAIN_JOBS=10 \
#   FUGU_CONFIG=gpt2-350m FUGU_DATA=data/mine/manifest.json FUGU_STEPS=200000 \
#     jobscripts/pjsub/chain.sh
#
# Every job runs jobscripts/pjsub/train.sh with --resume auto and a deadline before its elapse
# limit; it exits 0 when training is done, 4 when it checkpointed before the limit ("continue"),
# anything else on an error. Two ways to chain, neither calls pjsub inside a job:
#
#   FUGU_CHAIN_MODE=step (default): one step job of FUGU_CHAIN_JOBS sub-jobs, all submitted now
#     (pjsub --step). Sub-job K>0 has --sparam "jid=ID,sn=K,sd=ec!=4:all:K-1": when sub-job K-1
#     did not exit with 4 (done, or an error), PJM deletes sub-job K and all later ones. The
#     script returns at once; `pjstat` shows the sub-jobs.
#   FUGU_CHAIN_MODE=wait: submit one job (pjsub -z jid), wait for it (pjwait), read its exit
#     code from RUN_DIR/jobs.log, and submit the next only after exit 4. Keep this script
#     running (e.g. under nohup or tmux on the login node) for the whole chain.
#
# The training settings of train.sh (FUGU_CONFIG, FUGU_DATA, FUGU_STEPS, FUGU_TP, ...) are handed
# to every job through a settings file (FUGU_ENV_FILE) in RUN_DIR/job-env/. See docs/JOBS.md.
set -euo pipefail

# ----------------------------------------------------------------------------- settings
: "${FUGU_BIN:=}"                # fugu binary; empty: $FUGU_HOME/target/release/fugu
: "${FUGU_CONFIG:=gpt2-124m}"    # model config (see train.sh for the other FUGU_* training settings)
: "${FUGU_NODES:=1}"             # nodes per job
: "${FUGU_RANKS_PER_NODE:=4}"    # ranks per node (4 = one per CMG)
: "${FUGU_ELAPSE:=01:00:00}"     # elapse limit of every job (also the deadline's base)
: "${FUGU_CHAIN_JOBS:=5}"        # at most this many jobs in the chain
: "${FUGU_CHAIN_MODE:=step}"     # step: one step job with sd= dependencies; wait: pjsub -z + pjwait here
: "${FUGU_ECO_STATE:=0}"         # power knob eco_state: 0 = both FP pipelines, 2 = Fugaku's default (one)
: "${FUGU_LLIO_SHAREDTMP:=1Gi}"  # --llio sharedtmp-size per node, room for llio_transfer of the binary
: "${FUGU_GROUP:=}"              # -g for every job; empty: the #PJM -g line of train.sh
: "${FUGU_RSCGRP:=}"             # -L rscgrp=; empty: small, or large above 384 nodes
: "${FUGU_PJSUB_ARGS:=}"         # extra pjsub options for every job (split on spaces)
: "${FUGU_WORKDIR:=$PWD}"        # base of relative paths
: "${FUGU_OUT:=}"                # run directory; empty: runs/CONFIG-nRANKS-tpTP
: "${FUGU_TP:=1}"                # tensor-parallel degree (only for the default run directory name here)
: "${FUGU_PP:=1}"                # pipeline stages (only for the default run directory name here)

# ----------------------------------------------------------------------------- common code
for d in "${FUGU_HOME:+$FUGU_HOME/jobscripts}" "$(dirname -- "$0")/.." "$PWD/jobscripts"; do
  if [ -n "$d" ] && [ -f "$d/lib/common.sh" ]; then FUGU_COMMON=$d/lib/common.sh; break; fi
done
[ -n "${FUGU_COMMON:-}" ] || { echo "fugu: cannot find jobscripts/lib/common.sh; set FUGU_HOME=<the fugu checkout>" >&2; exit 2; }
# shellcheck source=jobscripts/lib/common.sh
. "$FUGU_COMMON"

# ----------------------------------------------------------------------------- checks
command -v pjsub >/dev/null || fugu_die "pjsub not found: run this on a Fugaku login node"
: "${FUGU_BIN:=$FUGU_HOME/target/release/fugu}"
# The binary is for A64FX and may not run on the (x86) login node: only check that it is there.
[ -f "$FUGU_BIN" ] || fugu_die "FUGU_BIN=$FUGU_BIN does not exist: build it (docs/JOBS.md, scripts/build-fugaku.sh) or set FUGU_BIN"
FUGU_BIN=$(cd "$(dirname -- "$FUGU_BIN")" && pwd)/$(basename -- "$FUGU_BIN")
fugu_require_uint FUGU_NODES FUGU_RANKS_PER_NODE FUGU_CHAIN_JOBS FUGU_TP FUGU_PP
{ [ "$FUGU_NODES" -ge 1 ] && [ "$FUGU_RANKS_PER_NODE" -ge 1 ]; } || fugu_die "FUGU_NODES and FUGU_RANKS_PER_NODE must be at least 1"
[ "$FUGU_CHAIN_JOBS" -ge 1 ] || fugu_die "FUGU_CHAIN_JOBS must be at least 1"
case "$FUGU_CHAIN_MODE" in step | wait) ;; *) fugu_die "FUGU_CHAIN_MODE must be step or wait (got '$FUGU_CHAIN_MODE')" ;; esac
fugu_parse_elapse "$FUGU_ELAPSE" >/dev/null || fugu_die "FUGU_ELAPSE=$FUGU_ELAPSE is not [[H:]M:]S"
fugu_pjm_power_args
fugu_pjm_llio_args
cfgfile=()
if fugu_config_is_file "$FUGU_CONFIG"; then
  FUGU_CONFIG=$(fugu_abs "$FUGU_CONFIG")
  cfgfile=("$FUGU_CONFIG")
fi
fugu_check_llio_fits "$FUGU_BIN" "${cfgfile[@]}"

ranks=$(( FUGU_NODES * FUGU_RANKS_PER_NODE ))
FUGU_OUT=$(fugu_abs "${FUGU_OUT:-runs/$(fugu_sanitize "$FUGU_CONFIG")-n$ranks-tp$FUGU_TP$(fugu_pp_suffix)}")
mkdir -p "$FUGU_OUT/job-env"
rscgrp=$FUGU_RSCGRP
if [ -z "$rscgrp" ]; then
  if [ "$FUGU_NODES" -gt 384 ]; then rscgrp=large; else rscgrp=small; fi
fi
# Every job: the same settings, no in-job resubmission, the elapse limit known to the deadline.
env_file=$FUGU_OUT/job-env/chain.sh
FUGU_AUTO_RESUBMIT=0 FUGU_WORKDIR=$FUGU_WORKDIR fugu_write_env "$env_file" "${FUGU_PJSUB_SETTINGS[@]}"
sub=(-L "node=$FUGU_NODES" -L "rscgrp=$rscgrp" -L "elapse=$FUGU_ELAPSE"
  --mpi "proc=$ranks" --mpi "max-proc-per-node=$FUGU_RANKS_PER_NODE"
  "${FUGU_PJM_POWER_ARGS[@]}" "${FUGU_PJM_LLIO_ARGS[@]}" -x "FUGU_ENV_FILE=$env_file")
[ -z "$FUGU_GROUP" ] || sub+=(-g "$FUGU_GROUP")
read -r -a extra <<<"$FUGU_PJSUB_ARGS"
sub+=("${extra[@]}")
script=$FUGU_JOBSCRIPTS/pjsub/train.sh
chainlog=$FUGU_OUT/chain.txt
fugu_log "chain of at most $FUGU_CHAIN_JOBS job(s) ($FUGU_CHAIN_MODE mode): $FUGU_NODES node(s) x $FUGU_RANKS_PER_NODE rank(s), elapse $FUGU_ELAPSE, eco_state=$FUGU_ECO_STATE -> $FUGU_OUT"

# submit ARGS...: pjsub -z jid ARGS... train.sh; prints the job id.
submit() {
  local out jid
  out=$(pjsub -z jid "$@" "${sub[@]}" "$script") || fugu_die "pjsub -z jid $* ${sub[*]} $script failed: $out"
  jid=$(fugu_pjsub_jid "$out")
  [ -n "$jid" ] || fugu_die "no job id in pjsub's answer: $out"
  echo "$jid"
}

# job_exit JID: the exit code train.sh recorded for job JID in jobs.log (empty if none).
job_exit() {
  sed -n "s/.* pjsub job $1 exit \([0-9][0-9]*\)$/\1/p" "$FUGU_OUT/jobs.log" 2>/dev/null | tail -n 1
}

if [ "$FUGU_CHAIN_MODE" = step ]; then
  first=$(submit --step --sparam "sn=0")
  base=${first%_*}
  echo "step 0 $first" >>"$chainlog"
  fugu_log "submitted sub-job $first"
  for (( k = 1; k < FUGU_CHAIN_JOBS; k++ )); do
    # Delete this sub-job and every later one unless the previous one checkpointed (exit 4).
    jid=$(submit --step --sparam "jid=$base,sn=$k,sd=ec!=$FUGU_EXIT_CHECKPOINTED:all:$(( k - 1 ))")
    echo "step $k $jid" >>"$chainlog"
    fugu_log "submitted sub-job $jid (runs only if sub-job $(( k - 1 )) exits $FUGU_EXIT_CHECKPOINTED)"
  done
  fugu_log "step job $base: $FUGU_CHAIN_JOBS sub-job(s); follow them with 'pjstat' and $FUGU_OUT/jobs.log"
  exit 0
fi

command -v pjwait >/dev/null || fugu_die "pjwait not found: run this on a Fugaku login node, or use FUGU_CHAIN_MODE=step"
for (( k = 0; k < FUGU_CHAIN_JOBS; k++ )); do
  jid=$(submit)
  echo "wait $k $jid" >>"$chainlog"
  fugu_log "submitted job $jid ($(( k + 1 )) of at most $FUGU_CHAIN_JOBS); waiting for it (pjwait)"
  pjwait "$jid" >/dev/null || fugu_log "pjwait $jid returned non-zero; reading the job's exit from $FUGU_OUT/jobs.log"
  rc=$(job_exit "$jid")
  case "$rc" in
    0) fugu_log "job $jid finished the training (exit 0): chain done"; exit 0 ;;
    "$FUGU_EXIT_CHECKPOINTED") fugu_log "job $jid checkpointed before its limit (exit 4): submitting the continuation" ;;
    '') fugu_die "job $jid recorded no exit in $FUGU_OUT/jobs.log (killed at the elapse limit, PJM code 11? see its .stats file): resubmit to continue from the last checkpoint" ;;
    *) fugu_log "job $jid failed (exit $rc): chain stopped (see fugu-train.$jid.out)"; exit "$rc" ;;
  esac
done
fugu_log "FUGU_CHAIN_JOBS=$FUGU_CHAIN_JOBS jobs ran and the training is not finished: run this again to continue"
exit "$FUGU_EXIT_CHECKPOINTED"
