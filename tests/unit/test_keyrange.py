"""The --where conditions a re-sync can record as a key range (cdcd/landing/keyrange.py), and the ones refused."""

from __future__ import annotations

import pytest

from cdcd.errors import ConfigError
from cdcd.landing.keyrange import KeyRange, key_kind, parse_where
from cdcd.landing.manifest import CoveredRecord, Manifest
from cdcd.landing.reader import covered_tables


@pytest.mark.parametrize(("where", "spark"), [
    ("id BETWEEN 10 AND 20", "`id` >= 10 AND `id` <= 20"),
    ("id >= 1 AND id < 500", "`id` >= 1 AND `id` < 500"),
    ("5 < id", "`id` > 5"),
    ("ID > -3 AND id <= 4", "`id` > -3 AND `id` <= 4"),
    ("id = 7", "`id` IN (7)"),
    ("id IN (1, 5, 9, 5)", "`id` IN (1, 5, 9)"),
])
def test_integer_key_ranges_and_lists(where: str, spark: str) -> None:
    r = parse_where(where, ["id"], "public.t", "integer")
    assert r.to_spark_sql() == spark
    assert KeyRange.from_json(r.to_json()) == r


def test_text_keys_take_lists_with_their_quotes() -> None:
    assert parse_where("code IN ('a', 'b''c')", ["code"], "s.t", "text").to_spark_sql() == r"`code` IN ('a', 'b\'c')"
    assert parse_where("code = 'x'", ["code"], "s.t", "text").values == ("x",)


@pytest.mark.parametrize(("where", "key", "kind", "why"), [
    ("v > 3", ["id"], "integer", "is not the key column"),
    ("id > 3 OR id < 1", ["id"], "integer", "joined by AND"),
    ("id % 5 = 0", ["id"], "integer", "cannot read"),
    ("id BETWEEN 'a' AND 'b'", ["id"], "integer", "integer bounds"),
    ("code > 'a'", ["code"], "text", "compares the key with an integer"),
    ("code BETWEEN 1 AND 3", ["code"], "text", "collation"),
    ("id IN (1, 'a')", ["id"], "integer", "mixes"),
    ("id = 'x'", ["id"], "integer", "compare it with integers"),
    ("id > 1 AND id > 2", ["id"], "integer", "two lower bounds"),
    ("a > 3", ["a", "b"], "integer", "only a one-column key"),
    ("u = 'x'", ["u"], "other", "neither an integer nor text"),
])
def test_other_conditions_are_refused_naming_the_forms(where: str, key: list[str], kind: str, why: str) -> None:
    with pytest.raises(ConfigError, match="cannot be recorded as a key range") as refused:
        parse_where(where, key, "s.t", kind)
    assert why in str(refused.value) and "KEY BETWEEN a AND b" in str(refused.value)


def test_key_kinds_of_both_sources() -> None:
    assert [key_kind(t) for t in ("bigint", "integer", "int(11) unsigned", "character varying(20)", "varchar",
                                  "uuid", "numeric(10,2)")] == ["integer"] * 3 + ["text"] * 2 + ["other"] * 2


def test_a_ranged_record_makes_a_version_5_manifest_and_keeps_its_own_bound() -> None:
    ranged = CoveredRecord("s", "t", "pg:5", {"column": "id", "lo": 1, "lo_inclusive": True, "hi": 9,
                                              "hi_inclusive": False})
    m = Manifest(1, "r", "z", "postgres", "now", 0, None, None, (), (ranged,))
    assert m.version == 5 and Manifest(1, "r", "z", "postgres", "now", 0, None, None, ()).version == 4
    whole = Manifest(2, "r", "z", "postgres", "now", 0, None, None, (), (CoveredRecord("s", "t", "pg:3"),))
    c = covered_tables([(1, m), (2, whole)])[("s", "t")]
    assert c.gone("p", str) == "p < pg:3 OR (p < pg:5 AND `id` >= 1 AND `id` < 9)"
    later = Manifest(3, "r", "z", "postgres", "now", 0, None, None, (), (CoveredRecord("s", "t", "pg:7"),))
    assert covered_tables([(1, m), (3, later)])[("s", "t")].gone("p", str) == "p < pg:7"  # the whole one covers it
