"""A simulated vLLM or SGLang engine: KV cache, scheduler, KV events, replay, gRPC discovery and HTTP.

``async with SimEngine(SimConfig(engine="vllm", ranks=2)) as engine:`` starts, per data-parallel
rank, a `PrefixCache`, an `EventPublisher` (PUB + ROUTER replay buffer) and a scheduler task;
plus the engine's gRPC discovery service (vLLM ``Control.GetKvEventSources`` or SGLang
``GetServerInfo``) and its HTTP server (`kvroute.sim._http`). It publishes what the real
engine would (docs/protocol.md): vLLM — map-form events (array form with ``form="array"``, as
vLLM ≤ 0.23), uint64 or bytes hashes seeded per process, one source per rank; SGLang — signed
int64 hashes, one BlockStored per page, ``json_info`` with ``kv_events`` whose per-rank ports
are base + rank (so consecutive ports are bound).

The scheduler imitates continuous batching: each step, requests are admitted first come first
served while their blocks fit (up to ``max_batch`` running), every running request decodes one
token, and prefills share ``max_batched_tokens`` (chunked prefill). A step lasts
``decode_time_per_step + prefill_time_per_token * uncached tokens prefilled`` (real sleeping,
so routing quality shows in latency); its cache events are published as one batch at its end.
Each rank keeps its own timeline: a step starts when the previous one ended (or at the latest
arrival it admits), so when a busy host wakes the rank late the overrun is caught up, not carried
into every later step, and the reported queue time, TTFT and latency are the model's, not the
host's scheduling noise. An idle rank sleeps on an event: no polling.

Outputs are deterministic: token i of a completion is a hash of the prompt and i (a greedy
"model"), and cache hashes derive from ``seed``, ``name``, rank and restart count.

Fault knobs: `drop_rate`, `pause` / `resume` (a slow subscriber), `restart` (seq back to 0,
cache lost, in-flight requests fail; optionally on new ports), `kill_replay` /
`revive_replay`, `reset_prefix_cache` (AllBlocksCleared). Ground truth: `cache`
(`PrefixCache.block_hashes`, `held_prefixes`, `match_blocks`), `in_flight` (the prompts each rank is
computing) and `publisher` (its history).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import zmq

from .._models import GATEWAY_SERVICES, EventSource
from .._wire import EventBatch
from ._cache import CapacityError, InvalidRequestError, PrefixCache, hash_seed
from ._gateway import GatewayKvService, LoadFigures
from ._grpc import GrpcServer, SglangService, VllmControlService, _Service, sglang_server_info, start_grpc_server
from ._http import EngineApp, HttpServer
from ._lifecycle import AsyncService
from ._publisher import EventPublisher
from ._request import Completion, RequestAbortedError, SimConfig, SimRequest

__all__ = ["Completion", "RequestAbortedError", "SimConfig", "SimEngine", "SimRequest"]

log = logging.getLogger("kvroute.sim")

# vLLM's KVEventsConfig.max_queue_size default (docs/protocol.md §1), advertised as is.
_MAX_QUEUE_SIZE = 100_000
# Attempts at finding free consecutive port ranges (SGLang): another process may take a probed
# port before it is bound, and on a busy machine the port after a free one is often an outgoing
# connection's (8 attempts failed a CI run beside a parallel test run); each attempt costs microseconds.
_PORT_ATTEMPTS = 64


class _Rank:
    __slots__ = ("cache", "clock", "index", "running", "waiting", "wake")

    def __init__(self, index: int, cache: PrefixCache) -> None:
        self.index = index
        self.cache = cache
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.wake = anyio.Event()
        #: When the rank's last step ended on its own timeline (`SimEngine._schedule`).
        self.clock = -math.inf


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _reserve_port_ranges(host: str, count: int, ranges: int) -> list[int]:
    """Bases of ``ranges`` disjoint runs of ``count`` consecutive free ports (probed, then released)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(_PORT_ATTEMPTS):
        held: list[socket.socket] = []
        try:
            bases = []
            for _ in range(ranges):
                first = socket.socket(family, socket.SOCK_STREAM)
                held.append(first)
                first.bind((host, 0))
                base = first.getsockname()[1]
                for offset in range(1, count):
                    s = socket.socket(family, socket.SOCK_STREAM)
                    held.append(s)
                    s.bind((host, base + offset))
                bases.append(base)
            return bases
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"no {ranges} runs of {count} consecutive free ports on {host}")


class SimEngine(AsyncService):
    """A simulated vLLM / SGLang engine (module docstring); use as ``async with SimEngine(config) as engine``.

    Starting takes a few milliseconds plus the gRPC server's start; `http_url`, `grpc_target`
    and `sources` tell where it listens. `complete` runs a request in-process; HTTP clients go
    through `http_url`. Leaving the block aborts in-flight requests and closes every socket.
    """

    def __init__(
        self, config: SimConfig | None = None, *, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.config = cfg = config or SimConfig()
        self._ctx = context
        self._own_ctx = context is None
        self._generation = 0
        self._next_id = 0
        self._drop_rate = cfg.drop_rate
        self._paused = False
        self._ranks = [_Rank(r, self._new_cache(r)) for r in range(cfg.ranks)]
        self._pubs: list[EventPublisher] | None = None
        self._bound: list[tuple[str, str | None]] = []  # per rank: bound PUB and ROUTER endpoints
        self._restart_request: anyio.Event | None = None
        self._pubs_ready: anyio.Event | None = None
        self._change_ports = False
        self._pub_error: BaseException | None = None
        self._grpc: GrpcServer | None = None
        self._gateway: GatewayKvService | None = None
        #: Milliseconds the simulated engine reports it has been silent (a wedged engine), or None.
        self.silence_ms: int | None = None
        self._http_port: int | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.config
        if self._ctx is None:
            self._ctx = zmq.Context()
        if ":" in cfg.host:
            self._ctx.setsockopt(zmq.IPV6, 1)
        stack.callback(self._abort_all, "engine stopped")
        if cfg.grpc_port is not None:
            service: _Service
            if cfg.gateway is not None:
                service = self._gateway = self._new_gateway()
            elif cfg.engine == "vllm":
                service = VllmControlService(self.advertised_sources)
            else:
                service = SglangService(self.server_info_json)
            self._grpc = await start_grpc_server([service], host=cfg.host, port=cfg.grpc_port)
            stack.push_async_callback(self._stop_grpc)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        await tg.start(self._own_publishers)
        if cfg.http_port is not None:
            server = HttpServer(EngineApp(self).handle, host=cfg.host, port=cfg.http_port)
            self._http_port = await tg.start(server.serve)
        for rank in self._ranks:
            tg.start_soon(self._schedule, rank)

    async def _stop_grpc(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop()

    def _new_gateway(self) -> GatewayKvService:
        cfg = self.config
        service = next(name for name, label in GATEWAY_SERVICES.items() if label == cfg.gateway)
        return GatewayKvService(ranks=cfg.ranks, service=service, load=self.gateway_load, history=cfg.gateway_history)

    def gateway_load(self, rank: int) -> LoadFigures:
        """Rank ``rank``'s load as the gateway servicer reports it (see `kvroute.sim.LoadFigures`)."""
        r = self._ranks[rank]
        bs = self.config.block_size
        uncached = sum(
            max(0, len(q.prompt) - r.cache.match_blocks(q.prompt, lora_name=q.lora_name) * bs) for q in r.waiting
        )
        pending = sum(len(q.prompt) - q.prefilled for q in r.running if q.prefilled < len(q.prompt))
        return len(r.running), len(r.waiting), uncached, r.cache.usage, pending, self.silence_ms

    @property
    def gateway(self) -> GatewayKvService:
        """The simulated gateway servicer (only with ``SimConfig.gateway``)."""
        if self._gateway is None:
            raise RuntimeError("the engine serves no gateway stream (SimConfig.gateway)")
        return self._gateway

    async def restart_gateway(self) -> None:
        """Restart the gateway servicer on the same port: open streams end, its history and record are lost."""
        old, grpc_server = self.gateway, self._grpc
        assert grpc_server is not None
        old.end_streams()
        await grpc_server.stop(grace=0)
        self._gateway = self._new_gateway()
        self._grpc = await start_grpc_server([self._gateway], host=self.config.host, port=grpc_server.port)

    def _release(self) -> None:
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _new_cache(self, rank: int) -> PrefixCache:
        cfg = self.config
        return PrefixCache(
            capacity_blocks=cfg.capacity_blocks,
            block_size=cfg.block_size,
            style=cfg.engine,
            bytes_hashes=cfg.bytes_hashes,
            seed=hash_seed(cfg.seed, cfg.name, rank, self._generation),
            new_fields=cfg.form == "map",
            lora_ids={name: i + 1 for i, name in enumerate(cfg.lora_names)},
        )

    # --- publishers: one "engine process" per generation, owned by one task -----------------

    async def _own_publishers(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Bind every rank's publisher, serve until a restart is asked, then rebind; forever.

        One task owns the publishers so each is entered and left in the same task, as anyio
        requires, whichever task asks for the restart.
        """
        first = True
        while True:
            self._restart_request = anyio.Event()
            try:
                async with contextlib.AsyncExitStack() as stack:
                    self._pubs = await self._open_publishers(stack, fresh=first or self._change_ports)
                    self._bound = [(p.endpoint, p.replay_endpoint) for p in self._pubs]
                    for pub in self._pubs:
                        if self._paused:
                            pub.pause()
                    if first:
                        task_status.started()
                        first = False
                    elif self._pubs_ready is not None:
                        self._pubs_ready.set()
                    for rank in self._ranks:
                        self._flush(rank)  # events of the new process made while rebinding
                    await self._restart_request.wait()
                    self._pubs = None
            except (OSError, zmq.ZMQError) as exc:
                if first:
                    raise
                # The restarted "process" could not bind: report it to `restart` and stay down.
                self._pub_error = exc
                if self._pubs_ready is not None:
                    self._pubs_ready.set()
                return

    async def _open_publishers(self, stack: contextlib.AsyncExitStack, *, fresh: bool) -> list[EventPublisher]:
        cfg = self.config
        n = cfg.ranks
        if not fresh:
            plan = self._bound
        else:
            replay_on = cfg.replay_port is not None
            events: list[str]
            replays: list[str | None]
            if cfg.event_port and not self._change_ports:
                events = [_tcp(cfg.host, cfg.event_port + r) for r in range(n)]
            elif cfg.engine == "sglang" and n > 1:
                events = [_tcp(cfg.host, p) for p in self._consecutive(n, 1)[0]]
            else:
                events = [_tcp(cfg.host, 0)] * n
            if not replay_on:
                replays = [None] * n
            elif cfg.replay_port and not self._change_ports:
                replays = [_tcp(cfg.host, cfg.replay_port + r) for r in range(n)]
            elif cfg.engine == "sglang" and n > 1:
                taken = {_port_of(e) for e in events}
                ports = next(r for r in self._consecutive(n, 2) if not taken & set(r))
                replays = [_tcp(cfg.host, p) for p in ports]
            else:
                replays = [_tcp(cfg.host, 0)] * n
            plan = list(zip(events, replays))
        pubs = []
        for r, (endpoint, replay) in enumerate(plan):
            pub = EventPublisher(
                endpoint=endpoint,
                replay_endpoint=replay,
                topic=cfg.topic,
                buffer_steps=cfg.buffer_steps,
                hwm=cfg.hwm,
                form=cfg.form,
                signed_hashes=cfg.engine == "sglang",
                reply_layout=cfg.reply_layout,
                data_parallel_rank=r,
                drop_rate=self._drop_rate,
                seed=cfg.seed * 1_000_003 + r * 1009 + self._generation,
                context=self._ctx,
            )
            pubs.append(await stack.enter_async_context(pub))
        return pubs

    def _consecutive(self, count: int, ranges: int) -> list[range]:
        bases = _reserve_port_ranges(self.config.host, count, ranges)
        return [range(b, b + count) for b in bases]

    # --- where it listens --------------------------------------------------------------------

    @property
    def http_port(self) -> int | None:
        """The bound HTTP port (None when HTTP is off)."""
        return self._http_port

    @property
    def http_url(self) -> str | None:
        """``http://host:port`` of the OpenAI-style server (None when HTTP is off)."""
        if self._http_port is None:
            return None
        host = self._connect_host()
        return f"http://[{host}]:{self._http_port}" if ":" in host else f"http://{host}:{self._http_port}"

    @property
    def grpc_target(self) -> str | None:
        """``host:port`` of the discovery server, as `kvroute.discover` takes it (None when off)."""
        if self._grpc is None:
            return None
        host = self._connect_host()
        return f"[{host}]:{self._grpc.port}" if ":" in host else f"{host}:{self._grpc.port}"

    def _connect_host(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "*", ""):
            return "127.0.0.1"
        if host in ("::", "[::]"):
            return "::1"
        return host.strip("[]")

    def _advertised(self, endpoint: str) -> str:
        host = self.config.advertise_host
        if host is None:
            return endpoint
        return _tcp(host.strip("[]"), _port_of(endpoint)) if host != "*" else f"tcp://*:{_port_of(endpoint)}"

    def advertised_sources(self) -> list[EventSource]:
        """The sources as the engine advertises them: endpoints as bound (or with ``advertise_host``), verbatim."""
        return self._sources(self.grpc_target or self.config.name, self._advertised, target=None)

    def sources(self, worker_id: str | None = None) -> list[EventSource]:
        """Connectable `EventSource` per rank, as discovery would resolve them.

        ``worker_id`` defaults to `grpc_target` (what `kvroute.discover` names the worker).
        """
        host = self._connect_host()

        def connectable(endpoint: str) -> str:
            return _tcp(host, _port_of(endpoint))

        return self._sources(worker_id or self.grpc_target or self.config.name, connectable, target=self.grpc_target)

    def _sources(self, worker_id: str, endpoint_of: Callable[[str], str], target: str | None) -> list[EventSource]:
        cfg = self.config
        return [
            EventSource(
                worker_id=worker_id,
                dp_rank=r,
                endpoint=endpoint_of(endpoint),
                topic=cfg.topic,
                replay_endpoint=endpoint_of(replay) if replay is not None else None,
                hwm=cfg.hwm,
                buffer_steps=cfg.buffer_steps if replay is not None else None,
                block_size=cfg.block_size,
                engine=cfg.engine,
                target=target,
            )
            for r, (endpoint, replay) in enumerate(self._bound)
        ]

    def kv_events_configs(self) -> dict[str, dict[str, object]]:
        """vLLM's ``GET /kv_event_sources`` body: ``{"<rank>": KVEventsConfig}``."""
        cfg = self.config
        return {
            str(s.dp_rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": s.endpoint,
                "replay_endpoint": s.replay_endpoint,
                "buffer_steps": cfg.buffer_steps,
                "hwm": cfg.hwm,
                "max_queue_size": _MAX_QUEUE_SIZE,
                "topic": cfg.topic,
            }
            for s in self.advertised_sources()
        }

    def server_info_json(self) -> str:
        """SGLang's ``GetServerInfo`` ``json_info``: ``kv_events`` (per-rank port bases) and ``kv_events_config``."""
        cfg = self.config
        if not self._bound:
            return sglang_server_info(None)
        endpoint, replay = self._bound[0]
        host = cfg.advertise_host or cfg.host
        kv_events: dict[str, object] = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": _port_of(endpoint),
            "topic": cfg.topic,
            "block_size": cfg.block_size,
            "dp_size": cfg.ranks,
        }
        raw: dict[str, object] = {
            "publisher": "zmq",
            "endpoint": self._advertised(endpoint),
            "topic": cfg.topic,
            "hwm": cfg.hwm,
            "buffer_steps": cfg.buffer_steps,
        }
        if replay is not None:
            kv_events["replay_endpoint_port_base"] = _port_of(replay)
            raw["replay_endpoint"] = self._advertised(replay)
        return sglang_server_info(
            kv_events, kv_events_config=json.dumps(raw), model_path=cfg.model, page_size=cfg.block_size
        )

    # --- ground truth and gauges ---------------------------------------------------------------

    def cache(self, rank: int = 0) -> PrefixCache:
        """Rank ``rank``'s KV cache: the ground truth of what it holds."""
        return self._ranks[rank].cache

    def publisher(self, rank: int = 0) -> EventPublisher:
        """Rank ``rank``'s current publisher (replaced by each `restart`)."""
        if self._pubs is None:
            raise RuntimeError("the engine is not running (or is restarting)")
        return self._pubs[rank]

    def in_flight(self, rank: int = 0) -> list[list[int]]:
        """The prompts rank ``rank`` is running or has queued, oldest first: ground truth of what it is computing."""
        r = self._ranks[rank]
        return [q.prompt for q in (*r.running, *r.waiting)]

    def load(self, rank: int) -> tuple[int, int]:
        """(running, waiting) requests on ``rank``."""
        r = self._ranks[rank]
        return len(r.running), len(r.waiting)

    def prometheus_metrics(self) -> str:
        """``GET /metrics``: each rank's running / waiting requests and KV usage under the engine's own names.

        vLLM 0.34.0: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
        ``vllm:kv_cache_usage_perc``, labelled ``model_name`` and ``engine`` (the rank). SGLang
        0.5.23: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
        labelled ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank`` and, with
        more than one rank, ``dp_rank`` (`kvroute.ENGINE_METRICS` reads them back).
        """
        cfg = self.config
        if cfg.engine == "vllm":
            names = (
                ("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            )
        else:
            names = (
                ("sglang:num_running_reqs", "The number of running requests."),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
                ("sglang:token_usage", "The token usage."),
            )
        lines = []
        for i, (name, doc) in enumerate(names):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
            for r in self._ranks:
                if cfg.engine == "vllm":
                    labels = f'engine="{r.index}",model_name="{cfg.model}"'
                else:
                    labels = f'engine_type="unified",model_name="{cfg.model}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
                    if cfg.ranks > 1:
                        labels = f'dp_rank="{r.index}",' + labels
                value = (len(r.running), len(r.waiting), r.cache.usage)[i]
                lines.append(f"{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n"

    @property
    def restarts(self) -> int:
        """How many times the engine restarted."""
        return self._generation

    # --- requests ------------------------------------------------------------------------------

    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        rank: int | None = None,
        lora_name: str | None = None,
        stream: bool = False,
    ) -> SimRequest:
        """Queue a request on ``rank`` (default: the least loaded) and return it; see `complete`."""
        cfg = self.config
        if self._stack is None:
            raise RequestAbortedError("the engine is not running (use `async with SimEngine(...)`)")
        prompt = list(token_ids)
        if not prompt:
            raise InvalidRequestError("empty prompt")
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens {max_tokens} < 1")
        try:
            # One C pass: rejects non-ints and negative ids; max() bounds the rest.
            out_of_vocab = max(array("Q", prompt)) >= cfg.vocab_size
        except (OverflowError, TypeError):
            out_of_vocab = True
        if out_of_vocab:
            raise InvalidRequestError(f"token ids must be ints in [0, {cfg.vocab_size})")
        if lora_name is not None and lora_name not in cfg.lora_names:
            raise InvalidRequestError(f"unknown LoRA adapter {lora_name!r}")
        if rank is None:
            rank = min(range(cfg.ranks), key=lambda r: (len(self._ranks[r].running) + len(self._ranks[r].waiting), r))
        elif not 0 <= rank < cfg.ranks:
            raise InvalidRequestError(f"rank {rank} is not in [0, {cfg.ranks})")
        needed = self._ranks[rank].cache.blocks_needed(len(prompt) + max_tokens)
        if needed > cfg.capacity_blocks:
            raise CapacityError(
                f"{len(prompt)} prompt tokens + {max_tokens} new ones need {needed} blocks;"
                f" the KV cache holds {cfg.capacity_blocks} blocks of {cfg.block_size} tokens"
            )
        self._next_id += 1
        req = SimRequest(
            f"{cfg.name}-{self._next_id}", rank, prompt, max_tokens, lora_name, anyio.current_time(), stream
        )
        target = self._ranks[rank]
        target.waiting.append(req)
        target.wake.set()
        return req

    async def complete(
        self,
        token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        rank: int | None = None,
        lora_name: str | None = None,
    ) -> Completion:
        """Run one request to completion and return what it cost; cancelling the caller aborts it.

        Raises `InvalidRequestError` (bad tokens, rank, LoRA), `CapacityError` (can never fit)
        or `RequestAbortedError` (the engine restarted or stopped meanwhile).
        """
        req = self.submit(token_ids, max_tokens, rank=rank, lora_name=lora_name)
        try:
            return await req.result()
        finally:
            self.abort(req)

    def abort(self, req: SimRequest) -> None:
        """Abort ``req`` if it is still queued or running (its blocks stay cached, unreferenced); no-op otherwise."""
        if req.finished:
            return
        rank = self._ranks[req.rank]
        if req in rank.waiting:
            rank.waiting.remove(req)
        elif req in rank.running:
            rank.running.remove(req)
            rank.cache.release(req.request_id)
        req.finish(None, RequestAbortedError(f"request {req.request_id} aborted"))

    def _abort_all(self, reason: str) -> None:
        for rank in self._ranks:
            for req in [*rank.waiting, *rank.running]:
                req.finish(None, RequestAbortedError(f"request {req.request_id}: {reason}"))
            rank.waiting.clear()
            rank.running.clear()

    # --- the scheduler ----------------------------------------------------------------------------

    async def _schedule(self, rank: _Rank) -> None:
        cfg = self.config
        while True:
            generation = self._generation
            plan, start = self._plan(rank)
            if not plan:
                await rank.wake.wait()
                rank.wake = anyio.Event()
                continue
            prefill = sum(chunk for _, chunk in plan)
            end = start + cfg.decode_time_per_step + cfg.prefill_time_per_token * prefill
            await anyio.sleep_until(end)
            if generation != self._generation:
                continue  # the engine restarted during the step: its work died with the process
            rank.clock = end
            self._finish_step(rank, plan, end)

    def _plan(self, rank: _Rank) -> tuple[list[tuple[SimRequest, int]], float]:
        """Admit what fits, then give each running request its share of the step: (request, prefill tokens).

        Also returns when the step starts on the rank's own timeline: where the last step ended, or
        the latest arrival it admits if later (an idle rank starts with the request that woke it). A
        step overrun by a busy host (the event loop late to wake the rank) is not carried into the next
        one: the rank catches up, as a GPU would not have waited, and reported times are the model's.
        """
        cfg = self.config
        cache = rank.cache
        start = rank.clock if rank.running else -math.inf
        admitted = []
        while rank.waiting and len(rank.running) < cfg.max_batch:
            req = rank.waiting[0]
            hits = cache.admit(req.request_id, req.prompt, max_tokens=req.max_tokens, lora_name=req.lora_name)
            if hits is None:
                break  # first come, first served: later requests wait behind it (vLLM's FCFS policy)
            rank.waiting.popleft()
            req.cached_tokens = req.prefilled = hits * cfg.block_size
            req.stored_blocks = hits
            admitted.append(req)
            rank.running.append(req)
        if admitted:
            start = max(rank.clock, *(req.arrival for req in admitted))
            for req in admitted:
                req.admitted_at = start
        budget = cfg.max_batched_tokens
        plan = []
        # Decodes first, then prefills in arrival order with what is left (vLLM V1's order).
        for req in rank.running:
            if req.prefilled >= len(req.prompt):
                plan.append((req, 0))
                budget -= 1
        for req in rank.running:
            if req.prefilled < len(req.prompt) and budget > 0:
                chunk = min(len(req.prompt) - req.prefilled, budget)
                budget -= chunk
                plan.append((req, chunk))
        return plan, start

    def _finish_step(self, rank: _Rank, plan: list[tuple[SimRequest, int]], now: float) -> None:
        cfg = self.config
        cache = rank.cache
        bs = cfg.block_size
        vllm = cfg.engine == "vllm"
        for req, chunk in plan:
            if req.finished:
                continue  # aborted during the step
            if chunk:
                req.prefilled += chunk
                if req.prefilled < len(req.prompt):
                    if vllm and req.prefilled // bs > req.stored_blocks:
                        cache.computed(req.request_id, req.prompt[: req.prefilled])
                        req.stored_blocks = req.prefilled // bs
                    continue
                req.first_token_at = now
            # The KV of every token but the one just sampled is computed (vLLM stores blocks as
            # they fill; SGLang inserts the prompt after prefill and the rest at the end).
            if (vllm or chunk) and len(req.seq) // bs > req.stored_blocks:
                cache.computed(req.request_id, req.seq)
                req.stored_blocks = len(req.seq) // bs
            req.emit(req.next_token(cfg.vocab_size))
            if req.generated >= req.max_tokens:
                computed = req.seq[:-1]
                if len(computed) // bs > req.stored_blocks:
                    cache.computed(req.request_id, computed)
                cache.release(req.request_id)
                rank.running.remove(req)
                req.finish(
                    Completion(
                        request_id=req.request_id,
                        rank=rank.index,
                        prompt_tokens=len(req.prompt),
                        cached_tokens=req.cached_tokens,
                        output_token_ids=req.seq[len(req.prompt) :],
                        finish_reason="length",
                        queue_time=req.admitted_at - req.arrival,
                        ttft=req.first_token_at - req.arrival,
                        latency=now - req.arrival,
                    )
                )
        self._flush(rank)

    def _flush(self, rank: _Rank) -> None:
        """Publish the rank's pending cache events as one batch (held while the publishers rebind)."""
        if self._pubs is None:
            return
        events = rank.cache.drain_events()
        if events:
            batch = EventBatch(time.time(), events, rank.index)
            seq = self._pubs[rank.index].publish_batch(batch)
            if self._gateway is not None:
                self._gateway.record(rank.index, seq, batch)

    # --- fault knobs ------------------------------------------------------------------------------

    @property
    def drop_rate(self) -> float:
        """Fraction of live messages every rank's PUB drops (seq consumed, batch still replayable)."""
        return self._drop_rate

    @drop_rate.setter
    def drop_rate(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"drop_rate {value} is not in [0, 1]")
        self._drop_rate = value
        for pub in self._pubs or ():
            pub.drop_rate = value

    def pause(self) -> None:
        """Hold every rank's live messages back (a subscriber that stalls) until `resume`."""
        self._paused = True
        for pub in self._pubs or ():
            pub.pause()

    def resume(self) -> None:
        """Send the held messages in one burst (the PUB drops past its hwm)."""
        self._paused = False
        for pub in self._pubs or ():
            pub.resume()

    def kill_replay(self, rank: int | None = None) -> None:
        """Close the replay endpoint of ``rank`` (default: every rank)."""
        for r in range(self.config.ranks) if rank is None else (rank,):
            self.publisher(r).kill_replay()

    def revive_replay(self, rank: int | None = None) -> None:
        """Bind the replay endpoint of ``rank`` (default: every rank) again; the buffer is intact."""
        for r in range(self.config.ranks) if rank is None else (rank,):
            self.publisher(r).revive_replay()

    def reset_prefix_cache(self) -> bool:
        """Empty every rank's prefix cache (AllBlocksCleared); False, and nothing done, while requests run."""
        if any(rank.running or rank.waiting for rank in self._ranks):
            return False
        for rank in self._ranks:
            rank.cache.reset()
            self._flush(rank)
        return True

    async def restart(self, *, change_ports: bool = False) -> None:
        """Simulate an engine process restart: in-flight requests fail, caches empty, seqs from 0.

        No AllBlocksCleared is sent (real engines send none on restart). vLLM hashes change
        (new seed); SGLang's do not. With ``change_ports`` the publishers bind new ports, which
        discovery then advertises. Raises OSError when the old ports cannot be bound again.
        """
        self._generation += 1
        self._abort_all("engine restarted")
        for rank in self._ranks:
            rank.cache = self._new_cache(rank.index)
        if self._restart_request is None or self._pub_error is not None:
            raise RuntimeError("the engine is not running") from self._pub_error
        self._change_ports = change_ports
        self._pubs = None  # until the new "process" has bound: events wait in the caches
        ready = self._pubs_ready = anyio.Event()
        self._restart_request.set()
        await ready.wait()
        if self._pub_error is not None:
            raise OSError(f"restarted engine could not bind: {self._pub_error}") from self._pub_error
