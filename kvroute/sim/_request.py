"""What a simulated engine is asked and answers: its options, a request in flight, a finished request.

Kept apart from `kvroute.sim._engine` (the scheduler and servers) so the HTTP layer can type what it
serves without importing the engine that starts it.
"""

from __future__ import annotations

from array import array
from typing import Literal

import anyio
import msgspec
import xxhash
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._errors import KvRouteError
from .._models import GATEWAY_SERVICES

__all__ = ["Completion", "RequestAbortedError", "SimConfig", "SimRequest"]


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Options of a `SimEngine`; every field has a working default (a 1-rank vLLM on free loopback ports).

    Ports: 0 picks free ones; a non-zero ``event_port`` / ``replay_port`` is rank 0's and rank r
    uses base + r, as both engines do. ``replay_port=None`` turns the replay buffer off;
    ``grpc_port`` / ``http_port`` None turn those servers off. ``advertise_host`` is the host
    written into advertised endpoints (e.g. ``"*"``, as vLLM advertises its bind address);
    default: ``host``. Give engines sharing a process distinct ``name`` or ``seed`` values: the
    hash seed derives from both, as separate engine processes have separate seeds.
    """

    engine: Literal["vllm", "sglang"] = "vllm"
    name: str = "sim"
    ranks: int = 1
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    grpc_port: int | None = 0
    http_port: int | None = 0
    event_port: int = 0
    replay_port: int | None = 0
    topic: str = ""
    block_size: int = 16
    capacity_blocks: int = 4096
    buffer_steps: int = 10_000
    hwm: int = 100_000
    form: Literal["map", "array"] = "map"
    bytes_hashes: bool = False
    reply_layout: Literal["new", "old"] = "new"
    drop_rate: float = 0.0
    seed: int = 0
    #: Seconds per uncached prompt token (5e-5: 20k tokens/s, a mid-size model on one GPU).
    prefill_time_per_token: float = 5e-5
    #: Seconds per engine step (one token for every running request).
    decode_time_per_step: float = 0.01
    #: Most requests running at once (vLLM's max_num_seqs).
    max_batch: int = 64
    #: Most tokens one step computes (vLLM's max_num_batched_tokens; prefills are chunked to fit).
    max_batched_tokens: int = 8192
    model: str = "sim-model"
    lora_names: tuple[str, ...] = ()
    vocab_size: int = 32_000
    #: Serve the gateway servicer's ``SubscribeKvEvents`` stream (docs/protocol.md §6) on the gRPC
    #: port instead of ZMQ discovery: "vllm", "sglang", "trtllm", "mlx" or "tokenspeed" names
    #: the servicer (``vllm serve --grpc`` is "vllm"). The ZMQ publishers still run.
    gateway: str | None = None
    #: Batches the simulated servicer keeps per rank; past them a new subscriber gets a snapshot.
    gateway_history: int = 10_000

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "sglang"):
            raise ValueError(f"engine must be 'vllm' or 'sglang', not {self.engine!r}")
        if self.ranks < 1:
            raise ValueError(f"ranks {self.ranks} < 1")
        if self.bytes_hashes and self.engine != "vllm":
            raise ValueError("bytes hashes exist only on vLLM")
        if not 0.0 <= self.drop_rate <= 1.0:
            raise ValueError(f"drop_rate {self.drop_rate} is not in [0, 1]")
        if self.prefill_time_per_token < 0 or self.decode_time_per_step < 0:
            raise ValueError("step times must be >= 0")
        for field in ("block_size", "capacity_blocks", "buffer_steps", "max_batch", "max_batched_tokens", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1")
        if self.gateway is not None and self.gateway not in GATEWAY_SERVICES.values():
            raise ValueError(f"gateway must be one of {sorted(GATEWAY_SERVICES.values())}, not {self.gateway!r}")
        if self.gateway_history < 1:
            raise ValueError("gateway_history must be >= 1")
        if self.max_batched_tokens < self.max_batch:
            raise ValueError("max_batched_tokens must be >= max_batch (every running request decodes one token)")


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request: what the engine reports, and how long it took (seconds, engine clock)."""

    request_id: str
    rank: int
    prompt_tokens: int
    cached_tokens: int
    output_token_ids: list[int]
    finish_reason: str
    queue_time: float
    ttft: float
    latency: float


class RequestAbortedError(KvRouteError):
    """A request died with its engine (restarted or stopped) or was aborted."""


class SimRequest:
    """A request in flight: `result` waits for its `Completion`; `tokens` streams its output ids (``stream=True``)."""

    def __init__(
        self,
        request_id: str,
        rank: int,
        prompt: list[int],
        max_tokens: int,
        lora_name: str | None,
        arrival: float,
        stream: bool,
    ) -> None:
        self.request_id = request_id
        self.rank = rank
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.lora_name = lora_name
        self.arrival = arrival
        self.seq = list(prompt)  # prompt, then generated tokens
        self.cached_tokens = 0
        self.prefilled = 0
        self.stored_blocks = 0  # blocks handed to the cache so far
        self.admitted_at = 0.0
        self.first_token_at = 0.0
        self.finished = False
        self.error: KvRouteError | None = None
        self._completion: Completion | None = None
        self._done = anyio.Event()
        self._digest = xxhash.xxh64_digest(array("Q", prompt).tobytes() + (lora_name or "").encode())
        self._send: MemoryObjectSendStream[int] | None = None
        self._receive: MemoryObjectReceiveStream[int] | None = None
        if stream:
            # Room for every token: the scheduler never waits on a slow reader.
            self._send, self._receive = anyio.create_memory_object_stream[int](max_tokens + 1)

    @property
    def generated(self) -> int:
        """Tokens generated so far."""
        return len(self.seq) - len(self.prompt)

    def next_token(self, vocab_size: int) -> int:
        """The greedy "model": the next token depends only on the prompt (and LoRA) and its position."""
        return xxhash.xxh64_intdigest(self._digest, seed=self.generated) % vocab_size

    def emit(self, token: int) -> None:
        """Append a generated token (and stream it)."""
        self.seq.append(token)
        if self._send is not None:
            self._send.send_nowait(token)

    def finish(self, completion: Completion | None, error: KvRouteError | None = None) -> None:
        """End the request with its completion or an error; wakes `result` and ends `tokens`."""
        if self.finished:
            return
        self.finished = True
        self._completion = completion
        self.error = error
        if self._send is not None:
            self._send.close()
        self._done.set()

    async def result(self) -> Completion:
        """Wait for the completion; raises `RequestAbortedError` if the request died."""
        await self._done.wait()
        if self.error is not None:
            raise self.error
        assert self._completion is not None  # finish() sets one or the other
        return self._completion

    def tokens(self) -> MemoryObjectReceiveStream[int]:
        """The generated token ids as they come (iterate with ``async for``); only with ``stream=True``."""
        if self._receive is None:
            raise RuntimeError("request was not submitted with stream=True")
        return self._receive
