"""Property tests of the pure PostgreSQL layers: framing under any split, array literals of any content."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from cdcd.sources.postgres.types import parse_array
from cdcd.sources.postgres.wire import protocol as p


def _array_out(value: list[object]) -> str:
    """What PostgreSQL's array_out prints for a (nested) list of text values."""
    parts: list[str] = []
    for v in value:
        if isinstance(v, list):
            parts.append(_array_out(v))
        elif v is None:
            parts.append("NULL")
        else:
            assert isinstance(v, str)
            needs_quotes = v == "" or v.upper() == "NULL" or any(c in v for c in '{}",\\ \t\n\r\v\f')
            escaped = v.replace("\\", "\\\\").replace('"', '\\"')
            parts.append(f'"{escaped}"' if needs_quotes else v)
    return "{" + ",".join(parts) + "}"


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8)


@given(st.lists(st.none() | texts, max_size=8))
def test_array_literals_round_trip(value: list[str | None]) -> None:
    assert parse_array(_array_out(value)) == value  # type: ignore[arg-type]


@given(st.lists(st.lists(st.none() | texts, min_size=2, max_size=2), min_size=1, max_size=4))
def test_two_dimensional_array_literals_round_trip(value: list[list[str | None]]) -> None:
    assert parse_array(_array_out(value)) == value  # type: ignore[arg-type]


@given(st.lists(st.tuples(st.sampled_from([b"d", b"Z", b"E", b"N"]), st.binary(max_size=40)), max_size=12),
       st.lists(st.integers(min_value=1, max_value=17), min_size=1, max_size=40))
def test_message_framing_survives_any_split(messages: list[tuple[bytes, bytes]], cuts: list[int]) -> None:
    stream = b"".join(kind + struct.pack("!i", len(body) + 4) + body for kind, body in messages)
    buf = p.MessageBuffer()
    got: list[tuple[bytes, bytes]] = []
    pos, i = 0, 0
    while pos < len(stream):
        step = cuts[i % len(cuts)]
        buf.feed(stream[pos : pos + step])
        pos, i = pos + step, i + 1
        got.extend((m.kind, m.payload) for m in buf)
    assert got == messages and buf.pending == 0
