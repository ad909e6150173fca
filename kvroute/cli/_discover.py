"""``kvroute discover``: ask engines' gRPC servers for their KV-event sources and print them.

Usage::

    kvroute discover HOST:PORT [HOST:PORT ...] [--engine auto|vllm|sglang] [--json] [--timeout S]
        [--worker-id ID] [--tls] [--ca PEM] [--cert PEM --key PEM] [--server-name NAME]
        [--header KEY=VALUE ...] [--token-env VAR] [--allow-ipc] [--allow-host HOST|CIDR ...]
        [--max-sources N]

Targets are asked concurrently. Sources go to stdout (a table, or with ``--json`` one object
``{"sources": [...], "errors": [{"target", "kind", "message"}]}``); failures are reported on
stderr, and the exit code is that of the first failing target in command-line order. A
malformed target is a usage error (nothing is asked); a refused connection is reported at once
(unreachable), not retried for the whole timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

import anyio
import msgspec

from kvroute._discovery import DEFAULT_MAX_SOURCES, ENGINES, DiscoveryOptions, discover_with, parse_target
from kvroute._errors import (
    DiscoveryError,
    EventsDisabledError,
    InvalidOptionsError,
    MalformedAnswerError,
    RpcRejectedError,
    TargetUnreachableError,
    TooManySourcesError,
    UnusableSourceError,
)
from kvroute._models import EventSource
from kvroute._tls import TlsConfig

from ._display import (
    EXIT_EVENTS_DISABLED,
    EXIT_FAILED,
    EXIT_MALFORMED_ANSWER,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TOO_MANY_SOURCES,
    EXIT_UNREACHABLE,
    EXIT_UNUSABLE_SOURCE,
    EXIT_USAGE,
    align,
    error,
)

__all__ = ["register", "run"]

# Most specific first: the first matching class names the failure kind and its exit code.
_FAILURE_KINDS: tuple[tuple[type[DiscoveryError], str, int], ...] = (
    (TargetUnreachableError, "unreachable", EXIT_UNREACHABLE),
    (EventsDisabledError, "events_disabled", EXIT_EVENTS_DISABLED),
    (UnusableSourceError, "unusable_source", EXIT_UNUSABLE_SOURCE),
    (MalformedAnswerError, "malformed_answer", EXIT_MALFORMED_ANSWER),
    (TooManySourcesError, "too_many_sources", EXIT_TOO_MANY_SOURCES),
    (RpcRejectedError, "rejected", EXIT_REJECTED),
    (DiscoveryError, "failed", EXIT_FAILED),
)

_EPILOG = "exit codes: " + ", ".join(
    f"{code} {kind.replace('_', ' ')}"
    for code, kind in sorted([(EXIT_OK, "ok"), (EXIT_USAGE, "usage")] + [(c, k) for _, k, c in _FAILURE_KINDS])
)


class _Failure(msgspec.Struct, frozen=True):
    target: str
    kind: str
    message: str


class _Report(msgspec.Struct, frozen=True):
    sources: list[EventSource]
    errors: list[_Failure]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``discover`` subcommand to the ``kvroute`` parser."""
    parser = sub.add_parser(
        "discover",
        help="list the KV-event sources of vLLM / SGLang engines (gRPC discovery)",
        description="Ask each engine's gRPC server (--grpc-port) where its KV-event publishers are.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("targets", nargs="+", metavar="HOST:PORT", help="engine gRPC address ([v6]:port for IPv6)")
    parser.add_argument("--engine", choices=ENGINES, default="auto", help="which engine to ask (default: auto)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds per target, retries included")
    parser.add_argument("--worker-id", help="name the workers (one target only; default: the target)")
    tls = parser.add_argument_group("TLS and authentication")
    tls.add_argument("--tls", action="store_true", help="use TLS with the system roots (implied by --ca/--cert)")
    tls.add_argument("--ca", metavar="PEM", help="root certificates file")
    tls.add_argument("--cert", metavar="PEM", help="client certificate chain file (with --key)")
    tls.add_argument("--key", metavar="PEM", help="client private key file (with --cert)")
    tls.add_argument("--server-name", help="name to check the server certificate against")
    tls.add_argument("--header", action="append", default=[], metavar="KEY=VALUE", help="call metadata (repeatable)")
    tls.add_argument("--token-env", metavar="VAR", help="send 'authorization: Bearer $VAR' (keeps it out of ps)")
    policy = parser.add_argument_group("endpoint policy")
    policy.add_argument("--allow-ipc", action="store_true", help="accept ipc:// endpoints of a local engine")
    policy.add_argument(
        "--allow-host", action="append", metavar="HOST|CIDR", help="accept only endpoints on these hosts (repeatable)"
    )
    policy.add_argument("--max-sources", type=int, default=DEFAULT_MAX_SOURCES, metavar="N", help="cap per target")
    parser.set_defaults(func=run)


def _options(args: argparse.Namespace) -> DiscoveryOptions:
    """Build the options from the arguments; raises InvalidOptionsError naming what is wrong."""
    if args.worker_id is not None and len(args.targets) > 1:
        raise InvalidOptionsError("--worker-id names the workers of one target; give one target")
    metadata: list[tuple[str, str]] = []
    for header in args.header:
        key, sep, value = header.partition("=")
        if not sep:
            raise InvalidOptionsError(f"--header {header!r}: expected KEY=VALUE")
        metadata.append((key.strip().lower(), value))
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise InvalidOptionsError(f"--token-env: environment variable {args.token_env} is unset or empty")
        metadata.append(("authorization", f"Bearer {token}"))
    tls = None
    if args.tls or args.ca or args.cert or args.key or args.server_name:
        tls = TlsConfig(
            root_certificates=args.ca, private_key=args.key, certificate_chain=args.cert, server_name=args.server_name
        )
    return DiscoveryOptions(
        engine=args.engine,
        timeout=args.timeout,
        tls=tls,
        metadata=metadata,
        worker_id=args.worker_id,
        allow_ipc=args.allow_ipc,
        allowed_hosts=args.allow_host,
        max_sources_per_target=args.max_sources,
        # One-shot: a closed port is the answer, not an engine about to start.
        retry_refused=False,
    )


def _kind(error: DiscoveryError) -> tuple[str, int]:
    for cls, kind, code in _FAILURE_KINDS:
        if isinstance(error, cls):
            return kind, code
    raise AssertionError("DiscoveryError is the last entry")  # pragma: no cover


async def _discover_all(targets: Sequence[str], options: DiscoveryOptions) -> list[list[EventSource] | DiscoveryError]:
    results: list[list[EventSource] | DiscoveryError] = [[] for _ in targets]

    async def one(i: int, target: str) -> None:
        try:
            results[i] = await discover_with(target, options)
        except DiscoveryError as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i, target in enumerate(targets):
            tg.start_soon(one, i, target)
    return results


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _table(sources: Sequence[EventSource], out: TextIO) -> None:
    header = ("WORKER", "RANK", "ENGINE", "ENDPOINT", "REPLAY", "TOPIC", "BLOCK", "HWM", "BUFFER")
    rows = [
        (s.worker_id, s.dp_rank, s.engine, s.endpoint, s.replay_endpoint, s.topic, s.block_size, s.hwm, s.buffer_steps)
        for s in sources
    ]
    for line in align([header, *[tuple(_cell(v) for v in row) for row in rows]]):
        out.write(line + "\n")


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``kvroute discover`` with parsed ``args``; returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        options = _options(args)
        for target in args.targets:
            parse_target(target)
    except InvalidOptionsError as exc:
        return error("discover", exc, EXIT_USAGE, err)
    except DiscoveryError as exc:
        return error("discover", exc, EXIT_USAGE, err)
    results = anyio.run(_discover_all, args.targets, options)
    sources = [s for r in results if not isinstance(r, DiscoveryError) for s in r]
    failures: list[_Failure] = []
    code = EXIT_OK
    for result in results:
        if isinstance(result, DiscoveryError):
            kind, kind_code = _kind(result)
            failures.append(_Failure(result.target, kind, result.cause))
            code = code or kind_code
            error("discover", f"{result.target}: {kind.replace('_', ' ')}: {result.cause}", kind_code, err)
    if args.json:
        out.write(msgspec.json.encode(_Report(sources, failures)).decode() + "\n")
    elif sources:
        _table(sources, out)
    return code
