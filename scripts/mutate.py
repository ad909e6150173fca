"""Mutation check: break each rule kvroute keeps on purpose and report which tests notice.

Each `Mutation` replaces one exact piece of source text (it must occur exactly once) with a
deliberately wrong one. The script copies the repository's tracked files to a temporary
directory, applies one mutation to the copy, runs the mutation's tests against the copy
(``PYTHONPATH`` points at it, and the script checks that ``kvroute`` imports from there; the
compiled core is built into the copy, and rebuilt for a mutation of the Rust sources), and
records which tests fail. The working tree is never modified, so an interrupted run (Ctrl-C,
SIGTERM, a crash) cannot leave it broken; the copy is removed on the way out. The baseline
(no mutation) runs first: a test that fails there is reported and ignored.

Each test is classed as a socket-level / end-to-end test (every anyio test: real ZMQ / gRPC
sockets, simulated engines; and the example and demo programs) or a unit test (the rest: the
sans-I/O machine, the index, the codec). A
mutation lists the socket-level tests that claim to check its rule (``claims``); the report
marks each that passes under the mutation as SURVIVED. The aim: every mutation caught by at
least one socket-level test, and no claiming test surviving.

Usage (from the repository root, with the test dependencies installed)::

    python scripts/mutate.py                 # every mutation
    python scripts/mutate.py clear lost-tail # some, by name
    python scripts/mutate.py --list          # names and rules

Adding a rule: append one `Mutation` to `MUTATIONS` (name, rule, file, the exact text to
break, its broken form, the tests to run, the socket-level tests that claim the rule). A rule
is broken where it is kept: the prefix index's and the wire decoder's in the Rust crate
(src/index/, src/wire.rs, src/wire/; their broken form must compile, the copy's core is rebuilt), the
receive path's in kvroute/_transports/zmq/ (the in-order fast path applies through
``PrefixIndex.apply_payload``), the recovery rules in kvroute/_source.py and its replay side,
kvroute/_replay_answers.py.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Test files whose tests run real processes end to end without being async (anyio) tests.
END_TO_END_FILES = frozenset({"test_examples.py", "test_demo.py"})


@dataclass(frozen=True)
class Mutation:
    """One deliberate bug: ``old`` (exactly once in ``file``) becomes ``new``."""

    name: str
    rule: str
    file: str
    old: str
    new: str
    #: pytest arguments selecting what to run (files or node ids); unit and socket tests both.
    tests: tuple[str, ...]
    #: Socket-level tests (node-id prefixes) that claim to check this rule: each must fail.
    claims: tuple[str, ...] = field(default=())
    #: A ``-k`` expression for the engine-conformance stage (tests/engines/run.sh, the engines' own
    #: cache code in their cached venvs); a failing run counts as the test ``tests/engines::<expr>``.
    engines: str | None = None
    #: Environment for this mutation's test run, e.g. the receiver a rule lives in: the tests run on
    #: the default (native) receiver, so a rule of the Python receiver's is checked on that one.
    env: tuple[tuple[str, str], ...] = ()


#: The Python receiver for the socket tests (tests/_publisher_helpers.py FAST), as CI's second pass runs them.
PYTHON_RECEIVER = (("KVROUTE_TEST_RECEIVER", "python"),)


MUTATIONS: list[Mutation] = [
    Mutation(
        "over-claim",
        "the index never claims a block a worker does not hold",
        "src/index/query.rs",
        "                self.rows.push((slot, value, bs));\n",
        "                self.rows.push((slot, value + 1, bs));\n",
        ("tests/test_index.py", "tests/test_client.py", "tests/test_sim_engine.py", "tests/test_warm_restart.py"),
        (
            "tests/test_client.py::test_cold_start_with_history",
            "tests/test_client.py::test_drops_inside_buffer_are_replayed",
            "tests/test_sim_engine.py::test_kvroute_client_index_converges_to_the_engines_ground_truth",
            "tests/test_warm_restart.py::test_warm_resume_replays_only_the_gap",
        ),
    ),
    Mutation(
        "lost-tail",
        "rule 8: a quiet source is probed, and the probe recovers a lost tail",
        "kvroute/_source.py",
        '        self._request_probe("probe", out)\n        return self._done(before, out)',
        "        return self._done(before, out)",
        ("tests/test_source.py", "tests/test_client.py"),
        ("tests/test_client.py::test_lost_tail_then_silence",),
    ),
    Mutation(
        "contiguity",
        "rule 1/3: only the batch that continues the applied run is applied; a hole is replayed first",
        "kvroute/_source.py",
        "            seq == self.last_seq + 1\n            and seq != REPLAY_END_SEQ",
        "            seq > self.last_seq\n            and seq != REPLAY_END_SEQ",
        ("tests/test_source.py", "tests/test_client.py"),
        ("tests/test_client.py::test_drops_inside_buffer_are_replayed",),
    ),
    Mutation(
        "identity-by-ts",
        "rule 7: an identity check compares the replayed seq's ts with the applied one",
        "kvroute/_replay_answers.py",
        "if seq != req.from_seq or batch is None or ts != anchor_ts:",
        "if seq != req.from_seq or batch is None:",
        ("tests/test_source.py", "tests/test_client.py", "tests/test_warm_restart.py", "tests/test_chaos.py"),
        (
            "tests/test_client.py::test_killed_and_restarted_on_the_same_port_silently",
            "tests/test_warm_restart.py::test_engine_restarted_while_the_router_was_down",
            "tests/test_chaos.py",
        ),
    ),
    Mutation(
        "unknown-parent",
        "a block whose parent is unknown (and its descendants) is never claimed",
        "src/index/store.rs",
        "                    self.unknown_parent += n as u64;\n                    None\n",
        "                    self.unknown_parent += n as u64;\n"
        "                    Some(self.root(ns.lora.as_deref(), ns.salt.as_deref()))\n",
        ("tests/test_index.py", "tests/test_client.py", "tests/test_sim_engine.py"),
        (
            "tests/test_client.py::test_drops_past_the_buffer_reset_without_overclaiming",
            "tests/test_client.py::test_dead_replay_endpoint",
        ),
    ),
    Mutation(
        "clear",
        "AllBlocksCleared drops every block of the worker",
        "src/index/store.rs",
        "            Event::Cleared => self.remove_worker(worker),",
        "            Event::Cleared => {}",
        ("tests/test_index.py", "tests/test_client.py", "tests/test_sim_engine.py", "tests/test_chaos.py"),
        (
            "tests/test_sim_engine.py::test_kvroute_client_index_converges_to_the_engines_ground_truth",
            "tests/test_chaos.py",
            "tests/test_client.py::test_clear_drops_everything_the_engine_held",
        ),
    ),
    Mutation(
        "stopped-driver",
        "a removed source's driver applies nothing more",
        "kvroute/_transports/zmq/driver.py",
        "        fast = (raw is not None or not self._sink.active) and not self._stopped\n",
        "        fast = raw is not None or not self._sink.active\n",
        ("tests/test_client.py",),
        ("tests/test_client.py::test_a_removed_source_touches_the_index_no_more",),
        env=PYTHON_RECEIVER,
    ),
    Mutation(
        "partial-positions",
        "a snapshot saves no position for a partial worker (its history is not the engine's)",
        "kvroute/_client.py",
        "if not self._subs[k].driver.machine.partial}",
        "if True}",
        ("tests/test_warm_restart.py", "tests/test_chaos.py"),
        ("tests/test_warm_restart.py",),
    ),
    Mutation(
        "signed-hashes",
        "SGLang's signed int64 hashes fold onto uint64 (one key whatever the form)",
        "src/wire.rs",
        "    BlockHash::Int(v as u64)\n",
        "    BlockHash::Int(v.unsigned_abs() as u64)\n",
        ("tests/test_wire.py", "tests/test_sim_engine.py", "tests/test_client.py"),
        (
            "tests/test_sim_engine.py::test_sglang_events_carry_the_engines_hashes",
            "tests/test_client.py::test_cold_start_with_history",
        ),
    ),
    Mutation(
        "duplicate-vs-restart",
        "rule 2: a live seq already applied is a duplicate only with the same ts; another ts is a restart",
        "kvroute/_source.py",
        "            if recorded == ts:\n                self.stats.duplicates += 1\n                return",
        "            if True:\n                self.stats.duplicates += 1\n                return",
        ("tests/test_source.py", "tests/test_client.py", "tests/test_sim_engine.py"),
        ("tests/test_client.py::test_a_restart_behind_a_forwarder_is_told_from_duplicates_by_its_ts",),
    ),
    Mutation(
        "no-apply",
        "the client applies what its sources publish (examples show it)",
        "src/recv/mod.rs",
        "                                let counts = idx.apply_batch(&src.key, &batch);\n",
        "                                let counts = crate::index::ApplyCounts::default();\n",
        ("tests/test_examples.py",),
        ("tests/test_examples.py",),
    ),
    Mutation(
        "ts-ring-never-grown",
        "the ts ring grown on demand keeps every seq a full ring keeps (rule 2: a duplicate is told from a restart)",
        "kvroute/_source.py",
        "            if old == REPLAY_END_SEQ or (old - seq) % self.ts_ring == 0 or self._ring_cap == self.ts_ring:\n",
        "            if True:\n",
        ("tests/test_source.py", "tests/test_warm_restart.py"),
    ),
    Mutation(
        "no-apply-python-receiver",
        "the Python receiver applies what its sources publish",
        "kvroute/_transports/zmq/payloads.py",
        "    report = index.apply_payload(key, payload, decoder.limits)\n",
        "    report = PrefixIndex().apply_payload(key, payload, decoder.limits)\n",
        # Live batches with no events() listener take the fast path (a listener takes the decoded
        # one); this test runs on both receivers by its own parameter.
        ("tests/test_hostile_fleet.py",),
        ("tests/test_hostile_fleet.py::test_a_flood_of_large_batches_stays_in_its_memory_bound_and_never_stalls_the_loop",),
    ),
    # --- production configurations (issue: kvroute against the engines as they really run) ---
    Mutation(
        "salt-ignored",
        "a salted block is keyed in its tenant's namespace, never claimed for a plain prompt",
        "src/index/store.rs",
        "    let mut salt = match &ev.cache_salt {\n"
        "        Value::Str(s) if !s.is_empty() => Some(s.clone()),\n"
        "        _ => None,\n"
        "    };\n",
        "    let mut salt: Option<String> = None;\n",
        ("tests/test_index_model.py", "tests/test_production_shapes.py", "tests/test_gateway_stream.py"),
        ("tests/engines::salt",),
        engines="salt and over",
    ),
    Mutation(
        "window-rule-off",
        "a hybrid hit needs the sliding-window group's blocks before the hit point",
        "src/index/query.rs",
        "            Some(win) if win >= 1 => div_ceil(win - 1, bs),",
        "            Some(win) if win >= 1 => 0 * div_ceil(win - 1, bs),",
        ("tests/test_index_groups.py", "tests/test_index_model.py", "tests/test_production_shapes.py"),
        ("tests/engines::hybrid-swa",),
        engines="hybrid-swa and over",
    ),
    Mutation(
        "last-token",
        "a worker is credited at most the prompt minus its last token (the engines never serve it)",
        "src/index/query.rs",
        "    let cap = floor_div(q.input.tokens.len() as i64 - 1, bs).max(0) as usize;",
        "    let cap = floor_div(q.input.tokens.len() as i64, bs).max(0) as usize;",
        ("tests/test_engine_rules.py", "tests/test_core_differential.py"),
        engines="evicting",
    ),
    Mutation(
        "key-buffer-kept",
        "a block's content key covers only its own tokens, extras and lookahead (its buffer is rewritten per block)",
        "src/keys.rs",
        "        buf.truncate(fixed);\n",
        "",
        ("tests/test_core_differential.py",),
    ),
    Mutation(
        "bigram-cap",
        "an SGLang EAGLE worker is credited the bigram view of the prompt minus one token: floor((n - 2) / P) pages",
        "src/index/query.rs",
        "            let cap = floor_div(n - 2, bs).max(0);",
        "            let cap = floor_div(n - 1, bs).max(0);",
        ("tests/test_sglang_bigram.py", "tests/test_core_differential.py"),
        engines="eagle",
    ),
    Mutation(
        "reports-as-copies",
        "where reuse reports may come, a repeat from block 0 counts once (a report adds no entry)",
        "src/index/store.rs",
        "    fn root_repeat_is_copy(&self) -> bool {\n        !self.reuse_reports\n",
        "    fn root_repeat_is_copy(&self) -> bool {\n        self.reuse_reports || true\n",
        ("tests/test_engine_rules.py", "tests/test_core_differential.py"),
        engines="reports",
    ),
    Mutation(
        "remote-credited",
        "a REMOTE (shared-tier) block is not the worker's own cache",
        "src/index/store.rs",
        "        if remote(&ev.locality) {\n            self.remote += n as u64;",
        "        if false {\n            self.remote += n as u64;",
        ("tests/test_production_shapes.py", "tests/test_index_model.py"),
    ),
    Mutation(
        "untrusted-batch",
        "an unreadable removal or clear resets the worker instead of applying the rest",
        "src/wire.rs",
        '        .map(|why| ("untrusted batch", why.clone()))',
        '        .map(|why| ("untrusted batch", why.clone()))\n        .filter(|_| false)',
        ("tests/test_index_groups.py",),
        ("tests/test_index_groups.py::test_an_unreadable_removal_resets_the_worker",),
    ),
    Mutation(
        "probe-behind-busy-slots",
        "a quiet tick asks no probe while every replay slot is taken or waited for (docs/recovery.md rule 9)",
        "kvroute/_transports/zmq/driver.py",
        "        replays = self._replays\n"
        "        if not replays.slot_free():\n"
        "            # Rule 9: every slot is taken or waited for. Under load kvroute's own slowness\n"
        "            # makes healthy sources look quiet, and a probe queued behind the slots would\n"
        "            # only lengthen the replays (a cold sync) that hold them. The next slot that comes\n"
        "            # free with no source waiting is offered to it (`_deferred_probe`), else the next\n"
        "            # quiet tick asks again.\n"
        "            self.counters.probes_deferred += 1\n"
        "            self._deferred_tick = (anyio.current_time(), self.counters.messages)\n"
        "            replays.defer(self._deferred_probe)\n"
        "            return\n"
        "        replays.reserve()\n",
        "",
        ("tests/test_fleet.py",),
        ("tests/test_fleet.py::test_a_quiet_source_is_not_probed_behind_a_busy_replay_slot",),
    ),
    Mutation(
        "deferred-probe-never-offered",
        "a deferred quiet probe is offered the next replay slot that comes free (docs/recovery.md rule 9)",
        "kvroute/_transports/zmq/replay.py",
        "        self._deferred[retry] = None\n",
        "        return\n",
        ("tests/test_fleet.py",),
        ("tests/test_fleet.py::test_a_deferred_probe_takes_the_next_free_slot",),
    ),
    Mutation(
        "replay-request-waits-in-a-task",
        "a replay request waiting for a slot waits in the slots' line, with no task of its own",
        "kvroute/_transports/zmq/driver.py",
        "        replays.queue(self._begin_replays)\n",
        "        self._begin_replays()\n",
        ("tests/test_fleet.py",),
        ("tests/test_fleet.py::test_a_request_waiting_for_a_replay_slot_holds_no_task",),
    ),
    Mutation(
        "replay-line-never-moves",
        "a replay slot that comes back goes to the oldest request waiting for one",
        "kvroute/_transports/zmq/replay.py",
        "        while self._waiting and self._taken < self._capacity:\n",
        "        while False:\n",
        ("tests/test_fleet.py", "tests/test_subscriber.py"),
        ("tests/test_fleet.py::test_a_request_waiting_for_a_replay_slot_holds_no_task",),
    ),
    Mutation(
        "unheld-cursors",
        "with the native receive loop on, cursors() and the index agree (the thread is held while they are read)",
        "kvroute/_client.py",
        "        tg = self._tg\n        held = [t for t in self._transports if t.hold()]\n",
        "        tg = self._tg\n        held: list[Transport] = []\n",
        ("tests/test_native_recv.py",),
        ("tests/test_native_recv.py::test_cursors_match_the_index_while_the_thread_applies",),
    ),
    Mutation(
        "native-tap-payload-dropped",
        "a raw tap (the JetStream relay) gets every batch the native thread applies for it, as the engine's bytes",
        "src/recv/mod.rs",
        "                            let payload = src.keep.then(|| frames[2].to_vec());\n",
        "                            let payload: Option<Vec<u8>> = None;\n",
        ("tests/test_relay_tap.py", "tests/test_jetstream_client.py"),
        ("tests/test_relay_tap.py::test_the_receive_thread_applies_for_a_tap_alone_and_hands_it_every_payload",),
    ),
    Mutation(
        "tap-closes-native-fast-path",
        "a raw tap as the only listener keeps the native thread's fast path open (payloads kept for it)",
        "kvroute/_transports/zmq/driver.py",
        "        keep = self._sink_raw() is not None\n",
        "        keep = False\n",
        ("tests/test_relay_tap.py",),
        ("tests/test_relay_tap.py::test_the_receive_thread_applies_for_a_tap_alone_and_hands_it_every_payload",),
    ),
    Mutation(
        "tap-attached-late-unheld",
        "a raw tap attached to a running client gets every batch applied after it (the thread's paths close first)",
        "kvroute/_client.py",
        "        self._hub.set_tap(tap)\n        if self._tg is not None:\n",
        "        self._hub.set_tap(tap)\n        if False:\n",
        ("tests/test_relay_tap.py",),
        ("tests/test_relay_tap.py::test_a_tap_attached_to_a_running_client_gets_every_batch_after_it",),
    ),
    Mutation(
        "native-monitor-left-attached",
        "the native thread detaches a SUB's monitor before closing it (a churned source cannot stall libzmq's I/O)",
        "src/recv/mod.rs",
        "        stop_monitor(&mut self.sub);\n",
        "        let _ = &mut self.sub;\n",
        ("tests/test_native_recv.py",),
        ("tests/test_native_recv.py::test_sources_churning_on_a_shared_endpoint_leave_the_kept_one_followed",),
    ),
    Mutation(
        "native-replay-hole-taken-whole",
        "the native thread applies a replay answer whole only if its seqs run without a hole (rules 3-4)",
        "src/recv/replay.rs",
        "            if it.batch.is_none() || it.seq != prev + 1 {\n",
        "            if it.batch.is_none() {\n",
        ("tests/test_native_replay.py",),
        ("tests/test_native_replay.py::test_an_answer_with_a_hole_goes_to_the_machine",),
    ),
    Mutation(
        "native-replay-risky-ignored",
        "the native thread applies no replay answer whole once the source handed Python a message or a "
        "disconnect since the request (the machine may have changed its mind)",
        "src/recv/mod.rs",
        "            let src = src.filter(|s| s.risky == consumed && s.applied == applied_seen)?;\n",
        "            let src = src.filter(|s| s.risky >= consumed && s.applied == applied_seen)?;\n",
        ("tests/test_native_replay_guards.py",),
        ("tests/test_native_replay_guards.py::test_an_answer_after_a_risky_hand_over_is_handed_over_not_applied",),
    ),
    Mutation(
        "native-replay-fast-path-applies-ignored",
        "the native thread applies no replay answer whole when its fast path applied a batch Python had not "
        "recorded when it worked out the terms (they came from the machine's last_seq then)",
        "src/recv/mod.rs",
        "            let src = src.filter(|s| s.risky == consumed && s.applied == applied_seen)?;\n",
        "            let src = src.filter(|s| s.risky == consumed && s.applied >= applied_seen)?;\n",
        ("tests/test_native_replay_guards.py",),
        (
            "tests/test_native_replay_guards.py::"
            "test_an_answer_to_terms_the_fast_path_overtook_is_handed_over_not_applied",
        ),
    ),
    Mutation(
        "native-replay-request-leaves-fast-path-open",
        "a replay request closes its source's fast path, as the machine's in_order does while a replay is in flight",
        "src/recv/mod.rs",
        "            src.open = false;\n        }\n        let ctx = self.replay_ctx.clone();\n",
        "            let _ = &mut src.open;\n        }\n        let ctx = self.replay_ctx.clone();\n",
        ("tests/test_native_replay_guards.py",),
        ("tests/test_native_replay_guards.py::test_a_request_closes_the_fast_path",),
    ),
    Mutation(
        "native-applied-records-never-signaled",
        "batches the native thread applied itself reach Python's bookkeeping within the note delay, hand-over or not",
        "src/recv/mod.rs",
        "        out.first_noted.get_or_insert(now);\n",
        "        let _ = now;\n",
        ("tests/test_native_recv.py",),
        ("tests/test_native_recv.py::test_the_stats_follow_what_the_thread_applied_without_a_hand_over",),
    ),
    Mutation(
        "native-replay-disarm-ignored",
        "the native thread applies no replay answer whole once Python disarmed the request",
        "src/recv/mod.rs",
        "            if !src.alive.load(Ordering::SeqCst) || !armed.load(Ordering::SeqCst) {\n",
        "            if !src.alive.load(Ordering::SeqCst) {\n",
        ("tests/test_native_replay_guards.py",),
        ("tests/test_native_replay_guards.py::test_a_disarmed_answer_is_handed_over_not_applied",),
    ),
    Mutation(
        "replay-applied-late-uncounted",
        "an answer the native thread applied whole from a late start counts the loss as `on_replay` does "
        "(rules 5-6, `on_replay_applied` against `on_replay`)",
        "kvroute/_replay_answers.py",
        "                self.stats.uncovered += 1\n"
        "                self._mark_partial(\"not-in-buffer\", first, out)\n",
        "                self._mark_partial(\"not-in-buffer\", first, out)\n",
        ("tests/test_replay_applied.py",),
    ),
    Mutation(
        "listener-fast-path-left-open",
        "a listener that comes while the native thread's fast paths are open gets every batch applied after it",
        "kvroute/_transports/zmq/native.py",
        "            if opened is not None and not d._native_fits(opened[2]):\n",
        "            if opened is not None and False:\n",
        ("tests/test_native_recv.py",),
        ("tests/test_native_recv.py::test_every_batch_after_events_returns_comes_with_its_envelope",),
    ),
    Mutation(
        "native-applied-unrecorded",
        "the batches the native thread applied for a source are recorded in the source's position",
        "kvroute/_transports/zmq/driver.py",
        "            self.machine.on_applied_many(seqs, tss)\n",
        "            pass\n",
        ("tests/test_native_recv.py", "tests/test_warm_restart.py", "tests/test_native_replay.py"),
        (
            "tests/test_native_recv.py::test_the_stats_follow_what_the_thread_applied_without_a_hand_over",
            "tests/test_warm_restart.py::"
            "test_a_batch_applied_off_the_event_loop_as_the_client_leaves_is_in_its_position",
        ),
    ),
    Mutation(
        "native-records-ring-not-grown",
        "a source's records the native thread hands over several at a time grow its ts ring as one at a time "
        "does, so an old seq coming again is known for a duplicate (rule 2)",
        "kvroute/_source.py",
        "            if cap != ts_ring and ring_seq[i] != REPLAY_END_SEQ:\n",
        "            if False:\n",
        ("tests/test_native_recv.py", "tests/test_source.py"),
        ("tests/test_native_recv.py::test_a_batch_applied_hundreds_of_seqs_ago_is_a_duplicate_when_it_comes_again",),
    ),
    Mutation(
        "removed-source-applies-unrecorded",
        "what the native thread applied for a source before it leaves is recorded in the source's position",
        "kvroute/_client.py",
        "            with self._receivers_held():\n                tg.cancel_scope.cancel()\n",
        "            with contextlib.nullcontext():\n                tg.cancel_scope.cancel()\n",
        ("tests/test_warm_restart.py",),
        (
            "tests/test_warm_restart.py::"
            "test_a_batch_applied_off_the_event_loop_as_the_client_leaves_is_in_its_position",
        ),
    ),
    Mutation(
        "dropped-connection-never-recreated",
        "a SUB whose connection libzmq dropped with no reconnect scheduled within 1 s (a message over "
        "max_message_size) is recreated, by the retry timer of the session that saw the disconnect",
        "kvroute/_transports/zmq/driver.py",
        "        if self._awaiting_retry and self._session is session:\n",
        "        if self._awaiting_retry and self._session is not session:\n",
        ("tests/test_hostile.py::test_a_message_over_max_message_size_is_dropped_and_the_source_recovers",),
        ("tests/test_hostile.py::test_a_message_over_max_message_size_is_dropped_and_the_source_recovers",),
    ),
    Mutation(
        "deferred-probe-beside-open-fast-path",
        "a deferred quiet probe closes the native fast path, with what it applied recorded, before it is asked",
        "kvroute/_transports/zmq/driver.py",
        "        self._close_native_fast()\n",
        "        pass\n",
        ("tests/test_native_replay.py",),
        ("tests/test_native_replay.py::test_a_deferred_probe_asked_beside_an_open_fast_path_is_no_restart",),
    ),
    Mutation(
        "deferred-probe-takes-a-given-away-slot",
        "a deferred quiet probe whose offered slot another source took meanwhile waits for the next (rule 9)",
        "kvroute/_transports/zmq/driver.py",
        "        if not self._replays.slot_free():\n            # The hold drained",
        "        if False:\n            # The hold drained",
        ("tests/test_native_replay.py",),
        (
            "tests/test_native_replay.py::"
            "test_a_deferred_probe_whose_slot_the_drain_gave_away_waits_for_the_next",
        ),
    ),
    Mutation(
        "native-turn-never-looks-for-waiters",
        "a replay turn on the native thread looks for waiting sources at its slice's end by itself",
        "kvroute/_transports/zmq/replay.py",
        "            elif slots.contended:\n                return  # had its slice",
        "            elif False:\n                return  # had its slice",
        ("tests/test_hostile_fleet.py",),
        ("tests/test_hostile_fleet.py::test_a_waiter_that_comes_early_in_a_turn_gets_the_slot_at_its_slice",),
    ),
    Mutation(
        "runs-header-uncounted",
        "a relay's record stays within its byte bound with its header (worker ids), not its payloads alone",
        "kvroute/_jetstream_publish.py",
        '            self._run_bytes += len(key.worker_id.encode("utf-8")) + _RUN_ENTRY_BYTES\n',
        "",
        ("tests/test_jetstream.py",),
        (),
    ),
    Mutation(
        "runs-records-always",
        "a relay told to write no runs records (for followers older than them) writes a batches record per worker",
        "kvroute/_jetstream_publish.py",
        "        if len(runs) == 1 or not self.runs_records:\n",
        "        if len(runs) == 1:\n",
        ("tests/test_jetstream.py",),
        (
            "tests/test_jetstream.py::"
            "test_a_follower_that_cannot_read_runs_records_is_exact_on_a_relay_that_writes_none",
        ),
    ),
    Mutation(
        "idle-draw-built-otherwise",
        "the compiled path builds the idle set as the reference does, so one seed draws the same idle worker",
        "kvroute/_router.py",
        "                idle = _unvetoed(universe, set(vetoed)).difference(scored.workers())\n",
        "                idle = universe.difference(scored.workers(), vetoed)\n",
        ("tests/test_router_engine_loads.py",),
        (),
    ),
    Mutation(
        "block-error-wrapped",
        "an exception raised in the client's block leaves it as raised, not wrapped in an ExceptionGroup",
        "kvroute/_client.py",
        "                await tg.__aexit__(None, None, None)\n",
        "                return await tg.__aexit__(exc_type, exc, tb)\n",
        ("tests/test_sync_errors.py",),
        ("tests/test_sync_errors.py::test_an_error_raised_in_the_block_leaves_it_as_raised",),
    ),
    Mutation(
        "sim-block-error-wrapped",
        "an exception raised in a simulated engine's or publisher's block leaves it as raised, like the client's",
        "kvroute/sim/_lifecycle.py",
        "                await stack.__aexit__(None, None, None)\n",
        "                await stack.__aexit__(exc_type, exc, tb)\n",
        ("tests/test_sim_engine.py::test_an_error_raised_in_the_block_leaves_it_as_raised",),
        ("tests/test_sim_engine.py::test_an_error_raised_in_the_block_leaves_it_as_raised",),
    ),
    Mutation(
        "silent-restore-drop",
        "restored state a source cannot resume is announced with a Reset, so replicas of the log drop it too",
        "kvroute/_restore.py",
        "        if why is not None:\n",
        "        if False:\n",
        ("tests/test_warm_restart.py", "tests/test_jetstream.py"),
        (
            "tests/test_jetstream.py::test_a_new_relay_resets_what_it_cannot_resume_on_every_replica",
            "tests/test_warm_restart.py::test_restored_state_a_source_cannot_resume_is_announced_with_a_reset",
        ),
    ),
    Mutation(
        "snapshot-over-foreign-record",
        "the relay writes no snapshot of its client's index over a log record it did not publish (it restarts)",
        "kvroute/_jetstream_relay.py",
        "        if outbox.start + stored != seq:\n",
        "        if False:\n",
        ("tests/test_jetstream.py",),
        ("tests/test_jetstream.py::test_a_record_the_relay_did_not_publish_is_never_under_its_snapshot",),
    ),
    Mutation(
        "snapshot-without-cursors",
        "the relay's snapshot carries each worker's newest batch in the log, so a replica continues its chain",
        "kvroute/_jetstream_publish.py",
        "{k: Cursor(*c) for k, c in self.last.items()}",
        "{}",
        ("tests/test_jetstream.py",),
        (
            "tests/test_jetstream.py::test_snapshots_taken_while_the_engines_publish_are_exact",
            "tests/test_jetstream.py::test_three_replicas_and_a_direct_client_agree",
        ),
    ),
    Mutation(
        "snapshot-without-partial",
        "the relay's snapshot names the workers the log marks partial (kept by its publisher)",
        "kvroute/_jetstream_publish.py",
        "            req.partial = [(k.worker_id, k.dp_rank) for k in sorted(self.partial)]\n",
        "            req.partial = []\n",
        ("tests/test_jetstream.py",),
        ("tests/test_jetstream.py::test_a_partial_worker_is_partial_in_the_relays_snapshot",),
    ),
    Mutation(
        "runs-body-offset",
        "a follower reads each run of a several-worker record from where the run before it ended",
        "kvroute/_jetstream_log.py",
        "                body = self._apply_run(sseq, WorkerKey(worker_id, dp_rank), prev, items, data, body)\n",
        "                self._apply_run(sseq, WorkerKey(worker_id, dp_rank), prev, items, data, body)\n",
        ("tests/test_jetstream.py",),
        ("tests/test_jetstream.py::test_three_replicas_and_a_direct_client_agree",),
    ),
    Mutation(
        "refused-run-dropped",
        "a payload the core refuses inside a run empties its worker, and the run's other batches still apply in order",
        "kvroute/_jetstream_log.py",
        "            self._apply_each(sseq, key, w, batches, payloads)\n            return\n",
        "            return\n",
        ("tests/test_jetstream.py::test_runs_of_batches_overlap_and_bad_payloads",),
    ),
    # --- the router ---
    Mutation(
        "footprint-unrecorded",
        "a new session the Router places counts on its worker's footprint, so the next goes where fewest started",
        "src/py/router.rs",
        "            fp.place(key, half_life);\n",
        "            drop((key, half_life));\n",
        ("tests/test_router_footprint.py",),
        ("tests/test_router_footprint.py::test_sessions_started_on_live_engines_spread_over_their_ranks",),
    ),
    Mutation(
        "footprint-draw-unordered",
        "the footprint draws among its tied workers in WorkerKey order, so both scoring paths pick alike",
        "src/scoring.rs",
        "|a, b| a.0.cmp(b.0)",
        "|_, _| std::cmp::Ordering::Equal",
        ("tests/test_router_footprint.py",),
    ),
    Mutation(
        "reuse-report-drops-copies",
        "a store from block 0 of a block already held (a reuse report) never lowers the copies a store with a parent"
        " added",
        "src/index/store.rs",
        "            None => {\n                if pos == 0 {\n                    self.repeated += 1;\n",
        "            None => {\n                if pos == 0 {\n"
        "                    w.copies.remove(ehash);\n                    self.repeated += 1;\n",
        ("tests/test_index.py",),
    ),
    Mutation(
        "live-before-unvouched",
        "a source's worker is in the unvouched set before it joins the live set a router reads",
        "kvroute/_client.py",
        "        self._track(driver)\n        self._subs[source.key] = _Subscription(driver, origin, scope)\n",
        "        self._subs[source.key] = _Subscription(driver, origin, scope)\n        self._track(driver)\n",
        ("tests/test_router_vouching.py", "tests/test_client_live_set.py"),
    ),
    Mutation(
        "engine-veto-ignored-compiled",
        "the compiled select vetoes a wedged engine (or one whose reports stopped while it holds requests) while "
        "another candidate is left, as EngineLoads.blend does",
        "src/py/router.rs",
        "            if inside < u.set.len()? {\n",
        "            if inside < u.set.len()? && false {\n",
        ("tests/test_router_engine_loads.py",),
    ),
    Mutation(
        "listed-keys-kept-past-a-new-record",
        "a load-only candidate is listed by its place among the engine records' keys, a list kept only while "
        "the records keep their keys: a worker's first record drops it",
        "src/py/router.rs",
        "        t.insert(k, Entry::new(value, note));\n        let stale = guard.keys.take();\n",
        "        t.insert(k, Entry::new(value, note));\n        let stale: Option<Arc<[PyKey]>> = None;\n",
        ("tests/test_router_engine_loads.py::test_load_only_candidates_follow_records_that_come_and_go_between_selects",),
    ),
    Mutation(
        "listed-keys-kept-past-a-removal",
        "a removed record moves the engine records' later keys: the kept list of them is dropped",
        "src/py/router.rs",
        "            let stale = guard.keys.take();\n            (f(Arc::make_mut(&mut guard.map)), stale)\n",
        "            let stale: Option<Arc<[PyKey]>> = None;\n            (f(Arc::make_mut(&mut guard.map)), stale)\n",
        ("tests/test_router_engine_loads.py::test_load_only_candidates_follow_records_that_come_and_go_between_selects",),
    ),
    Mutation(
        "engine-slot-hint-unchecked",
        "the compiled select believes a slot's kept record position only while the record there holds the "
        "index's own key object for that slot's worker (records move up on a removal; slots are reused)",
        "src/py/router.rs",
        ".is_some_and(|(k, _)| k.same(key))",
        ".is_some()",
        ("tests/test_router_engine_loads.py::test_scored_workers_records_and_membership_follow_the_fleet_between_selects",),
    ),
    Mutation(
        "engine-record-note-any-generation",
        "a record's note answers a worker's live-set membership only for the kept set it was written for",
        "src/py/router.rs",
        "            if m >> 1 == self.gen {\n                return Ok(m & 1 == 1);\n",
        "            if m != 0 {\n                return Ok(m & 1 == 1);\n",
        ("tests/test_router_engine_loads.py::test_scored_workers_records_and_membership_follow_the_fleet_between_selects",),
    ),
    Mutation(
        "engine-blend-engine-only",
        "the compiled select blends the engine's queue with the router's own in-flight tokens (the larger)",
        "src/scoring.rs",
        "        (LoadMode::Blend, Some(e), Some(m)) if m > e => m,\n",
        "",
        ("tests/test_router_engine_loads.py",),
    ),
    Mutation(
        "engine-stale-used",
        "a stale engine record is not blended in (the router's own count is)",
        "src/scoring.rs",
        "        self.received + stale_after >= now\n",
        "        self.received + stale_after >= now || true\n",
        ("tests/test_router_engine_loads.py",),
    ),
    Mutation(
        "vouched-before-removal",
        "a removed source's worker stays unvouched until the index has dropped its blocks",
        "kvroute/_client.py",
        "        self._index.remove_worker(key)\n"
        "        # Vouched for only once its blocks are gone: a router that read the live set before this\n"
        "        # removal must not find the worker trusted while the index still holds what it claimed.\n"
        "        self._vouching.discard(key)\n",
        "        self._vouching.discard(key)\n        self._index.remove_worker(key)\n",
        ("tests/test_router_vouching.py",),
    ),
    Mutation(
        "long-prefix-unread",
        "the compiled core prices CostModel.long_prefix as the Python reference does (it reads the setting)",
        "src/py/router.rs",
        'intern!(py, "long_prefix"),\n',
        'intern!(py, "temperature"),\n',
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-prefix-inlined-linear",
        "the stock model's Python path (with approximate workers) prices CostModel.long_prefix, not a linear inline",
        "kvroute/_scoring.py",
        "        stock = type(model) is CostModel and not model.long_prefix\n        weight = model.overlap_weight\n"
        "        full_credit",
        "        stock = type(model) is CostModel\n        weight = model.overlap_weight\n        full_credit",
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-prefix-hint-inlined-linear",
        "a worker only the routing hint credits is priced with CostModel.long_prefix on the stock model's Python path",
        "kvroute/_scoring.py",
        "        stock = type(model) is CostModel and not model.long_prefix\n        weight = model.overlap_weight\n"
        "        load_get",
        "        stock = type(model) is CostModel\n        weight = model.overlap_weight\n        load_get",
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-move-unread",
        "the compiled core prices CostModel.long_move as the Python reference does (it reads the setting)",
        "src/py/router.rs",
        'intern!(py, "long_move"),\n',
        'intern!(py, "temperature"),\n',
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-move-from-nothing",
        "the long-move term prices what a candidate recomputes over the best candidate, not its whole prefill",
        "kvroute/_scoring.py",
        "    best = min((e.prefill_blocks for e in entries), default=idle_prefill)\n",
        "    best = 0.0\n",
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-move-from-nothing-core",
        "the compiled core's long-move term measures a move from the least prefill, as the Python reference does",
        "src/py/router.rs",
        "let best = scoring::least_prefill(rows.iter().map(|r| r.prefill), idle_prefill);",
        "let best = 0.0;",
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-move-default-off",
        "the default CostModel prices a move by what it recomputes over the best candidate (long_move on)",
        "kvroute/_cost.py",
        "    long_move: bool = True\n",
        "    long_move: bool = False\n",
        ("tests/test_router_scoring.py",),
    ),
    Mutation(
        "long-move-idle-unpriced",
        "the compiled core adds the long-move term to the idle group's cost too (one idle worker is a candidate)",
        "src/py/router.rs",
        "        idle_cost + params.move_price(idle_prefill - best)\n",
        "        idle_cost\n",
        ("tests/test_router_scoring.py",),
    ),
    # --- the gateway stream ---
    Mutation(
        "data-loss-kept",
        "DATA_LOSS on a gateway stream clears that rank's worker before it starts over",
        "kvroute/_source.py",
        '        self._reset("data-loss", detail, out)\n',
        "",
        ("tests/test_gateway_stream.py",),
        ("tests/test_gateway_stream.py::test_data_loss_clears_the_rank_and_resubscribes",),
    ),
    Mutation(
        "replay-untrusted-raw",
        "rule 3: a replayed copy judged untrusted on the raw path is a hole, never applied (the worker is reset)",
        "kvroute/_transports/zmq/driver.py",
        "        if kind:\n            self._bad_payload(kind, detail)\n            return math.nan, None\n",
        '        if kind == "undecodable payload":\n            self._bad_payload(kind, detail)\n'
        "            return math.nan, None\n",
        ("tests/test_fleet.py",),
        ("tests/test_fleet.py::test_replay_answers_are_applied_as_raw_payloads_by_the_machines_rules",),
    ),
    Mutation(
        "replay-skips-uncounted",
        "an unusable event in a replayed payload judged on the raw path is skipped and counted",
        "kvroute/_transports/zmq/payloads.py",
        "    if skipped:\n        decoder.count_skipped(skipped)\n",
        "",
        ("tests/test_fleet.py",),
        ("tests/test_fleet.py::test_replay_answers_are_applied_as_raw_payloads_by_the_machines_rules",),
    ),
    # --- the router ---
    Mutation(
        "vouching-unreported",
        "a router believes a source's claims exactly while its state is synced (and not partial): "
        "the client's unvouched set follows every state change",
        "kvroute/_source.py",
        "            if self.on_vouching is not None:\n                self.on_vouching()\n",
        "            pass\n",
        ("tests/test_router_vouching.py",),
        (
            "tests/test_router_vouching.py::"
            "test_a_source_turning_partial_unsynced_and_synced_is_judged_by_the_very_next_select",
        ),
    ),
    Mutation(
        "unvouched-ignored-compiled",
        "the compiled select does not credit the claims of a worker in the unvouched set",
        "src/py/router.rs",
        "            return Ok(!u.contains(w)?);\n",
        "            return Ok(!u.contains(w)? || true);\n",
        ("tests/test_router_vouching.py",),
        (
            "tests/test_router_vouching.py::"
            "test_a_source_turning_partial_unsynced_and_synced_is_judged_by_the_very_next_select",
        ),
    ),
    Mutation(
        "router-unlocked",
        "one Router serves several threads: its bookkeeping changes under its lock",
        "kvroute/_router.py",
        "        self._lock = threading.RLock()\n",
        # a semaphore nobody runs out of: every `with self._lock` still runs, and excludes nothing
        "        self._lock = threading.Semaphore(1 << 30)\n",
        ("tests/test_router_threads.py",),
        ("tests/test_router_threads.py::test_worker_threads_select_while_the_client_ingests_a_live_engine",),
    ),
    Mutation(
        "hashed-placement-unhashed",
        "the demo's kvroute_hashed places a new session by a hash of its leading tokens, not where cost alone sends it",
        "kvroute/cli/_demo_policies.py",
        '            worker = max(eligible, key=lambda w: _ring_hash(key + f"#{w.worker_id}#{w.dp_rank}".encode()))\n',
        "            worker = d.worker\n",
        ("tests/test_demo_policies.py",),
    ),
    Mutation(
        "key-growth-lookup-skips-old",
        "while the key table grows a few records at a time, a query finds a key not moved yet in the old table",
        "src/index/table.rs",
        "            None => self.moving.as_ref()?.find(h, key, recs),\n",
        "            None => None,\n",
        ("tests/test_index.py",),
    ),
    Mutation(
        "key-distance-stale",
        "a key the id index shifts back after a removal keeps a true distance from its home, so it is found again",
        "src/index/table.rs",
        "            |s, to, home| s & !dist_mask | dist_field(past(home, to, cap), id_bits, far),\n",
        "            |s, _, _| s,\n",
        ("tests/test_index.py", "tests/test_production_shapes.py", "tests/test_client.py"),
    ),
    Mutation(
        "token-walk-form-unchecked",
        "a window of token ids is walked as uint 16 / uint 32 only when every marker in it is one of those two",
        "src/wire/token_ids.rs",
        "    (walked & !(ce | cd) == 0).then_some((q, k))\n",
        "    Some((q, k))\n",
        ("tests/test_wire.py", "tests/test_wire_differential.py", "tests/test_client.py"),
        ("tests/test_client.py::test_drops_inside_buffer_are_replayed",),
    ),
    Mutation(
        "token-vector-form-unchecked",
        "the vector reader takes a window's token ids only when each starts at a uint 16 / uint 32 marker",
        "src/wire/token_ids.rs",
        "        if _mm512_test_epi8_mask(at_marker, at_marker) & taken_bits != taken_bits {\n",
        "        if _mm512_test_epi8_mask(at_marker, at_marker) & taken_bits != taken_bits & 0 {\n",
        ("tests/test_wire.py", "tests/test_wire_differential.py", "tests/test_client.py"),
        ("tests/test_client.py::test_drops_inside_buffer_are_replayed",),
    ),
    Mutation(
        "vllm-removal-misread",
        "vLLM's removal, decoded by its fixed bytes, names the block the engine removed (its hash big-endian)",
        "src/wire.rs",
        "            block_hashes: smallvec::smallvec![BlockHash::Int(u64::from_be_bytes(*hash))],\n",
        "            block_hashes: smallvec::smallvec![BlockHash::Int(u64::from_le_bytes(*hash))],\n",
        (
            "tests/test_wire.py",
            "tests/test_wire_differential.py",
            "tests/test_client.py",
            "tests/test_production_shapes.py",
        ),
        ("tests/test_client.py::test_vllm_removals_byte_for_byte_drop_exactly_their_blocks",),
    ),
    Mutation(
        "worker-growth-lookup-skips-old",
        "while a worker's table grows a few runs at a time, an engine hash not moved yet is found in the old slots",
        "src/index/mod.rs",
        "        let i = self.old_slot(h, hh)?;\n        self.old.as_deref().map(|o| &o.slots[i].1)\n",
        "        None\n",
        ("tests/test_index.py",),
    ),
    Mutation(
        "stale-open-read-on",
        "a stale open leaves the native thread's source unread until Python's next command (a flood converges)",
        "src/recv/mod.rs",
        "                            src.awaiting_open.get_or_insert_with(Instant::now);\n",
        "                            let _ = Instant::now;\n",
        ("tests/test_native_recv.py",),
        ("tests/test_native_recv.py::test_a_stale_open_leaves_the_source_unread_until_python_takes_the_rest",),
    ),
    Mutation(
        "medium-borrowed-wrong",
        "a medium the decoder keeps without a copy is the name the engine sent (CPU stays CPU, not a GPU block)",
        "src/protocols.rs",
        '        "CPU" => Cow::Borrowed("CPU"),\n',
        '        "CPU" => Cow::Borrowed("GPU"),\n',
        ("tests/test_wire_differential.py", "tests/test_client.py"),
        ("tests/test_client.py::test_a_removal_from_another_tier_leaves_the_gpu_block_claimed",),
    ),
]


def _copy_tree(dest: Path) -> None:
    """Copy the tracked files (and untracked, not ignored ones) of the repository to ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _build_core(tree: Path) -> None:
    """Build ``tree``'s compiled core (src/) into ``tree/kvroute/_core.abi3.so``, where the copy imports it from.

    One cargo target directory serves every copy (and every run), so a mutation rebuilds only
    the kvroute crate. Cargo decides that crate is fresh by file times, and a copy keeps its
    sources' times: the last build, a mutant of another copy, would pass for this tree's. So
    the sources are stamped now, and the build and the copy-out hold the target's lock
    against a concurrent run.
    """
    target = Path(tempfile.gettempdir()) / "kvroute-mutate-target"
    target.mkdir(exist_ok=True)
    now = time.time()
    for src in (tree / "src").rglob("*"):
        if src.is_file():
            os.utime(src, (now, now))
    with open(target / "kvroute-mutate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cargo = ["cargo", "build", "-q", "--release", "--lib", "--features", "extension-module"]
        subprocess.run(
            [*cargo, "--target-dir", str(target)],
            cwd=tree,
            check=True,
        )
        shutil.copy2(target / "release" / "libkvroute_core.so", tree / "kvroute" / "_core.abi3.so")


def _env(tree: Path, extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    env = dict(os.environ) | dict(extra)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["CI"] = "1"  # fixed hypothesis seed: a mutation's verdict does not depend on the day's search
    return env


def _check_import(tree: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import kvroute, kvroute._core; print(kvroute.__file__); print(kvroute._core.__file__)"],
        cwd=tree,
        env=_env(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for path in out:
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"kvroute imports {path}, not from the mutated copy {tree}")


def _run(
    tree: Path, tests: tuple[str, ...], timeout: float, extra: tuple[tuple[str, str], ...] = ()
) -> tuple[set[str], set[str], float]:
    """Run ``tests`` in ``tree`` with ``extra`` in the environment: (failed node ids, passed node ids, seconds)."""
    report = tree / "junit.xml"
    report.unlink(missing_ok=True)
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
        cwd=tree,
        env=_env(tree, extra),
        capture_output=True,
        timeout=timeout,
    )
    took = time.monotonic() - t0
    failed: set[str] = set()
    passed: set[str] = set()
    if not report.exists():
        return failed, passed, took
    for case in ET.parse(report).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # "tests.test_client" -> tests/test_client.py; a class in the file adds "::Class".
        mod = next(i for i, p in enumerate(parts) if p.startswith("test_")) if any(
            p.startswith("test_") for p in parts
        ) else len(parts) - 1
        node = "/".join(parts[: mod + 1]) + ".py" + "".join("::" + p for p in parts[mod + 1 :]) + "::" + name
        if case.find("skipped") is not None:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(node)
        else:
            passed.add(node)
    return failed, passed, took


def _run_engines(tree: Path, expr: str, timeout: float) -> bool:
    """Run the engine-conformance stage of ``tree`` on the configurations ``expr`` selects: True if it passed."""
    done = subprocess.run(
        ["bash", str(tree / "tests/engines/run.sh"), "-q", "-k", expr],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        timeout=timeout,
    )
    return done.returncode == 0


def _base(node: str) -> str:
    """A node id without its parameters: one test function."""
    return node.split("[", 1)[0]


def _is_socket(node: str) -> bool:
    """Socket-level or end to end: every socket test here is an anyio test, run on both backends."""
    if node.startswith("tests/engines::"):
        return True  # the engines' own cache managers and publishers against a real client
    return "[asyncio" in node or "[trio" in node or Path(node.split("::", 1)[0]).name in END_TO_END_FILES


def main() -> int:
    # A terminated run cleans up like an interrupted one: SystemExit unwinds the temporary
    # directory, and subprocess.run kills the pytest child it was waiting for.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    args = parser.parse_args()
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:22} {m.rule}")
        return 0
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")

    with tempfile.TemporaryDirectory(prefix="kvroute-mutate-") as tmp:
        pristine = Path(tmp) / "pristine"
        _copy_tree(pristine)
        _build_core(pristine)
        _check_import(pristine)
        all_tests = tuple(sorted({t for m in chosen for t in m.tests}))
        print(f"baseline: {' '.join(all_tests)}", flush=True)
        base_failed, base_passed, took = _run(pristine, all_tests, args.timeout)
        print(f"baseline: {len(base_passed)} passed, {len(base_failed)} failed ({took:.0f} s)", flush=True)
        for node in sorted(base_failed):
            print(f"  baseline failure (ignored below): {node}")
        rows: list[tuple[Mutation, set[str], set[str], list[str], list[str]]] = []
        for m in chosen:
            tree = Path(tmp) / m.name
            shutil.copytree(pristine, tree)
            path = tree / m.file
            text = path.read_text()
            count = text.count(m.old)
            if count != 1:
                print(f"{m.name}: the text to break occurs {count} times in {m.file}; fix the entry", flush=True)
                rows.append((m, set(), set(), [], ["(not applied)"]))
                continue
            path.write_text(text.replace(m.old, m.new))
            if m.file.startswith("src/"):
                _build_core(tree)
            failed, passed, took = _run(tree, m.tests, args.timeout, m.env)
            if m.engines is not None:
                node = f"tests/engines::{m.engines}"
                if not _run_engines(pristine, m.engines, args.timeout):
                    base_failed.add(node)
                elif _run_engines(tree, m.engines, args.timeout):
                    passed.add(node)
                else:
                    failed.add(node)
            new_failures = failed - base_failed
            caught = {_base(n) for n in new_failures}
            socket = {_base(n) for n in new_failures if _is_socket(n)}
            survived = [c for c in m.claims if not any(n.startswith(c) for n in new_failures)]
            flaky = [c for c in m.claims if any(n.startswith(c) for n in base_failed)]
            missing = [c for c in m.claims if not any(n.startswith(c) for n in failed | passed)]
            print(f"{m.name}: {len(caught)} tests caught it ({took:.0f} s)", flush=True)
            rows.append((m, caught, socket, survived, missing + [f"failed at baseline: {c}" for c in flaky]))
            shutil.rmtree(tree)

    print()
    print("| mutation | rule | caught by (unit / socket-level) | socket-level tests that caught it | survived |")
    print("|---|---|---|---|---|")
    status = 0
    for m, caught, socket, survived, missing in rows:
        units = caught - socket
        names = sorted(n.split("::", 1)[-1] for n in socket)
        shown = ", ".join(names[:4]) + (f", +{len(names) - 4} more" if len(names) > 4 else "")
        bad = [f"**{c}**" for c in survived if c not in missing] + [
            f"({c})" if c.startswith("failed at baseline") else f"(not run: {c})" for c in missing
        ]
        if bad or not socket:
            status = 1
        print(f"| {m.name} | {m.rule} | {len(units)} / {len(socket)} | {shown or '—'} | {', '.join(bad) or '—'} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
