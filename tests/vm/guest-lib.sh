# Reporting helpers for the guests' /init scripts (sourced; busybox sh). The host
# side reads the UDRIVE-RESULT lines from the console.

log() { echo "udrive-guest: $*"; }
# result NAME PASS|FAIL DETAIL...  (detail is one line, no newlines)
result() {
    n=$1 s=$2
    shift 2
    echo "UDRIVE-RESULT name=$n status=$s detail=$(echo "$*" | tr '\n' ' ' | cut -c1-300)"
}
# run NAME FUNC: FUNC sets $DETAIL and returns 0 for PASS; its output is
# shown (indented) only on failure.
run() {
    name=$1
    DETAIL=
    if "$2" >/tmp/out 2>&1; then
        result "$name" PASS "$DETAIL"
    else
        sed 's/^/    | /' /tmp/out | tail -n 40
        result "$name" FAIL "$DETAIL"
    fi
}
