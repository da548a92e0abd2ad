# shellcheck shell=bash
# Helpers of the device-call scripts (gpu-check.sh, gpu-baselines.sh), sourced by them: a time
# budget shared by the stages and a log. The caller sets BUDGET (seconds) and LOG.

# left: seconds left of BUDGET.
left() { echo $((BUDGET - SECONDS)); }
# say TEXT: print and log.
say() { printf '%s\n' "$*" | tee -a "$LOG"; }
# stage TITLE: a section header with the time left.
stage() { say ""; say "=== $* ($(left) s left) ==="; }
# limited SECONDS CMD...: CMD under `timeout`, at most SECONDS and what is left of the budget.
limited() {
    local lim=$1 l
    shift
    l=$(($(left) - 10))
    [ "$lim" -gt "$l" ] && lim=$l
    if [ "$lim" -le 5 ]; then
        say "skipped: out of time budget for: $*"
        return 124
    fi
    timeout -k 5 "$lim" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && say "timed out after ${lim} s: $*"
    return "$rc"
}
