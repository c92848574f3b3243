"""Which column is which (``cdcd/sources/postgres/columns.py``): a Relation message's columns matched with the
catalog's attributes read later, and the cases where the catalog cannot tell."""

from __future__ import annotations

from cdcd.sources.postgres.columns import Attribute, Known, resolve

INT, TEXT = 23, 25
NAMES = {INT: "int4", TEXT: "text"}


def rel(*cols: tuple[str, int]) -> list[tuple[str, str]]:
    """A Relation message's columns: (name, type oid)."""
    return [(name, NAMES[oid]) for name, oid in cols]


def known(*cols: tuple[str, int, int]) -> list[Known]:
    """The columns the source knew: (name, attnum, type oid)."""
    return [(n, num, NAMES[oid]) for n, num, oid in cols]


def attrs(*rows: tuple[int, str | None, int]) -> list[Attribute]:
    """The catalog now: (attnum, name or None when dropped, type oid)."""
    return [Attribute(num, name or f"........pg.dropped.{num}........", oid if name else 0, -1, name is None)
            for num, name, oid in rows]


OLD = known(("id", 1, INT), ("label", 2, TEXT))


def test_a_rename_keeps_the_id_and_a_new_column_takes_its_attnum() -> None:
    got = resolve(rel(("id", INT), ("title", TEXT), ("n", INT)), attrs((1, "id", INT), (2, "title", TEXT),
                                                                      (3, "n", INT)), OLD)
    assert got.ids == (1, 2, 3) and got.new == (False, False, True) and not got.doubts


def test_a_column_renamed_or_dropped_after_the_relation_keeps_the_id_the_source_knew() -> None:
    renamed = resolve(rel(("id", INT), ("label", TEXT)), attrs((1, "id", INT), (2, "title", TEXT)), OLD)
    dropped = resolve(rel(("id", INT), ("label", TEXT)), attrs((1, "id", INT), (2, None, 0), (3, "x", INT)), OLD)
    assert renamed.ids == dropped.ids == (1, 2) and not renamed.doubts and not dropped.doubts


def test_a_name_the_catalog_does_not_have_and_the_source_did_not_know_is_a_doubt() -> None:
    got = resolve(rel(("id", INT), ("label", TEXT), ("c", INT)), attrs((1, "id", INT), (2, "label", TEXT),
                                                                      (3, "d", INT)), OLD)
    assert got.ids == (1, 2, None) and got.doubts == ("column 'c' is not in the catalog any more (renamed or "
                                                      "dropped since)",)


def test_names_swapped_after_the_relation_are_a_doubt() -> None:
    old = known(("id", 1, INT), ("a", 2, TEXT), ("b", 3, TEXT))
    got = resolve(rel(("id", INT), ("a", TEXT), ("b", TEXT)), attrs((1, "id", INT), (2, "b", TEXT),
                                                                    (3, "a", TEXT)), old)
    assert got.doubts and "orders the columns otherwise" in got.doubts[0]


def test_a_live_column_missing_from_the_relation_is_a_doubt() -> None:
    # 'label' renamed to 'tmp' and a new 'label' added, both after the Relation: it names the old one 'label'.
    got = resolve(rel(("id", INT), ("label", TEXT)), attrs((1, "id", INT), (2, "tmp", TEXT), (3, "label", TEXT)),
                  OLD)
    assert got.ids == (1, 3) and got.doubts and "'tmp' are missing" in got.doubts[0]


def test_the_same_name_added_again_is_a_new_column_unless_its_type_is_the_same() -> None:
    now = [(1, "id", INT), (2, None, 0)]
    other = resolve(rel(("id", INT), ("label", INT)), attrs(*now, (3, "label", INT)), OLD)
    same = resolve(rel(("id", INT), ("label", TEXT)), attrs(*now, (3, "label", TEXT)), OLD)
    assert other.ids == same.ids == (1, 3) and other.new == (False, True) and not other.doubts
    assert same.doubts and "may be attnum 2" in same.doubts[0]  # dropped and added again after the Relation?


def test_a_column_the_source_saw_dropped_is_no_candidate() -> None:
    # 'label' (2) left in an earlier Relation; now a text column is added: it cannot be the dropped one.
    now = attrs((1, "id", INT), (2, None, 0), (3, "note", TEXT))
    assert resolve(rel(("id", INT), ("note", TEXT)), now, known(("id", 1, INT)), top=2).doubts == ()
    assert resolve(rel(("id", INT), ("note", TEXT)), now, known(("id", 1, INT)), top=1).doubts != ()


def test_a_column_added_and_dropped_since_may_be_the_relations_new_one() -> None:
    got = resolve(rel(("id", INT), ("label", TEXT), ("z", TEXT)),
                  attrs((1, "id", INT), (2, "label", TEXT), (3, None, 0), (4, "z", TEXT)), OLD)
    assert got.ids == (1, 2, 4) and got.doubts and "may be attnum 3" in got.doubts[0]
    before = known(("id", 1, INT), ("x", 3, TEXT))  # attnum 2 was dropped before the source knew the table
    assert not resolve(rel(("id", INT), ("x", TEXT), ("y", INT)),
                       attrs((1, "id", INT), (2, None, 0), (3, "x", TEXT), (4, "y", INT)), before).doubts
