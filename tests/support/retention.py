"""What the retention-budget tests of both sources share: the metrics of a status document, the reading of a
source's stream in the background, an async wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from source_driver import SourceDriver

from cdcd.daemon.metrics import StatusCollector


def scrape(status: dict[str, Any]) -> dict[str, float]:
    """The /metrics samples of a daemon status document, by name and labels (``name{label="value"}``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: status, lambda: True))
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def pull(d: SourceDriver) -> None:
    """Keep reading the stream (an incremental snapshot's chunks go out through it); nothing is committed unless
    the test says so: a consumer that stopped committing."""
    while await d.next(3600) is not None:
        pass


async def wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.05)
