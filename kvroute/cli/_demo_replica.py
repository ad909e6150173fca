"""``kvroute demo --replicas N``: N router processes, each following every engine, the requests spread over them.

`ReplicaPolicy` (in the demo's process) starts N copies of this module (``python -m
kvroute.cli._demo_replica TARGET...``), each a `KvEventClient` following every engine's gateway stream
and a `Router` over its own index, and sends each request to the next replica in turn, as a load balancer
in front of router replicas does. With ``engine`` load each Router prices the engines' reported queues
(`EngineLoads`, blended with its own in-flight requests); with ``router`` load it sees only the requests
it routed itself, 1/N of the fleet's. At the end every replica reports a digest of its index (what it
claims for each of the workload's prompts, and its block count per worker): at quiescence they agree.

With ``kvroute demo --jetstream`` (`DemoOptions.jetstream`: the policy is given a NATS server), the policy
runs one `JetStreamRelay` following every engine instead, and each replica process is a `KvEventClient` on
the JetStream transport (``jetstream="nats://host:port/<stream>"``: its sources are the log's workers, it
never talks to the engines); the log carries no engine load, so both load modes then price the replica's own
requests.

The replica speaks JSON lines on stdin / stdout: ``{"op": "route", "id", "tokens"}`` -> ``{"id",
"worker", "rank"}``; ``{"op": "prefill" | "finish", "id"}`` (no answer); ``{"op": "digest", "prompts"}``
-> ``{"digest", "blocks"}``. It prints ``{"ready": true}`` once every source is synced, and exits when
stdin closes.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import anyio
import anyio.abc
import msgspec
import xxhash
from anyio.streams.buffered import BufferedByteReceiveStream

from kvroute import (
    CostModel,
    JetStreamRelay,
    KvEventClient,
    KvRouteError,
    LoadPolicy,
    PrefixIndex,
    Router,
    SubscriberConfig,
    WorkerKey,
)
from kvroute._load import EngineLoads

__all__ = ["LOAD_MODES", "ReplicaPolicy", "index_digest", "nats_server"]

#: How replicas learn load: their own in-flight requests only, or the engines' reports blended in.
LOAD_MODES = ("router", "engine")
# A routed prompt of 128k tokens as JSON is ~1 MB: lines up to this long are read whole.
_MAX_LINE = 64 * 1024 * 1024


def index_digest(index: PrefixIndex, prompts: Sequence[Sequence[int]]) -> tuple[str, int]:
    """A digest of what ``index`` claims: every prompt's overlap per worker, and blocks per worker.

    Two indexes built from the same events give the same digest; one that missed or over-claims a block
    any of the prompts reaches gives another.
    """
    h = xxhash.xxh3_64()
    for i, prompt in enumerate(prompts):
        scores = index.find_matches(prompt)
        for w, blocks in sorted(scores.items()):
            h.update(f"{i}|{w.worker_id}|{w.dp_rank}|{blocks};".encode())
    workers = sorted(index.workers())
    for w in workers:
        h.update(f"{w.worker_id}|{w.dp_rank}|{index.num_blocks(w)};".encode())
    return h.hexdigest(), sum(index.num_blocks(w) for w in workers)


class _Route(msgspec.Struct, kw_only=True):
    op: str
    id: int = 0
    tokens: list[int] = msgspec.field(default_factory=list)
    prompts: list[list[int]] = msgspec.field(default_factory=list)


async def _serve(
    targets: list[str], load: str, block_size: int, overlap_weight: float, seed: int, nats: str | None, stream: str
) -> None:
    config = SubscriberConfig(quiet_interval=0.5, events_buffer=100_000)
    out = sys.stdout.buffer
    encoder = msgspec.json.Encoder()
    decoder = msgspec.json.Decoder(_Route)

    def reply(obj: dict[str, Any]) -> None:
        out.write(encoder.encode(obj) + b"\n")
        out.flush()

    follower = (
        KvEventClient(jetstream=f"{nats}/{stream}")
        if nats is not None
        else KvEventClient(targets=targets, config=config)
    )
    async with follower as client:
        await client.wait_synced(30)
        # The log carries no engine load: a replica of it prices its own requests only.
        engine = load == "engine" and nats is None
        loads = client.engine_loads if engine else EngineLoads(LoadPolicy(mode="router"))
        router = Router(
            client.index,
            states=client,
            block_size=block_size,
            seed=seed,
            cost=CostModel(overlap_weight=overlap_weight),
            engine_loads=loads,
        )
        reply({"ready": True})
        while True:
            # A blocking read in a worker thread: the event loop keeps following the engines meanwhile.
            line = await anyio.to_thread.run_sync(sys.stdin.buffer.readline)
            if not line:
                return  # stdin closed: the demo is done with this replica
            msg = decoder.decode(line)
            if msg.op == "route":
                worker = router.select(msg.tokens, request_id=msg.id).worker
                reply({"id": msg.id, "worker": worker.worker_id, "rank": worker.dp_rank})
            elif msg.op == "prefill":
                router.on_prefill_done(msg.id)
            elif msg.op == "finish":
                router.on_finish(msg.id)
            elif msg.op == "digest":
                with contextlib.suppress(TimeoutError):
                    await client.wait_synced(10)
                digest, blocks = index_digest(client.index, msg.prompts)
                reply({"digest": digest, "blocks": blocks})


class _Replica:
    """One router process and the requests waiting for its answers."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None and process.stdin is not None
        self.reader = BufferedByteReceiveStream(process.stdout)
        self.stdin = process.stdin
        self.waiting: dict[int, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self.digest: anyio.Event = anyio.Event()
        self.digest_answer: dict[str, Any] = {}
        self.lock = anyio.Lock()
        self.gone = False

    async def send(self, obj: dict[str, Any]) -> None:
        async with self.lock:  # one line at a time: concurrent requests must not interleave their bytes
            try:
                await self.stdin.send(msgspec.json.encode(obj) + b"\n")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                raise KvRouteError("a router replica process exited mid-run") from None

    async def read_answers(self) -> None:
        while True:
            try:
                line = await self.reader.receive_until(b"\n", _MAX_LINE)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
                # The process is gone: wake everyone waiting on it, empty-handed (they raise).
                self.gone = True
                for event, _ in self.waiting.values():
                    event.set()
                self.waiting.clear()
                self.digest.set()
                return
            answer = msgspec.json.decode(line)
            if "digest" in answer:
                self.digest_answer = answer
                self.digest.set()
            elif "id" in answer and answer["id"] in self.waiting:
                event, box = self.waiting.pop(answer["id"])
                box.append(answer)
                event.set()


class ReplicaPolicy:
    """The demo's policy for ``--replicas``: each request routed by the next replica process in turn.

    Use as ``async with ReplicaPolicy(...) as policy``: the processes start (and have synced every
    source) on entry and stop on exit. ``digests`` asks each replica for its `index_digest`. With
    ``nats`` (a NATS server with JetStream: ``kvroute demo --jetstream`` starts one), a `JetStreamRelay`
    (in this process) follows the engines and the replicas its stream.
    """

    def __init__(
        self,
        targets: Sequence[str],
        *,
        replicas: int,
        load: str,
        block_size: int,
        overlap_weight: float,
        seed: int,
        nats: str | None = None,
    ) -> None:
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {LOAD_MODES}, not {load!r}")
        self._argv = [
            sys.executable,
            "-m",
            "kvroute.cli._demo_replica",
            "--load",
            load,
            "--block-size",
            str(block_size),
            "--overlap-weight",
            str(overlap_weight),
            "--seed",
            str(seed),
            *targets,
        ]
        self._targets = list(targets)
        self.nats = nats
        self._count = replicas
        self._replicas: list[_Replica] = []
        self._next = 0
        self._ids: dict[Hashable, tuple[_Replica, int]] = {}
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> ReplicaPolicy:
        argv = self._argv
        try:
            tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._stack.callback(tg.cancel_scope.cancel)
            if self.nats is not None:
                # One relay for this fleet (a stream of its own: every policy run starts new engines).
                stream = f"DEMO{uuid.uuid4().hex[:8].upper()}"
                relay = await self._stack.enter_async_context(
                    JetStreamRelay(
                        self.nats,
                        targets=self._targets,
                        stream=stream,
                        config=SubscriberConfig(quiet_interval=0.5, events_buffer=100_000),
                        snapshot_interval=1.0,
                        storage="memory",
                    )
                )
                await relay.wait_synced(30)
                argv = [*argv, "--nats", self.nats, "--stream", stream]
            for _ in range(self._count):
                process = await anyio.open_process(argv, stderr=subprocess.DEVNULL)
                self._stack.push_async_callback(self._stop, process)
                replica = _Replica(process)
                line = await replica.reader.receive_until(b"\n", _MAX_LINE)
                if not msgspec.json.decode(line).get("ready"):
                    raise RuntimeError("a router replica did not start")
                tg.start_soon(replica.read_answers)
                self._replicas.append(replica)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    @staticmethod
    async def _stop(process: anyio.abc.Process) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            if process.stdin is not None:
                await process.stdin.aclose()
        with anyio.move_on_after(5):
            await process.wait()
            return
        process.kill()
        await process.wait()

    async def choose(self, request_id: Hashable, token_ids: Sequence[int]) -> WorkerKey:
        replica = self._replicas[self._next % len(self._replicas)]
        self._next += 1
        rid = len(self._ids)
        self._ids[request_id] = (replica, rid)
        event, box = anyio.Event(), list[dict[str, Any]]()
        replica.waiting[rid] = (event, box)
        await replica.send({"op": "route", "id": rid, "tokens": list(token_ids)})
        await event.wait()
        if not box:
            raise KvRouteError("a router replica process exited mid-run")
        return WorkerKey(box[0]["worker"], box[0]["rank"])

    async def prefill_done(self, request_id: Hashable) -> None:
        replica, rid = self._ids[request_id]
        await replica.send({"op": "prefill", "id": rid})

    async def finished(self, request_id: Hashable) -> None:
        replica, rid = self._ids[request_id]
        await replica.send({"op": "finish", "id": rid})

    async def digests(self, prompts: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
        """Every replica's `index_digest` over ``prompts``, once it has settled."""
        out = []
        for replica in self._replicas:
            replica.digest = anyio.Event()
            await replica.send({"op": "digest", "prompts": [list(p) for p in prompts]})
            await replica.digest.wait()
            if replica.gone:
                raise KvRouteError("a router replica process exited before its digest")
            out.append((str(replica.digest_answer["digest"]), int(replica.digest_answer["blocks"])))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run one router replica (module docstring); the demo starts these, not users."""
    p = argparse.ArgumentParser(prog="python -m kvroute.cli._demo_replica")
    p.add_argument("targets", nargs="+")
    p.add_argument("--load", choices=LOAD_MODES, default="engine")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--overlap-weight", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nats", default=None, help="follow this NATS server's JetStream log instead of the engines")
    p.add_argument("--stream", default="KVROUTE")
    args = p.parse_args(argv)
    anyio.run(_serve, args.targets, args.load, args.block_size, args.overlap_weight, args.seed, args.nats, args.stream)
    return 0


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A ``nats-server -js`` on a free loopback port with a temporary store, for the demo; its URL.

    Raises `KvRouteError` when ``nats-server`` is not on PATH or does not start.
    """
    binary = shutil.which("nats-server")
    if binary is None:
        raise KvRouteError("--jetstream needs nats-server on PATH (apt-get install nats-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="kvroute-demo-js-") as store:
        proc = subprocess.Popen(
            [binary, "-js", "-sd", store, "-a", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise KvRouteError("nats-server did not start")
                time.sleep(0.02)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
