"""``cdcd run``: the daemon process around the Runtime (DESIGN.md section 7).

Signals: SIGTERM/SIGINT stop gracefully (exit 0); a second SIGTERM/SIGINT
during the grace period, or SIGQUIT at any time, force-stops (pending
batches dropped and counted, checkpoint at the last acked batch, exit
``FORCE_STOPPED``); SIGHUP re-reads the config file and applies ``log.level``
and ``source.tables`` (``cdcd.daemon.operator``; a file that does not load
changes nothing). They arrive through ``cdcd.daemon.signals.SignalGuard``,
which also bounds the whole stop, even while the event loop is held; a stop
signal after the stop finished its work exits at once with the code decided.
sd_notify: READY=1 once ``Runtime.start()`` returned (checkpoint loaded,
source connected), STATUS= while running, STOPPING=1, WATCHDOG=1 from the
pipeline loop.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import structlog

from cdcd import __version__
from cdcd.config import Config
from cdcd.daemon.exitcodes import ExitCode, exit_code_for
from cdcd.daemon.httpserver import HttpServer, Response
from cdcd.daemon.operator import Answer, Operator
from cdcd.daemon.progress import RateTracker, progress_fields, render_live, summary_line
from cdcd.daemon.sdnotify import Notifier
from cdcd.daemon.signals import SignalGuard
from cdcd.daemon.token import daemon_token
from cdcd.errors import CdcdError, StateError
from cdcd.logging import bind_context
from cdcd.memory import MemorySettings, freeze_startup
from cdcd.runtime.interfaces import Sink
from cdcd.runtime.runtime import Runtime, RuntimeState
from cdcd.sinks import zone_name

_log = structlog.get_logger("cdcd.daemon")

#: /healthz fails when the running pipeline loop has not ticked for this long.
STALL_AFTER_S = 30.0
#: /healthz fails when checkpoint saves or landing writes have failed without a break for this long
#: (/readyz fails at once): a full disk that nobody frees must reach the operator's health checks.
STORAGE_UNHEALTHY_AFTER_S = 30.0
#: How often progress is logged when not on a TTY.
PROGRESS_LOG_INTERVAL_S = 30.0
_STATUS_INTERVAL_S = 2.0
#: How long a cancelled step of the stop (the graceful stop a second signal overrides, the progress reporter)
#: is waited for before the stop goes on without it.
CANCEL_WAIT_S = 5.0


class Daemon:
    def __init__(self, config: Config, config_path: Path, notifier: Notifier | None = None,
                 tty: bool | None = None, memory: MemorySettings | None = None) -> None:
        self.config = config
        self.memory = memory  # the allocator settings run_daemon applied (None when run in-process by tests)
        self.config_path = config_path
        self.notifier = notifier or Notifier.from_env()
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.rt: Runtime | None = None
        self.ready = False
        self.started_at = time.time()
        self._ready_mono = 0.0
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._reloads: set[asyncio.Task[Answer]] = set()  # SIGHUP reloads under way
        self._http: HttpServer | None = None
        self._guard: SignalGuard | None = None
        self.operator = Operator(config, config_path, lambda: self.rt)

    # -- status for HTTP, metrics, progress ---------------------------------------

    def status(self) -> dict[str, Any]:
        base: dict[str, Any] = (
            self.rt.status() if self.rt is not None
            else {"state": RuntimeState.IDLE.value, "stats": {}, "source": {}, "checkpoint": None}
        )
        base.update(
            incremental_snapshots=self.rt.source.snapshot_progress() if self.rt is not None else [],
            pid=os.getpid(), version=__version__, ready=self.is_ready(), source_kind=self.config.source.kind,
            uptime_s=round(time.time() - self.started_at, 1), stopping=self._stop.is_set(),
            memory=None if self.memory is None else self.memory.to_json(),
        )
        fault = self.storage_fault()
        base["storage_fault"] = None if fault is None else {"error": fault[0], "failing_for_s": round(fault[1], 1)}
        return base

    def is_ready(self) -> bool:
        rt = self.rt
        if not self.ready or rt is None or rt.state is not RuntimeState.RUNNING or self._stop.is_set():
            return False
        return bool(rt.source.status().get("connected", True)) and self.storage_fault() is None

    def _tick_age(self) -> float | None:
        if self.rt is None or not self.ready or self.rt.state is not RuntimeState.RUNNING:
            return None
        return time.monotonic() - max(self.rt.stats.last_tick, self._ready_mono)

    def storage_fault(self) -> tuple[str, float] | None:
        """The write failure the pipeline waits on (what, seconds failing), or None."""
        rt = self.rt
        if rt is None:
            return None
        now = time.time()
        since = rt.stats.checkpoint_failing_since
        if since is not None:
            return f"checkpoint saves are failing: {rt.stats.checkpoint_error}", now - since
        sink = rt.sink.status()
        since = sink.get("failing_since")
        if isinstance(since, float):
            return f"landing writes are failing: {sink.get('last_write_error')}", now - since
        return None

    def _healthz(self) -> Response:
        age = self._tick_age()
        if age is not None and age > STALL_AFTER_S:
            return Response(503, f"unhealthy: the pipeline loop has not ticked for {age:.0f}s\n".encode())
        fault = self.storage_fault()
        if fault is not None and fault[1] > STORAGE_UNHEALTHY_AFTER_S:
            return Response(503, f"unhealthy for {fault[1]:.0f}s: {fault[0]}\n".encode())
        return Response(200, b"ok\n")

    def _readyz(self) -> Response:
        if self.is_ready():
            return Response(200, b"ready\n")
        fault = self.storage_fault()
        state = self.rt.state.value if self.rt is not None else "idle"
        why = "stopping" if self._stop.is_set() else ("connecting to the source" if not self.ready else state)
        if fault is not None and not self._stop.is_set():
            why = f"{fault[0]} (for {fault[1]:.0f}s)"
        return Response(503, f"not ready: {why}\n".encode())

    # -- signals -------------------------------------------------------------------

    def _on_stop_signal(self, signame: str) -> None:
        if self._stop.is_set() and self.rt is not None and self.rt.state is RuntimeState.STOPPED:
            _log.info("stop signal after the runtime stopped: nothing left to force", signal=signame)
        elif self._stop.is_set():
            _log.warning("second stop signal: force-stopping", signal=signame)
            self._force.set()
        else:
            _log.info("stop signal: stopping gracefully", signal=signame,
                      grace_s=self.config.runtime.shutdown_grace_s)
            self._stop.set()

    def _on_force_signal(self, signame: str) -> None:
        _log.warning("force-stop signal", signal=signame)
        self._stop.set()
        self._force.set()

    def _on_reload(self) -> None:
        # logs what it did, or why it changed nothing; held until done (the loop keeps only weak references)
        task = asyncio.get_running_loop().create_task(self.operator.reload("SIGHUP"), name="cdcd-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        # Not loop.add_signal_handler: its handlers cannot run while the loop is held (issue 27). Never removed:
        # a signal after the stop must not kill the process with the signal's default action.
        self._guard = SignalGuard(loop, self.config.runtime.shutdown_grace_s, self._on_stop_signal,
                                  self._on_force_signal, self._on_reload)
        self._guard.install()

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        code: int = ExitCode.FAILURE  # an unexpected error
        try:
            code = await self._run()
            return code
        finally:
            if self._guard is not None:
                self._guard.decided(code)  # from here on a stop signal exits at once with it

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        src = self.config.source
        # Bound before the signal handlers are installed: their callbacks copy this context.
        bind_context(source=src.kind, database=src.database)
        self._install_signals(loop)
        _log.info("cdcd starting", version=__version__, pid=os.getpid(), config=str(self.config_path),
                  source_host=src.host, source_port=src.effective_port, tables=src.tables,
                  state=str(self.config.state.path), landing=zone_name(self.config),
                  memory=None if self.memory is None else self.memory.to_json())
        reporter: asyncio.Task[None] | None = None
        try:
            self.rt = self._make_runtime()
            # The state directory's lock first: a second daemon on it is refused naming the holder (exit 7),
            # before it could fail on the HTTP port the first one holds.
            self.rt.store.lock()
            if self.config.http.enabled:
                self._http = self._make_http(daemon_token(self.config))
                await self._http.start()
            self.notifier.status("starting: loading the checkpoint and connecting to the source")
            if self.memory is not None:  # run_daemon's process (never a test's): the modules of the run are loaded
                freeze_startup(self.memory)
            code = await self._start()
            if code is not None:
                return code
            reporter = loop.create_task(self._report(), name="cdcd-progress")
            return await self._serve()
        except CdcdError as exc:
            _log.error("cdcd failed", error=str(exc), error_type=type(exc).__name__)
            return exit_code_for(exc)
        finally:
            if reporter is not None:
                reporter.cancel()
                await asyncio.wait({reporter}, timeout=CANCEL_WAIT_S)
            if self._http is not None:
                await self._http.close()
            self.notifier.close()

    def _make_runtime(self) -> Runtime:
        from cdcd.sources import make_source

        # Loaded on use: the landing sink (and pyarrow behind it) is not needed by the other commands.
        make_sink: Callable[[Config], Sink] = importlib.import_module("cdcd.sinks").make_sink
        rt = Runtime(self.config, source=make_source(self.config), sink=make_sink(self.config))
        rt.on_tick = self._on_tick
        return rt

    def _on_tick(self) -> None:
        self.notifier.watchdog()

    def _make_http(self, token: str) -> HttpServer:
        # Loaded on use: prometheus_client (and http.server, email behind it) only when http.listen is set.
        from cdcd.daemon.metrics import CONTENT_TYPE, make_registry, render

        registry = make_registry(self.status, self.is_ready)
        host, port = self.config.http.host_port
        return HttpServer(host, port, {
            "/metrics": lambda: Response(200, render(registry), CONTENT_TYPE),
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/status": lambda: Response.json(200, self.status()),
        }, {
            "/snapshot": lambda doc: _respond_async(self.operator.snapshot(doc)),
            "/tables/reload": lambda doc: _respond_async(self.operator.reload("tables reload")),
        }, token)

    async def _start(self) -> int | None:
        """Start the runtime; a stop signal while connecting abandons the start. None means running."""
        assert self.rt is not None
        start = asyncio.ensure_future(self.rt.start())
        stop_wait = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not start.done():
            self.notifier.stopping("stopping before the source connected")
            await _cancel(start, "connecting to the source")
            _log.info("stopped before the source connected")
            return ExitCode.FORCE_STOPPED if self._force.is_set() else ExitCode.OK
        start.result()  # raises the start error
        self.ready = True
        self._ready_mono = time.monotonic()
        self.notifier.ready(summary_line(self.status()))
        _log.info("ready", http=self.config.http.listen or None, sd_notify=self.notifier.enabled,
                  watchdog=self.notifier.watchdog_enabled)
        return None

    async def _serve(self) -> int:
        assert self.rt is not None
        rt = self.rt
        ended = asyncio.ensure_future(rt.wait())
        stop_wait = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({ended, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if ended.done():
            return self._ended(ended)
        self.notifier.stopping(f"stopping: waiting up to {self.config.runtime.shutdown_grace_s:g}s for acks")
        if self._force.is_set():
            ended.cancel()
            return await self._force_stop("SIGQUIT")
        return await self._graceful(ended)

    async def _graceful(self, ended: asyncio.Future[None]) -> int:
        assert self.rt is not None
        stop = asyncio.ensure_future(self.rt.stop())
        force_wait = asyncio.ensure_future(self._force.wait())
        waiting: set[asyncio.Future[Any]] = {stop, force_wait, ended}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        force_wait.cancel()
        if stop.done():
            ended.cancel()
            try:
                stop.result()
            except StateError as exc:  # acks still missing after the grace period
                _log.error("graceful stop incomplete", error=str(exc))
                return await self._force_stop("grace period over")
            _log.info("stopped gracefully", events_committed=self.rt.stats.events_committed,
                      committed_batch=self.rt.stats.committed_batch_seq)
            return ExitCode.OK
        if ended.done() and ended.exception() is not None:  # the pipeline failed while draining
            await _cancel(stop, "the graceful stop")
            return self._ended(ended)
        await _cancel(stop, "the graceful stop")
        ended.cancel()
        return await self._force_stop("second stop signal")

    async def _force_stop(self, why: str) -> int:
        assert self.rt is not None
        if self.rt.state is RuntimeState.STOPPING:  # the cancelled graceful stop is stuck: force_stop() would refuse
            _log.error("force-stopped while the graceful stop is stuck; exiting without waiting for it", reason=why,
                       committed_batch=self.rt.stats.committed_batch_seq)
            return ExitCode.FORCE_STOPPED
        dropped = await self.rt.force_stop()
        _log.warning("force-stopped: pending events dropped; the checkpoint stays at the last acked batch",
                     reason=why, dropped_events=len(dropped), committed_batch=self.rt.stats.committed_batch_seq,
                     committed_position=self.rt.stats.committed_position)
        return ExitCode.FORCE_STOPPED

    def _ended(self, ended: asyncio.Future[None]) -> int:
        exc = ended.exception()
        if exc is None:
            _log.info("pipeline ended (snapshot complete, snapshot.mode = initial_only)")
            return ExitCode.OK
        _log.error("stopped by a fatal error", error=str(exc), error_type=type(exc).__name__)
        return exit_code_for(exc)

    async def _report(self) -> None:
        """sd_notify STATUS= every few seconds; the live display on a TTY, log lines otherwise."""
        rates = RateTracker()
        last_log = time.monotonic()
        live = None
        if self.tty:
            from rich.live import Live

            live = Live(render_live(self.status(), rates), refresh_per_second=2, transient=True)
            live.start()
        last_status = ""
        try:
            while True:
                await asyncio.sleep(_STATUS_INTERVAL_S if live is None else 0.5)
                status = self.status()
                line = summary_line(status)
                if line != last_status:
                    self.notifier.status(line)
                    last_status = line
                if live is not None:
                    live.update(render_live(status, rates))
                elif time.monotonic() - last_log >= PROGRESS_LOG_INTERVAL_S:
                    last_log = time.monotonic()
                    _log.info("progress", **progress_fields(status, rates))
        finally:
            if live is not None:
                live.stop()


async def _respond_async(answer: Awaitable[Answer]) -> Response:
    return _respond(await answer)


async def _cancel(fut: asyncio.Future[Any], what: str) -> None:
    """Cancel ``fut`` and wait for it to end, at most ``CANCEL_WAIT_S``: a step that ignores its cancellation
    (or is stuck in a finally) must not hold the stop."""
    fut.cancel()
    await asyncio.wait({fut}, timeout=CANCEL_WAIT_S)
    if not fut.done():
        _log.error(f"{what} did not end within {CANCEL_WAIT_S:g}s of being cancelled; the stop goes on without it")
    elif not fut.cancelled() and fut.exception() is not None:
        exc = fut.exception()
        _log.warning(f"{what} ended with an error as it was cancelled", error=str(exc), error_type=type(exc).__name__)


def _respond(answer: Answer) -> Response:
    return Response.json(answer.status, answer.doc)


def run_daemon(config: Config, config_path: Path) -> NoReturn:
    from cdcd import memory

    # Before asyncio.run: glibc's arena limit holds only for threads that allocate after it is set.
    settings = memory.apply(config.runtime.memory)
    code = asyncio.run(Daemon(config, config_path, memory=settings).run())
    # The work is done and the checkpoint saved: exit now, with this code. The interpreter's own exit would wait
    # without a bound for leftover threads (a landing write a force-stop abandoned) and restores the signals'
    # default actions before the process ends, so that a late SIGTERM would end it as killed by the signal.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
