# shellcheck shell=bash
# CPU time of processes and threads from /proc, in clock ticks (getconf CLK_TCK);
# sourced by the benchmarks that report CPU per I/O.
#
#   stat_ticks FILE     utime + stime of a /proc/.../stat file (0 when it is gone:
#                       the thread or process ended)
#   reactor_ticks PID   the same summed over the process's reactor threads

# Fields 14 and 15 (utime, stime) counted after the parenthesised name, which may
# itself hold spaces.
stat_ticks() {
    local v
    v=$(sed 's/.*) //' "$1" 2>/dev/null | awk '{print $12 + $13}') || v=0
    echo "${v:-0}"
}

reactor_ticks() {
    local t sum=0
    for t in /proc/"$1"/task/*; do
        if grep -q '^reactor' "$t/comm" 2>/dev/null; then
            sum=$((sum + $(stat_ticks "$t/stat")))
        fi
    done
    echo "$sum"
}
