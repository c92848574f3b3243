from __future__ import annotations
from my_helpers import Driver, events_of
from cdcd.events import Op

DDL = """CREATE TABLE u (id INT PRIMARY KEY, u UUID, i6 INET6, i4 INET4, p POINT, z DATE, zdt DATETIME, zts TIMESTAMP NULL,
 f FLOAT, lat VARCHAR(10) CHARACTER SET latin1, ud DECIMAL(10,2) UNSIGNED)"""
ROW = ("(1, '123e4567-e89b-12d3-a456-426655440000', '::1', '192.0.2.1', POINT(1,2), '0000-00-00', '0000-00-00 00:00:00', "
       "'0000-00-00 00:00:00', 1.2345678, 'caf\u00e9', 12.5),"
       "(2, 'ffffffff-ffff-ffff-ffff-ffffffffffff', '::ffff:192.0.2.1', '0.0.0.0', NULL, '2024-00-15', NULL, NULL, 16777216, 'x', 0),"
       "(3, '00000000-0000-0000-0000-000000000001', '2001:db8::ff00:42:8329', '255.255.255.255', NULL, NULL, NULL, NULL, NULL, NULL, NULL)")

async def test_scratch(make_config, sql):
    sql("SET SESSION sql_mode=''", DDL, "INSERT INTO u VALUES " + ROW)
    print(sql("SELECT id, u, i6, i4, HEX(u), HEX(i6), CAST(f AS DOUBLE), f+0E0 FROM u"))
    async with Driver(make_config(["u"])) as d:
        got = await d.until_mark("snapshot_done")
        for e in events_of(got):
            print("SNAP", e.after)
        sql("SET SESSION sql_mode=''", "DELETE FROM u", "INSERT INTO u VALUES " + ROW)
        evs = await d.events(6)
        for e in evs:
            print("STREAM", e.op, e.after or e.before)
        print([ (c.name, c.source_type, c.type) for c in evs[-1].schema.columns])
