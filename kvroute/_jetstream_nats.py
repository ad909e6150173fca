"""The asyncio loop nats-py runs on, for the JetStream relay and replica on either anyio backend.

nats-py is asyncio-only: under asyncio it runs on the caller's loop; under trio each relay and
replica runs its NATS connection on an asyncio loop in a thread (as grpcio runs behind worker
threads), so callers on both anyio backends work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import sniffio

from ._jetstream import JetStreamError, log, nats_module

__all__ = ["NatsLoop", "Signal"]

T = TypeVar("T")

#: nats-py's cap on unacknowledged `publish_async` calls (its default, 4,000, is the relay's window).
_PUBLISH_ASYNC_MAX = 1 << 20
#: Bytes nats-py reads from its socket at once, and its stream reader's limit (nats-py: 32 KB). At 32 KB a
#: follower's reader paused and resumed the socket (two epoll_ctl calls and a loop turn) every 32-64 KB
#: of records: 30 % of a replica's CPU samples in session 10's profile.
_READ_BUFFER = 1 << 20
#: Bytes of commands nats-py holds before a publish waits for them to be written (its `pending_size`).
#: Its flusher joins all it holds into one bytes object and asyncio copies the unsent rest into the
#: transport's buffer, so the larger the cap, the larger (and the less cache- and page-resident) each
#: copy: at 64 MiB the flusher's writes were a quarter of the relay's py-spy samples (session 13).
#: Publishing 200 MB of 90 KB records to a real server cost 0.32-0.44x the CPU at 4 MiB of what it cost
#: at 64 MiB, peak RSS 40-43 MB against 275 MB (bench/bench_nats_publish.py). It is also what a reconnect
#: buffers: past it a publish fails, and the relay's session starts over from what the log holds, as on
#: any failed publish (`_jetstream_publish`).
_PENDING_BYTES = 4 << 20


class NatsLoop:
    """One NATS connection, callable from any anyio backend.

    On asyncio, nats-py runs on the caller's own loop (no thread: a second thread would hand the
    GIL back and forth on every wake-up). On trio, it runs on an asyncio loop in a daemon thread.
    """

    def __init__(self, servers: Sequence[str], name: str) -> None:
        self.servers = list(servers)
        self.name = name
        self.threaded = True
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.nc: Any = None
        self.js: Any = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, connect_timeout: float, *, own_thread: bool = False) -> None:
        """Start the loop (trio, or ``own_thread``) and connect (nats-py then reconnects on its own, forever).

        ``own_thread``: run on an asyncio loop in a thread on asyncio too (the relay's lease
        renewals: a starved caller's loop must not stop them).
        """
        self.threaded = own_thread or sniffio.current_async_library() != "asyncio"
        if self.threaded:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name=f"nats-{self.name}", daemon=True)
            self._thread.start()
        else:
            self.loop = asyncio.get_running_loop()
        nats = nats_module()
        # nats-py reads this module constant at each connect and read; it has no option for it. Only raised,
        # never lowered, so any other nats-py user in the process keeps at least its own setting.
        client_module = nats.aio.client
        client_module.DEFAULT_BUFFER_SIZE = max(client_module.DEFAULT_BUFFER_SIZE, _READ_BUFFER)

        async def quiet(_exc: Exception) -> None:
            log.debug("nats %s: %s", self.name, _exc)

        async def connect() -> None:
            # Reconnects are unlimited once connected; the first connect is bounded (nats-py would
            # retry it forever too).
            self.nc = await asyncio.wait_for(
                nats.connect(
                    servers=self.servers,
                    name=self.name,
                    connect_timeout=connect_timeout,
                    reconnect_time_wait=0.2,
                    max_reconnect_attempts=-1,
                    error_cb=quiet,
                    pending_size=_PENDING_BYTES,
                ),
                connect_timeout,
            )
            # The relay bounds its unacknowledged records itself (`_jetstream_publish._WINDOW`), far below
            # this: nats-py's own bound must never make `publish_async` wait (see `_Outbox._publish`).
            self.js = self.nc.jetstream(timeout=connect_timeout, publish_async_max_pending=_PUBLISH_ASYNC_MAX)

        try:
            await self.call(connect())
        except Exception as exc:
            await self.close()
            raise JetStreamError(f"cannot connect to NATS at {', '.join(self.servers)}: {exc!r}") from exc

    async def call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the NATS loop and wait for its result (cancelling the caller cancels it)."""
        if not self.threaded:
            return await coro
        assert self.loop is not None
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
        except BaseException:
            fut.cancel()
            raise

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Call ``fn(*args)`` soon on the NATS loop, without waiting (from the caller's thread)."""
        assert self.loop is not None
        if self.threaded:
            self.loop.call_soon_threadsafe(fn, *args)
        else:
            self.loop.call_soon(fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task on the NATS loop (call it from that loop), cancelled by `close`."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def signal(self) -> Signal:
        """A wake-up the NATS loop sets and the caller's side waits on."""
        return Signal(self.threaded)

    async def close(self) -> None:
        """Drop the connection (without waiting on a dead server) and stop the loop."""
        tasks = list(self._tasks)
        if tasks and self.loop is not None:

            async def cancel() -> None:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            with contextlib.suppress(Exception):
                await self.call(cancel())
        if self.nc is not None:
            nc, self.nc = self.nc, None
            with contextlib.suppress(Exception):
                await self.call(asyncio.wait_for(nc.close(), 2.0))
        if self._thread is not None and self.loop is not None:
            if self._thread.is_alive():
                with contextlib.suppress(Exception):
                    await self.call(asyncio.wait_for(_cancel_all(), 2.0))
                self.loop.call_soon_threadsafe(self.loop.stop)
                await anyio.to_thread.run_sync(self._thread.join, 5.0)
            if not self.loop.is_running():
                self.loop.close()


class Signal:
    """Set on the NATS loop, awaited by the caller: a threading.Event across threads, an anyio.Event on one loop."""

    def __init__(self, threaded: bool) -> None:
        self._threaded = threaded
        self._event = threading.Event()
        self._flag = False
        self._waiter: anyio.Event | None = None

    def set(self) -> None:
        """Wake the waiter (from the NATS loop)."""
        if self._threaded:
            self._event.set()
        else:
            self._flag = True
            if self._waiter is not None:
                self._waiter.set()

    def clear(self) -> None:
        """Forget a past wake-up (the waiter then re-checks what it waits for)."""
        self._event.clear()
        self._flag = False

    async def wait(self, timeout: float) -> None:  # noqa: ASYNC109 (a short poll bound, not an API timeout)
        """Wait until set, at most ``timeout`` seconds."""
        if self._threaded:
            await anyio.to_thread.run_sync(self._event.wait, timeout, abandon_on_cancel=True)
            return
        if self._flag:
            return
        self._waiter = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._waiter.wait()
        self._waiter = None


async def _cancel_all() -> None:
    """Cancel what nats-py left running on this loop (a subscription's heartbeat checks), so it stops clean."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

