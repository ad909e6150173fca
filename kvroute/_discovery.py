"""Discovery: ask an engine's gRPC server where its KV-event publishers are (docs/protocol.md §1).

`discover` calls vLLM's ``/vllm.Control/GetKvEventSources`` or SGLang's
``/sglang.runtime.v1.SglangService/GetServerInfo`` and returns one `EventSource` per
data-parallel rank, endpoints made connectable (wildcard bind hosts replaced by the host that
was dialled) and checked against the endpoint policy: what a discovery answer says is data from
the network, and it decides where the router connects.

Endpoint policy (every endpoint and replay endpoint):
- ``tcp://`` only by default; ``ipc://`` with ``allow_ipc=True`` and only when the target is
  this host (a loopback address or ``localhost``); ``inproc://`` and other transports never.
- A publisher bound to loopback is refused when the target is a remote host: connecting to
  127.0.0.1 here would reach this machine, not the engine.
- ``allowed_hosts`` (None = any): IP addresses, CIDR networks and host names (matched as names,
  case-insensitively, never resolved) an endpoint's host must match after wildcard substitution.
- At most ``max_sources_per_target`` sources per answer.

Failures are typed (all `DiscoveryError`, carrying ``target`` and ``cause``):
`TargetUnreachableError` (UNAVAILABLE / DEADLINE_EXCEEDED until the timeout; these are retried
with jittered exponential backoff inside the caller's one overall timeout), `RpcRejectedError`
(any other status, not retried), `EventsDisabledError`, `UnusableSourceError`,
`MalformedAnswerError`, `TooManySourcesError`. Options that cannot work raise
`InvalidOptionsError` (also a ValueError) before anything is sent.

Hosts are judged as addresses, not spellings (`kvroute._endpoints`: IPv4 shorthands, IPv4-mapped
IPv6 and host names resolved here count as loopback or unspecified when they are).

Threads: grpc's asyncio API runs only on asyncio and kvroute supports trio as well, so each call
uses grpc's threaded client; the wait for its answer runs in a worker thread from the
discovery's own limiter (one thread per discovery, never anyio's shared pool), and
cancelling the caller cancels the call, which frees that thread at once.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.to_thread
import grpc
import msgspec
import tenacity

from ._answers import KNOWN_SCHEMA_VERSIONS, _check_count, _sglang_sources, _vllm_sources
from ._endpoints import (
    _LOCAL_NAMES,
    _address,
    _fmt_host,
    _HostAllowList,
    _is_local,
    _pin_names,
    _resolve,
    _Resolver,
    _Unusable,
    parse_target,
)
from ._errors import (
    DiscoveryError,
    InvalidOptionsError,
    KvRouteError,
    MalformedAnswerError,
    RpcRejectedError,
    TargetUnreachableError,
    TooManySourcesError,
    UnusableSourceError,
)
from ._grpc import answer_ended, serialize
from ._models import GATEWAY_SERVICES, RANK_COUNTING_SERVICES, EventSource, WorkerKey, gateway_sources
from ._proto import sglang_service_pb2 as sglang_pb
from ._proto import smg_common_pb2 as smg_pb
from ._proto import vllm_control_pb2 as vllm_pb
from ._tls import TlsConfig

__all__ = [
    "ENGINES",
    "KNOWN_SCHEMA_VERSIONS",
    "SGLANG_METHOD",
    "VLLM_METHOD",
    "DiscoveryOptions",
    "InvalidOptionsError",
    "MalformedAnswerError",
    "RpcRejectedError",
    "SourceDiff",
    "TargetUnreachableError",
    "TlsConfig",
    "TooManySourcesError",
    "diff_sources",
    "discover",
    "discover_with",
    "follow_target",
    "parse_target",
    # The endpoint policy's helpers (kvroute._endpoints), importable from here as before.
    "_Resolver",
    "_Unusable",
    "_pin_names",
]

log = logging.getLogger("kvroute.discovery")

VLLM_METHOD: Final = "/vllm.Control/GetKvEventSources"
SGLANG_METHOD: Final = "/sglang.runtime.v1.SglangService/GetServerInfo"
ENGINES: Final = ("auto", "vllm", "sglang", "gateway")
# The statuses retried as transient: the server is not there yet, or did not answer in time.
_TRANSIENT: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# What grpc's UNAVAILABLE details say when the port answers HTTP/1 (a web server, an engine's
# OpenAI port), and when nothing listens.
_HTTP1: Final = "Failed parsing HTTP/2"
_REFUSED: Final = "Connection refused"
# Backoff between attempts: start small so a server coming up is found quickly; cap at 1 s so a
# late server is still picked up within about a second of listening (tenacity's jittered backoff).
_BACKOFF_INITIAL: Final = 0.05
_BACKOFF_MAX: Final = 1.0
# The least time worth a last attempt: a loopback or LAN connect plus TLS handshake fits in 50 ms.
_MIN_ATTEMPT: Final = 0.05
# A fresh channel per attempt must not share (and wait out) another channel's reconnect backoff,
# which grpc's process-wide subchannel pool would otherwise impose.
_CHANNEL_OPTIONS: Final = (("grpc.use_local_subchannel_pool", 1),)
# Default cap on sources per answer: real deployments run at most a few hundred DP ranks per
# engine; the cap bounds how many sockets one (possibly hostile) answer can make the router open.
DEFAULT_MAX_SOURCES: Final = 1024
# follow_target logs a persisting failure once a minute: a dead target polled every second must
# stay visible in the logs without flooding them.
_REPEAT_LOG_INTERVAL: Final = 60.0
# gRPC metadata rules (grpc/doc/PROTOCOL-HTTP2.md): lowercase keys; "grpc-" is reserved;
# "-bin" keys carry bytes, the others printable ASCII.
_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
# ZeroMQ's z85 alphabet (a CURVE key is 40 of these characters).
_Z85 = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]+")


# Call metadata keys that carry credentials: refused over plaintext to a remote target unless
# allowed, and never shown by repr.
_CREDENTIAL_KEY = re.compile(r".*(auth|token|secret|password|passwd|cookie|api-?key|credential|session).*")


def _is_credential(key: str) -> bool:
    return _CREDENTIAL_KEY.fullmatch(key) is not None


class DiscoveryOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to ask a target: engine, overall timeout, TLS, call metadata, naming and endpoint policy.

    ``engine``: "auto" (vLLM, then SGLang, then the gateway servicers' ``SubscribeKvEvents``, each
    when the one before is UNIMPLEMENTED), "vllm", "sglang" or "gateway" (docs/protocol.md §6).
    ``timeout``: seconds for the whole discovery, retries included. ``metadata``: (key, value)
    pairs sent with every call (e.g. ``("authorization", "Bearer <token>")``). ``worker_id``:
    the name of the target's workers (default: the target string). ``allow_ipc``,
    ``allowed_hosts``, ``max_sources_per_target``: the endpoint policy (module docstring).
    ``allow_plaintext_credentials``: send credential metadata (``authorization``, keys naming
    a token, key, secret, password, cookie or session) without TLS to a target that is not
    this machine; refused by default (`InvalidOptionsError` when discovering). ``curve_server_keys``:
    the CURVE server public key (z85) of each target's publishers, by target string as given
    to the client (engines do not advertise keys); every source discovered from that target
    carries it. ``retry_refused``: retry a refused connection within ``timeout`` (an engine
    still starting); False answers `TargetUnreachableError` at once (``kvroute discover``).
    ``repr`` shows neither credential values nor a private key.
    """

    engine: str = "auto"
    timeout: float = 5.0
    tls: TlsConfig | None = None
    metadata: Sequence[tuple[str, str | bytes]] = ()
    worker_id: str | None = None
    allow_ipc: bool = False
    allowed_hosts: Sequence[str] | None = None
    max_sources_per_target: int = DEFAULT_MAX_SOURCES
    allow_plaintext_credentials: bool = False
    curve_server_keys: Mapping[str, str] | Sequence[tuple[str, str]] = ()
    retry_refused: bool = True

    def __repr__(self) -> str:
        shown = []
        for name, value in msgspec.structs.asdict(self).items():
            if name == "metadata":
                value = tuple((k, "<secret>" if _is_credential(k) else v) for k, v in value)
            shown.append(f"{name}={value!r}")
        return f"DiscoveryOptions({', '.join(shown)})"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidOptionsError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InvalidOptionsError(f"timeout must be > 0 seconds, not {self.timeout!r}")
        cap = self.max_sources_per_target
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise InvalidOptionsError(f"max_sources_per_target must be an int >= 1, not {cap!r}")
        if self.worker_id is not None and not self.worker_id:
            raise InvalidOptionsError("worker_id must not be empty")
        metadata = tuple(self.metadata)
        for item in metadata:
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidOptionsError(f"metadata items are (key, value) pairs, not {item!r}")
            _check_metadata(*item)
        msgspec.structs.force_setattr(self, "metadata", metadata)
        if self.allowed_hosts is not None:
            hosts = tuple(self.allowed_hosts)
            _HostAllowList(hosts)  # validates every entry
            msgspec.structs.force_setattr(self, "allowed_hosts", hosts)
        # Kept as sorted (target, key) pairs: the options stay hashable, like the other sequences.
        keys = dict(self.curve_server_keys)
        for target, key in keys.items():
            if not isinstance(key, str) or len(key) != 40 or not _Z85.fullmatch(key):
                raise InvalidOptionsError(f"curve_server_keys[{target!r}] must be a 40-character z85 public key")
        msgspec.structs.force_setattr(self, "curve_server_keys", tuple(sorted(keys.items())))

    def curve_server_key(self, target: str) -> str | None:
        """The CURVE server key configured for ``target``'s publishers, if any."""
        return dict(self.curve_server_keys).get(target)

    def check_channel(self, target: str, host: str) -> None:
        """Refuse credential metadata over plaintext to a remote ``target`` (unless allowed)."""
        if self.tls is not None or self.allow_plaintext_credentials or _is_local(host):
            return
        secret = [k for k, _ in self.metadata if _is_credential(k)]
        if secret:
            raise InvalidOptionsError(
                f"{target}: metadata {', '.join(secret)} would go over plaintext; "
                "configure tls, or set allow_plaintext_credentials=True"
            )


def _check_metadata(key: str, value: str | bytes) -> None:
    if not _METADATA_KEY.fullmatch(key) or key.startswith("grpc-"):
        raise InvalidOptionsError(f"metadata key {key!r}: lowercase [0-9a-z_.-] only, not starting with 'grpc-'")
    if key.endswith("-bin"):
        if not isinstance(value, bytes):
            raise InvalidOptionsError(f"metadata key {key!r} ends in -bin: its value must be bytes")
    elif not isinstance(value, str) or not _METADATA_VALUE.fullmatch(value):
        raise InvalidOptionsError(f"metadata value of {key!r} must be printable ASCII text")


class _Caller:
    """Unary calls to one target, retried within one deadline, failures mapped to typed errors."""

    def __init__(
        self, target: str, host: str, port: int, options: DiscoveryOptions, limiter: anyio.CapacityLimiter
    ) -> None:
        self.target = target
        self.limiter = limiter
        self.address = f"{_fmt_host(host)}:{port}"
        self.options = options
        self.deadline = time.monotonic() + options.timeout
        self.metadata: tuple[tuple[str, str | bytes], ...] = tuple(options.metadata)
        self.channel_options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
        self.credentials: grpc.ChannelCredentials | None = None
        tls = options.tls
        if tls is not None:
            self.credentials = tls.credentials(target)
            if tls.server_name:
                self.channel_options.append(("grpc.ssl_target_name_override", tls.server_name))

    def _channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.address, options=self.channel_options)
        return grpc.secure_channel(self.address, self.credentials, options=self.channel_options)

    async def _once(self, method: str, request: Any, parse: Callable[[bytes], Any], seconds: float) -> Any:
        channel = self._channel()
        try:
            call = channel.unary_unary(method, request_serializer=serialize, response_deserializer=parse)
            future = call.future(request, timeout=seconds, metadata=self.metadata)
            try:
                return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True, limiter=self.limiter)
            finally:
                # A no-op once answered; on cancellation it ends the call and frees the waiting thread.
                future.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves Future.cancel untyped
        finally:
            channel.close()

    async def call(self, method: str, request: Any, parse: Callable[[bytes], Any]) -> Any:
        attempts = 0
        backoff = tenacity.wait_exponential(multiplier=_BACKOFF_INITIAL, max=_BACKOFF_MAX) + tenacity.wait_random(
            0, _BACKOFF_INITIAL
        )

        def wait(state: tenacity.RetryCallState) -> float:
            # Never sleep past the point where a last attempt still fits in the caller's timeout.
            return max(0.0, min(backoff(state), self.deadline - time.monotonic() - _MIN_ATTEMPT))

        def transient(exc: BaseException) -> bool:
            if not isinstance(exc, grpc.RpcError) or exc.code() not in _TRANSIENT:
                return False
            details = exc.details() or ""
            # An HTTP/1 server answers every attempt the same; a refused port may be an engine
            # still starting, retried unless the caller wants the answer now.
            return _HTTP1 not in details and (self.options.retry_refused or _REFUSED not in details)

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(transient),
            wait=wait,
            stop=lambda state: self.deadline - time.monotonic() < _MIN_ATTEMPT,
            sleep=anyio.sleep,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    return await self._once(method, request, parse, max(0.0, self.deadline - time.monotonic()))
        except grpc.RpcError as exc:
            raise self._error(method, exc, attempts) from None
        raise AssertionError("unreachable: tenacity either returns or reraises")  # pragma: no cover

    def _error(self, method: str, exc: grpc.RpcError, attempts: int) -> DiscoveryError:
        code = exc.code()
        details = exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE and _HTTP1 in details:
            return RpcRejectedError(
                self.target,
                code.name,
                f"{self.address} is an HTTP/1 server, not gRPC: pass the engine's gRPC port (vllm --grpc-port)",
            )
        if code == grpc.StatusCode.UNAVAILABLE and _REFUSED in details and not self.options.retry_refused:
            return TargetUnreachableError(self.target, f"connection refused: nothing listens on {self.address}")
        if code in _TRANSIENT:
            tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
            return TargetUnreachableError(
                self.target, f"no answer within {self.options.timeout:g}s ({tries}; last: {code.name}: {details})"
            )
        if code == grpc.StatusCode.INTERNAL and details.startswith("Exception deserializing response"):
            return MalformedAnswerError(self.target, f"{method} answer is not a valid protobuf message")
        return RpcRejectedError(self.target, code.name, f"{method} failed: {code.name}: {details}")


async def discover(
    target: str,
    *,
    engine: str = "auto",
    timeout: float = 5.0,  # noqa: ASYNC109  # the public API's signature; it bounds retries too, which fail_after cannot
    tls: TlsConfig | None = None,
    metadata: Sequence[tuple[str, str | bytes]] = (),
    worker_id: str | None = None,
    allow_ipc: bool = False,
    allowed_hosts: Sequence[str] | None = None,
    max_sources_per_target: int = DEFAULT_MAX_SOURCES,
) -> list[EventSource]:
    """Ask the engine's gRPC server at ``target`` (``host:port``) for its KV-event sources, one per rank.

    See `DiscoveryOptions` for the parameters and the module docstring for the endpoint policy.
    Raises a `DiscoveryError` subclass naming the target and the cause, or `InvalidOptionsError`.
    """
    options = DiscoveryOptions(
        engine=engine,
        timeout=timeout,
        tls=tls,
        metadata=metadata,
        worker_id=worker_id,
        allow_ipc=allow_ipc,
        allowed_hosts=allowed_hosts,
        max_sources_per_target=max_sources_per_target,
    )
    return await discover_with(target, options)


def _with_curve(target: str, sources: list[EventSource], options: DiscoveryOptions) -> list[EventSource]:
    """Every source of ``target`` carries the CURVE server key configured for it, if any."""
    key = options.curve_server_key(target)
    if key is None:
        return sources
    return [msgspec.structs.replace(src, curve_server_key=key) for src in sources]


async def discover_with(
    target: str, options: DiscoveryOptions, *, streaming: str | None = None
) -> list[EventSource]:
    """`discover` with its options in one `DiscoveryOptions` value (what `follow_target` uses).

    Its worker threads (the gRPC wait, name resolution) come from a limiter of its own, one
    thread per discovery: targets that never answer cannot hold up another target's discovery
    by exhausting anyio's shared thread pool. ``streaming``: the gateway service whose stream
    from ``target`` is live in this process; that stream is the target's proof of life, so
    only its rank count is asked (``GetLoads``, where the servicer has it), no stream opened.
    """
    host, port = parse_target(target)
    options.check_channel(target, host)
    limiter = anyio.CapacityLimiter(1)
    caller = _Caller(target, host, port, options, limiter)
    dialled: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    if _address(host) is None and host.lower() not in _LOCAL_NAMES:
        try:
            dialled = await _resolve(target, host, caller.deadline, limiter)
        except UnusableSourceError as exc:
            # The target itself cannot be found: nothing was asked, nothing advertised.
            raise TargetUnreachableError(target, exc.cause) from None
    resolver = _Resolver(host, options, dialled)
    if streaming is not None and streaming in GATEWAY_SERVICES:
        return await _gateway_ranks(target, caller, options, streaming)
    if options.engine == "gateway":
        return await _gateway(target, caller, options)
    if options.engine in ("auto", "vllm"):
        try:
            answer = await caller.call(
                VLLM_METHOD, vllm_pb.GetKvEventSourcesRequest(), vllm_pb.GetKvEventSourcesResponse.FromString
            )
        except RpcRejectedError as exc:
            if options.engine == "vllm" and exc.code == "UNIMPLEMENTED":
                raise RpcRejectedError(target, exc.code, f"{exc.cause} (not vLLM? try engine auto)") from None
            if options.engine == "vllm" or exc.code != "UNIMPLEMENTED":
                raise
            log.debug("%s: no vLLM Control service, trying SGLang", target)
        else:
            sources = _vllm_sources(target, resolver, options, answer)
            return _with_curve(target, await _pin_names(target, sources, resolver, caller.deadline, limiter), options)
    try:
        info = await caller.call(
            SGLANG_METHOD, sglang_pb.GetServerInfoRequest(), sglang_pb.GetServerInfoResponse.FromString
        )
    except RpcRejectedError as exc:
        if options.engine == "auto" and exc.code == "UNIMPLEMENTED":
            return await _gateway(target, caller, options)
        if exc.code == "UNIMPLEMENTED":
            raise RpcRejectedError(target, exc.code, f"{exc.cause} (not SGLang? try engine auto)") from None
        raise
    sources = _sglang_sources(target, resolver, options, info.json_info)
    return _with_curve(target, await _pin_names(target, sources, resolver, caller.deadline, limiter), options)


async def _probe_stream(caller: _Caller, service: str) -> grpc.RpcError | None:
    """Open ``service``'s ``SubscribeKvEvents``: None when it streams, else the ended call.

    A servicer with no publisher answers UNIMPLEMENTED, as does a server without the service.
    The stream is cancelled as soon as its headers arrive.
    """
    channel = caller._channel()
    try:
        stub = channel.unary_stream(
            f"/{service}/SubscribeKvEvents", request_serializer=serialize, response_deserializer=None
        )
        deadline = max(0.1, caller.deadline - time.monotonic())
        call: Any = stub(smg_pb.SubscribeKvEventsRequest(), timeout=deadline, metadata=caller.metadata)
        try:
            await anyio.to_thread.run_sync(call.initial_metadata, abandon_on_cancel=True, limiter=caller.limiter)
            if await answer_ended(call) and call.code() != grpc.StatusCode.OK:
                err: grpc.RpcError = call  # the ended call is the RpcError grpc would raise
                return err
            return None
        finally:
            call.cancel()
    finally:
        channel.close()


async def _gateway(target: str, caller: _Caller, options: DiscoveryOptions) -> list[EventSource]:
    """A gateway servicer's stream (the first of `GATEWAY_SERVICES` that streams): one source per rank."""
    for service in GATEWAY_SERVICES:
        ended = await _probe_stream(caller, service)
        if ended is not None and ended.code() == grpc.StatusCode.UNIMPLEMENTED:
            continue
        if ended is not None:
            raise caller._error(f"/{service}/SubscribeKvEvents", ended, 1)
        return await _gateway_ranks(target, caller, options, service)
    methods = ", ".join([VLLM_METHOD, SGLANG_METHOD, *(f"/{s}/SubscribeKvEvents" for s in GATEWAY_SERVICES)])
    raise RpcRejectedError(
        target, "UNIMPLEMENTED", f"serves none of {methods} (is it the engine's gRPC port, with KV events on?)"
    )


async def _gateway_ranks(target: str, caller: _Caller, options: DiscoveryOptions, service: str) -> list[EventSource]:
    """One source per rank ``GetLoads`` reports (a hint: the stream starts any rank it leaves out)."""
    ranks = 1
    if service in RANK_COUNTING_SERVICES:
        try:
            answer = await caller.call(
                f"/{service}/GetLoads", smg_pb.RankCountRequest(), smg_pb.RankCountResponse.FromString
            )
            ranks = max(1, answer.dp_rank_count)
        except RpcRejectedError as exc:
            if exc.code != "UNIMPLEMENTED":
                raise
    _check_count(target, ranks, options)
    return gateway_sources(target, caller.address, service, ranks, options.worker_id or target)


class SourceDiff(msgspec.Struct, frozen=True, kw_only=True):
    """How a target's sources changed: new ranks, vanished ranks, and ranks whose connection changed.

    ``replaced`` holds the new version of each source whose key stayed but whose endpoint, topic,
    replay endpoint or block size changed (its subscription must be rebuilt).
    """

    added: list[EventSource] = msgspec.field(default_factory=list)
    removed: list[EventSource] = msgspec.field(default_factory=list)
    replaced: list[EventSource] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.replaced)


def _connection(source: EventSource) -> tuple[str, str, str | None, int | None]:
    return (source.endpoint, source.topic, source.replay_endpoint, source.block_size)


def _by_key(sources: Sequence[EventSource], name: str) -> dict[WorkerKey, EventSource]:
    keyed = {s.key: s for s in sources}
    if len(keyed) != len(sources):
        raise KvRouteError(f"diff_sources: {name} lists a WorkerKey more than once")
    return keyed


def diff_sources(old: Sequence[EventSource], new: Sequence[EventSource]) -> SourceDiff:
    """Compare two source lists by `WorkerKey` (each list must hold a key at most once).

    Lists keep the order of ``new`` (added, replaced) and ``old`` (removed). Changes that do not
    affect the connection (hwm, buffer_steps) count as unchanged.
    """
    before = _by_key(old, "old")
    after = _by_key(new, "new")
    return SourceDiff(
        added=[s for k, s in after.items() if k not in before],
        removed=[s for k, s in before.items() if k not in after],
        replaced=[s for k, s in after.items() if k in before and _connection(before[k]) != _connection(s)],
    )


async def follow_target(
    target: str,
    options: DiscoveryOptions,
    on_sources: Callable[[list[EventSource]], Awaitable[None]],
    on_unreachable: Callable[[BaseException], Awaitable[None]],
    *,
    interval: float,
    grace: float,
    streaming: Callable[[], str | None] = lambda: None,
    on_failure: Callable[[KvRouteError], None] = lambda exc: None,
) -> None:
    """Rediscover ``target`` every ``interval`` seconds, forever; cancel the task to stop it.

    Each success awaits ``on_sources(every current source)``. When discovery has failed for
    longer than ``grace`` seconds in a row (from the start of the first failing attempt), awaits
    ``on_unreachable(last_error)`` once; it is called again only after a success in between.
    Discovery failures are logged (a persisting one once a minute) and never raised; what the
    callbacks raise propagates. ``streaming()``: the gateway service whose stream from the
    target is live now, if any (`discover_with`'s ``streaming``), asked before each round.
    ``on_failure(error)`` is called after every failing round.
    """
    if not interval > 0 or not grace >= 0:
        raise InvalidOptionsError(f"follow_target needs interval > 0 and grace >= 0, not {interval!r}, {grace!r}")
    failing_since: float | None = None
    notified = False
    last_logged: tuple[str, float] | None = None
    while True:
        started = time.monotonic()
        try:
            sources = await discover_with(target, options, streaming=streaming())
        except KvRouteError as exc:
            on_failure(exc)
            now = time.monotonic()
            if failing_since is None:
                failing_since = started
            message = str(exc)
            if last_logged is None or last_logged[0] != message or now - last_logged[1] >= _REPEAT_LOG_INTERVAL:
                log.warning("discovery of %s failing for %.1fs: %s", target, now - failing_since, message)
                last_logged = (message, now)
            if not notified and now - failing_since > grace:
                notified = True
                await on_unreachable(exc)
        else:
            if failing_since is not None:
                log.info("discovery of %s answers again (%d sources)", target, len(sources))
            failing_since = None
            notified = False
            last_logged = None
            await on_sources(sources)
        await anyio.sleep(interval)
