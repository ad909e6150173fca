"""A minimal grpc.aio gateway servicer around smg-grpc-servicer's own ``kv_relay.relay()`` (test harness).

Runs in the venv ``tests/relay/setup.sh`` builds, not in kvroute's: it serves
``vllm.grpc.engine.VllmEngine`` with ``SubscribeKvEvents`` relayed by the released relay from the
ZMQ publishers named on the command line, and ``GetLoads`` answering the rank count (or
``--announced-ranks``, as vLLM's servicer does before every rank has stats; every other
method is the generated servicer's UNIMPLEMENTED). Prints ``PORT <n>`` once serving; exits when
its stdin closes.

    python harness.py --endpoints tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \
        --replay-endpoints tcp://127.0.0.1:5567,tcp://127.0.0.1:5568 --hwm 8
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_servicer import kv_relay


class Servicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, sources: list[kv_relay.RankSource], hwm: int | None, announced: int | None) -> None:
        self.sources = sources
        self.hwm = hwm
        # vLLM's servicer names a rank in GetLoads only once it has stats: a fresh engine, one.
        self.announced = announced if announced is not None else len(sources)

    @staticmethod
    def load(rank: int | None) -> common_pb2.EngineLoad:
        # A fixed record: the harness cannot see the simulated engine's queue, only its events.
        return common_pb2.EngineLoad(running_requests=1, waiting_requests=rank or 0, token_usage=0.25)

    async def SubscribeKvEvents(self, request, context):
        async for batch in kv_relay.relay(
            self.sources,
            kv_relay.Engine.VLLM,
            request.start_sequence_number,
            context,
            hwm=self.hwm,
            load_source=self.load,
            heartbeat_interval=0.2,
            heartbeat_backoff=0.2,
        ):
            yield batch

    async def GetLoads(self, request, context):
        return vllm_engine_pb2.GetLoadsResponse(dp_rank_count=self.announced)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--replay-endpoints", default="")
    parser.add_argument("--hwm", type=int, default=None)
    parser.add_argument("--announced-ranks", type=int, default=None, help="GetLoads' rank count (default: all)")
    args = parser.parse_args()
    endpoints = args.endpoints.split(",")
    replays = args.replay_endpoints.split(",") if args.replay_endpoints else [None] * len(endpoints)
    sources = [
        kv_relay.RankSource(rank=r, endpoint=e, replay_endpoint=p) for r, (e, p) in enumerate(zip(endpoints, replays))
    ]
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(Servicer(sources, args.hwm, args.announced_ranks), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"PORT {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(grace=None)


if __name__ == "__main__":
    asyncio.run(main())
