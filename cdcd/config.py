"""The TOML configuration of DESIGN.md section 8.

Every key can be overridden by an environment variable ``CDCD_SECTION__KEY``
(``CDCD_SOURCE__POSTGRES__SLOT`` for nested sections). Unknown keys, wrong
types and missing required keys raise ``ConfigError`` naming the key. The
password is a ``SecretStr``: it never appears in ``repr``, logs or errors.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from cdcd.errors import ConfigError
from cdcd.events import TableId

ENV_PREFIX = "CDCD_"


class _Section(BaseModel):
    # A key's docstring is its description: docs/config.md is rendered from them (cdcd/configref.py).
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class PostgresOptions(_Section):
    slot: str = Field(default="cdcd", pattern=r"^[a-z0-9_]{1,63}$")
    """The logical replication slot (created when absent; lower case, digits and _)."""
    publication: str = Field(default="cdcd", pattern=r"^[A-Za-z0-9_]{1,63}$")
    """The publication of `source.tables` (created when absent, checked when present; docs/postgres.md,
    "Publication")."""
    heartbeat_s: float = Field(default=10.0, gt=0)
    """Seconds of quiet after which a heartbeat message keeps the slot advancing."""
    stream_in_progress: bool = True
    """pgoutput protocol 2 (PostgreSQL 14+): large transactions stream while in progress, staged under state.path;
    false: protocol 1."""
    open_transactions_wait_s: float = Field(default=600.0, gt=0)
    """How long a table's incremental snapshot waits, after the table joined the publication, for the transactions
    open at that moment to end (pgoutput never sends what they wrote before it); past it the snapshot fails naming
    them (docs/postgres.md, "Incremental snapshots")."""
    failover_slot: bool = False
    """On PostgreSQL 17+: create the slot with `failover`, so that a standby with `sync_replication_slots = on`
    keeps a copy and cdcd goes on after a promotion (docs/postgres.md, "Failover slots"); refused on an older
    server. Applies when cdcd creates the slot."""


class MySqlOptions(_Section):
    server_id: int | None = Field(default=None, ge=1, le=2**32 - 1)
    """The server id cdcd replicates as: required for MySQL/MariaDB, unique among the server's replicas."""
    incremental_watermark: Literal["auto", "exact", "bracketing"] = "auto"
    """How an incremental snapshot chunk's low watermark is taken (docs/mysql.md, "Incremental snapshots"): "auto" is
    MariaDB's exact snapshot position, the bracketing position on MySQL (which has none)."""


class RetentionOptions(_Section):
    margin: float = Field(default=0.2, ge=0, le=1)
    """The share of the source's retention budget left at which cdcd warns and pauses incremental snapshots
    (PostgreSQL: safe_wal_size of max_slot_wal_keep_size; MariaDB/MySQL: the time left before the checkpoint's
    binlog file expires, of the expiry); 0 turns this test off (docs/operations.md, "WAL budget and binlog
    expiry")."""
    margin_s: float = Field(default=3600.0, ge=0)
    """Warn and pause too when the budget lasts less than this many seconds at the current rate (PostgreSQL: WAL
    written per second; MariaDB/MySQL: until the expiry); 0 turns this test off."""
    check_interval_s: float = Field(default=30.0, gt=0, le=3600)
    """How often the budget is read from the source (one short query, bounded by runtime.source_read_timeout_s)."""


class SourceConfig(_Section):
    kind: Literal["postgres", "mariadb", "mysql"]
    """The source database: postgres, mariadb or mysql."""
    host: str = "127.0.0.1"
    """The server's host name or address."""
    port: int | None = Field(default=None, ge=1, le=65535)
    """The server's port; unset: 5432 for postgres, 3306 for mariadb and mysql."""
    user: str
    """The user cdcd connects as (the privileges it needs: docs/postgres.md, docs/mysql.md)."""
    password: SecretStr | None = None
    """The password inline; never shown in logs, errors or /status. Set this or password_file, not both; neither: no
    password (trust, peer)."""
    password_file: Path | None = None
    """A file holding the password (a trailing newline is ignored); read only by the commands that connect."""
    database: str
    """The database to capture (MySQL/MariaDB: the one connected to; tables name their own)."""
    tables: list[str] = Field(min_length=1)
    """The captured tables, "schema.table" (MySQL/MariaDB: "database.table"); SIGHUP or `cdcd tables reload` re-reads
    them."""
    sslmode: Literal["disable", "prefer", "require", "verify-ca", "verify-full"] = "prefer"
    """TLS as libpq means it: disable, prefer, require, verify-ca, verify-full."""
    sslrootcert: Path | None = None
    """The CA bundle for verify-ca and verify-full; unset: the system's CAs."""
    connect_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds to wait for a connection."""
    on_position_lost: Literal["fail", "resnapshot"] = "fail"
    """What a lost position (replication slot gone or invalidated, binlog purged or reset) does: fail (exit 9, fix
    with `cdcd recover`), or resnapshot (the daemon recovers by itself: a new slot or the current binlog position,
    the gap recorded in the landing zone, every table re-snapshotted incrementally; docs/operations.md)."""
    retention: RetentionOptions = RetentionOptions()
    """The warning before the source drops what the checkpoint needs (WAL budget, binlog expiry)."""
    postgres: PostgresOptions = PostgresOptions()
    """PostgreSQL options."""
    mysql: MySqlOptions = MySqlOptions()
    """MySQL/MariaDB options."""

    @field_validator("tables")
    @classmethod
    def _tables_are_qualified(cls, tables: list[str]) -> list[str]:
        for t in tables:
            try:
                TableId.parse(t)
            except ValueError as exc:
                raise ValueError(f"{exc} (MySQL/MariaDB: 'database.table')") from exc
        if len(set(tables)) != len(tables):
            raise ValueError("tables are listed more than once")
        return tables

    @model_validator(mode="after")
    def _check(self) -> SourceConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("set either password or password_file, not both")
        if self.kind in ("mariadb", "mysql") and self.mysql.server_id is None:
            raise ValueError("source.mysql.server_id is required for MySQL/MariaDB (a number unique among replicas)")
        return self

    @property
    def effective_port(self) -> int:
        if self.port is not None:
            return self.port
        return 5432 if self.kind == "postgres" else 3306

    @property
    def table_ids(self) -> list[TableId]:
        return [TableId.parse(t) for t in self.tables]

    def secret(self) -> str | None:
        """The password, read from ``password_file`` when that is set."""
        if self.password is not None:
            return self.password.get_secret_value()
        if self.password_file is not None:
            try:
                return self.password_file.read_text().rstrip("\r\n")
            except OSError as exc:
                raise ConfigError(
                    f"source.password_file: cannot read {self.password_file}: {exc.strerror}; "
                    "check the path and that the daemon's user may read it"
                ) from exc
        return None


class SnapshotConfig(_Section):
    mode: Literal["initial", "never", "initial_only", "when_needed"] = "initial"
    """initial (snapshot, then stream), never (stream only), initial_only (snapshot, then exit), when_needed
    (snapshot again when the position is lost)."""
    parallelism: int = Field(default=2, ge=1, le=64)
    """Tables read at once during the initial snapshot."""
    chunk_rows: int = Field(default=50000, ge=1)
    """Rows per key-ordered snapshot chunk."""
    chunk_bytes: int = Field(default=32 << 20, ge=1 << 16)
    """Bytes per snapshot block as well as rows: a chunk of huge rows is cut into blocks of about this size (at least
    one row), so memory stays bounded whatever the row size."""


class LandingS3Options(_Section):
    endpoint: str | None = None
    """An S3-compatible store's URL (http://host:port); unset: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS."""
    region: str | None = None
    """The store's region; unset: AWS_REGION or the AWS config file."""
    path_style: bool = True
    """Path-style addressing (http://endpoint/bucket/key), which S3-compatible stores need; false: virtual hosts."""
    access_key_id: str | None = None
    """The access key id; unset: the environment (AWS_ACCESS_KEY_ID), the AWS credentials file (AWS_PROFILE), or
    the machine's role. Set with secret_access_key_file."""
    secret_access_key_file: Path | None = None
    """A file holding the secret access key (a trailing newline is ignored); never shown in logs or /status."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Seconds each request to the store may take (connect, and each read)."""

    @model_validator(mode="after")
    def _keys_together(self) -> LandingS3Options:
        if (self.access_key_id is None) != (self.secret_access_key_file is None):
            raise ValueError("set access_key_id and secret_access_key_file together, or neither (then the "
                             "environment or the AWS credentials file gives them)")
        return self

    def secret(self) -> str | None:
        """The secret access key, read from ``secret_access_key_file`` when that is set."""
        if self.secret_access_key_file is None:
            return None
        try:
            return self.secret_access_key_file.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"landing.s3.secret_access_key_file: cannot read {self.secret_access_key_file}: {exc.strerror}; "
                "check the path and that the daemon's user may read it"
            ) from exc


class LandingConfig(_Section):
    path: Path = Path("/var/lib/cdcd/landing")
    """The landing zone the Spark consumer reads (docs/landing-format.md): a directory, or object storage as
    s3://bucket/prefix (landing.s3)."""
    s3: LandingS3Options = LandingS3Options()
    """How to reach the object store when landing.path is s3://bucket/prefix (docs/operations.md, "Landing on
    object storage")."""
    ack: Literal["landed", "consumed"] = "landed"
    """landed: a batch is acked once durable in the landing zone; consumed: once the Spark consumer committed it."""
    max_batch_events: int = Field(default=50000, ge=1)
    """A batch is cut at this many events ..."""
    max_batch_delay_ms: int = Field(default=500, ge=0)
    """... or when its first event is this old (milliseconds)."""
    retention_s: float = Field(default=86400.0, ge=0)
    """Consumed batches are removed after this many seconds; unconsumed ones never."""


class HistoryTierConfig(_Section):
    every_s: float = Field(gt=0)
    """Keep one earlier checkpoint per this many seconds ..."""
    span_s: float = Field(gt=0)
    """... among those saved in the last this many seconds."""


class StateConfig(_Section):
    path: Path = Path("/var/lib/cdcd/state")
    """The checkpoint, its history, the control token and the daemon's lock; one daemon per directory."""
    keep_checkpoints: int = Field(default=10, ge=1)
    """The newest earlier checkpoints kept for `cdcd checkpoint rollback` ..."""
    checkpoint_history: list[HistoryTierConfig] = Field(default_factory=lambda: [
        HistoryTierConfig(every_s=60, span_s=3600), HistoryTierConfig(every_s=3600, span_s=86400)])
    """... and, per tier, one per `every_s` of those saved in the last `span_s` seconds (a quiet source saves on
    every heartbeat: a count alone reaches back minutes)."""


class RuntimeConfig(_Section):
    max_inflight_batches: int = Field(default=4, ge=1)
    """Batches delivered but not yet acked before reading pauses."""
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long to wait for acks before stopping without them (exit 3)."""
    reconnect_max_s: float = Field(default=60.0, gt=0)
    """The cap of the exponential backoff between reconnect attempts."""
    source_retry_timeout_s: float = Field(default=600.0, ge=0)
    """A source outage (every reconnect failing) longer than this is fatal (exit 4); 0 retries for ever."""
    source_read_timeout_s: float = Field(default=300.0, gt=0)
    """The longest one query or snapshot chunk on a source connection may take before the connection is taken for
    dead (a transient error: reconnect)."""
    memory: Literal["tuned", "default"] = "tuned"
    """"tuned": Arrow on the system allocator, glibc with 2 arenas and fixed mmap/trim thresholds (freed memory goes
    back to the system), Python's collector frozen after start-up and run less often (docs/operations.md,
    "Memory"); "default": the allocators and the collector as they are."""


class HttpConfig(_Section):
    listen: str = Field(default="127.0.0.1:9187", pattern=r"^(\[[0-9a-fA-F:]+\]|[^:\s]*):\d{1,5}$|^$")
    """host:port of /metrics, /healthz, /readyz, /status and the control endpoints; "" turns the listener off."""
    token_file: Path | None = None
    """The control token's file (POST /snapshot and /tables/reload need the token); unset: the daemon writes a new
    one to state.path/http-token (0600) at every start (docs/operations.md, "Control token")."""

    @property
    def enabled(self) -> bool:
        return self.listen != ""

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """debug, info, warning or error (re-read on SIGHUP)."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto (JSON unless stdout is a TTY), json or console."""


class Config(_Section):
    source: SourceConfig
    """The source database and its tables."""
    snapshot: SnapshotConfig = SnapshotConfig()
    """The initial snapshot."""
    landing: LandingConfig = LandingConfig()
    """The landing zone."""
    state: StateConfig = StateConfig()
    """The checkpoint store."""
    runtime: RuntimeConfig = RuntimeConfig()
    """The pipeline's limits and retries."""
    http: HttpConfig = HttpConfig()
    """The HTTP listener."""
    log: LogConfig = LogConfig()
    """Logging."""


def _apply_env(doc: dict[str, Any], env: Mapping[str, str]) -> None:
    """Overlay ``CDCD_SECTION__KEY=value`` onto the parsed TOML document.

    Values are parsed as TOML values when they parse (numbers, booleans,
    arrays, quoted strings), else taken as plain strings.
    """
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty section or key; use CDCD_SECTION__KEY")
        node = doc
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: '{part}' is a value, not a section")
            node = child
        node[path[-1]] = _env_value(raw)


def _env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _describe(error: Mapping[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"{key}: unknown key; remove it or check its spelling (see config/cdcd.example.toml)"
    if kind == "missing":
        return f"{key}: required key is missing"
    shown = "<hidden>" if _is_secret(key) else json.dumps(redacted(error.get("input")), default=str)
    return f"{key}: {error['msg']} (got {shown})"


_SECRET_WORDS = ("password", "secret", "token", "credential", "key_id", "access_key")


def _is_secret(key: str) -> bool:
    """A key whose value must never be shown: ``password``, ``password_file``'s contents, tokens, keys."""
    last = key.rsplit(".", 1)[-1].lower()
    return any(word in last for word in _SECRET_WORDS)


def redacted(value: Any) -> Any:
    """``value`` with the value of every secret key, at any depth, replaced by ``"<hidden>"``: the one place
    a configuration (or a part of one) is described for an error, a log line or ``/status``."""
    if isinstance(value, Mapping):
        return {k: "<hidden>" if _is_secret(str(k)) else redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redacted(v) for v in value]
    return value


def parse_config(doc: dict[str, Any], env: Mapping[str, str] | None = None, origin: str = "<config>") -> Config:
    """Validate a parsed TOML document with environment overrides applied."""
    doc = json.loads(json.dumps(doc, default=str))  # a deep copy we may modify
    _apply_env(doc, os.environ if env is None else env)
    try:
        return Config.model_validate(doc)
    except ValidationError as exc:
        problems = "\n  ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"{origin}: invalid configuration:\n  {problems}") from None


def load_config(path: str | Path, env: Mapping[str, str] | None = None, connects: bool = True) -> Config:
    """Read, override and validate a TOML config file. ``connects``: the caller connects to the source, so an
    unreadable ``password_file`` is an error now; commands that never connect (status, stop, checkpoint) pass
    False and do not need the secret."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    config = parse_config(doc, env, origin=str(path))
    if connects:
        config.source.secret()  # an unreadable password_file is a config error now, not at connect time
        config.landing.s3.secret()
    return config
