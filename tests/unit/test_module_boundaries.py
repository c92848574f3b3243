"""The package map (docs/README.md): what each package owns and the imports it may make, checked on every import.

``MAP`` below is the table of docs/README.md ("Packages and the imports each may make"); a test holds the two
equal. Every module of ``cdcd/``, ``bench/`` and ``devtools/`` belongs to the most specific row whose name is its
own or a prefix of it, and may import its own row's modules and what its row lists: a package, a module, or a
single module of another package (``cdcd.daemon.httpserver``). An import is any ``import``/``from ... import`` (at
the top or inside a function) and any ``importlib.import_module("...")`` with a string literal. Where the code
breaks a rule today, the exception is listed below with its reason; an exception the code no longer needs fails
too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "cdcd"
TOP = ("cdcd", "bench", "devtools")  # the packages of this repository (tests are not in the map)
DOC = REPO / "docs" / "README.md"

E = "cdcd.errors"  # the one error hierarchy: every package of cdcd may raise its errors
#: package -> what it may import besides itself. Mirrors docs/README.md, from the ground floor up.
MAP: dict[str, frozenset[str]] = {
    "cdcd": frozenset(),
    E: frozenset(),
    "cdcd.logging": frozenset({E}),
    "cdcd.fsutil": frozenset({E}),
    "cdcd.sockets": frozenset({E}),
    "cdcd.positions": frozenset({E}),
    "cdcd.memory": frozenset({E}),
    "cdcd.events": frozenset({E, "cdcd.positions"}),
    "cdcd.config": frozenset({E, "cdcd.events"}),
    "cdcd.configref": frozenset({E, "cdcd.config"}),
    "cdcd.retry": frozenset({E, "cdcd.config"}),
    "cdcd.landing": frozenset({E, "cdcd.events", "cdcd.fsutil"}),
    "cdcd.checkpoint": frozenset({E, "cdcd.config", "cdcd.fsutil", "cdcd.positions"}),
    # capture and the sources check and record a re-sync's key range: the landing contract's cdcd.landing.keyrange
    "cdcd.capture": frozenset({E, "cdcd.config", "cdcd.events", "cdcd.landing", "cdcd.positions", "cdcd.retry"}),
    "cdcd.runtime": frozenset({E, "cdcd.checkpoint", "cdcd.config", "cdcd.events", "cdcd.positions", "cdcd.retry"}),
    "cdcd.sinks": frozenset({E, "cdcd.config", "cdcd.events", "cdcd.fsutil", "cdcd.landing", "cdcd.retry",
                             "cdcd.runtime"}),
    "cdcd.sources.postgres": frozenset({E, "cdcd.capture", "cdcd.config", "cdcd.events", "cdcd.fsutil",
                                        "cdcd.landing", "cdcd.positions", "cdcd.runtime", "cdcd.sockets"}),
    "cdcd.sources.mysql": frozenset({E, "cdcd.capture", "cdcd.config", "cdcd.events", "cdcd.landing", "cdcd.positions",
                                     "cdcd.runtime", "cdcd.sockets"}),
    "cdcd.sources": frozenset({E, "cdcd.config", "cdcd.runtime", "cdcd.sources.mysql", "cdcd.sources.postgres"}),
    "cdcd.daemon": frozenset({E, "cdcd", "cdcd.checkpoint", "cdcd.config", "cdcd.fsutil", "cdcd.logging",
                              "cdcd.memory", "cdcd.runtime", "cdcd.sinks", "cdcd.sources"}),
    # The Spark job reads the landing zone through cdcd.landing only (never the sink), and takes two modules of
    # the daemon package: its small HTTP server (the consumer's --metrics-listen endpoint, on purpose) and the
    # exit codes every command shares (docs/operations.md), which live in cdcd.daemon.
    "cdcd.spark": frozenset({E, "cdcd", "cdcd.daemon.exitcodes", "cdcd.daemon.httpserver", "cdcd.fsutil",
                             "cdcd.landing", "cdcd.logging"}),
    "cdcd.verify": frozenset({E, "cdcd.checkpoint", "cdcd.config", "cdcd.events", "cdcd.landing", "cdcd.positions",
                              "cdcd.sources.mysql", "cdcd.sources.postgres", "cdcd.spark"}),
    "cdcd.repair": frozenset({E, "cdcd.config", "cdcd.daemon", "cdcd.events", "cdcd.verify"}),
    "cdcd.sparkcds": frozenset({E, "cdcd", "cdcd.events", "cdcd.landing", "cdcd.positions", "cdcd.runtime",
                                "cdcd.sinks", "cdcd.spark"}),
    "cdcd.cli": frozenset({E, "cdcd", "cdcd.checkpoint", "cdcd.config", "cdcd.daemon", "cdcd.logging", "cdcd.repair",
                           "cdcd.runtime", "cdcd.sources", "cdcd.spark", "cdcd.verify"}),
    "devtools.servers": frozenset({E}),
    "devtools.s3server": frozenset({"devtools.servers"}),
    "devtools.sparkcluster": frozenset({"devtools.servers", "cdcd.spark"}),
    "devtools.derby": frozenset({"devtools.servers", "cdcd.spark"}),
    "bench": frozenset({"devtools.servers", "devtools.s3server", "devtools.sparkcluster", "cdcd.landing",
                        "cdcd.sources.postgres"}),
    "devtools": frozenset({"cdcd.config", "devtools.servers", "devtools.s3server", "devtools.sparkcluster",
                           "cdcd.landing", "cdcd.verify"}),
}

#: (file, imported module) -> why the code breaks the map there today.
EXCEPTIONS: dict[tuple[str, str], str] = {}

#: (file, private name of another package it imports) -> why. No package takes another's ``_names``.
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Files that import each other in a loop today (issue 32 breaks them up); no other circle may appear.
CIRCLE_EXCEPTIONS: set[frozenset[str]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES: dict[str, Path] = {module_name(p): p for top in TOP for p in sorted((REPO / top).rglob("*.py"))}
#: every module and package (a folder without ``__init__.py``, like ``cdcd/spark/``, too)
KNOWN = {".".join(m.split(".")[:i]) for m in FILES for i in range(1, m.count(".") + 2)}


def _is_import_module(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")


@functools.cache
def imports(path: Path) -> frozenset[str]:
    """Every name ``path`` imports, as dotted names (``pkg.module`` or ``pkg.module.name``): ``import``,
    ``from ... import`` (relative ones resolved), at the top or inside functions, and the string literal given to
    ``importlib.import_module``."""
    me = module_name(path) if path.is_relative_to(REPO) else path.stem
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            found |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and _is_import_module(node) and node.args:
            arg = node.args[0]
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                f"{path}:{node.lineno}: import_module with a computed name: name the module as a string literal, so "
                "the package map (docs/README.md) can check the import")
            found.add(arg.value)
    return frozenset(found)


def module_of(name: str) -> str | None:
    """The module of this repository that ``name`` is or lies in (``cdcd.daemon.httpserver.HttpServer`` ->
    ``cdcd.daemon.httpserver``); None for other libraries."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in KNOWN:
            return ".".join(parts[:i])
    return None


def row_of(module: str) -> str:
    rows = [r for r in MAP if module == r or module.startswith(r + ".")]
    assert rows, f"{module} is in no row of the package map: add it to MAP and to docs/README.md"
    return max(rows, key=len)


def allowed(row: str, module: str) -> bool:
    target = row_of(module)
    return target == row or any(
        (module == e or module.startswith(e + ".")) and row_of(e) == target for e in MAP[row])


def relpath(path: Path) -> str:
    return str(path.relative_to(REPO))


def observed_breaks() -> set[tuple[str, str]]:
    out = set()
    for name, path in FILES.items():
        row = row_of(name)
        for imported in imports(path):
            module = module_of(imported)
            if module is not None and not allowed(row, module):
                out.add((relpath(path), module))
    return out


def doc_table() -> dict[str, frozenset[str]]:
    """The package table of docs/README.md: | `package` | what it owns | may import (`names`, or "nothing") |."""
    text = DOC.read_text()
    section = text.split("## Packages and the imports each may make", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, frozenset[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([^`]+)`", cells[2])
        assert names or cells[2] == "nothing", f"docs/README.md: the row of {cells[0]} lists no imports: {cells[2]!r}"
        rows[cells[0].strip("`").removesuffix("/")] = frozenset(names)
    return rows


def test_the_map_is_the_table_in_docs_readme() -> None:
    table = doc_table()
    assert list(table) == list(MAP), "docs/README.md lists other packages, or in another order, than MAP"
    differ = {p: {"docs": sorted(table[p]), "test": sorted(MAP[p])} for p in MAP if table[p] != MAP[p]}
    assert differ == {}, "docs/README.md and MAP in this test disagree: change both"


def test_every_module_has_a_row_and_every_row_a_module() -> None:
    unmapped = sorted(m for m in FILES if m != "cdcd" and row_of(m) == "cdcd")
    assert unmapped == [], "give these packages a row of their own in MAP and docs/README.md"
    assert sorted(r for r in MAP if r not in KNOWN) == []
    assert sorted(e for deps in MAP.values() for e in deps if e not in KNOWN) == []


def test_every_import_follows_the_map() -> None:
    breaks = observed_breaks()
    new = sorted(breaks - EXCEPTIONS.keys())
    assert new == [], "imports the package map (docs/README.md) does not allow: change the code, or the map and table"
    stale = sorted(EXCEPTIONS.keys() - breaks)
    assert stale == [], "exceptions the code no longer needs: remove them here and in docs/README.md"


def test_the_map_runs_one_way() -> None:
    """No circle between packages: the allowed imports form floors (docs/README.md lists them from the ground up)."""
    rows = list(MAP)
    for i, row in enumerate(rows):
        later = {row_of(e) for e in MAP[row]} & set(rows[i:])
        assert later == set(), f"{row} may import {sorted(later)}, listed after it: a circle, or a row out of order"
    for (path, module) in EXCEPTIONS:
        assert rows.index(row_of(module)) < rows.index(row_of(module_name(REPO / path))), (path, module)


def test_no_package_takes_another_packages_private_names() -> None:
    taken = set()
    for name, path in FILES.items():
        for imported in imports(path):
            module = module_of(imported)
            if module is None or row_of(module) == row_of(name):
                continue
            tail = imported.split(".")
            if any(p.startswith("_") and not p.startswith("__") for p in tail):
                taken.add((relpath(path), imported))
    assert sorted(taken - PRIVATE_EXCEPTIONS.keys()) == []
    assert sorted(PRIVATE_EXCEPTIONS.keys() - taken) == [], "exceptions no longer needed: remove them"


def _circles() -> set[frozenset[str]]:
    graph = {m: {t for i in imports(p) if (t := module_of(i)) is not None and t != m} for m, p in FILES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.add(frozenset(relpath(FILES[m]) for m in members))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_but_the_known_ones() -> None:
    circles = _circles()
    assert sorted(map(sorted, circles - CIRCLE_EXCEPTIONS)) == []
    assert sorted(map(sorted, CIRCLE_EXCEPTIONS - circles)) == [], "circles that are gone: remove their exception"


def test_imports_through_importlib_are_seen(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("import importlib\nfrom importlib import import_module\n"
                   "def f():\n    importlib.import_module('cdcd.sinks').make_sink\n    import_module('cdcd.verify')\n")
    assert imports(src) == {"importlib", "importlib.import_module", "cdcd.sinks", "cdcd.verify"}
    assert not allowed("cdcd.spark", "cdcd.sinks")  # the rule the Spark job's boundary rests on
    computed = tmp_path / "computed.py"
    computed.write_text("import importlib\nname = 'cdcd.sinks'\nimportlib.import_module(name)\n")
    with pytest.raises(AssertionError, match="string literal"):
        imports(computed)


def test_apply_strategies_do_not_import_the_job() -> None:
    job = ("cdcd.spark.job", "cdcd.spark.consumer")
    for name in ("strategy", "formats", "parquet", "delta", "iceberg", "lakehouse", "lakehouse_ddl", "lakehouse_sql",
                 "collapse", "rule", "session", "state"):
        path = ROOT / "spark" / f"{name}.py"
        assert not {m for m in imports(path) if m.startswith(job)}, f"{path} imports the job"


#: The rooms' sizes (issue 32): a module over this many lines, or a class over ``MAX_CLASS_LINES``, has outgrown
#: one purpose; split it by what it does rather than raise the limit.
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 350


def test_no_module_over_500_lines_and_no_class_over_350() -> None:
    big = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(REPO)
        if text.count("\n") > MAX_MODULE_LINES:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{name}: class {node.name} {lines} lines")
    assert not big, f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class: {big}"
