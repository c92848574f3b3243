"""The daemon's memory settings, applied once at start-up (docs/operations.md, "Memory").

Measured on the benchmark lines (docs/benchmarks-history.md, "Peak memory and the collector"): on the
snapshot lines most of the daemon's peak RSS above its ~110 MB of imports was memory already freed
but kept by allocators, not data in flight:

- Arrow's default pool (mimalloc) keeps freed pages per thread; ``release_unused`` after a landed
  batch only reaches the landing thread's heap, not those of the snapshot readers' threads. Arrow's
  C++ code takes its pool from ``ARROW_DEFAULT_MEMORY_POOL`` when pyarrow is imported, so that
  choice is made by ``cdcd/__init__.py`` (``system`` unless the environment names one), not here;
  ``apply`` only reports it.
- glibc gives every thread an arena of its own (up to 8 per core) and raises its mmap threshold
  each time a large block is freed, so later multi-megabyte column buffers come from the arenas'
  heaps, where freed space stays resident until the top of a heap is free.

``tuned`` (the default of ``runtime.memory``) gives glibc two arenas, a fixed mmap threshold
(blocks from 256 KiB are mapped and unmapped on their own) and a 1 MiB trim threshold (a heap
whose free top exceeds it shrinks at once). ``default`` leaves glibc and the collector as they
are. Settings an operator made in the environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) are left alone.

Python's cyclic collector: streaming allocates a few container objects per event, so with the default
thresholds (700, 10, 10) it ran about 800 young and 6 full collections in 10 s at 20,000 events/s, the
full ones scanning every object of the imported modules and stopping the event loop and the landing
thread (the GIL) for up to 64 ms, which is more than the 50 ms latency target. ``tuned`` moves what
start-up allocated out of the collector's way (``gc.freeze``: those objects live as long as the
process) and raises the first threshold to 10,000, so that collections are rarer and scan only
objects made since start-up; cycles are still collected.

glibc reads ``M_ARENA_MAX`` when a thread first allocates, so ``apply`` must run before the daemon
starts any thread: ``cdcd.daemon.lifecycle.run_daemon`` calls it before the event loop exists.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cdcd.errors import ConfigError

MemoryMode = Literal["tuned", "default"]

#: ``gc.set_threshold`` under ``tuned``: young collections every 10,000 net allocations instead of 700.
GC_TUNED_THRESHOLD = (10_000, 10, 10)

#: mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

#: What ``tuned`` asks of glibc: parameter -> (value, environment variables that set it instead).
GLIBC_TUNED: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "arena_max": (M_ARENA_MAX, 2, ("MALLOC_ARENA_MAX", "glibc.malloc.arena_max")),
    "mmap_threshold": (M_MMAP_THRESHOLD, 256 << 10, ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold")),
    "trim_threshold": (M_TRIM_THRESHOLD, 1 << 20, ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold")),
}


@dataclass
class MemorySettings:
    """What ``apply`` (and ``freeze_startup``) did, for the start-up log and ``/status``."""

    mode: MemoryMode
    arrow_pool: str  # the backend of Arrow's default pool (ARROW_DEFAULT_MEMORY_POOL, see cdcd/__init__.py)
    glibc: dict[str, int] = field(default_factory=dict)  # mallopt parameters set
    left_to_environment: list[str] = field(default_factory=list)  # settings the environment made instead
    gc_threshold: tuple[int, int, int] = field(default_factory=gc.get_threshold)
    gc_frozen: int = 0  # objects moved out of the collector's way after start-up

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "arrow_pool": self.arrow_pool, "glibc": dict(self.glibc),
                "left_to_environment": list(self.left_to_environment), "gc_threshold": list(self.gc_threshold),
                "gc_frozen": self.gc_frozen}


def glibc_version() -> str | None:
    """``"2.36"`` under glibc; None under another C library (musl), where mallopt is not glibc's."""
    try:
        found = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return None
    if not found or not found.startswith("glibc "):
        return None
    return found.split()[1]


def _env_sets(names: tuple[str, ...], env: Mapping[str, str]) -> str | None:
    """The environment variable (or ``GLIBC_TUNABLES`` entry) among ``names`` that is set, if any."""
    tunables = env.get("GLIBC_TUNABLES", "")
    for name in names:
        if name.startswith("glibc."):
            if any(part.split("=", 1)[0] == name for part in tunables.replace(":", " ").split()):
                return f"GLIBC_TUNABLES {name}"
        elif name in env:
            return name
    return None


def _mallopt(libc: ctypes.CDLL, param: int, value: int, name: str) -> None:
    if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
        raise ConfigError(
            f"runtime.memory = \"tuned\": glibc refused mallopt({name}, {value}); set runtime.memory = "
            "\"default\" to leave the allocators as they are, and report this with the glibc version "
            f"({glibc_version()})"
        )


def apply(mode: MemoryMode, env: Mapping[str, str] | None = None) -> MemorySettings:
    """Set the process's allocators and collector for ``mode``; call before any thread is started."""
    import pyarrow as pa

    env = os.environ if env is None else env
    if mode == "default":
        return MemorySettings(mode, pa.default_memory_pool().backend_name)
    if mode != "tuned":
        raise ConfigError(f"runtime.memory: unknown value {mode!r}; use \"tuned\" or \"default\"")
    left: list[str] = []
    glibc: dict[str, int] = {}
    if glibc_version() is not None:
        libc = ctypes.CDLL(None)  # the process's C library, which is glibc here
        for name, (param, value, names) in GLIBC_TUNED.items():
            by_env = _env_sets(names, env)
            if by_env is not None:
                left.append(by_env)
                continue
            _mallopt(libc, param, value, name)
            glibc[name] = value
    gc.set_threshold(*GC_TUNED_THRESHOLD)
    return MemorySettings(mode, pa.default_memory_pool().backend_name, glibc, left, gc.get_threshold())


def freeze_startup(settings: MemorySettings) -> None:
    """Under ``tuned``: once the daemon's modules are loaded, leave what start-up made out of later collections."""
    if settings.mode != "tuned":
        return
    gc.collect()  # what start-up left as garbage goes now, not frozen for ever
    gc.freeze()
    settings.gc_frozen = gc.get_freeze_count()
