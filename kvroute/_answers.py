"""What vLLM's and SGLang's discovery answers say, as `EventSource`s, checked (docs/protocol.md §1).

`_vllm_sources` reads ``GetKvEventSources``, `_sglang_sources` SGLang's ``GetServerInfo``
``kv_events`` JSON; every endpoint goes through the endpoint policy (`kvroute._endpoints`), and
what cannot be used is a typed `DiscoveryError` naming the ranks and why.

Where to send requests: SGLang's answer also names its HTTP server (``host``, ``port`` and
``ssl_certfile`` of its ``ServerArgs``, 0.5.23 ``build_server_info``), so its sources carry
``http_url``; vLLM's ``Control`` service says nothing of its HTTP port (its ``GetServerInfo`` is
versions, parallelism and sizes), so a vLLM target's URL is given to the client.
"""

from __future__ import annotations

import logging
from typing import Annotated, Final

import msgspec

from ._endpoints import Policy, _fmt_host, _Resolver, _Unusable
from ._errors import EventsDisabledError, MalformedAnswerError, TooManySourcesError, UnusableSourceError
from ._models import EventSource
from ._proto import vllm_control_pb2 as vllm_pb

__all__ = ["KNOWN_SCHEMA_VERSIONS", "_check_count", "_sglang_sources", "_vllm_sources"]

log = logging.getLogger("kvroute.discovery")

#: Event schema versions this kvroute decodes (docs/protocol.md §1: vLLM sends 1).
KNOWN_SCHEMA_VERSIONS: Final = frozenset({1})
# How much of a long list of per-rank problems goes into one error message.
_MAX_REPORTED_PROBLEMS: Final = 3


def _raise_unusable(target: str, problems: list[str]) -> None:
    if problems:
        shown = problems[:_MAX_REPORTED_PROBLEMS]
        more = len(problems) - len(shown)
        cause = "unusable KV-event source: " + " | ".join(shown) + (f" | ... and {more} more" if more else "")
        raise UnusableSourceError(target, cause)


def _check_count(target: str, count: int, options: Policy) -> None:
    if count > options.max_sources_per_target:
        # Raised, not logged here: the caller reports it (follow_target once a minute), so a
        # followed target over the cap does not log an error every round.
        cause = f"answer lists {count} sources, more than max_sources_per_target={options.max_sources_per_target}"
        raise TooManySourcesError(target, cause)


def _vllm_sources(
    target: str, resolver: _Resolver, options: Policy, answer: vllm_pb.GetKvEventSourcesResponse
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
    # The HTTP server's bind host and port, and its TLS certificate (None: plain HTTP). Read
    # leniently (see _sglang_http_url): where requests go is a convenience, never a reason to
    # refuse the event sources.
    host: object = None
    port: object = None
    ssl_certfile: object = None


def _sglang_http_url(target: str, resolver: _Resolver, info: _SglangInfo) -> str | None:
    """The engine's HTTP base URL from ``host`` / ``port``, judged like an endpoint; None when unusable.

    A wildcard bind host is the host that was dialled; SGLang's default bind, 127.0.0.1, is
    reachable only when the target is this machine (the endpoint policy's loopback rule).
    """
    host, port = info.host, info.port
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        return None
    scheme = "https" if isinstance(info.ssl_certfile, str) and info.ssl_certfile else "http"
    bound = "*" if not host.strip("[]") else _fmt_host(host.strip("[]"))
    try:
        connectable = resolver.endpoint(f"tcp://{bound}:{port}")
    except _Unusable as exc:
        log.debug("%s: SGLang's HTTP server is not reachable from here: %s", target, exc)
        return None
    return f"{scheme}://{connectable.removeprefix('tcp://')}"


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


def _sglang_sources(target: str, resolver: _Resolver, options: Policy, json_info: str) -> list[EventSource]:
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
    http_url = _sglang_http_url(target, resolver, info)
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
                http_url=http_url,
            )
        )
    _raise_unusable(target, problems)
    return sources
