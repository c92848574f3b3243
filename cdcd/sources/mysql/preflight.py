"""`cdcd check` for MySQL/MariaDB: server settings, privileges and tables.

``evaluate`` is pure: it judges the variables, grants and table facts a
connection collected, so the rules are testable against recorded output of
either flavor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cdcd.runtime.interfaces import CheckResult
from cdcd.sources.mysql.tls import Tls


@dataclass
class ServerFacts:
    version: str
    variables: dict[str, str]  # lower-case names
    grants: list[str]
    tables: dict[str, tuple[bool, tuple[str, ...]]] = field(default_factory=dict)  # name: (exists, primary key)
    server_id: int | None = None  # ours, from source.mysql.server_id

    @property
    def flavor(self) -> str:
        return "mariadb" if "mariadb" in self.version.lower() else "mysql"


def _version_tuple(version: str) -> tuple[int, ...]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)


def _has_privilege(grants: list[str], *names: str) -> bool:
    for g in grants:
        head = g.upper().split(" ON ")[0]
        if "ALL PRIVILEGES" in head and " ON *.* " in g.upper():
            return True
        if any(n in head for n in names) and " ON *.* " in g.upper():
            return True
    return False


def _has_select(grants: list[str], databases: set[str]) -> bool:
    for g in grants:
        up = g.upper()
        head = up.split(" ON ")[0]
        if "SELECT" not in head and "ALL PRIVILEGES" not in head:
            continue
        if " ON *.* " in up:
            return True
        m = re.search(r" ON `?([^`.]+)`?\.\*", g)
        if m and m.group(1) in databases:
            databases = databases - {m.group(1)}
            if not databases:
                return True
    return False


def undecodable_settings(v: dict[str, str]) -> list[str]:
    """MySQL 8 settings that make the binlog hold events cdcd cannot decode: each with its fix."""
    out = []
    if v.get("binlog_transaction_compression", "OFF").upper() in ("ON", "1"):
        out.append("the server compresses its binlog transactions (binlog_transaction_compression = ON), which cdcd "
                   "cannot decode: SET GLOBAL binlog_transaction_compression = OFF and set it OFF in my.cnf "
                   "(see docs/mysql.md)")
    if "PARTIAL_JSON" in v.get("binlog_row_value_options", "").upper():
        out.append("the server logs JSON updates as partial diffs (binlog_row_value_options = PARTIAL_JSON), which "
                   "leave the new value unknown: SET GLOBAL binlog_row_value_options = '' and set it empty in my.cnf "
                   "(see docs/mysql.md)")
    return out


def evaluate(f: ServerFacts) -> list[CheckResult]:
    v = f.variables
    out: list[CheckResult] = []
    flavor = f.flavor
    ver = _version_tuple(f.version)
    cnf = "my.cnf [mariadbd]" if flavor == "mariadb" else "my.cnf [mysqld]"
    out.append(CheckResult("server", True, f"{flavor} {f.version}"))
    min_ver = (10, 5, 0) if flavor == "mariadb" else (8, 0, 14)
    out.append(CheckResult(
        "version", ver >= min_ver,
        f"{flavor} {'.'.join(map(str, ver))}" + ("" if ver >= min_ver else " has no binlog_row_metadata"),
        "" if ver >= min_ver else f"upgrade to {flavor} {'.'.join(map(str, min_ver))} or newer",
    ))
    log_bin = v.get("log_bin", "OFF").upper() in ("ON", "1")
    out.append(CheckResult("log_bin", log_bin, f"log_bin = {v.get('log_bin', 'OFF')}",
                           "" if log_bin else f"set log_bin = mysql-bin in {cnf} and restart the server"))
    for name, want in (("binlog_format", "ROW"), ("binlog_row_image", "FULL"), ("binlog_row_metadata", "FULL")):
        have = v.get(name, "")
        ok = have.upper() == want
        out.append(CheckResult(
            name, ok, f"{name} = {have or '(not supported)'}",
            "" if ok else f"SET GLOBAL {name} = '{want}' and set {name} = {want} in {cnf} (persists restarts)",
        ))
    if flavor == "mariadb":
        compressed = v.get("log_bin_compress", "OFF").upper() in ("ON", "1")
        out.append(CheckResult(
            "log_bin_compress", not compressed, f"log_bin_compress = {v.get('log_bin_compress', 'OFF')}",
            f"SET GLOBAL log_bin_compress = OFF and set log_bin_compress = OFF in {cnf}: cdcd cannot decode "
            "compressed binlog events" if compressed else "",
        ))
    if flavor == "mysql":
        problems = undecodable_settings(v)
        for name in ("binlog_transaction_compression", "binlog_row_value_options"):
            mine = [p for p in problems if f"({name} =" in p]
            have = v.get(name, "")
            out.append(CheckResult(name, not mine, f"{name} = {have or '(empty)'}",
                                   mine[0].split(": ", 1)[1] if mine else ""))
    sid = v.get("server_id", "")
    if f.server_id is None:
        out.append(CheckResult("server_id", False, "source.mysql.server_id is not set",
                               "set source.mysql.server_id to a number unique among the server's replicas"))
    elif str(f.server_id) == sid:
        out.append(CheckResult("server_id", False, f"source.mysql.server_id {f.server_id} is the server's own id",
                               "choose another source.mysql.server_id, unique among the server's replicas"))
    else:
        out.append(CheckResult("server_id", True, f"cdcd replicates as server_id {f.server_id} (server is {sid})"))
    repl = _has_privilege(f.grants, "REPLICATION SLAVE", "REPLICATION REPLICA", "REPLICA")
    out.append(CheckResult("privilege REPLICATION SLAVE", repl, "granted" if repl else "missing",
                           "" if repl else "GRANT REPLICATION SLAVE ON *.* TO the cdc user"))
    client = _has_privilege(f.grants, "REPLICATION CLIENT", "BINLOG MONITOR", "SUPER")
    out.append(CheckResult("privilege REPLICATION CLIENT", client, "granted" if client else "missing",
                           "" if client else "GRANT REPLICATION CLIENT ON *.* TO the cdc user "
                           "(MariaDB 10.5+: BINLOG MONITOR)"))
    dbs = {t.split(".", 1)[0] for t in f.tables}
    sel = _has_select(f.grants, dbs)
    out.append(CheckResult("privilege SELECT", sel, "granted" if sel else f"missing on {', '.join(sorted(dbs))}",
                           "" if sel else "GRANT SELECT ON each captured database (db.*) TO the cdc user"))
    if flavor == "mysql":
        reload_ok = _has_privilege(f.grants, "RELOAD")
        out.append(CheckResult("privilege RELOAD", reload_ok,
                               "granted" if reload_ok else "missing (the snapshot needs FLUSH TABLES WITH READ LOCK)",
                               "" if reload_ok else "GRANT RELOAD ON *.* TO the cdc user"))
        gtid = v.get("gtid_mode", "OFF").upper()
        out.append(CheckResult("gtid_mode", True, f"gtid_mode = {gtid}: resume by "
                               + ("GTID" if gtid == "ON" else "binlog file and position")))
    else:
        out.append(CheckResult("gtid", True, f"gtid_binlog_pos = {v.get('gtid_binlog_pos', '') or '(empty)'}: "
                               "resume by GTID"))
    for name, (exists, key) in sorted(f.tables.items()):
        if not exists:
            out.append(CheckResult(f"table {name}", False, "does not exist or is not visible to the cdc user",
                                   "create the table, fix source.tables, or GRANT SELECT on it"))
        elif not key:
            out.append(CheckResult(f"table {name}", False, "has no primary key: updates and deletes cannot be "
                                   "merged and a restarted snapshot re-reads it",
                                   f"ALTER TABLE {name} ADD PRIMARY KEY (...)"))
        else:
            out.append(CheckResult(f"table {name}", True, f"primary key ({', '.join(key)})"))
    return out


def tls_check(tls: Tls, version: str, cipher: str) -> CheckResult:
    """Whether the connection is encrypted (the session's ``Ssl_version`` / ``Ssl_cipher``)."""
    mode = f"source.sslmode = '{tls.sslmode}'"
    if cipher:
        return CheckResult("tls", True, f"encrypted with {f'{version} ' if version else ''}{cipher} "
                                        f"({mode}: {tls.describe()})")
    if tls.sslmode == "disable":
        return CheckResult("tls", True, f"not encrypted ({mode})")
    if tls.sslmode == "prefer":
        return CheckResult("tls", True, f"not encrypted: the server at {tls.where} offers no TLS ({mode}); to "
                           "encrypt, enable TLS on the server (ssl_cert, ssl_key) and set source.sslmode = "
                           "'verify-full'")
    # cannot happen: the connection would have been refused
    return CheckResult("tls", False, f"not encrypted although {mode}", tls.no_tls_offered().fix)
