"""pgoutput row messages -> ``ChangeBlock``s: tuple data kept in wire form, converted a whole column at a time.

``BlockBuilder`` collects the Insert/Update/Delete messages of one relation inside one transaction, each tuple as
the server sent it (text values, None for NULL, ``UNCHANGED_TOAST``), and ``build`` turns them into one
``ChangeBlock``: the columns are transposed in C (``zip``) and converted by the snapshot's COPY-text converters
(``copytext.CopyDecoder.wire_column``), so no Python value and no row dict is made per column value.

The semantics are the row path's (``stream.PgStream._row_event`` with ``shape.RowDecoder``), value for value:

* an insert lands its new tuple; an update its new tuple, with its old tuple ('K': the replica identity
  columns, 'O': the whole old row under REPLICA IDENTITY FULL) as ``before``; a delete lands its old tuple;
* an unchanged TOAST value of a new tuple is NULL and unavailable, unless the update carries the whole old
  row, whose value then fills it in (the old row's NULL too); in an old tuple it is NULL;
* a 'K' tuple's other columns are not part of the old row (NULL in ``before``, absent from ``events()``);
* ``key_changed``: an update with an old tuple whose key (``schema.key``) differs from the new row's.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdcd.events import BEFORE_FULL, BEFORE_KEY, BEFORE_NONE, ChangeBlock
from cdcd.positions import PgPosition
from cdcd.sources.postgres.copytext import CopyDecoder
from cdcd.sources.postgres.pgoutput import UNCHANGED_TOAST, TupleValue, _tuple
from cdcd.sources.postgres.protocol import ProtocolError
from cdcd.sources.postgres.shape import TableShape, Warnings

_I, _U, _D = ord("I"), ord("U"), ord("D")
_N, _K, _O = ord("N"), ord("K"), ord("O")

Tuple = tuple[TupleValue, ...]


class BlockBuilder:
    """The row messages of one table shape, gathered until ``build`` (the stream cuts a block there)."""

    def __init__(self, shape: TableShape, warnings: Warnings) -> None:
        self.shape = shape
        self._names = shape.schema.column_names
        self._identity = tuple(n for n, ident in zip(self._names, shape.identity, strict=True) if ident)
        # 'K' tuples: the non-identity columns are not part of the old row (the server sends them as NULL)
        self._not_identity = [j for j, ident in enumerate(shape.identity) if not ident]
        self._convert = CopyDecoder(shape, warnings)
        self._schema = pa.schema([pa.field(c.name, c.type) for c in shape.schema.columns])
        self._key = [self._names.index(k) for k in shape.schema.key]
        self._clear()

    def _clear(self) -> None:
        self.rows: list[Tuple] = []  # the landed tuple of each row (new for c/u, old for d)
        self._ops: list[str] = []
        self._olds: list[Tuple] = []  # the old tuples, of the rows in ``_old_rows``
        self._old_rows: list[int] = []
        self._old_kinds: list[int] = []
        self._unavailable: dict[int, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, data: bytes) -> None:
        """One Insert, Update or Delete message of this table (protocol-1 form)."""
        tag = data[0]
        row = len(self.rows)
        if tag == _I:
            if data[5] != _N:
                raise ProtocolError("pgoutput: Insert without a new tuple")
            new, _ = _tuple(data, 6)
            self._ops.append("c")
            self._new(row, new, None)
            return
        if tag == _U:
            pos = 5
            marker = data[pos]
            old: Tuple | None = None
            kind = BEFORE_NONE
            if marker in (_K, _O):
                kind = BEFORE_KEY if marker == _K else BEFORE_FULL
                old, pos = _tuple(data, pos + 1)
                marker = data[pos]
            if marker != _N:
                raise ProtocolError("pgoutput: Update without a new tuple")
            new, _ = _tuple(data, pos + 1)
            self._ops.append("u")
            self._new(row, new, old if kind == BEFORE_FULL else None)
            if old is not None:
                self._old(row, old, kind)
            return
        if tag == _D:
            kind = BEFORE_FULL if data[5] == _O else BEFORE_KEY
            old, _ = _tuple(data, 6)
            old = self._old(row, old, kind)
            self._ops.append("d")
            self.rows.append(old)
            return
        raise ProtocolError(f"pgoutput: {data[:1]!r} is not a row message")

    def _new(self, row: int, new: Tuple, full_old: Tuple | None) -> None:
        if UNCHANGED_TOAST in new:
            values = list(new)
            gone: list[str] = []
            for j, v in enumerate(values):
                if v is UNCHANGED_TOAST:
                    if full_old is not None and full_old[j] is not UNCHANGED_TOAST:
                        values[j] = full_old[j]  # the whole old row has the value (or its NULL)
                    else:
                        values[j] = None
                        gone.append(self._names[j])
            if gone:
                self._unavailable[row] = tuple(gone)
            new = tuple(values)
        self.rows.append(new)

    def _old(self, row: int, old: Tuple, kind: int) -> Tuple:
        if kind == BEFORE_KEY and self._not_identity:
            values = list(old)
            for j in self._not_identity:
                values[j] = None
            old = tuple(values)
        if UNCHANGED_TOAST in old:
            old = tuple(None if v is UNCHANGED_TOAST else v for v in old)
        self._olds.append(old)
        self._old_rows.append(row)
        self._old_kinds.append(kind)
        return old

    def build(self, start: PgPosition, tx_id: str | None, commit_ts: object) -> ChangeBlock:
        """The gathered rows as one block whose first row is at ``start``; the builder starts empty again."""
        n = len(self.rows)
        schema = self.shape.schema
        data = self._table(self.rows)
        before = kinds = changed = None
        if self._olds:
            compact = self._table(self._olds)
            # every row gets a before row: NULL (via a NULL index) where the message had no old tuple
            index = np.full(n, -1, dtype=np.int64)
            index[self._old_rows] = np.arange(len(self._old_rows))
            take = pa.array(index, mask=index < 0)
            before = compact.take(take)
            kind = np.zeros(n, dtype=np.int8)
            kind[self._old_rows] = self._old_kinds
            kinds = pa.array(kind)
            changed = self._key_changed(data, before)
        unavailable = None
        if self._unavailable:
            unavailable = tuple(self._unavailable.get(i, ()) for i in range(n))
        block = ChangeBlock(schema, start, pa.array(self._ops, pa.string()), data, before, kinds, self._identity,
                            unavailable, changed, tx_id, commit_ts)  # type: ignore[arg-type]
        self._clear()
        return block

    def _table(self, tuples: list[Tuple]) -> pa.Table:
        width = len(self._names)
        for t in tuples:
            if len(t) != width:
                raise ProtocolError(f"pgoutput: a tuple of {self.shape.table} has {len(t)} columns, its Relation "
                                    f"message {width}")
        columns = list(zip(*tuples, strict=True))
        arrays = [self._convert.wire_column(j, columns[j]) for j in range(width)]
        return pa.Table.from_arrays(arrays, schema=self._schema)

    def _key_changed(self, data: pa.Table, before: pa.Table) -> pa.Array | None:
        """Updates with an old tuple whose old key is not equal (as Python's ``==`` on the key tuples) to the
        new one; None when there is none."""
        if not self._key:
            return None
        ops = np.array([o == "u" for o in self._ops])
        has_old = np.zeros(len(ops), dtype=bool)
        has_old[self._old_rows] = True
        candidates = ops & has_old
        if not candidates.any():
            return None
        same = np.ones(len(ops), dtype=bool)
        for j in self._key:
            new, old = data.column(j), before.column(j)
            if pa.types.is_nested(new.type):
                eq = np.array([a == b for a, b in zip(new.to_pylist(), old.to_pylist(), strict=True)])
            else:
                both_null = pc.and_(pc.is_null(new), pc.is_null(old))
                equal = pc.fill_null(pc.equal(new, old), False)
                eq = pc.or_(both_null, equal).to_numpy(zero_copy_only=False)
            same &= eq
        changed = candidates & ~same
        if not changed.any():
            return None
        return pa.array(changed)
