"""`RecoveryMachine.replay_terms` + `on_replay_applied` against `on_replay`, over random answers.

The native receive thread applies an answer itself when the machine's `replay_terms` say a
complete, clean answer would be taken whole, and then tells the machine only a summary
(`on_replay_applied`). That must leave the machine exactly where feeding the same answer to
`on_replay` reply by reply would have: the same state, positions, ts ring, stats and actions
(less the `Apply`, which the thread did), and the same behaviour afterwards. The answers are
random (empty, starting late, with holes, undecodable replies, cut short, from a restarted
engine); the ones the thread would not take whole (`_taken_whole`, the thread's own test in
src/recv/replay.rs) go to `on_replay` in both worlds and need no comparison.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_source import batch_of, items, live, ts_of

from kvroute._source import Action, Apply, SourceMachine

_RING = 8  # small, so answers longer than the ring are drawn too


def _machine(scenario: str, upto: int) -> SourceMachine:
    """A machine with a replay in flight: a cold start's, or a quiet probe's or a reconnect's
    identity check (anchored) after a cold sync through ``upto``."""
    m = SourceMachine(has_replay=True, ts_ring=_RING)
    m.start()
    m.on_reconnected()
    if scenario == "cold":
        return m
    m.on_replay(items(range(upto + 1)), complete=True)
    assert m.state == "synced"
    if scenario == "probe":
        m.on_quiet()
    else:
        m.on_disconnected()
        m.on_reconnected()
    assert m.replay_in_flight is not None
    return m


def _taken_whole(terms: tuple[float | None, bool], from_seq: int, answer: Sequence[Any], complete: bool) -> bool:
    """Whether the thread applies ``answer`` itself (src/recv/replay.rs `Running::whole`)."""
    if not complete or not answer or any(b is None for _, _, b in answer):
        return False
    anchor, late_ok = terms
    first = answer[0][0]
    if anchor is not None:
        starts = first == from_seq and answer[0][1] == anchor
    else:
        starts = first == from_seq or (late_ok and first > from_seq)
    return starts and all(b[0] == a[0] + 1 for a, b in itertools.pairwise(answer))


def _state(m: SourceMachine) -> tuple[Any, ...]:
    """Everything the machine decides by: its phase, positions, ts ring, counters and reports."""
    return (
        m.phase,
        m.state,
        m.partial,
        m.last_seq,
        m.applied,
        m.replay_in_flight,
        m.held,
        m.probe_due,
        m.vouching,
        [m._recorded(s) for s in range(-1, m.last_seq + 2)],  # the ts ring
        msgspec.structs.asdict(m.stats),
    )


def _without_apply(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, Apply)]


@st.composite
def _answers(draw: st.DrawFn) -> tuple[str, int, list[Any], bool]:
    scenario = draw(st.sampled_from(["cold", "probe", "identity"]))
    upto = draw(st.integers(0, 12))
    epoch = draw(st.sampled_from([0, 0, 0, 1]))  # 1: the engine restarted since
    late = draw(st.sampled_from([0, 0, 0, 1, 3]))  # the buffer no longer reaches back
    n = draw(st.integers(0, 2 * _RING + 2))
    from_seq = 0 if scenario == "cold" else upto
    seqs = list(range(from_seq + late, from_seq + late + n))
    holes = draw(st.sets(st.sampled_from(seqs), max_size=2)) if seqs and draw(st.integers(0, 3)) == 0 else set()
    bad = draw(st.sets(st.sampled_from(seqs), max_size=1)) if seqs and draw(st.integers(0, 5)) == 0 else set()
    answer = [(s, ts_of(s, epoch), None if s in bad else batch_of(s, epoch)) for s in seqs if s not in holes]
    complete = draw(st.integers(0, 4)) > 0
    return scenario, upto, answer, complete


@settings(max_examples=400, deadline=None)
@given(_answers())
def test_an_answer_applied_whole_leaves_the_machine_where_on_replay_would(
    case: tuple[str, int, list[Any], bool],
) -> None:
    scenario, upto, answer, complete = case
    summarised, replied = _machine(scenario, upto), _machine(scenario, upto)
    terms = summarised.replay_terms()
    assert terms is not None  # nothing held, nothing moot: every scenario here may be taken whole
    req = summarised.replay_in_flight
    assert req is not None
    if not _taken_whole(terms, req.from_seq, answer, complete):
        event("not taken whole")
        return
    event(f"{scenario}: taken whole, {'late' if answer[0][0] > req.from_seq else 'from the start'}")
    anchor, _ = terms
    run = answer[1:] if anchor is not None else answer
    first, last = (run[0][0], run[-1][0]) if run else (req.from_seq + 1, req.from_seq)
    got = summarised.on_replay_applied(first, last, [(s, ts) for s, ts, _ in run][-4096:], len(run))
    want = replied.on_replay(answer, complete=True)
    # What the thread applied is what the machine would have applied, nothing else differs.
    assert [s for a in want if isinstance(a, Apply) for s, _, _ in a.items] == [s for s, _, _ in run]
    assert got == _without_apply(want)
    assert _state(summarised) == _state(replied)
    # And afterwards: the next live batch, a duplicate of the newest, and a quiet tick.
    epoch = 1 if answer and answer[0][1] != ts_of(answer[0][0]) else 0
    newest = max(summarised.last_seq, 0)
    for step in (
        lambda m: live(m, m.last_seq + 1, epoch),
        lambda m: m.on_live(newest, ts_of(newest, epoch), batch_of(newest, epoch)),
        lambda m: m.on_quiet(),
    ):
        assert step(summarised) == step(replied)
        assert _state(summarised) == _state(replied)
