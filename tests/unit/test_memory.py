"""cdcd.memory: the allocator and collector settings take effect in the process (each case in a fresh
interpreter: the settings are process-wide and glibc's arena limit holds only for threads started after it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from cdcd.memory import glibc_version

glibc_only = pytest.mark.skipif(glibc_version() is None, reason="mallopt settings are glibc's")

PROBE = textwrap.dedent("""
    import ctypes, gc, json, os, sys, threading
    from cdcd import memory

    settings = memory.apply(sys.argv[1])
    memory.freeze_startup(settings)
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc.mallinfo2.restype = MallInfo2

    # glibc raises its mmap threshold to the size of a freed mapped block unless the threshold was set:
    # after freeing 8 MiB, a 1 MiB block is mapped only with a fixed threshold.
    libc.free(libc.malloc(8 << 20))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(1 << 20)
    mapped = libc.mallinfo2().hblkhd - before >= 1 << 20
    libc.free(block)

    # Each new thread that allocates gets an arena of its own until glibc's limit.
    barrier = threading.Barrier(6)
    def work():
        barrier.wait()
        libc.free(libc.malloc(1000))
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    libc.malloc_stats()  # one "Arena N:" block per arena, on stderr
    os.dup2(saved, 2)
    os.close(w)
    stats = os.read(r, 1 << 20).decode()
    import pyarrow as pa
    print(json.dumps({"settings": settings.to_json(), "mapped_after_free": mapped,
                      "arenas": stats.count("Arena "), "pool": pa.default_memory_pool().backend_name,
                      "gc_threshold": gc.get_threshold(), "gc_frozen": gc.get_freeze_count()}))
""")


def probe(mode: str, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "ARROW_DEFAULT_MEMORY_POOL")}
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


@glibc_only
def test_tuned_bounds_arenas_fixes_the_mmap_threshold_and_puts_arrow_on_the_system_allocator() -> None:
    got = probe("tuned")
    assert got["pool"] == "system"
    assert got["arenas"] == 2
    assert got["mapped_after_free"] is True
    assert got["gc_threshold"] == [10_000, 10, 10]
    assert got["gc_frozen"] > 1000  # the imported modules' objects
    assert got["settings"] == {"mode": "tuned", "arrow_pool": "system",
                               "glibc": {"arena_max": 2, "mmap_threshold": 256 << 10, "trim_threshold": 1 << 20},
                               "left_to_environment": [], "gc_threshold": [10_000, 10, 10],
                               "gc_frozen": got["gc_frozen"]}


@glibc_only
def test_default_leaves_glibc_and_the_collector_alone() -> None:
    got = probe("default")
    assert got["pool"] == "system"  # chosen at import (cdcd/__init__.py), whatever runtime.memory says
    assert got["arenas"] > 2  # the main arena and one per thread
    assert got["mapped_after_free"] is False
    assert got["gc_threshold"] == [700, 10, 10] and got["gc_frozen"] == 0  # Python's defaults
    assert got["settings"] == {"mode": "default", "arrow_pool": got["pool"], "glibc": {},
                               "left_to_environment": [], "gc_threshold": [700, 10, 10], "gc_frozen": 0}


@glibc_only
def test_settings_made_in_the_environment_win() -> None:
    got = probe("tuned", MALLOC_ARENA_MAX="4", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=4194304",
                ARROW_DEFAULT_MEMORY_POOL="jemalloc")
    settings = got["settings"]
    assert settings["glibc"] == {"trim_threshold": 1 << 20}
    assert settings["left_to_environment"] == ["MALLOC_ARENA_MAX", "GLIBC_TUNABLES glibc.malloc.mmap_threshold"]
    assert got["pool"] == "jemalloc" == settings["arrow_pool"]
    assert got["arenas"] == 4
    assert got["mapped_after_free"] is False  # the environment's 4 MiB threshold, not ours


ARROW_POOLS = textwrap.dedent("""
    import json, sys
    import cdcd  # before pyarrow, as every cdcd command imports it
    import pyarrow as pa, pyarrow.parquet as pq

    table = pa.table({"id": list(range(200_000)), "b": ["row %d" % i for i in range(200_000)]})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy")
    back = pq.read_table(pa.BufferReader(sink.getvalue()))
    print(json.dumps({"pool": pa.default_memory_pool().backend_name, "rows": back.num_rows,
                      "mimalloc_peak": pa.mimalloc_memory_pool().max_memory()}))
""")


def arrow_pools(**env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    proc = subprocess.run([sys.executable, "-c", ARROW_POOLS], capture_output=True, text=True, timeout=60,
                          env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_importing_cdcd_puts_arrows_cpp_code_on_the_system_allocator() -> None:
    # pa.set_memory_pool would not do: Parquet's C++ code allocates from the pool chosen at import
    got = arrow_pools()
    assert got == {"pool": "system", "rows": 200_000, "mimalloc_peak": 0}


def test_an_arrow_pool_named_in_the_environment_is_kept() -> None:
    got = arrow_pools(ARROW_DEFAULT_MEMORY_POOL="mimalloc")
    assert got["pool"] == "mimalloc" and got["mimalloc_peak"] > 0
