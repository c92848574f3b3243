"""landing.path as an object-store URL and the landing.s3 keys: parsed, checked, secrets kept out of errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd.config import load_config, parse_config
from cdcd.errors import ConfigError
from cdcd.landing.objstore import Location, is_object_url

SOURCE = {"kind": "postgres", "user": "u", "database": "d", "tables": ["public.t"]}


def test_an_s3_landing_path_survives_the_config(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s3cr3t-value\n")
    c = parse_config({"source": SOURCE, "landing": {"path": "s3://lake/cdc/app", "s3": {
        "endpoint": "http://127.0.0.1:9000", "access_key_id": "AKIA1",
        "secret_access_key_file": str(tmp_path / "secret"),
    }}}, env={})
    assert is_object_url(c.landing.path) and Location.parse(c.landing.path) == Location("lake", "cdc/app")
    assert Location.parse(c.landing.path).url == "s3://lake/cdc/app"
    assert c.landing.s3.secret() == "s3cr3t-value" and c.landing.s3.path_style
    assert not is_object_url(Path("/var/lib/cdcd/landing")) and not is_object_url("relative/s3:/x")


def test_keys_come_together_and_an_unreadable_secret_fails_at_load(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="access_key_id and secret_access_key_file together"):
        parse_config({"source": SOURCE, "landing": {"s3": {"access_key_id": "AKIA1"}}}, env={})
    cfg = tmp_path / "c.toml"
    cfg.write_text('[source]\nkind = "postgres"\nuser = "u"\ndatabase = "d"\ntables = ["public.t"]\n'
                   '[landing]\npath = "s3://lake/x"\n[landing.s3]\naccess_key_id = "AKIA-HIDDEN"\n'
                   f'secret_access_key_file = "{tmp_path / "missing"}"\n')
    with pytest.raises(ConfigError, match=r"landing\.s3\.secret_access_key_file: cannot read") as failed:
        load_config(cfg, env={})
    assert "AKIA-HIDDEN" not in str(failed.value)
