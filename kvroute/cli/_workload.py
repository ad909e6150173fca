"""Request workloads for the demo: a synthetic shared-prefix mix, Mooncake traces, and their reachable hits.

`generate_workload` builds what KV-aware routing is for, deterministically from a seed:

- **tenant** requests: one of several tenants' system prompts (popularity Zipf-like, tenant k
  weighted 1/(k+1)) followed by a fresh question;
- **turn** requests: multi-turn conversations on a tenant's system prompt; each turn's prompt is
  the previous turn's prompt, a reply, and a new user message, so it grows and extends the last
  one. A turn ``follows`` the previous one: a driver should send it only after that one finished
  (plus ``think_time``), as a user would;
- **oneoff** requests: prompts sharing nothing with anything else.

Arrivals are a Poisson process at ``rate`` requests per second. A conversation's next turn is
due a geometric number of arrivals later (mean ``turn_gap``), so conversations overlap in time
the way sessions of many users do.

`read_mooncake_trace` reads the JSON-lines format KV-routing traces are published in (Mooncake's
``{"timestamp", "input_length", "output_length", "hash_ids"}``, timestamps in milliseconds).
Each hash id stands for one block of ``block_tokens`` tokens (512 in Mooncake's traces); it is
expanded into a deterministic token block, so equal hash ids give equal tokens, and any engine
block size dividing ``block_tokens`` sees the same sharing the trace recorded.

`reachable_hits` measures what any router could get from a workload: the prompt tokens an
infinite prefix cache that sees every request, in arrival order, finds cached. That is also the
best assignment of requests to workers (all of them on one worker with unbounded cache): a
request can only hit blocks an earlier request computed, wherever that ran.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import sys
from array import array
from collections.abc import Iterator, Sequence

import msgspec
import xxhash

from kvroute import KvRouteError

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_SHAPES",
    "Reachable",
    "TraceError",
    "TraceRecord",
    "WorkloadConfig",
    "WorkloadRequest",
    "distinct_blocks",
    "generate_mooncake_trace",
    "generate_workload",
    "iter_mooncake_records",
    "reachable_hits",
    "read_mooncake_trace",
    "trace_requests",
    "write_mooncake_trace",
]

#: Tokens one hash id stands for in Mooncake's published traces.
MOONCAKE_BLOCK_TOKENS = 512

# Request kinds, as `WorkloadRequest.kind` spells them.
TENANT = "tenant"
TURN = "turn"
ONEOFF = "oneoff"
TRACE = "trace"


class TraceError(KvRouteError):
    """A trace file cannot be read: missing, or a line that is not a trace record (file:line in the message)."""


class WorkloadConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The synthetic workload's shape; every field has a default that makes a meaningful demo.

    Token counts are ``(low, high)`` ranges drawn uniformly. ``conversation_share`` /
    ``oneoff_share``: the chance that a new (not follow-up) request starts a conversation or
    is a one-off; the rest are tenant requests. ``rate``: mean arrivals per second.
    ``max_tokens``: output tokens per request. ``vocab_size``: token ids are drawn below it
    (32,000 is Llama-2's vocabulary, also the simulator's default).
    """

    requests: int = 600
    seed: int = 0
    tenants: int = 16
    system_tokens: tuple[int, int] = (512, 2048)
    question_tokens: tuple[int, int] = (64, 256)
    conversation_share: float = 0.45
    oneoff_share: float = 0.1
    turns: tuple[int, int] = (3, 8)
    user_tokens: tuple[int, int] = (64, 256)
    reply_tokens: tuple[int, int] = (64, 256)
    oneoff_tokens: tuple[int, int] = (256, 1536)
    turn_gap: float = 12.0
    think_time: float = 0.05
    rate: float = 100.0
    max_tokens: int = 16
    vocab_size: int = 32_000

    def __post_init__(self) -> None:
        if self.requests < 0:
            raise ValueError(f"requests must be >= 0, not {self.requests}")
        if self.tenants < 1:
            raise ValueError(f"tenants must be >= 1, not {self.tenants}")
        for name in ("system_tokens", "question_tokens", "turns", "user_tokens", "reply_tokens", "oneoff_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range (low, high) with 1 <= low <= high, not {(low, high)}")
        shares = (self.conversation_share, self.oneoff_share)
        if not all(0.0 <= s <= 1.0 for s in shares) or sum(shares) > 1.0:
            raise ValueError("conversation_share and oneoff_share must be in [0, 1] and sum to at most 1")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be > 0 requests/s, not {self.rate}")
        if not self.turn_gap >= 1.0:
            raise ValueError(f"turn_gap must be >= 1 arrival, not {self.turn_gap}")
        if not self.think_time >= 0.0:
            raise ValueError(f"think_time must be >= 0 s, not {self.think_time}")
        if self.max_tokens < 1 or self.vocab_size < 2:
            raise ValueError("max_tokens must be >= 1 and vocab_size >= 2")


class WorkloadRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a workload.

    ``arrival``: seconds from the workload's start (the earliest it may be sent). ``follows``:
    the id of a request that must have finished first (the previous turn), then wait
    ``think_time`` more. ``kind``: "tenant", "turn", "oneoff" or "trace". ``tenant`` /
    ``session``: the tenant and conversation it belongs to, when any.
    """

    id: int
    arrival: float
    token_ids: list[int]
    max_tokens: int
    kind: str
    tenant: int | None = None
    session: int | None = None
    follows: int | None = None
    think_time: float = 0.0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` uniform token ids below ``vocab`` from one C-level draw (per-token Python calls cost 10x)."""
    raw = array("I")
    raw.frombytes(rng.getrandbits(32 * n).to_bytes(4 * n, "little"))
    if sys.byteorder != "little":
        raw.byteswap()
    return [t % vocab for t in raw]


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    return rng.randint(span[0], span[1])


class _Conversation:
    __slots__ = ("history", "id", "last", "tenant", "turns_left")

    def __init__(self, cid: int, tenant: int, history: list[int], turns_left: int) -> None:
        self.id = cid
        self.tenant = tenant
        self.history = history
        self.turns_left = turns_left
        self.last: int | None = None


def generate_workload(config: WorkloadConfig | None = None) -> list[WorkloadRequest]:
    """The synthetic shared-prefix workload of ``config`` (module docstring), in arrival order.

    Deterministic: the same config (seed included) gives the same requests on every platform.
    """
    cfg = config or WorkloadConfig()
    rng = random.Random(cfg.seed)
    vocab = cfg.vocab_size
    systems = [_tokens(rng, _draw(rng, cfg.system_tokens), vocab) for _ in range(cfg.tenants)]
    weights = [1.0 / (k + 1) for k in range(cfg.tenants)]
    due: list[tuple[int, int]] = []  # (arrival slot, conversation id), a heap
    conversations: dict[int, _Conversation] = {}
    out: list[WorkloadRequest] = []
    t = 0.0
    for slot in range(cfg.requests):
        t += rng.expovariate(cfg.rate)
        if due and due[0][0] <= slot:
            conv = conversations[heapq.heappop(due)[1]]
        else:
            roll = rng.random()
            if roll < cfg.oneoff_share:
                out.append(
                    WorkloadRequest(
                        id=slot,
                        arrival=t,
                        token_ids=_tokens(rng, _draw(rng, cfg.oneoff_tokens), vocab),
                        max_tokens=cfg.max_tokens,
                        kind=ONEOFF,
                    )
                )
                continue
            tenant = rng.choices(range(cfg.tenants), weights)[0]
            if roll >= cfg.oneoff_share + cfg.conversation_share:
                prompt = systems[tenant] + _tokens(rng, _draw(rng, cfg.question_tokens), vocab)
                out.append(
                    WorkloadRequest(
                        id=slot, arrival=t, token_ids=prompt, max_tokens=cfg.max_tokens, kind=TENANT, tenant=tenant
                    )
                )
                continue
            cid = len(conversations)
            conv = conversations[cid] = _Conversation(cid, tenant, list(systems[tenant]), _draw(rng, cfg.turns))
        if conv.last is not None:
            conv.history += _tokens(rng, _draw(rng, cfg.reply_tokens), vocab)  # the assistant's last answer
        conv.history += _tokens(rng, _draw(rng, cfg.user_tokens), vocab)
        out.append(
            WorkloadRequest(
                id=slot,
                arrival=t,
                token_ids=list(conv.history),
                max_tokens=cfg.max_tokens,
                kind=TURN,
                tenant=conv.tenant,
                session=conv.id,
                follows=conv.last,
                think_time=cfg.think_time if conv.last is not None else 0.0,
            )
        )
        conv.last = slot
        conv.turns_left -= 1
        if conv.turns_left > 0:
            # Geometric gap with mean turn_gap arrivals (at least 1).
            gap = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - 1.0 / cfg.turn_gap)) if cfg.turn_gap > 1 else 1
            heapq.heappush(due, (slot + gap, conv.id))
    return out


# --- Mooncake traces -----------------------------------------------------------------------------


class TraceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a Mooncake-format trace; unknown keys are ignored.

    ``timestamp`` in milliseconds; ``hash_ids``: one id per block of the prompt (the last block
    may be partial); ``output_length``: tokens generated.
    """

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_record_decoder = msgspec.json.Decoder(TraceRecord)


def iter_mooncake_records(path: str | os.PathLike[str]) -> Iterator[TraceRecord]:
    """The records of a Mooncake JSON-lines trace, checked; blank lines are skipped.

    Raises `TraceError` (with file and line) for an unreadable file or a line that is not a
    record: a non-JSON line, missing fields, negative lengths or hash ids outside int64.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed by the with below; open errors are mapped first)
    except OSError as exc:
        raise TraceError(f"{path}: cannot open trace: {exc.strerror or exc}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = _record_decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not a trace record: {exc}") from None
            if rec.input_length < 1 or rec.output_length < 0 or not math.isfinite(rec.timestamp):
                raise TraceError(f"{path}:{lineno}: input_length must be >= 1, output_length >= 0, timestamp finite")
            if any(not -(2**63) <= h < 2**64 for h in rec.hash_ids):
                raise TraceError(f"{path}:{lineno}: hash ids must fit in 64 bits")
            yield rec


def read_mooncake_trace(
    path: str | os.PathLike[str],
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
    speedup: float = 1.0,
    max_tokens: int | None = None,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Turn a Mooncake trace file into requests (`trace_requests`); ``limit``: the first ``limit`` records only.

    Raises `TraceError` for an unreadable file or record.
    """
    if block_tokens < 1 or not (math.isfinite(speedup) and speedup > 0):
        raise ValueError("block_tokens must be >= 1 and speedup > 0")
    records: list[TraceRecord] = []
    for rec in iter_mooncake_records(path):
        if limit is not None and len(records) >= limit:
            break
        records.append(rec)
    return trace_requests(
        records, block_tokens=block_tokens, speedup=speedup, max_tokens=max_tokens, vocab_size=vocab_size
    )


def trace_requests(
    records: Sequence[TraceRecord],
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    speedup: float = 1.0,
    max_tokens: int | None = None,
    vocab_size: int = 32_000,
) -> list[WorkloadRequest]:
    """Turn Mooncake trace records into requests, in timestamp order (ties keep the records' order).

    Hash id ``h`` becomes ``block_tokens`` tokens that depend only on ``h``; a prompt is its
    blocks' tokens cut to ``input_length``. Tokens past the last hash id (a trace whose
    ``input_length`` exceeds its blocks) are unique to the request. ``speedup``: divide
    inter-arrival times (timestamps are in ms). ``max_tokens``: cap on ``output_length`` (at
    least 1 token is generated).
    """
    if block_tokens < 1 or not (math.isfinite(speedup) and speedup > 0):
        raise ValueError("block_tokens must be >= 1 and speedup > 0")
    blocks: dict[int, list[int]] = {}
    order = sorted(range(len(records)), key=lambda i: records[i].timestamp)
    start = records[order[0]].timestamp if records else 0.0
    out: list[WorkloadRequest] = []
    for rid, i in enumerate(order):
        rec = records[i]
        prompt: list[int] = []
        for h in rec.hash_ids:
            if len(prompt) >= rec.input_length:
                break
            block = blocks.get(h)
            if block is None:
                # The block's tokens depend on its id alone: one seeded stream per id.
                seed = xxhash.xxh64_intdigest((h % 2**64).to_bytes(8, "little"), seed=block_tokens)
                block = blocks[h] = _tokens(random.Random(seed), block_tokens, vocab_size)
            prompt += block
        if len(prompt) < rec.input_length:
            tail = random.Random(f"kvroute-trace-tail:{i}:{rec.timestamp}")
            prompt += _tokens(tail, rec.input_length - len(prompt), vocab_size)
        del prompt[rec.input_length :]
        out_len = max(1, rec.output_length)
        out.append(
            WorkloadRequest(
                id=rid,
                arrival=(rec.timestamp - start) / 1000.0 / speedup,
                token_ids=prompt,
                max_tokens=out_len if max_tokens is None else min(out_len, max_tokens),
                kind=TRACE,
            )
        )
    return out


# --- generated Mooncake-format traces -------------------------------------------------------------

#: The trace shapes `generate_mooncake_trace` makes, after the three traces Mooncake published.
TRACE_SHAPES = ("conversation", "toolagent", "synthetic")


class _Ids:
    """Fresh hash ids, counting up from 1 (0 is the system prompt every request of a shape shares)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _record(t_ms: float, hash_ids: list[int], rng: random.Random, output: tuple[int, int]) -> TraceRecord:
    # The last block is partial, as a real prompt's usually is.
    length = (len(hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS + rng.randint(1, MOONCAKE_BLOCK_TOKENS)
    return TraceRecord(
        timestamp=float(round(t_ms)), input_length=length, output_length=_draw(rng, output), hash_ids=hash_ids
    )


def generate_mooncake_trace(shape: str, records: int = 400, seed: int = 0) -> list[TraceRecord]:
    """A Mooncake-format trace of ``records`` records shaped like one of Mooncake's published traces.

    Hash ids stand for 512-token blocks; timestamps are in ms; every shape's prompts start with block
    0 (a system prompt all share), as the published traces' do. Deterministic for a seed.

    - ``conversation``: chat sessions (~3.5 requests/s in all). Each turn's prompt is the previous
      turn's blocks plus the reply and a new message (1-4 new blocks); turns of a session come 10-60 s
      apart, so sessions interleave and their reuse is far apart in time.
    - ``toolagent``: agent loops over 4 tool sets (8-16 shared blocks each, popularity 1/k). A step's
      prompt is the previous step's plus a tool result (1-3 blocks); steps come 1-8 s apart; short
      outputs. Prefix reuse is high and close in time.
    - ``synthetic``: questions about 24 long documents (6-40 blocks each, popularity 1/k), each prompt
      a document plus a question block of its own, arriving as a Poisson stream (~5/s).
    """
    if shape not in TRACE_SHAPES:
        raise ValueError(f"trace shape must be one of {', '.join(TRACE_SHAPES)}, not {shape!r}")
    if records < 0:
        raise ValueError(f"records must be >= 0, not {records}")
    rng = random.Random(f"kvroute-mooncake:{shape}:{seed}")
    ids = _Ids()
    out: list[TraceRecord] = []
    if shape == "synthetic":
        docs = [[0, *ids.take(rng.randint(6, 40))] for _ in range(24)]
        weights = [1.0 / (k + 1) for k in range(len(docs))]
        t = 0.0
        for _ in range(records):
            t += rng.expovariate(5.0) * 1000.0
            doc = rng.choices(docs, weights)[0]
            out.append(_record(t, [*doc, *ids.take(1)], rng, (8, 300)))
        return out
    if shape == "conversation":
        start_rate, gap, grow, first, output = 1.0, (10_000.0, 60_000.0), (1, 4), (1, 24), (20, 700)
        turns: tuple[int, int] = (2, 8)
        prefixes = [[0]]
    else:
        start_rate, gap, grow, first, output = 0.6, (1_000.0, 8_000.0), (1, 3), (1, 4), (5, 300)
        turns = (3, 12)
        prefixes = [[0, *ids.take(rng.randint(8, 16))] for _ in range(4)]
    weights = [1.0 / (k + 1) for k in range(len(prefixes))]
    due: list[tuple[float, int, list[int], int]] = []  # (time, tie-break, hash ids so far, turns left): a heap
    t_start = 0.0
    n = 0
    while len(out) < records:
        # The next event is a new session's start or a session's next turn, whichever comes first.
        if due and due[0][0] <= t_start:
            t, _, history, left = heapq.heappop(due)
            history = [*history, *ids.take(_draw(rng, grow))]
        else:
            t = t_start
            t_start += rng.expovariate(start_rate) * 1000.0
            history = [*rng.choices(prefixes, weights)[0], *ids.take(_draw(rng, first))]
            left = _draw(rng, turns)
        out.append(_record(t, history, rng, output))
        if left > 1:
            n += 1
            heapq.heappush(due, (t + rng.uniform(*gap), n, history, left - 1))
    return out


def write_mooncake_trace(path: str | os.PathLike[str], records: Sequence[TraceRecord]) -> None:
    """Write ``records`` as a Mooncake JSON-lines trace (`iter_mooncake_records` reads it back)."""
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for rec in records:
            f.write(encoder.encode(rec) + b"\n")


# --- what any router could reach ------------------------------------------------------------------


class Reachable(msgspec.Struct, frozen=True, kw_only=True):
    """The hits of an infinite cache that sees every request of a workload (module docstring).

    ``cached_tokens``: prompt tokens it finds cached, counted as the engines count them (whole
    blocks, never the last prompt token); ``hit_rate``: that share of ``prompt_tokens``.
    """

    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens (0 for an empty workload)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def reachable_hits(workload: list[WorkloadRequest], block_size: int) -> Reachable:
    """The reachable hits of ``workload`` on engines with ``block_size``-token blocks.

    Requests are taken in arrival order; each finds the longest chain of leading full blocks
    an earlier request stored (a block is its content and its whole prefix, as engines key
    them), capped below the prompt's last token as the engines cap it, then stores its own.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    stored: set[bytes] = set()
    prompt = cached = 0
    for req in sorted(workload, key=lambda r: r.arrival):
        tokens = req.token_ids
        prompt += len(tokens)
        key = b""
        hits = 0
        matching = True
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = array("I", tokens[start : start + block_size]).tobytes()
            key = xxhash.xxh3_128_digest(key + block)
            if matching and start + block_size <= len(tokens) - 1 and key in stored:
                hits += 1
            else:
                matching = False
            stored.add(key)
        cached += hits * block_size
    return Reachable(prompt_tokens=prompt, cached_tokens=cached)


def distinct_blocks(workload: Sequence[WorkloadRequest], block_size: int) -> int:
    """Distinct full blocks (each keyed by its whole prefix, as engines key them) the workload's prompts contain.

    What an infinite cache holds at the end of the workload (outputs aside): its working set.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    seen: set[bytes] = set()
    for req in workload:
        tokens = req.token_ids
        key = b""
        for start in range(0, len(tokens) - block_size + 1, block_size):
            key = xxhash.xxh3_128_digest(key + array("I", tokens[start : start + block_size]).tobytes())
            seen.add(key)
    return len(seen)
