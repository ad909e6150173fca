"""The simulated engines' OpenAI-compatible server, driven by the ``openai`` client: chat, streaming, /tokenize."""

from __future__ import annotations

import httpx
import pytest
from openai import AsyncOpenAI

from kvroute.sim import SimConfig, SimEngine, render_chat, tokenize

pytestmark = pytest.mark.anyio

SYSTEM = "You answer in one word. " * 30


async def test_chat_completions_whole_and_streamed_with_cached_tokens() -> None:
    # Each client is closed inside its own test: one left to the garbage collector closes its trio-bound
    # connections from whatever event loop runs then (the next test's asyncio loop) and fails that test.
    async with (
        SimEngine(SimConfig(engine="vllm", ranks=2)) as engine,
        AsyncOpenAI(base_url=f"{engine.http_url}/v1", api_key="unused", max_retries=0) as openai,
    ):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
        first = await openai.chat.completions.create(
            model="sim-model",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=5,
            extra_headers={"X-data-parallel-rank": "1"},
        )
        reply = first.choices[0].message
        assert reply.role == "assistant" and reply.content and len(reply.content.split()) == 5
        assert first.object == "chat.completion" and first.choices[0].finish_reason == "length"
        prompt = tokenize(render_chat([(m["role"], m["content"]) for m in messages]), engine.config.vocab_size)
        assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
        assert engine.cache(1).match_blocks(prompt) == len(prompt) // 16  # rank 1 (the header) holds it

        # The next turn repeats the conversation: streamed, on the same rank, it finds the history cached.
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "and then?"}]
        stream = await openai.chat.completions.create(
            model="sim-model",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"data_parallel_rank": 1},
        )
        chunks = [chunk async for chunk in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        assert len("".join(d.content or "" for d in deltas).split()) == 4
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == len(prompt) // 16 * 16


async def test_completions_streamed_and_tokenize_agree_with_the_engine() -> None:
    async with (
        SimEngine(SimConfig(engine="sglang")) as engine,
        httpx.AsyncClient() as http,
        AsyncOpenAI(base_url=f"{engine.http_url}/v1", api_key="unused", max_retries=0) as openai,
    ):
        text = "tok1 tok2 hello world " * 20
        stream = await openai.completions.create(model="sim-model", prompt=text, max_tokens=3, stream=True)
        pieces = [c.choices[0].text async for c in stream if c.choices]
        assert len("".join(pieces).split()) == 3
        answer = (await http.post(f"{engine.http_url}/tokenize", json={"prompt": text})).json()
        assert answer["tokens"] == tokenize(text, engine.config.vocab_size) and answer["count"] == 80
        assert engine.cache().match_blocks(answer["tokens"]) == 80 // 16  # what /tokenize gave is what it cached
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        tokens = (await http.post(f"{engine.http_url}/tokenize", json=chat)).json()["tokens"]
        assert tokens == tokenize("<|user|> hi <|assistant|>", engine.config.vocab_size)
        bad = await http.post(f"{engine.http_url}/tokenize", json={"prompt": "a", "messages": []})
        assert bad.status_code == 400
        metrics = (await http.get(f"{engine.http_url}/metrics")).text
        assert 'sglang:num_running_reqs{engine_type="unified",model_name="sim-model"' in metrics
