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

Hosts are judged as addresses, not spellings: every IPv4 shorthand libzmq would accept
("127.1", "2130706433", "0x7f000001"), IPv4-mapped IPv6, and host names (resolved here, in
the discovery's thread, then connected to by the address judged) count as loopback or
unspecified when they are; an unspecified address is a wildcard (the dialled host).

Threads: grpc's asyncio API runs only on asyncio and kvroute supports trio as well, so each call
uses grpc's threaded client; the wait for its answer runs in a worker thread from the
discovery's own limiter (one thread per discovery, never anyio's shared pool), and
cancelling the caller cancels the call, which frees that thread at once.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any, Final

import anyio
import anyio.to_thread
import grpc
import msgspec
import tenacity

from ._errors import (
    DiscoveryError,
    EventsDisabledError,
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
]

log = logging.getLogger("kvroute.discovery")

VLLM_METHOD: Final = "/vllm.Control/GetKvEventSources"
SGLANG_METHOD: Final = "/sglang.runtime.v1.SglangService/GetServerInfo"
ENGINES: Final = ("auto", "vllm", "sglang", "gateway")
#: Event schema versions this kvroute decodes (docs/protocol.md §1: vLLM sends 1).
KNOWN_SCHEMA_VERSIONS: Final = frozenset({1})
# Bind-all hosts an engine may advertise (docs/protocol.md §1), compared without brackets.
_WILDCARD_HOSTS: Final = frozenset({"*", "0.0.0.0", "::"})
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
# How much of a long list of per-rank problems goes into one error message.
_MAX_REPORTED_PROBLEMS: Final = 3
# follow_target logs a persisting failure once a minute: a dead target polled every second must
# stay visible in the logs without flooding them.
_REPEAT_LOG_INTERVAL: Final = 60.0
# gRPC metadata rules (grpc/doc/PROTOCOL-HTTP2.md): lowercase keys; "grpc-" is reserved;
# "-bin" keys carry bytes, the others printable ASCII.
_METADATA_KEY = re.compile(r"[0-9a-z_.\-]+")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")
# Host names a discovery answer may use: DNS-ish labels (underscores appear in container names).
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?")
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


class _HostAllowList:
    """``allowed_hosts`` parsed: IP networks (single addresses are /32 or /128) and host names."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.names: set[str] = set()
        for entry in entries:
            text = entry.strip().strip("[]") if isinstance(entry, str) else ""
            if not text:
                raise InvalidOptionsError(f"allowed_hosts entry {entry!r} is empty or not a string")
            try:
                self.networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if "/" in text or not _HOST_NAME.fullmatch(text):
                raise InvalidOptionsError(
                    f"allowed_hosts entry {entry!r} is neither an IP, a CIDR network nor a host name"
                )
            self.names.add(text.lower())

    def allows(self, host: str) -> bool:
        address = _ip(host)
        if address is None:
            return host.lower() in self.names
        return any(address.version == net.version and address in net for net in self.networks)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# The IPv4 spellings inet_aton (and so getaddrinfo, and so libzmq) also accepts: 1 to 4 parts,
# each decimal, octal or hex ("127.1", "2130706433", "0x7f000001", "0177.0.0.1", "0").
_INET_ATON = re.compile(r"(?:0[xX][0-9a-fA-F]*|[0-9]+)(?:\.(?:0[xX][0-9a-fA-F]*|[0-9]+)){0,3}")
_LOCAL_NAMES: Final = frozenset({"localhost", "localhost.", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address ``host`` spells, however it spells it; None for a host name.

    Judged as an address, not a spelling: shorthand IPv4 is expanded, an IPv4-mapped or
    IPv4-compatible IPv6 address is its IPv4 address.
    """
    address = _ip(host)
    if address is None and _INET_ATON.fullmatch(host):
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        packed = address.packed
        if packed[:12] == bytes(12) and packed[12:] != bytes(4) and address != ipaddress.IPv6Address("::1"):
            return ipaddress.IPv4Address(packed[12:])  # ::a.b.c.d, the deprecated compatible form
    return address


def _this_host(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Connecting to ``address`` reaches this machine: loopback, or unspecified (0.0.0.0, ::)."""
    return address.is_loopback or address.is_unspecified


def _is_local(host: str) -> bool:
    address = _address(host)
    return _this_host(address) if address is not None else host.lower() in _LOCAL_NAMES


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host without brackets, port); a `DiscoveryError` when malformed."""
    if target.startswith("["):
        host, sep, port = target[1:].partition("]:")
        address = _ip(host)
        ok = bool(sep) and address is not None and address.version == 6
    else:
        host, sep, port = target.rpartition(":")
        ok = bool(sep) and ":" not in host and _HOST_NAME.fullmatch(host) is not None
    if not ok or not port.isdigit() or not 0 < int(port) < 65536:
        raise DiscoveryError(
            target, "target must be host:port with port 1-65535, no scheme (IPv6 in brackets: [::1]:50051)"
        )
    return host, int(port)


class _Unusable(Exception):
    """One endpoint failed the policy; the message is the reason."""


class _Resolver:
    """Turns advertised endpoints into connectable, policy-checked ones for one dialled host."""

    def __init__(
        self,
        dialled: str,
        options: DiscoveryOptions,
        dialled_addresses: Sequence[ipaddress.IPv4Address | ipaddress.IPv6Address] = (),
    ) -> None:
        self.dialled = dialled
        self.dialled_addresses = list(dialled_addresses)
        # A dialled name is judged by what it resolved to (discover_with resolves it first).
        self.dialled_is_local = _is_local(dialled) or any(_this_host(a) for a in dialled_addresses)
        self.allow_ipc = options.allow_ipc
        self.allow_list = None if options.allowed_hosts is None else _HostAllowList(options.allowed_hosts)

    def endpoint(self, endpoint: str) -> str:
        scheme, sep, rest = endpoint.partition("://")
        scheme = scheme.lower()
        if not sep:
            raise _Unusable(f"{endpoint!r} is not a ZMQ endpoint (transport://address)")
        if scheme == "tcp":
            return self._tcp(endpoint, rest)
        if scheme == "ipc":
            if not self.allow_ipc:
                raise _Unusable(f"{endpoint}: ipc:// endpoints are refused unless allow_ipc is set")
            if not self.dialled_is_local:
                raise _Unusable(f"{endpoint}: ipc:// is a path on the engine's host, and {self.dialled} is remote")
            if not rest:
                raise _Unusable(f"{endpoint}: empty ipc path")
            return endpoint
        allowed = "tcp://, ipc://" if self.allow_ipc else "tcp://"
        raise _Unusable(f"{endpoint}: transport {scheme}:// is not supported (accepted: {allowed})")

    def _tcp(self, endpoint: str, rest: str) -> str:
        if rest.startswith("["):
            host, sep, port = rest[1:].partition("]:")
        else:
            host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise _Unusable(f"{endpoint}: needs host:port with a port in 1-65535")
        address = _address(host)
        if host in _WILDCARD_HOSTS or (address is not None and address.is_unspecified):
            host, address = self.dialled, _address(self.dialled)
        elif address is None and not _HOST_NAME.fullmatch(host):
            raise _Unusable(f"{endpoint}: {host!r} is not an IP address or host name")
        elif _is_local(host) and not self.dialled_is_local:
            raise _Unusable(f"{endpoint}: bound to loopback on {self.dialled}, unreachable from here")
        if self.allow_list is not None and not self.allow_list.allows(host if address is None else str(address)):
            raise _Unusable(f"{endpoint}: host {host} is not in allowed_hosts")
        # Connect to the address judged, in its canonical form: libzmq must not read another
        # meaning into a spelling. A host name is resolved and judged later (`_pin_names`).
        return f"tcp://{_fmt_host(host if address is None else str(address))}:{int(port)}"


def _raise_unusable(target: str, problems: list[str]) -> None:
    if problems:
        shown = problems[:_MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        cause = "unusable KV-event source: " + " | ".join(shown) + (f" | ... and {more} more" if more else "")
        raise UnusableSourceError(target, cause)


def _check_count(target: str, count: int, options: DiscoveryOptions) -> None:
    if count > options.max_sources_per_target:
        # Raised, not logged here: the caller reports it (follow_target once a minute), so a
        # followed target over the cap does not log an error every round.
        cause = f"answer lists {count} sources, more than max_sources_per_target={options.max_sources_per_target}"
        raise TooManySourcesError(target, cause)


def _vllm_sources(
    target: str, resolver: _Resolver, options: DiscoveryOptions, answer: vllm_pb.GetKvEventSourcesResponse
) -> list[EventSource]:
    if not answer.sources:
        raise EventsDisabledError(target, "vLLM lists no KV-event sources (started without --kv-events-config?)")
    _check_count(target, len(answer.sources), options)
    # data_parallel_rank is always set by vLLM; a list without it is read in order.
    ranks = [s.data_parallel_rank if s.HasField("data_parallel_rank") else i for i, s in enumerate(answer.sources)]
    if len(set(ranks)) != len(ranks):
        raise MalformedAnswerError(target, f"vLLM lists a data_parallel_rank twice: {sorted(ranks)}")
    worker_id = options.worker_id or target
    sources: list[EventSource] = []
    problems: list[str] = []
    for rank, src in zip(ranks, answer.sources):
        reasons = []
        if src.transport != "zmq":
            reasons.append(f"transport {src.transport!r} is not 'zmq'")
        if src.encoding != "msgpack":
            reasons.append(f"encoding {src.encoding!r} is not 'msgpack'")
        if src.schema_version not in KNOWN_SCHEMA_VERSIONS:
            known = ", ".join(map(str, sorted(KNOWN_SCHEMA_VERSIONS)))
            reasons.append(f"schema_version {src.schema_version} is unknown (kvroute reads {known})")
        endpoint = replay = None
        try:
            endpoint = resolver.endpoint(src.endpoint)
            replay = resolver.endpoint(src.replay_endpoint) if src.replay_endpoint else None
        except _Unusable as exc:
            reasons.append(str(exc))
        if reasons or endpoint is None:
            problems.append(f"rank {rank}: " + "; ".join(reasons))
            continue
        sources.append(
            EventSource(
                worker_id=worker_id,
                dp_rank=rank,
                endpoint=endpoint,
                topic=src.topic,
                replay_endpoint=replay,
                hwm=src.hwm,
                buffer_steps=src.buffer_steps,
                engine="vllm",
                target=target,
            )
        )
    _raise_unusable(target, problems)
    return sorted(sources, key=lambda s: s.dp_rank)


_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _SglangKvEvents(msgspec.Struct):
    """SGLang's ``kv_events`` descriptor (docs/protocol.md §1); unknown keys are ignored."""

    publisher: str
    endpoint_host: str
    endpoint_port_base: _Port
    topic: str
    block_size: _Positive
    dp_size: _Positive
    replay_endpoint_port_base: _Port | None = None


class _SglangInfo(msgspec.Struct):
    kv_events: _SglangKvEvents | None
    # A JSON string or object when present; decoded leniently (see _sglang_tuning).
    kv_events_config: msgspec.Raw = msgspec.Raw()


class _SglangTuning(msgspec.Struct):
    hwm: _NonNegative | None = None
    buffer_steps: _NonNegative | None = None


def _sglang_tuning(target: str, raw: msgspec.Raw) -> _SglangTuning:
    """hwm / buffer_steps from the top-level ``kv_events_config``; a bad one is logged and ignored.

    They only tune the subscriber; the descriptor itself is valid, so its sources stay usable.
    """
    if not raw:
        return _SglangTuning()
    try:
        value = msgspec.json.decode(raw, type=str | _SglangTuning | None)
        if isinstance(value, str):
            value = msgspec.json.decode(value, type=_SglangTuning)
    except msgspec.MsgspecError as exc:
        log.warning("%s: ignoring SGLang kv_events_config: %s", target, exc)
        return _SglangTuning()
    return value or _SglangTuning()


def _sglang_sources(target: str, resolver: _Resolver, options: DiscoveryOptions, json_info: str) -> list[EventSource]:
    try:
        info = msgspec.json.decode(json_info, type=_SglangInfo)
    except msgspec.MsgspecError as exc:
        raise MalformedAnswerError(target, f"SGLang GetServerInfo json_info: {exc}") from None
    kv = info.kv_events
    if kv is None:
        raise EventsDisabledError(target, "SGLang reports kv_events null (started without --kv-events-config)")
    _check_count(target, kv.dp_size, options)
    for name, base in (
        ("endpoint_port_base", kv.endpoint_port_base),
        ("replay_endpoint_port_base", kv.replay_endpoint_port_base),
    ):
        if base is not None and base + kv.dp_size - 1 > 65535:
            raise MalformedAnswerError(target, f"SGLang {name} {base} + dp_size {kv.dp_size} runs past port 65535")
    if kv.publisher != "zmq":
        raise UnusableSourceError(target, f"unusable KV-event source: SGLang publisher {kv.publisher!r} is not 'zmq'")
    kv_ports = range(kv.endpoint_port_base, kv.endpoint_port_base + kv.dp_size)
    replay_base = kv.replay_endpoint_port_base
    if replay_base is not None and replay_base < kv_ports.stop and kv.endpoint_port_base < replay_base + kv.dp_size:
        # docs/protocol.md §1: SGLang then fails to bind some publisher; the answer is still reported.
        log.warning(
            "%s: SGLang replay ports %d-%d overlap event ports %d-%d (dp_size %d): the engine cannot bind them all",
            target, replay_base, replay_base + kv.dp_size - 1, kv_ports.start, kv_ports.stop - 1, kv.dp_size,
        )  # fmt: skip
    tuning = _sglang_tuning(target, info.kv_events_config)
    host = _fmt_host(kv.endpoint_host.strip("[]"))
    worker_id = options.worker_id or target
    sources: list[EventSource] = []
    problems: list[str] = []
    for rank in range(kv.dp_size):
        # docs/protocol.md §1/§5: rank r publishes (and replays) on base + r.
        try:
            endpoint = resolver.endpoint(f"tcp://{host}:{kv.endpoint_port_base + rank}")
            replay = None if replay_base is None else resolver.endpoint(f"tcp://{host}:{replay_base + rank}")
        except _Unusable as exc:
            problems.append(f"rank {rank}: {exc}")
            continue
        sources.append(
            EventSource(
                worker_id=worker_id,
                dp_rank=rank,
                endpoint=endpoint,
                topic=kv.topic,
                replay_endpoint=replay,
                hwm=tuning.hwm,
                buffer_steps=tuning.buffer_steps,
                block_size=kv.block_size,
                engine="sglang",
                target=target,
            )
        )
    _raise_unusable(target, problems)
    return sources


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


async def _resolve(
    target: str, host: str, deadline: float, limiter: anyio.CapacityLimiter
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every address ``host`` resolves to (in this discovery's own worker thread, within its deadline)."""
    try:
        with anyio.fail_after(max(0.0, deadline - time.monotonic())):
            infos = await anyio.to_thread.run_sync(
                socket.getaddrinfo, host, None, 0, socket.SOCK_STREAM, abandon_on_cancel=True, limiter=limiter
            )
    except (OSError, TimeoutError) as exc:
        raise UnusableSourceError(target, f"cannot resolve {host!r}: {exc or 'timed out'}") from None
    out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for info in infos:
        address = _address(str(info[4][0]).partition("%")[0])
        if address is not None and address not in out:
            out.append(address)
    if not out:
        raise UnusableSourceError(target, f"{host!r} resolves to no address")
    return out


async def _pin_names(
    target: str, sources: list[EventSource], resolver: _Resolver, deadline: float, limiter: anyio.CapacityLimiter
) -> list[EventSource]:
    """Resolve every host name the answer uses, judge the addresses, and connect to those instead.

    A name resolving to this machine (loopback or unspecified) from a remote target is refused
    like the address itself; resolving here and connecting to the result means a later DNS
    answer cannot send the router somewhere the policy never saw.
    """
    if resolver.dialled_is_local:
        return sources  # a target on this machine may point anywhere: nothing to judge
    # The dialled name (a wildcard's substitute) is pinned to what it was judged by.
    pinned: dict[str, str] = {}
    if resolver.dialled_addresses:
        pinned[resolver.dialled] = _fmt_host(str(resolver.dialled_addresses[0]))

    async def pin(endpoint: str | None) -> str | None:
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        rest = endpoint[len("tcp://") :]
        host, _, port = rest.rpartition(":")
        if host.startswith("[") or _address(host) is not None:
            return endpoint
        if host not in pinned:
            addresses = await _resolve(target, host, deadline, limiter)
            if not resolver.dialled_is_local and any(_this_host(a) for a in addresses):
                raise UnusableSourceError(
                    target,
                    f"unusable KV-event source: {endpoint}: {host} resolves to this machine "
                    f"({', '.join(map(str, addresses))}), and {resolver.dialled} is remote",
                )
            pinned[host] = _fmt_host(str(addresses[0]))
        return f"tcp://{pinned[host]}:{port}"

    out = []
    for src in sources:
        endpoint = await pin(src.endpoint)
        assert endpoint is not None
        out.append(msgspec.structs.replace(src, endpoint=endpoint, replay_endpoint=await pin(src.replay_endpoint)))
    return out


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
