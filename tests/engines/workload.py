"""The request stream every engine run replays: engine-neutral, seeded, bounded.

Shared system prompts, multi-turn sessions (each turn's prompt = the previous prompt + the engine's
output + a new user turn), exact repeats, and per-configuration namespaces (LoRA adapters, cache salts,
multimodal items whose placeholder tokens are identical across images, so only the item's identity
tells two prompts apart). With ``align`` every prompt is a whole number of ``align``-token blocks (the new
user turn is lengthened to the boundary), the case where the engine's last-token rule costs a block; with
``past`` too, every prompt ends ``past`` tokens after such a boundary (``past=1``: the prompt minus its last
token is whole blocks, where SGLang's EAGLE bigram view costs a page).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from harness import Mm

# Placeholder token of an image: the same for every image, as in a real multimodal prompt.
IMAGE_TOKEN = 7


@dataclass(frozen=True)
class Namespaces:
    """Which namespaces a configuration's sessions draw from (None = plain)."""

    loras: tuple[str | None, ...] = (None,)
    salts: tuple[str | None, ...] = (None,)
    images: tuple[str | None, ...] = (None,)


@dataclass
class Req:
    """One request as a client sends it."""

    rid: str
    prompt: list[int]
    max_tokens: int
    lora: str | None = None
    salt: str | None = None
    mm: list[Mm] = field(default_factory=list)
    session: int = -1
    report: bool = False  # vLLM: kv_cache_report_mode "full"
    of: str | None = None  # an exact repeat: the request it repeats


@dataclass
class _Session:
    history: list[int]
    lora: str | None
    salt: str | None
    mm: list[Mm]


class Workload:
    """Generates requests; `finish` feeds the engine's output back into the request's session."""

    def __init__(self, seed: int, ns: Namespaces, *, n_system: int = 4, vocab: int = 5000, align: int = 0,
                 past: int = 0) -> None:
        self._rng = random.Random(seed)
        self._align = align
        self._past = past
        self._ns = ns
        self._vocab = vocab
        self._systems = [self._tokens(self._rng.randint(48, 260)) for _ in range(n_system)]
        self._sessions: list[_Session] = []
        self._done: list[Req] = []
        self._n = 0

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.randint(100, self._vocab) for _ in range(n)]

    def _turn(self, before: int, n: int) -> list[int]:
        """A new user turn of about ``n`` tokens after ``before`` tokens (ending ``past`` tokens after a
        block boundary when aligned)."""
        if self._align:
            n += -(before + n - self._past) % self._align
        return self._tokens(n)

    def next(self) -> Req:
        """The next request: an exact repeat, a session's next turn, or a new session."""
        rng = self._rng
        self._n += 1
        rid = f"r{self._n}"
        roll = rng.random()
        if self._done and roll < 0.12:
            old = rng.choice(self._done)
            return Req(rid, list(old.prompt), rng.randint(1, 24), old.lora, old.salt, list(old.mm), -1, of=old.rid)
        if self._sessions and roll < 0.6:
            sid = rng.randrange(len(self._sessions))
            s = self._sessions[sid]
            if len(s.history) < 900:
                prompt = s.history + self._turn(len(s.history), rng.randint(4, 60))
                return Req(rid, prompt, rng.randint(1, 40), s.lora, s.salt, list(s.mm), sid)
        lora = rng.choice(self._ns.loras)
        salt = rng.choice(self._ns.salts)
        image = rng.choice(self._ns.images)
        prompt = list(rng.choice(self._systems))
        mm: list[Mm] = []
        if image is not None:
            # The image sits in the first user turn, after a few text tokens.
            prompt += self._tokens(rng.randint(0, 20))
            length = rng.randint(12, 40)
            mm.append(Mm(image, len(prompt), length))
            prompt += [IMAGE_TOKEN] * length
        prompt += self._turn(len(prompt), rng.randint(4, 60))
        self._sessions.append(_Session([], lora, salt, mm))
        return Req(rid, prompt, rng.randint(1, 40), lora, salt, mm, len(self._sessions) - 1)

    def output(self, n: int) -> list[int]:
        """``n`` tokens the 'model' generates."""
        return self._tokens(n)

    def finish(self, req: Req, all_tokens: list[int]) -> None:
        """Record a finished request: its session continues from prompt + output."""
        self._done.append(req)
        if req.session >= 0:
            self._sessions[req.session].history = list(all_tokens)
