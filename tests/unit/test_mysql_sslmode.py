"""The sslmode → SSLContext function of the MySQL source, the `cdcd check` line and the error texts."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from cdcd.errors import SourceFatal
from cdcd.sources.mysql.preflight import tls_check
from cdcd.sources.mysql.tls import SSLMODES, Tls, TlsError, ssl_context


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=cdcd-unit-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt")],
                   check=True, capture_output=True)
    return d / "ca.crt"


def test_disable_is_plain() -> None:
    assert ssl_context("disable", None, "db") is None


@pytest.mark.parametrize("mode", ["prefer", "require"])
def test_prefer_and_require_encrypt_without_verifying(mode: str) -> None:
    ctx = ssl_context(mode, None, "db")
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_NONE and ctx.check_hostname is False


def test_prefer_ignores_sslrootcert(ca: Path) -> None:
    ctx = ssl_context("prefer", ca, "db")
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(("mode", "hostname"), [("require", False), ("verify-ca", False), ("verify-full", True)])
def test_verifying_modes_trust_only_sslrootcert(mode: str, hostname: bool, ca: Path) -> None:
    ctx = ssl_context(mode, ca, "db.example.com")
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname is hostname
    assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "cdcd-unit-ca"),),)]
    assert not ctx.verify_flags & getattr(ssl, "VERIFY_X509_STRICT", 0)


@pytest.mark.parametrize("mode", ["verify-ca", "verify-full"])
def test_verifying_without_sslrootcert_uses_the_system_cas(mode: str) -> None:
    ctx = ssl_context(mode, None, "db.example.com")
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname is (mode == "verify-full")


def test_verify_full_needs_a_host(ca: Path) -> None:
    with pytest.raises(TlsError, match=r"needs a host name .* source.host is empty"):
        ssl_context("verify-full", ca, "")
    assert ssl_context("verify-ca", ca, "") is not None


def test_unreadable_sslrootcert(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsError, match=f"source.sslrootcert = '{missing}' cannot be loaded .*No such file") as info:
        ssl_context("verify-ca", missing, "db")
    assert "PEM file of the CA" in info.value.fix
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsError, match=f"source.sslrootcert = '{garbage}' cannot be loaded"):
        ssl_context("require", garbage, "db")


def test_unknown_mode() -> None:
    with pytest.raises(TlsError, match="'allow' is not a TLS mode: use one of disable, prefer"):
        ssl_context("allow", None, "db")
    assert SSLMODES == ("disable", "prefer", "require", "verify-ca", "verify-full")


def test_tls_errors_are_fatal_and_name_the_fix() -> None:
    tls = Tls.build("require", None, "db.example.com", 3306)
    assert tls.required and not Tls.build("prefer", None, "db", 3306).required
    err = tls.no_tls_offered()
    assert isinstance(err, SourceFatal) and err.fatal
    assert str(err) == ("the server at db.example.com:3306 does not offer TLS but source.sslmode = 'require': "
                        "enable TLS on the server (ssl_cert and ssl_key in my.cnf, then restart it) or set "
                        "source.sslmode = 'prefer'")
    assert tls.explain(ValueError("unrelated")) is None


def test_check_line() -> None:
    full = Tls.build("verify-full", None, "db", 3306)
    line = tls_check(full, "TLSv1.3", "TLS_AES_256_GCM_SHA384")
    assert line.ok and line.detail == ("encrypted with TLSv1.3 TLS_AES_256_GCM_SHA384 (source.sslmode = "
                                       "'verify-full': certificate and host name verified)")
    line = tls_check(Tls.build("prefer", None, "db", 3306), "", "")
    assert line.ok and line.detail.startswith("not encrypted: the server at db:3306 offers no TLS")
    assert tls_check(Tls.build("disable", None, "db", 3306), "", "").detail == \
        "not encrypted (source.sslmode = 'disable')"
    assert not tls_check(full, "", "").ok
