"""The daemon's allocator settings, applied once at start-up (docs/operations.md, "Memory").

Measured on the benchmark lines (docs/benchmarks.md, "Peak memory"): most of the daemon's peak RSS
above its ~110 MB of imports was memory already freed but kept by allocators, not data in flight:

- Arrow's default pool (mimalloc) keeps freed pages per thread; ``release_unused`` after a landed
  batch only reaches the landing thread's heap, not those of the snapshot readers' threads.
- glibc gives every thread an arena of its own (up to 8 per core) and raises its mmap threshold
  each time a large block is freed, so later multi-megabyte column buffers come from the arenas'
  heaps, where freed space stays resident until the top of a heap is free.

``tuned`` (the default of ``runtime.allocator``) therefore puts Arrow on the system allocator and
gives glibc two arenas, a fixed mmap threshold (blocks from 256 KiB are mapped and unmapped on
their own) and a 1 MiB trim threshold; Arrow's ``release_unused`` on the system pool then also
trims glibc's heaps (``malloc_trim``). ``default`` leaves both libraries as they are. Settings an
operator made in the environment (``ARROW_DEFAULT_MEMORY_POOL``, ``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) are left alone.

glibc reads ``M_ARENA_MAX`` when a thread first allocates, so ``apply`` must run before the daemon
starts any thread: ``cdcd.daemon.lifecycle.run_daemon`` calls it before the event loop exists.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cdcd.errors import ConfigError

Allocator = Literal["tuned", "default"]

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
ARROW_TUNED_POOL = "system"
ARROW_POOL_ENV = "ARROW_DEFAULT_MEMORY_POOL"


@dataclass(frozen=True)
class MemorySettings:
    """What ``apply`` did, for the start-up log and ``/status``."""

    allocator: Allocator
    arrow_pool: str  # the backend of Arrow's default pool after apply
    glibc: dict[str, int] = field(default_factory=dict)  # mallopt parameters set
    left_to_environment: list[str] = field(default_factory=list)  # settings the environment made instead

    def to_json(self) -> dict[str, Any]:
        return {"allocator": self.allocator, "arrow_pool": self.arrow_pool, "glibc": dict(self.glibc),
                "left_to_environment": list(self.left_to_environment)}


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
            f"runtime.allocator = \"tuned\": glibc refused mallopt({name}, {value}); set runtime.allocator = "
            "\"default\" to leave the C allocator as it is, and report this with the glibc version "
            f"({glibc_version()})"
        )


def apply(allocator: Allocator, env: Mapping[str, str] | None = None) -> MemorySettings:
    """Set the process's allocators for ``allocator``; call before any thread is started."""
    import pyarrow as pa

    env = os.environ if env is None else env
    if allocator == "default":
        return MemorySettings(allocator, pa.default_memory_pool().backend_name)
    if allocator != "tuned":
        raise ConfigError(f"runtime.allocator: unknown value {allocator!r}; use \"tuned\" or \"default\"")
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
    if ARROW_POOL_ENV in env:
        left.append(ARROW_POOL_ENV)
    else:
        pa.set_memory_pool(pa.system_memory_pool())
    return MemorySettings(allocator, pa.default_memory_pool().backend_name, glibc, left)
