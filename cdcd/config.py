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
    model_config = ConfigDict(extra="forbid", frozen=True)


class PostgresOptions(_Section):
    slot: str = Field(default="cdcd", pattern=r"^[a-z0-9_]{1,63}$")
    publication: str = Field(default="cdcd", pattern=r"^[A-Za-z0-9_]{1,63}$")
    heartbeat_s: float = Field(default=10.0, gt=0)
    #: pgoutput protocol 2 with in-progress transaction streaming (PostgreSQL 14+); false: protocol 1.
    stream_in_progress: bool = True


class MySqlOptions(_Section):
    server_id: int | None = Field(default=None, ge=1, le=2**32 - 1)
    #: How an incremental snapshot chunk's low watermark is taken (docs/mysql.md, "Incremental snapshots"): "auto"
    #: is MariaDB's exact snapshot position, the bracketing position on MySQL (which has none).
    incremental_watermark: Literal["auto", "exact", "bracketing"] = "auto"


class SourceConfig(_Section):
    kind: Literal["postgres", "mariadb", "mysql"]
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535)
    user: str
    password: SecretStr | None = None
    password_file: Path | None = None
    database: str
    tables: list[str] = Field(min_length=1)
    sslmode: Literal["disable", "prefer", "require", "verify-ca", "verify-full"] = "prefer"
    sslrootcert: Path | None = None
    connect_timeout_s: float = Field(default=10.0, gt=0)
    postgres: PostgresOptions = PostgresOptions()
    mysql: MySqlOptions = MySqlOptions()

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
    parallelism: int = Field(default=2, ge=1, le=64)
    chunk_rows: int = Field(default=50000, ge=1)
    #: Bytes per snapshot block as well as rows: a chunk of huge rows is cut into blocks of about this size
    #: (at least one row), so memory stays bounded whatever the row size.
    chunk_bytes: int = Field(default=32 << 20, ge=1 << 16)


class LandingConfig(_Section):
    path: Path = Path("/var/lib/cdcd/landing")
    ack: Literal["landed", "consumed"] = "landed"
    max_batch_events: int = Field(default=50000, ge=1)
    max_batch_delay_ms: int = Field(default=500, ge=0)
    retention_s: float = Field(default=86400.0, ge=0)


class HistoryTierConfig(_Section):
    every_s: float = Field(gt=0)
    span_s: float = Field(gt=0)


class StateConfig(_Section):
    path: Path = Path("/var/lib/cdcd/state")
    #: The newest earlier checkpoints kept for `cdcd checkpoint rollback` ...
    keep_checkpoints: int = Field(default=10, ge=1)
    #: ... and, per tier, one per `every_s` of those saved in the last `span_s` seconds.
    checkpoint_history: list[HistoryTierConfig] = Field(default_factory=lambda: [
        HistoryTierConfig(every_s=60, span_s=3600), HistoryTierConfig(every_s=3600, span_s=86400)])


class RuntimeConfig(_Section):
    max_inflight_batches: int = Field(default=4, ge=1)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    reconnect_max_s: float = Field(default=60.0, gt=0)
    #: A source outage (every reconnect failing) longer than this is fatal (exit 4); 0 retries for ever.
    source_retry_timeout_s: float = Field(default=600.0, ge=0)
    #: The longest one query or snapshot chunk on a source connection may take before the connection is
    #: taken for dead (a transient error: reconnect).
    source_read_timeout_s: float = Field(default=300.0, gt=0)
    #: "tuned": Arrow on the system allocator, glibc with 2 arenas and fixed mmap/trim thresholds (freed memory
    #: goes back to the system), Python's collector frozen after start-up and run less often (cdcd/memory.py,
    #: docs/operations.md "Memory"); "default": leave the allocators and the collector as they are.
    memory: Literal["tuned", "default"] = "tuned"


class HttpConfig(_Section):
    listen: str = Field(default="127.0.0.1:9187", pattern=r"^(\[[0-9a-fA-F:]+\]|[^:\s]*):\d{1,5}$|^$")
    #: The control token's file (POST endpoints need it); unset: the daemon writes a new one to
    #: state.path/http-token (0600) at every start (cdcd/daemon/token.py).
    token_file: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.listen != ""

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class Config(_Section):
    source: SourceConfig
    snapshot: SnapshotConfig = SnapshotConfig()
    landing: LandingConfig = LandingConfig()
    state: StateConfig = StateConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    http: HttpConfig = HttpConfig()
    log: LogConfig = LogConfig()


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
    return config
