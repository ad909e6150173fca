"""``kvroute sim``: run one simulated vLLM or SGLang engine in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, TextIO

import anyio
import msgspec
import zmq

from kvroute._models import GATEWAY_SERVICES
from kvroute.sim import SimConfig, SimEngine

from ._display import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error

__all__ = ["register", "run_sim"]


def register(sub: Any) -> None:
    """Add the ``sim`` subcommand to the ``kvroute`` parser's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "sim",
        help="run a simulated vLLM or SGLang engine (KV events, replay, gRPC discovery, HTTP completions)",
        description=(
            "Run a simulated engine until Ctrl-C: a paged prefix cache per data-parallel rank that publishes "
            "KV-cache events exactly as the real engine does, its gRPC discovery service, and an OpenAI-style "
            "POST /v1/completions. Port 0 picks a free port; rank r of a base port listens on base + r."
        ),
    )
    d = SimConfig()
    p.add_argument(
        "--engine", choices=("vllm", "sglang"), default=d.engine, help="engine to imitate (default: %(default)s)"
    )
    p.add_argument("--ranks", type=int, default=d.ranks, help="data-parallel ranks (default: %(default)s)")
    p.add_argument("--host", default=d.host, help="address every server binds (default: %(default)s)")
    p.add_argument("--advertise-host", default=None, help="host written into advertised endpoints, e.g. '*'")
    p.add_argument("--grpc-port", type=int, default=0, help="gRPC discovery port (default: a free one)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--event-port", type=int, default=0, help="rank 0's KV-event PUB port (default: free ones)")
    p.add_argument("--replay-port", type=int, default=0, help="rank 0's replay ROUTER port (default: free ones)")
    p.add_argument("--no-replay", action="store_true", help="run without a replay buffer")
    p.add_argument("--topic", default=d.topic, help="topic frame of every message (default: empty)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument(
        "--capacity-blocks", type=int, default=d.capacity_blocks, help="KV blocks per rank (default: %(default)s)"
    )
    p.add_argument(
        "--buffer-steps", type=int, default=d.buffer_steps, help="batches kept for replay (default: %(default)s)"
    )
    p.add_argument("--hwm", type=int, default=d.hwm, help="PUB send high-water mark (default: %(default)s)")
    p.add_argument(
        "--drop-rate", type=float, default=d.drop_rate, help="fraction of live messages dropped (default: 0)"
    )
    p.add_argument("--array-form", action="store_true", help="tagged-array events (vLLM <= 0.23, SGLang <= 0.5.18)")
    p.add_argument(
        "--old-replay-layout", action="store_true", help="replay replies [b'', seq, payload] (older engines)"
    )
    p.add_argument("--bytes-hashes", action="store_true", help="32-byte block hashes (vLLM without int hashes)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of hashes, drops and outputs (default: %(default)s)")
    p.add_argument("--name", default=d.name, help="engine name, part of its hash seed (default: %(default)s)")
    p.add_argument("--model", default=d.model, help="served model name (default: %(default)s)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME", help="a LoRA adapter name (repeatable)")
    p.add_argument(
        "--prefill-time-per-token",
        type=float,
        default=d.prefill_time_per_token,
        help="seconds per uncached prompt token (default: %(default)s)",
    )
    p.add_argument(
        "--decode-time-per-step",
        type=float,
        default=d.decode_time_per_step,
        help="seconds per engine step (default: %(default)s)",
    )
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="most running requests (default: %(default)s)")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=d.max_batched_tokens,
        help="most tokens one step computes; prefills are chunked to fit (default: %(default)s)",
    )
    p.add_argument(
        "--gateway-stream",
        choices=sorted(GATEWAY_SERVICES.values()),
        default=None,
        metavar="SERVICER",
        help="serve that gateway servicer's SubscribeKvEvents stream (vllm, sglang, trtllm, mlx, tokenspeed) "
        "on the gRPC port instead of ZMQ discovery",
    )
    p.add_argument(
        "--gateway-history",
        type=int,
        default=d.gateway_history,
        help="batches the gateway servicer keeps per rank; later subscribers get a snapshot (default: %(default)s)",
    )
    p.set_defaults(func=run_sim)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The `SimConfig` the parsed flags describe; raises ValueError (with the reason) when they are inconsistent."""
    try:
        return SimConfig(
            engine=args.engine,
            name=args.name,
            ranks=args.ranks,
            host=args.host,
            advertise_host=args.advertise_host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            event_port=args.event_port,
            replay_port=None if args.no_replay else args.replay_port,
            topic=args.topic,
            block_size=args.block_size,
            capacity_blocks=args.capacity_blocks,
            buffer_steps=args.buffer_steps,
            hwm=args.hwm,
            form="array" if args.array_form else "map",
            bytes_hashes=args.bytes_hashes,
            reply_layout="old" if args.old_replay_layout else "new",
            drop_rate=args.drop_rate,
            seed=args.seed,
            prefill_time_per_token=args.prefill_time_per_token,
            decode_time_per_step=args.decode_time_per_step,
            max_batch=args.max_batch,
            max_batched_tokens=args.max_batched_tokens,
            model=args.model,
            lora_names=tuple(args.lora),
            gateway=args.gateway_stream,
            gateway_history=args.gateway_history,
        )
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def describe(engine: SimEngine) -> list[str]:
    """The lines `kvroute sim` prints once the engine listens."""
    cfg = engine.config
    method = (
        "vllm.Control/GetKvEventSources" if cfg.engine == "vllm" else "sglang.runtime.v1.SglangService/GetServerInfo"
    )
    if cfg.gateway is not None:
        service = next(name for name, label in GATEWAY_SERVICES.items() if label == cfg.gateway)
        method = f"{service}/SubscribeKvEvents"
    lines = [f"kvroute sim: {cfg.engine} engine {cfg.name!r}, {cfg.ranks} rank(s), block size {cfg.block_size}"]
    lines.append(f"  http    {engine.http_url}  (POST /v1/completions, GET /health, GET /v1/models)")
    lines.append(f"  grpc    {engine.grpc_target}  ({method})")
    for s in engine.sources():
        lines.append(f"  rank {s.dp_rank}  events {s.endpoint}  replay {s.replay_endpoint or '-'}")
    lines.append("Ctrl-C to stop.")
    return lines


async def serve_until_signal(config: SimConfig, out: TextIO) -> None:
    """Run the engine, print where it listens, return on SIGINT or SIGTERM."""
    async with SimEngine(config) as engine:
        print("\n".join(describe(engine)), file=out, flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                return


def run_sim(args: argparse.Namespace) -> int:
    """Entry point of ``kvroute sim``: 0 after Ctrl-C, 2 on bad flags, 1 when it cannot listen."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        return error("sim", exc, EXIT_USAGE)
    try:
        anyio.run(serve_until_signal, config, sys.stdout)
    except Exception as exc:
        cause = _bind_error(exc)
        if cause is None:
            raise
        return error("sim", f"cannot listen: {cause}", EXIT_FAILED)
    return EXIT_OK


def _bind_error(exc: BaseException) -> BaseException | None:
    """The OSError / ZMQError behind ``exc``, looking inside exception groups (task groups raise those)."""
    if isinstance(exc, (OSError, zmq.ZMQError)):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _bind_error(inner)
        if found is not None:
            return found
    return None
