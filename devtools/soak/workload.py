"""The soak's workload: small mixed transactions without pause, no model of the rows."""

from __future__ import annotations

import contextlib
import random
import threading
import time

from devtools.soak.common import (
    BASE_TABLES,
    EXTRA_TABLES,
    INITIAL_ROWS,
    SoakError,
)
from devtools.soak.sources import Conn, Source


class Workload(threading.Thread):
    """Small transactions without pause: inserts, updates (some leaving the large value unchanged, some
    changing it), deletes, primary-key changes, one to four of them over several tables, one in ten rolled
    back. It keeps no model of the rows: the source itself is what the mirror is compared with."""

    def __init__(self, source: Source, seed: int) -> None:
        super().__init__(name="workload", daemon=True)
        self.source, self.rng = source, random.Random(seed)
        self.next_id = {t: INITIAL_ROWS + 1 for t in BASE_TABLES + EXTRA_TABLES}
        self.stop_event = threading.Event()
        self.commits = self.rollbacks = self.errors = 0
        self.error: BaseException | None = None

    def statement(self) -> str:
        rng, src = self.rng, self.source
        t = rng.choice(BASE_TABLES + EXTRA_TABLES)
        n = self.next_id[t]
        some = ", ".join(str(rng.randint(1, n - 1)) for _ in range(rng.randint(1, 5)))
        kind = rng.choices(["insert", "update", "update-big", "delete", "key", "range"], [30, 30, 8, 12, 10, 3])[0]
        if kind == "insert":
            k = rng.randint(1, 20)
            self.next_id[t] = n + k
            rows = ", ".join(f"({i}, {rng.randint(0, 10**6)}, 'i{i}', "
                             f"{src.large(rng) if rng.random() < 0.15 else 'NULL'})" for i in range(n, n + k))
            return f"INSERT INTO {t} (id, v, note, big) VALUES {rows}"
        if kind == "update":  # the large value is left unchanged (PostgreSQL: an unchanged TOAST value)
            return f"UPDATE {t} SET v = v + 1, note = 'u{rng.randint(0, 999)}' WHERE id IN ({some})"
        if kind == "update-big":
            value = rng.choice([src.large(rng), "NULL", "'small'"])
            return f"UPDATE {t} SET big = {value} WHERE id IN ({some})"
        if kind == "delete":
            return f"DELETE FROM {t} WHERE id IN ({some})"
        if kind == "key":  # a primary-key change to a fresh id, the large value unchanged
            self.next_id[t] = n + 1
            return f"UPDATE {t} SET id = {n}, v = v + 1 WHERE id = {rng.randint(1, n - 1)}"
        lo = rng.randint(1, n)
        return f"UPDATE {t} SET v = v + 1 WHERE id BETWEEN {lo} AND {lo + 60}"

    def run(self) -> None:
        conn: Conn | None = None
        failing_since: float | None = None
        while not self.stop_event.is_set():
            statements = [self.statement() for _ in range(self.rng.choices([1, 2, 3, 4], [40, 30, 20, 10])[0])]
            commit = self.rng.random() >= 0.1
            try:
                if conn is None:
                    conn = self.source.connect()
                conn.run(statements, commit)
                failing_since = None
                if commit:
                    self.commits += 1
                else:
                    self.rollbacks += 1
            except Exception as exc:  # a source restart cuts the connection: reconnect, bounded
                self.errors += 1
                if conn is not None:
                    with contextlib.suppress(Exception):  # the connection is broken already
                        conn.close()
                conn = None
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > 180:
                    self.error = SoakError(f"the workload failed for 180 s on {self.source.kind}; last: {exc!r}")
                    return
                time.sleep(0.5)
                continue
            time.sleep(self.rng.uniform(0.005, 0.06))
        if conn is not None:
            conn.close()

    def finish(self) -> None:
        self.stop_event.set()
        self.join(120)
        if self.is_alive():
            raise SoakError("the workload thread did not stop within 120 s")
        if self.error is not None:
            raise self.error
