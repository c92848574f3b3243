"""The soak: the real daemon and a following Spark consumer under a steady mixed workload while a
seeded scheduler injects faults at random moments and in random combinations (run by scripts/soak.sh).

Per source (PostgreSQL, MariaDB or both, one after the other) it starts a throwaway server
(``devtools.servers``), a fault proxy in front of it (``tests/faultproxy.py``), `cdcd run` and
`cdcd spark run` (following, without ``--once``) as real processes, a workload thread (inserts,
updates, deletes, primary-key changes, large values, multi-table transactions, rollbacks) and the
fault scheduler. At the end it stops the workload, lets everything catch up (bounded waits), stops
the daemon gracefully, runs `cdcd verify` and the landing replay (the landing zone applied by the
rule of docs/landing-format.md, compared with the source by verify's comparison) and prints one
summary line per source. Exit 0 only if every verify and replay is equal. docs/testing.md, "Soak".
"""
