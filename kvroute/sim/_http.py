"""The simulated engines' HTTP side: a small HTTP/1.1 server on anyio and the OpenAI-style routes.

`HttpServer` speaks enough HTTP/1.1 for routers and load generators (RFC 9112): persistent
connections, ``Content-Length`` bodies (``Expect: 100-continue`` honoured), chunked *responses*
for streaming, ``HEAD``; bounded head and body sizes and timeouts; a clear 4xx for anything it
will not take (chunked request bodies get 411, as servers that need a length answer).

`EngineApp` serves a `SimEngine` the way vLLM's (and SGLang's) OpenAI server does:

- ``POST /v1/completions`` — ``prompt`` is a list of token ids, or text split by the trivial
  tokenizer (`tokenize`); ``max_tokens`` (default 16); ``model`` (the served model or one of
  its LoRA adapters); ``stream`` (SSE, with ``stream_options.include_usage``);
  ``return_token_ids`` (vLLM); the DP rank from the ``X-data-parallel-rank`` header (vLLM)
  or the ``data_parallel_rank`` field (SGLang), else the least loaded rank. It answers after
  the simulated time with ``usage.prompt_tokens_details.cached_tokens``, plus a ``sim``
  object (rank, queue time, TTFT, latency in seconds).
- ``POST /v1/chat/completions`` — ``messages`` rendered by the trivial chat template
  (`render_chat`: ``<|role|>`` then the content, per message, then ``<|assistant|>``) and
  tokenized by `tokenize`; the rest as for completions (``max_completion_tokens`` too), answers
  ``chat.completion`` objects or, streamed, ``chat.completion.chunk`` deltas.
- ``POST /tokenize`` — vLLM's: ``{"prompt": text}`` or ``{"messages": [...]}`` (the chat template
  applied) -> ``{"count", "max_model_len", "tokens"}``: how a router gets the token ids the engine
  will see (one round trip; the engine's own tokenizer and template, so the ids match its cache).
- ``GET /metrics``: Prometheus gauges per rank under the engine's own names (`SimEngine.prometheus_metrics`).
- ``GET /health``, ``GET /v1/models``, ``GET /kv_event_sources`` (vLLM's HTTP mirror of gRPC
  discovery), ``GET /get_server_info`` (SGLang), ``POST /reset_prefix_cache`` (vLLM) and
  ``POST /flush_cache`` (SGLang): reset every rank's prefix cache (AllBlocksCleared).
"""

from __future__ import annotations

import email.utils
import logging
import re
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from .._errors import KvRouteError
from ._cache import CapacityError, InvalidRequestError
from ._request import SimConfig, SimRequest

__all__ = ["EngineApp", "HttpRequest", "HttpServer", "Responder", "detokenize", "render_chat", "tokenize"]

log = logging.getLogger("kvroute.sim.http")

_REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
# RFC 9110 §5.1: a field name is a token.
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
# ASCII digits only: str.isdigit() accepts "²", which int() then rejects.
_DIGITS = re.compile(r"^[0-9]{1,18}$")


class HttpError(KvRouteError):
    """A request the server refuses: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class HttpRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One parsed request; header names are lower-cased (a repeated header keeps the last value)."""

    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    body: bytes


class Responder:
    """How a handler answers: `send` a whole response, or `start_stream` / `write` / `end` a chunked one."""

    def __init__(self, stream: anyio.abc.ByteSendStream, *, version: str, keep_alive: bool, head: bool) -> None:
        self._stream = stream
        self._chunked = version == "HTTP/1.1"
        self.keep_alive = keep_alive
        self._head = head
        #: True once the status line went out (a handler failing later can only close).
        self.started = False
        self._open_stream = False

    def _head_bytes(self, status: int, headers: Sequence[tuple[str, str]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", f"Date: {email.utils.formatdate(usegmt=True)}"]
        lines += [f"{k}: {v}" for k, v in headers]
        lines.append(f"Connection: {'keep-alive' if self.keep_alive else 'close'}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/json",
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Send a complete response."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        all_headers = [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers]
        await self._stream.send(self._head_bytes(status, all_headers) + (b"" if self._head else body))

    async def start_stream(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        """Start a streamed response: chunked on HTTP/1.1, delimited by closing the connection on 1.0."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self._open_stream = True
        headers = [("Content-Type", content_type), ("Cache-Control", "no-cache")]
        if self._chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        else:
            self.keep_alive = False
        await self._stream.send(self._head_bytes(status, headers))

    async def write(self, data: bytes) -> None:
        """Send one piece of a streamed response."""
        if not self._open_stream:
            raise RuntimeError("no stream started")
        if not data or self._head:
            return
        await self._stream.send(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)

    async def end(self) -> None:
        """Finish a streamed response."""
        if not self._open_stream:
            raise RuntimeError("no stream started")
        self._open_stream = False
        if self._chunked and not self._head:
            await self._stream.send(b"0\r\n\r\n")

    @property
    def unfinished(self) -> bool:
        """True while a streamed response is open (the connection cannot be reused)."""
        return self._open_stream


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


def _parse_head(head: bytes) -> tuple[str, str, str, str, dict[str, str]]:
    lines = head.lstrip(b"\r\n").split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise HttpError(400, "malformed request line")
    method, target, version = (p.decode("latin-1") for p in parts)
    if not _TOKEN.match(parts[0]):
        raise HttpError(400, "malformed method")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, f"unsupported version {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        # Obsolete line folding and whitespace before the colon are rejected (RFC 9112 §5).
        if not sep or not _TOKEN.match(name):
            raise HttpError(400, "malformed header line")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != text:
            raise HttpError(400, "conflicting Content-Length headers")
        headers[key] = text
    path, _, query = target.partition("?")
    return method, path, query, version, headers


class HttpServer:
    """A minimal HTTP/1.1 server calling ``handler`` for each request; see the module docstring.

    Run it with ``port = await task_group.start(server.serve)``; cancel the task group to stop.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_head_bytes: int = 16 * 1024,
        max_body_bytes: int = 4 * 1024 * 1024,
        idle_timeout: float = 60.0,
        read_timeout: float = 30.0,
    ) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        # 16 KiB of headers: the order of common servers' defaults (nginx 8-32 KiB, uvicorn's h11 16 KiB).
        self.max_head_bytes = max_head_bytes
        # 4 MiB holds a 128k-token prompt as JSON ids; anything bigger is not a prompt.
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the bound port through ``task_status``, and serve until cancelled."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        async with listener:
            port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
            async with anyio.create_task_group() as tg:
                task_status.started(port)
                await listener.serve(self._connection, task_group=tg)

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                await self._serve_connection(stream)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError):
                pass  # the client went away
            except Exception:
                # One connection's failure must not take the engine (this task group) down.
                log.exception("simulated engine: HTTP connection failed")

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        while True:
            try:
                with anyio.fail_after(self.idle_timeout):
                    head = await reader.receive_until(b"\r\n\r\n", self.max_head_bytes)
            except (anyio.IncompleteRead, TimeoutError):
                return  # closed between requests, or idle too long: just close
            except anyio.DelimiterNotFound:
                head = None
            # receive_until returns a head that arrived whole even when it is longer than asked.
            if head is None or len(head) > self.max_head_bytes:
                await self._refuse(stream, HttpError(431, f"request head exceeds {self.max_head_bytes} bytes"))
                return
            try:
                request, keep_alive = await self._read_request(stream, reader, head)
            except HttpError as exc:
                await self._refuse(stream, exc)
                return
            responder = Responder(stream, version=request.version, keep_alive=keep_alive, head=request.method == "HEAD")
            try:
                await self.handler(request, responder)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                raise
            except Exception:
                log.exception("simulated engine: handler failed on %s %s", request.method, request.path)
                if responder.started:
                    return
                responder.keep_alive = False
                await responder.send(500, _error_body(500, "internal error"))
                return
            if not responder.started:
                await responder.send(500, _error_body(500, "no response"))
            if not responder.keep_alive or responder.unfinished:
                return

    async def _read_request(
        self, stream: anyio.abc.SocketStream, reader: BufferedByteReceiveStream, head: bytes
    ) -> tuple[HttpRequest, bool]:
        method, path, query, version, headers = _parse_head(head)
        if version == "HTTP/1.1" and "host" not in headers:
            raise HttpError(400, "missing Host header")  # RFC 9112 §3.2
        if "transfer-encoding" in headers:
            raise HttpError(411, "send the body with Content-Length")
        length_text = headers.get("content-length", "0")
        if not _DIGITS.match(length_text):
            raise HttpError(400, "malformed Content-Length")
        length = int(length_text)
        if length > self.max_body_bytes:
            raise HttpError(413, f"body exceeds {self.max_body_bytes} bytes")
        if length and headers.get("expect", "").lower() == "100-continue" and version == "HTTP/1.1":
            await stream.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            with anyio.fail_after(self.read_timeout):
                body = await reader.receive_exactly(length) if length else b""
        except TimeoutError:
            raise HttpError(408, "body not received in time") from None
        except anyio.IncompleteRead:
            raise anyio.EndOfStream from None
        connection = headers.get("connection", "").lower()
        keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
        request = HttpRequest(method=method, path=path, query=query, version=version, headers=headers, body=body)
        return request, keep_alive

    @staticmethod
    async def _refuse(stream: anyio.abc.SocketStream, exc: HttpError) -> None:
        responder = Responder(stream, version="HTTP/1.1", keep_alive=False, head=False)
        await responder.send(exc.status, _error_body(exc.status, exc.message))


# --- the trivial tokenizer --------------------------------------------------------------------

_TOKEN_WORD = re.compile(r"^tok(0|[1-9][0-9]{0,8})$")


def tokenize(text: str, vocab_size: int) -> list[int]:
    """Split ``text`` on whitespace into one token per word.

    ``tokN`` is token N (when N < vocab_size); any other word is its CRC32 mod vocab_size.

    Deterministic across processes and machines, and `detokenize` output tokenizes back to
    the same ids, so a multi-turn conversation sent as text keeps its token prefix.
    """
    out = []
    for word in text.split():
        m = _TOKEN_WORD.match(word)
        if m is not None and int(m.group(1)) < vocab_size:
            out.append(int(m.group(1)))
        else:
            out.append(zlib.crc32(word.encode("utf-8")) % vocab_size)
    return out


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """The trivial chat template: ``<|role|> content`` per (role, content) message, then ``<|assistant|>``.

    A conversation's next request repeats the earlier messages, so its rendering (and token ids)
    extends the previous one's, as a real chat template's does.
    """
    return " ".join(f"<|{role}|> {content}" for role, content in messages) + " <|assistant|>"


def detokenize(token_ids: Sequence[int]) -> str:
    """The text of generated tokens: `` tokN`` per token (leading space, as completion text continues a prompt)."""
    return "".join(f" tok{t}" for t in token_ids)


# --- the OpenAI-style app ------------------------------------------------------------------------


class _StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _CompletionBody(msgspec.Struct, kw_only=True):
    prompt: Any = None
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    return_token_ids: bool = False
    data_parallel_rank: int | None = None


class _Message(msgspec.Struct, kw_only=True):
    role: str
    content: Any = None


class _ChatBody(msgspec.Struct, kw_only=True):
    messages: list[_Message]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    data_parallel_rank: int | None = None


class _TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None


class _TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class _ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class _ChatChoice(msgspec.Struct):
    index: int
    message: _ChatMessage | None = None
    delta: _ChatMessage | None = None
    finish_reason: str | None = None
    logprobs: None = None


class _ChatResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: _Usage | None = None
    sim: _SimInfo | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptDetails


class _Choice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: None = None
    token_ids: list[int] | None = None


class _SimInfo(msgspec.Struct):
    rank: int
    queue_time: float
    ttft: float
    latency: float


class _CompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[_Choice]
    usage: _Usage | None = None
    sim: _SimInfo | None = None


class _ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class _ModelList(msgspec.Struct):
    object: str
    data: list[_ModelCard]


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
_json = msgspec.json.Encoder()
_body_decoder = msgspec.json.Decoder(_CompletionBody)
_chat_decoder = msgspec.json.Decoder(_ChatBody)
_tokenize_decoder = msgspec.json.Decoder(_TokenizeBody)
# OpenAI's default for /v1/completions when max_tokens is omitted.
_DEFAULT_MAX_TOKENS = 16


def _error_body(status: int, message: str) -> bytes:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return _json.encode(_ErrorBody(_ErrorDetail(message, kind, None, status)))


class ServedEngine(Protocol):
    """What `EngineApp` asks of the engine it serves (a `SimEngine`, which starts it; hence not imported here)."""

    config: SimConfig

    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        rank: int | None = None,
        lora_name: str | None = None,
        stream: bool = False,
    ) -> SimRequest: ...

    def abort(self, req: SimRequest) -> None: ...

    def kv_events_configs(self) -> dict[str, dict[str, object]]: ...

    def server_info_json(self) -> str: ...

    def reset_prefix_cache(self) -> bool: ...

    def prometheus_metrics(self) -> str: ...


class EngineApp:
    """The HTTP routes of a `SimEngine` (module docstring); pass `handle` to an `HttpServer`."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine
        self._created = int(time.time())
        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
            "/tokenize": {"POST": self._tokenize},
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/metrics": {"GET": self._metrics},
            "/reset_prefix_cache": {"POST": self._reset},
            "/flush_cache": {"POST": self._reset, "GET": self._reset},
        }
        if engine.config.engine == "vllm":
            self._routes["/kv_event_sources"] = {"GET": self._kv_event_sources}
        else:
            self._routes["/get_server_info"] = {"GET": self._server_info}

    async def handle(self, request: HttpRequest, respond: Responder) -> None:
        """Dispatch one request to its route (404 / 405 otherwise)."""
        methods = self._routes.get(request.path)
        if methods is None:
            await respond.send(404, _error_body(404, f"no route {request.path}"))
            return
        method = "GET" if request.method == "HEAD" else request.method
        route = methods.get(method)
        if route is None:
            allow = ", ".join(sorted(methods))
            await respond.send(405, _error_body(405, f"use {allow}"), headers=[("Allow", allow)])
            return
        try:
            await route(request, respond)
        except HttpError as exc:
            await respond.send(exc.status, _error_body(exc.status, exc.message))

    async def _health(self, request: HttpRequest, respond: Responder) -> None:
        await respond.send(200, b"", content_type="text/plain")

    async def _models(self, request: HttpRequest, respond: Responder) -> None:
        cfg = self.engine.config
        max_len = cfg.capacity_blocks * cfg.block_size
        cards = [_ModelCard(cfg.model, "model", self._created, cfg.engine, cfg.model, None, max_len)]
        cards += [
            _ModelCard(name, "model", self._created, cfg.engine, cfg.model, cfg.model, max_len)
            for name in cfg.lora_names
        ]
        await respond.send(200, _json.encode(_ModelList("list", cards)))

    async def _metrics(self, request: HttpRequest, respond: Responder) -> None:
        body = self.engine.prometheus_metrics().encode()
        await respond.send(200, body, content_type="text/plain; version=0.0.4; charset=utf-8")

    async def _kv_event_sources(self, request: HttpRequest, respond: Responder) -> None:
        await respond.send(200, _json.encode(self.engine.kv_events_configs()))

    async def _server_info(self, request: HttpRequest, respond: Responder) -> None:
        await respond.send(200, self.engine.server_info_json().encode())

    async def _reset(self, request: HttpRequest, respond: Responder) -> None:
        done = self.engine.reset_prefix_cache()
        await respond.send(200 if done else 400, _json.encode({"success": done}))

    def _chat_prompt(self, messages: Sequence[_Message]) -> list[int]:
        rendered = []
        for m in messages:
            content = m.content
            if isinstance(content, list):  # OpenAI content parts: the text ones, in order
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise HttpError(400, "message content must be a string or a list of text parts")
            rendered.append((m.role, content))
        if not rendered:
            raise HttpError(400, "messages must not be empty")
        return tokenize(render_chat(rendered), self.engine.config.vocab_size)

    async def _tokenize(self, request: HttpRequest, respond: Responder) -> None:
        try:
            body = _tokenize_decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"invalid JSON body: {exc}") from None
        if (body.prompt is None) == (body.messages is None):
            raise HttpError(400, "give either prompt or messages")
        cfg = self.engine.config
        if body.messages is not None:
            tokens = self._chat_prompt(body.messages)
        else:
            tokens = tokenize(body.prompt or "", cfg.vocab_size)
        answer = _TokenizeResponse(len(tokens), cfg.capacity_blocks * cfg.block_size, tokens)
        await respond.send(200, _json.encode(answer))

    async def _chat(self, request: HttpRequest, respond: Responder) -> None:
        try:
            body = _chat_decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"invalid JSON body: {exc}") from None
        tokens = self._chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        as_completion = _CompletionBody(
            prompt=tokens,
            model=body.model,
            max_tokens=max_tokens,
            stream=body.stream,
            stream_options=body.stream_options,
            data_parallel_rank=body.data_parallel_rank,
        )
        await self._serve(request, respond, as_completion, chat=True)

    def _prompt(self, body: _CompletionBody) -> list[int]:
        prompt = body.prompt
        vocab = self.engine.config.vocab_size
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tokens = tokenize(prompt, vocab)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            tokens = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise HttpError(400, "only one prompt per request is supported")
        else:
            raise HttpError(400, "prompt must be a string or a list of token ids")
        if not tokens:
            raise HttpError(400, "prompt is empty")
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HttpError(400, f"token id {bad} is out of vocabulary (size {vocab})")
        return tokens

    def _rank(self, request: HttpRequest, body: _CompletionBody) -> int | None:
        header = request.headers.get("x-data-parallel-rank")
        if header is None:
            return body.data_parallel_rank
        if not _DIGITS.match(header.strip()):
            raise HttpError(400, "X-data-parallel-rank must be a non-negative integer")
        return int(header)

    async def _completions(self, request: HttpRequest, respond: Responder) -> None:
        try:
            body = _body_decoder.decode(request.body)
        except msgspec.DecodeError as exc:
            raise HttpError(400, f"invalid JSON body: {exc}") from None
        await self._serve(request, respond, body, chat=False)

    async def _serve(self, request: HttpRequest, respond: Responder, body: _CompletionBody, *, chat: bool) -> None:
        cfg = self.engine.config
        tokens = self._prompt(body)
        model = body.model or cfg.model
        if model != cfg.model and model not in cfg.lora_names:
            raise HttpError(404, f"The model `{model}` does not exist.")
        lora = model if model != cfg.model else None
        max_tokens = _DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens < 1:
            raise HttpError(400, "max_tokens must be at least 1")
        try:
            req = self.engine.submit(
                tokens, max_tokens, rank=self._rank(request, body), lora_name=lora, stream=body.stream
            )
        except (CapacityError, InvalidRequestError) as exc:
            raise HttpError(400, str(exc)) from None
        try:
            if body.stream and chat:
                await self._chat_stream(req, model, body, respond)
            elif body.stream:
                await self._stream(req, model, body, respond)
            elif chat:
                result = await req.result()
                chat_response = _ChatResponse(
                    id=f"chatcmpl-{req.request_id}",
                    object="chat.completion",
                    created=int(time.time()),
                    model=model,
                    choices=[
                        _ChatChoice(
                            0,
                            message=_ChatMessage("assistant", detokenize(result.output_token_ids)),
                            finish_reason=result.finish_reason,
                        )
                    ],
                    usage=_usage(result.prompt_tokens, result.cached_tokens, len(result.output_token_ids)),
                    sim=_SimInfo(result.rank, result.queue_time, result.ttft, result.latency),
                )
                await respond.send(200, _json.encode(chat_response))
            else:
                result = await req.result()
                response = _CompletionResponse(
                    id=f"cmpl-{req.request_id}",
                    object="text_completion",
                    created=int(time.time()),
                    model=model,
                    choices=[
                        _Choice(
                            0,
                            detokenize(result.output_token_ids),
                            finish_reason=result.finish_reason,
                            token_ids=result.output_token_ids if body.return_token_ids else None,
                        )
                    ],
                    usage=_usage(result.prompt_tokens, result.cached_tokens, len(result.output_token_ids)),
                    sim=_SimInfo(result.rank, result.queue_time, result.ttft, result.latency),
                )
                await respond.send(200, _json.encode(response))
        except KvRouteError as exc:  # aborted: the engine restarted or stopped
            if respond.started:
                respond.keep_alive = False
                return
            await respond.send(503, _error_body(503, str(exc)))
        finally:
            self.engine.abort(req)

    async def _stream(self, req: SimRequest, model: str, body: _CompletionBody, respond: Responder) -> None:
        created = int(time.time())
        rid = f"cmpl-{req.request_id}"
        await respond.start_stream()
        async for token in req.tokens():
            chunk = _CompletionResponse(
                id=rid,
                object="text_completion",
                created=created,
                model=model,
                choices=[_Choice(0, detokenize([token]), token_ids=[token] if body.return_token_ids else None)],
            )
            await respond.write(b"data: " + _json.encode(chunk) + b"\n\n")
        result = await req.result()
        last = _CompletionResponse(
            id=rid,
            object="text_completion",
            created=created,
            model=model,
            choices=[_Choice(0, "", finish_reason=result.finish_reason)],
        )
        await respond.write(b"data: " + _json.encode(last) + b"\n\n")
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _CompletionResponse(
                id=rid,
                object="text_completion",
                created=created,
                model=model,
                choices=[],
                usage=_usage(result.prompt_tokens, result.cached_tokens, len(result.output_token_ids)),
                sim=_SimInfo(result.rank, result.queue_time, result.ttft, result.latency),
            )
            await respond.write(b"data: " + _json.encode(usage) + b"\n\n")
        await respond.write(b"data: [DONE]\n\n")
        await respond.end()

    async def _chat_stream(self, req: SimRequest, model: str, body: _CompletionBody, respond: Responder) -> None:
        created = int(time.time())
        rid = f"chatcmpl-{req.request_id}"

        def chunk(delta: _ChatMessage | None, finish: str | None = None) -> bytes:
            choices = [] if delta is None else [_ChatChoice(0, delta=delta, finish_reason=finish)]
            return (
                b"data: " + _json.encode(_ChatResponse(rid, "chat.completion.chunk", created, model, choices)) + b"\n\n"
            )

        await respond.start_stream()
        first = True
        async for token in req.tokens():
            if first:  # vLLM sends the role with the first output, after the prefill
                first = False
                await respond.write(chunk(_ChatMessage(role="assistant", content="")))
            await respond.write(chunk(_ChatMessage(content=detokenize([token]))))
        result = await req.result()
        await respond.write(chunk(_ChatMessage(), result.finish_reason))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _ChatResponse(
                rid,
                "chat.completion.chunk",
                created,
                model,
                [],
                usage=_usage(result.prompt_tokens, result.cached_tokens, len(result.output_token_ids)),
                sim=_SimInfo(result.rank, result.queue_time, result.ttft, result.latency),
            )
            await respond.write(b"data: " + _json.encode(usage) + b"\n\n")
        await respond.write(b"data: [DONE]\n\n")
        await respond.end()


def _usage(prompt: int, cached: int, completion: int) -> _Usage:
    return _Usage(prompt, completion, prompt + completion, _PromptDetails(cached))
