"""Config: every documented key parses, bad input names the key, env wins, secrets stay secret."""

from __future__ import annotations

import io
import logging
import tomllib
from pathlib import Path

import pytest
import structlog

from cdcd.config import load_config, parse_config
from cdcd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "config" / "cdcd.example.toml", ROOT / "config" / "cdcd.mariadb.example.toml"]


def _minimal(**source: object) -> dict[str, object]:
    base: dict[str, object] = {"kind": "postgres", "user": "cdc", "database": "app", "tables": ["public.t"]}
    base.update(source)
    return {"source": base}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse_with_every_key(path: Path, tmp_path: Path) -> None:
    text = path.read_text().replace("/run/secrets/cdc", str(tmp_path / "pw"))
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "c.toml").write_text(text)
    config = load_config(tmp_path / "c.toml", env={})
    doc = tomllib.loads(text)
    # Every key written in the example is a real key with the written value.
    dumped = config.model_dump(mode="json")
    for section, keys in doc.items():
        for key, value in keys.items():
            if isinstance(value, dict):
                for sub, subvalue in value.items():
                    assert dumped[section][key][sub] == subvalue, f"{section}.{key}.{sub}"
            elif key == "password_file":
                assert config.source.secret() == "s3cret"
            else:
                assert dumped[section][key] == value, f"{section}.{key}"


def test_defaults_match_design() -> None:
    c = parse_config(_minimal(), env={})
    assert c.source.effective_port == 5432
    assert (c.snapshot.mode, c.snapshot.parallelism, c.snapshot.chunk_rows) == ("initial", 2, 50000)
    assert (c.landing.ack, c.landing.max_batch_events, c.landing.max_batch_delay_ms) == ("landed", 50000, 500)
    assert (c.runtime.max_inflight_batches, c.runtime.shutdown_grace_s) == (4, 30)
    assert c.http.listen == "127.0.0.1:9187"
    assert (c.log.level, c.log.format) == ("info", "auto")
    assert (c.source.postgres.slot, c.source.postgres.publication) == ("cdcd", "cdcd")


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({**_minimal(), "landing": {"bogus": 1}}, "landing.bogus: unknown key"),
        (_minimal(colour="blue"), "source.colour: unknown key"),
        ({"source": {"kind": "postgres", "database": "app", "tables": ["public.t"]}}, "source.user: required key"),
        ({**_minimal(), "snapshot": {"parallelism": "lots"}}, "snapshot.parallelism: Input should be a valid integer"),
        ({**_minimal(), "snapshot": {"mode": "sometimes"}}, "snapshot.mode: Input should be 'initial'"),
        (_minimal(tables=["orders"]), "source.tables: Value error, table 'orders' must be written as 'schema.table'"),
        (_minimal(kind="oracle"), "source.kind: Input should be 'postgres', 'mariadb' or 'mysql'"),
        (_minimal(kind="mariadb"), "source.mysql.server_id is required"),
        (_minimal(password="x", password_file="/x"), "either password or password_file"),
        ({**_minimal(), "runtime": {"max_inflight_batches": 0}}, "runtime.max_inflight_batches: Input should be"),
    ],
)
def test_bad_input_names_the_key(doc: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(doc, env={})
    assert expected in str(err.value)


def test_env_overrides_win() -> None:
    env = {
        "CDCD_SOURCE__HOST": "db1.internal",
        "CDCD_SOURCE__PORT": "6543",
        "CDCD_SOURCE__POSTGRES__SLOT": "orders_slot",
        "CDCD_LANDING__ACK": "consumed",
        "CDCD_SOURCE__TABLES": '["public.a", "public.b"]',
        "CDCD_RUNTIME__SHUTDOWN_GRACE_S": "5.5",
        "UNRELATED": "x",
    }
    c = parse_config(_minimal(host="db0"), env=env)
    assert c.source.host == "db1.internal" and c.source.port == 6543
    assert c.source.postgres.slot == "orders_slot"
    assert c.landing.ack == "consumed"
    assert c.source.tables == ["public.a", "public.b"]
    assert c.runtime.shutdown_grace_s == 5.5


def test_env_override_with_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"landing\.colour: unknown key"):
        parse_config(_minimal(), env={"CDCD_LANDING__COLOUR": "red"})


def test_password_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    c = parse_config(_minimal(password_file=str(tmp_path / "pw")), env={})
    assert c.source.secret() == "from-file"
    missing = parse_config(_minimal(password_file=str(tmp_path / "nope")), env={})
    with pytest.raises(ConfigError, match=r"source\.password_file: cannot read"):
        missing.source.secret()


def test_unreadable_password_file_fails_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[source]\nkind = "postgres"\nuser = "u"\ndatabase = "d"\ntables = ["public.t"]\n'
        f'password_file = "{tmp_path / "missing"}"\n'
    )
    with pytest.raises(ConfigError, match="password_file"):
        load_config(cfg, env={})


def test_password_never_shown(tmp_path: Path) -> None:
    secret = "hunter2-very-secret"
    c = parse_config(_minimal(password=secret), env={})
    assert secret not in repr(c)
    assert secret not in str(c.model_dump())
    with pytest.raises(ConfigError) as err:
        parse_config(_minimal(password=secret, port="not-a-port"), env={})
    assert secret not in str(err.value)
    with pytest.raises(ConfigError) as err2:
        parse_config(_minimal(password=12345), env={})
    assert "12345" not in str(err2.value) and "<hidden>" in str(err2.value)
    out = io.StringIO()
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(out),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    try:
        structlog.get_logger().info("config loaded", config=c, source=c.source)
    finally:
        structlog.reset_defaults()
    assert "config loaded" in out.getvalue() and secret not in out.getvalue()


SECRET = "S3cr3t!-recognisable"

# Every way a source section can be refused, each with the secret set as a password: the error shows the
# section (a model-level error's input is the whole section) and must not show the secret.
SECRET_ERROR_CASES = [
    {"kind": "mariadb"},  # server_id missing: a model-level error on the whole source section
    {"password_file": "/x"},  # password and password_file both set
    {"port": "not-a-port"},
    {"tables": ["no_schema"]},
    {"tables": ["public.t", "public.t"]},
    {"kind": "oracle"},
    {"sslmode": "sometimes"},
    {"mysql": {"server_id": 0}},
    {"postgres": {"slot": "Bad-Slot"}},
    {"unknown_key": 1},
    {"user": None},
]


@pytest.mark.parametrize("bad", SECRET_ERROR_CASES, ids=lambda b: next(iter(b)))
def test_no_config_error_shows_the_password(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_minimal(password=SECRET, **bad), env={})
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)


def test_no_config_error_shows_a_password_from_the_environment() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"source": {"kind": "mysql", "user": "u", "database": "d", "tables": ["d.t"]}},
                     env={"CDCD_SOURCE__PASSWORD": SECRET})
    assert "server_id" in str(err.value) and SECRET not in str(err.value)


def test_connect_params_hide_the_password() -> None:
    from cdcd.sources.mysql.connection import ConnectParams as MyParams
    from cdcd.sources.postgres.connection import ConnectParams as PgParams

    assert SECRET not in repr(PgParams("h", 1, "u", "d", SECRET))
    assert SECRET not in repr(MyParams("h", 1, "u", SECRET))


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "absent.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[source\nkind=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})
