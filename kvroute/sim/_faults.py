"""Faults for simulated fleets: the seeded fault driver the chaos test and the soak benchmark share.

A `FaultDriver` holds a fleet of `SimEngine`s, each behind a `DiscoveryServer` it can hide or
stop, and injects one named fault at a time (`FAULT_KINDS`): drop rates, restarts on the same or
new ports, a silent restart (a young process, then another whose first batches are all lost),
replay endpoints killed or muted, publishers held back, discovery hidden or down, and a prefix
cache reset. Every random choice comes from the driver's own ``random.Random``: a seed names
one fault sequence, whatever the machine's speed. What a fault changes is undone by `undo_due`
(at the time given to `inject`) or by `heal` (everything, at once).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Literal, get_args

import anyio

from ._engine import SimEngine
from ._grpc import GrpcServer, SglangService, VllmControlService, sglang_server_info, start_grpc_server

__all__ = ["FAULT_KINDS", "DiscoveryServer", "FaultDriver", "FaultKind"]

FaultKind = Literal[
    "drop",
    "restart",
    "restart-new-ports",
    "silent-restart",
    "kill-replay",
    "mute-replay",
    "pause",
    "hide",
    "down",
    "clear",
]
FAULT_KINDS: Final[tuple[FaultKind, ...]] = get_args(FaultKind)

#: How often (2 ms apart) a "clear" tries for a moment with no request running (the engine refuses otherwise).
_CLEAR_TRIES: Final = 1000


class DiscoveryServer:
    """An engine's gRPC discovery server that can be hidden (an empty answer) or stopped and started on its port."""

    def __init__(self, eng: SimEngine) -> None:
        self.eng = eng
        self.hidden = False
        self.service: VllmControlService | SglangService
        if eng.config.engine == "vllm":
            self.service = VllmControlService(lambda: [] if self.hidden else eng.advertised_sources())
        else:
            self.service = SglangService(lambda: sglang_server_info(None) if self.hidden else eng.server_info_json())
        self.server: GrpcServer | None = None
        self.port = 0

    @property
    def target(self) -> str:
        """The ``host:port`` a client dials (the same across stops and starts)."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Serve (again, on the same port once it has one); a no-op while serving."""
        if self.server is not None:
            return
        with anyio.fail_after(10):
            while self.server is None:
                try:
                    self.server = await start_grpc_server([self.service], port=self.port)
                except OSError:
                    await anyio.sleep(0.02)  # the old listener is still closing
        self.port = self.server.port

    async def stop(self) -> None:
        """Stop serving (clients see the target down)."""
        server, self.server = self.server, None
        if server is not None:
            await server.stop()


class FaultDriver:
    """Inject, undo and heal faults on a fleet, every choice drawn from ``rng``.

    ``on_restart`` is called with an engine right after each of its restarts (the chaos test
    records the new process there). ``done`` counts the faults injected, by kind.
    """

    def __init__(
        self,
        engines: Sequence[SimEngine],
        discos: Sequence[DiscoveryServer],
        rng: random.Random,
        *,
        on_restart: Callable[[SimEngine], None] | None = None,
    ) -> None:
        self.engines = list(engines)
        self.discos = list(discos)
        self.rng = rng
        self.on_restart = on_restart
        self.done: dict[FaultKind, int] = {}
        # (when, undo): what `undo_due` runs once its time (if any) has come; `heal` runs them all.
        self._undo: list[tuple[float | None, Callable[[], Awaitable[None]]]] = []

    def plan(
        self, count: int, kinds: Sequence[FaultKind], *, every_run: Sequence[FaultKind] = ()
    ) -> list[tuple[FaultKind, int, int]]:
        """``count`` faults as (kind, engine index, rank), each kind of ``every_run`` among them.

        Drawn from the seed alone, before anything runs: the sequence does not depend on timing.
        """
        rng = self.rng
        out: list[tuple[FaultKind, int, int]] = []
        for n in range(max(count, len(every_run))):
            kind = every_run[n] if n < len(every_run) else rng.choice(kinds)
            i = rng.randrange(len(self.engines))
            out.append((kind, i, rng.randrange(self.engines[i].config.ranks)))
        rng.shuffle(out)
        return out

    async def inject(self, kind: FaultKind, i: int, rank: int = 0, *, undo_at: float | None = None) -> bool:
        """Inject ``kind`` into engine ``i`` (``rank`` where it matters); False when it does not apply.

        ``undo_at`` (anyio clock): when `undo_due` lifts a fault that lasts (replay killed or muted,
        publisher held, discovery hidden or down); None leaves it to `heal`.
        """
        eng, disco, rng = self.engines[i], self.discos[i], self.rng
        rank %= eng.config.ranks
        has_replay = eng.config.replay_port is not None
        if kind == "drop":
            eng.drop_rate = rng.choice([0.0, 0.2, 0.5, 0.9])
        elif kind in ("restart", "restart-new-ports"):
            await eng.restart(change_ports=kind == "restart-new-ports")
            self._restarted(eng)
        elif kind == "silent-restart":
            # A young process, then another one whose first batches are all lost: its first
            # seq the client sees is past anything the first one sent, so no seq goes back
            # and only an identity check can tell. Shorter than a typical quiet interval, so
            # the reconnect's check, not the quiet probe's, is the one exercised.
            await eng.restart()
            self._restarted(eng)
            await anyio.sleep(rng.uniform(0.03, 0.06))
            rate, eng.drop_rate = eng.drop_rate, 1.0
            await eng.restart()
            self._restarted(eng)
            await anyio.sleep(rng.uniform(0.15, 0.25))
            eng.drop_rate = rate
        elif kind == "kill-replay" and has_replay:
            pub = eng.publisher(rank)
            pub.kill_replay()

            def revive() -> None:
                # Only while that process lives: a restarted engine's new one has its own (and
                # a dead publisher must not bind again: nothing would close that socket).
                with contextlib.suppress(RuntimeError):
                    if eng.publisher(rank) is pub:
                        pub.revive_replay()

            self._later(undo_at, revive)
        elif kind == "mute-replay" and has_replay:
            pub = eng.publisher(rank)
            pub.replay_mute = True
            self._later(undo_at, lambda: setattr(pub, "replay_mute", False))
        elif kind == "pause":
            eng.pause()
            self._later(undo_at, eng.resume)
        elif kind == "hide":
            disco.hidden = True
            self._later(undo_at, lambda: setattr(disco, "hidden", False))
        elif kind == "down":
            await disco.stop()
            self._undo.append((undo_at, disco.start))
        elif kind == "clear":
            # Refused while requests run: try between them, for a bounded while.
            for _ in range(_CLEAR_TRIES):
                if eng.reset_prefix_cache():
                    break
                await anyio.sleep(0.002)
            else:
                return False
        else:
            return False
        self.done[kind] = self.done.get(kind, 0) + 1
        return True

    async def undo_due(self) -> None:
        """Lift the faults whose `inject` time has come."""
        now = anyio.current_time()
        due = [fix for when, fix in self._undo if when is not None and when <= now]
        self._undo = [(when, fix) for when, fix in self._undo if when is None or when > now]
        for fix in due:
            await fix()

    async def heal(self) -> None:
        """Lift every fault: drop rates 0, publishers flowing, replay and discovery back."""
        for _, fix in self._undo:
            await fix()
        self._undo = []
        for eng, disco in zip(self.engines, self.discos):
            eng.drop_rate = 0.0
            eng.resume()
            disco.hidden = False
            await disco.start()

    def _restarted(self, eng: SimEngine) -> None:
        if self.on_restart is not None:
            self.on_restart(eng)

    def _later(self, when: float | None, fix: Callable[[], object]) -> None:
        async def run() -> None:
            fix()

        self._undo.append((when, run))
