"""The package boundaries the code relies on: the landing format is all the daemon and the Spark job share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "cdcd"


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at the top or inside functions), as dotted names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = sorted(m for m in imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if bad:
            out[str(path.relative_to(ROOT.parent))] = bad
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("spark", ("cdcd.sinks", "cdcd.verify")),  # the Spark job reads the landing zone through cdcd.landing
        ("verify", ("cdcd.sinks",)),
        ("landing", ("cdcd.sinks", "cdcd.spark", "cdcd.verify", "cdcd.runtime", "cdcd.sources")),
    ],
)
def test_package_does_not_import(package: str, forbidden: tuple[str, ...]) -> None:
    assert offending(package, forbidden) == {}


def test_apply_strategies_do_not_import_the_job() -> None:
    job = ("cdcd.spark.job", "cdcd.spark.consumer")
    for name in ("strategy", "parquet", "lakehouse", "lakehouse_sql", "collapse", "rule", "session", "state"):
        path = ROOT / "spark" / f"{name}.py"
        assert not {m for m in imports(path) if m.startswith(job)}, f"{path} imports the job"


def test_the_spark_job_takes_only_the_http_server_from_the_daemon() -> None:
    """`--metrics-listen` reuses the daemon's small HTTP server; nothing else of the daemon's lifecycle."""
    allowed = {"cdcd.daemon.httpserver", "cdcd.daemon.httpserver.HttpServer", "cdcd.daemon.httpserver.Response"}
    for path in sorted((ROOT / "spark").rglob("*.py")):
        daemon = {m for m in imports(path) if m.startswith("cdcd.daemon")}
        assert daemon <= allowed, f"{path} imports {sorted(daemon - allowed)}"
