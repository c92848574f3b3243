#!/bin/sh
# PID 1 of the cdcd container image. Runs cdcd with the container's arguments, passes
# the signals on (SIGTERM/SIGINT: graceful stop, a second one or SIGQUIT: force-stop,
# SIGHUP: reload) and exits with cdcd's exit code.
#
# Except exit 9, a lost source position (replication slot gone, binlog purged or
# reset, another server history; docs/operations.md, "Exit codes"): container restart
# policies cannot leave out one exit code, and a restart after a lost position could
# resume from the wrong place. The container then stays up with cdcd stopped (its
# health check fails, the reason is the last log line) until it is stopped, and
# exits 9. CDCD_BIN names the cdcd executable (default /opt/cdcd/bin/cdcd).
set -u
"${CDCD_BIN:-/opt/cdcd/bin/cdcd}" "$@" &
child=$!
for sig in TERM INT QUIT HUP; do
    trap "kill -$sig $child 2>/dev/null" "$sig"
done
while :; do
    wait "$child"
    rc=$?
    # a signal passed on interrupts wait while cdcd still runs: wait again
    kill -0 "$child" 2>/dev/null || break
done
if [ "$rc" -eq 9 ]; then
    # the traps first: a stop that comes right after the message below must end the container
    sleeper=""
    trap 'kill $sleeper 2>/dev/null; exit 9' TERM INT QUIT
    trap '' HUP
    echo "cdcd-entrypoint: cdcd exited 9, the source position is lost; not restarting it (a restart could resume" \
        "from the wrong place). Recover as docs/operations.md (Faults) says, then start the container again." >&2
    while :; do
        sleep 3600 &
        sleeper=$!
        wait "$sleeper"
    done
fi
exit "$rc"
