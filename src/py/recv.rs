//! `kvroute._core.NativeReceiver`: the Python face of the native receive loop (`crate::recv`).
//!
//! Python (kvroute/_subscriber.py, `NativeReceiver`) adds and removes sources, opens the fast
//! path as its recovery machine allows, waits on `fileno()` and `drain()`s what the thread
//! applied and handed over. Every failure is a Python exception or a reason in `drain()`'s
//! ``dead``: nothing here panics into Python.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::index::{PyIndex, PyKey};
use crate::recv::{
    self, Command, Context, Handover, ReplayOutcome, ReplayRequest, Settings, Shared, SubOptions,
    Terms,
};

/// A replay request's "armed" flag and its progress, shared with the thread.
type ReplayFlags = (Arc<AtomicBool>, Arc<AtomicU64>);

/// Sources a chunk of a drain's plain records holds at most (`PyNativeReceiver::drain`): ~0.5 ms
/// of Python work at a few records a source, the longest the event loop's other tasks wait for it.
const PLAIN_CHUNK: usize = 128;
/// u64s (a source's four and its seqs) past which a chunk ends before `PLAIN_CHUNK` sources
/// (sources behind by thousands of records each, after the event loop was held up).
const PLAIN_CHUNK_NUMBERS: usize = 1024;

/// One receive thread over every SUB socket of a client.
#[pyclass(frozen, module = "kvroute._core", name = "NativeReceiver")]
pub struct PyNativeReceiver {
    // `shared` before `ctx`: queued sockets close before the context terminates.
    shared: Arc<Shared<PyKey>>,
    ctx: Arc<Context>,
    closed: AtomicBool,
    /// Each source's "alive" flag (see `crate::recv`), cleared by `stop`.
    alive: Mutex<HashMap<u64, Arc<AtomicBool>>>,
    /// Each replay request's "armed" flag (`crate::recv::ReplayRequest`), cleared by
    /// `disarm_replay`, and its progress (decodable replies so far).
    armed: Mutex<HashMap<u64, ReplayFlags>>,
}

#[pymethods]
impl PyNativeReceiver {
    /// Start the thread applying to ``index``; ``quiet`` in seconds, the caps as in
    /// `SubscriberConfig` and `Limits`; ``max_sockets`` sizes the thread's libzmq context;
    /// ``nice``: steps the receive side's threads run below the caller's.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        index: &Bound<'_, PyIndex>,
        visit: usize,
        wakeup_bytes: usize,
        quiet: f64,
        outbox_bytes: usize,
        max_sockets: i32,
        max_events_per_batch: &Bound<'_, PyAny>,
        max_blocks_per_event: &Bound<'_, PyAny>,
        max_block_size: &Bound<'_, PyAny>,
        nice: i32,
    ) -> PyResult<Self> {
        let limits =
            super::wire::limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
        if !(quiet.is_finite() && quiet > 0.0) {
            return Err(PyRuntimeError::new_err(format!(
                "quiet must be > 0, not {quiet}"
            )));
        }
        let settings = Settings {
            visit: visit.max(1),
            wakeup_bytes: wakeup_bytes.max(1),
            quiet: Duration::from_secs_f64(quiet),
            outbox_bytes: outbox_bytes.max(1),
            limits,
            nice,
        };
        let ctx = Arc::new(Context::new(max_sockets).map_err(PyOSError::new_err)?);
        let shared =
            recv::start(index.get().shared(), settings, ctx.clone()).map_err(PyOSError::new_err)?;
        Ok(PyNativeReceiver {
            shared,
            ctx,
            closed: AtomicBool::new(false),
            alive: Mutex::new(HashMap::new()),
            armed: Mutex::new(HashMap::new()),
        })
    }

    /// The descriptor that turns readable when `drain` has something.
    fn fileno(&self) -> i32 {
        self.shared.notify_r
    }

    /// Subscribe ``worker``'s source ``token`` at ``endpoint`` (a SUB with its monitor, created
    /// and connected here, the GIL released); raises OSError when libzmq refuses.
    #[allow(clippy::too_many_arguments)]
    fn add(
        &self,
        py: Python<'_>,
        token: u64,
        worker: &Bound<'_, PyAny>,
        endpoint: &str,
        topic: &[u8],
        rcvhwm: i32,
        max_message_size: i64,
        reconnect_ivl_ms: i32,
        reconnect_ivl_max_ms: i32,
        tcp_keepalive: bool,
    ) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(PyRuntimeError::new_err("the native receiver is closed"));
        }
        if token >= 1 << 62 {
            return Err(PyRuntimeError::new_err("source token out of range"));
        }
        let key = PyKey::extract(worker)?;
        let opts = SubOptions {
            rcvhwm,
            max_message_size,
            reconnect_ivl: reconnect_ivl_ms,
            reconnect_ivl_max: reconnect_ivl_max_ms,
            tcp_keepalive,
        };
        let ctx = &self.ctx;
        let (sub, mon) = py
            .detach(|| ctx.subscribe(endpoint, topic, &opts))
            .map_err(PyOSError::new_err)?;
        let alive = Arc::new(AtomicBool::new(true));
        self.alive.lock().insert(token, alive.clone());
        self.shared.command(Command::Add {
            token,
            key,
            sub,
            mon,
            alive,
        });
        Ok(())
    }

    /// Nothing more is applied for ``token`` once this returns (before its worker leaves the
    /// index: the thread checks under the index's lock); its sockets stay until `remove`.
    fn stop(&self, token: u64) {
        if let Some(alive) = self.alive.lock().get(&token) {
            alive.store(false, Ordering::SeqCst);
        }
    }

    /// Stop following ``token`` and close its sockets (its later hand-overs never come).
    fn remove(&self, token: u64) {
        self.stop(token);
        self.alive.lock().remove(&token);
        self.shared.command(Command::Remove { token });
    }

    /// Let the thread apply ``token``'s batches from ``next_seq`` on, if ``consumed`` (the
    /// hand-overs Python has taken for it) is all it handed over; with ``keep``, `drain` lists
    /// each applied batch's payload too (for a raw tap).
    #[pyo3(signature = (token, next_seq, consumed, keep=false))]
    fn open(&self, token: u64, next_seq: u64, consumed: u64, keep: bool) {
        self.shared.command(Command::Open {
            token,
            next_seq,
            consumed,
            keep,
        });
    }

    /// Hand every message of ``token`` over until the next `open`.
    fn close_fast(&self, token: u64) {
        self.shared.command(Command::Close { token });
    }

    /// Leave ``token``'s messages unread (in libzmq's queue, then the engine's) while ``parked``
    /// (a replay of it is in flight), or read them again. Its monitor is read either way, and
    /// a parked source gets no quiet tick.
    fn park(&self, token: u64, parked: bool) {
        self.shared.command(Command::Park { token, parked });
    }

    /// Carry out replay request ``id`` for source ``token`` on the thread: a DEALER to
    /// ``endpoint`` (the SUB's options), asking from ``from_seq``. ``whole``: the machine would
    /// take a complete, clean answer whole (`ReplayAnswers.replay_terms`: ``anchor``, the ts the
    /// first reply must have; ``late_ok``, a later first seq is a loss that resets nothing), so
    /// the thread applies it itself if the source handed nothing over since that may change the
    /// machine's mind (``consumed``: the messages, quiet ticks and monitor events other than a
    /// completed handshake Python had taken when it asked) and its fast path applied nothing
    /// Python had not recorded then (``applied_seen``: the batches of `drain`'s ``applied`` it
    /// took, elided ones included). The request closes the source's fast path. It ends
    /// after ``silent`` s without a decodable reply, ``deadline`` s, ``budget`` replies, or
    /// ``max_items`` batches or ``max_bytes`` payload bytes; its outcome is a hand-over.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, token, endpoint, rcvhwm, max_message_size, reconnect_ivl_ms,
        reconnect_ivl_max_ms, tcp_keepalive, from_seq, whole, anchor, late_ok, consumed,
        applied_seen, silent, deadline, budget, max_items, max_bytes))]
    fn replay(
        &self,
        id: u64,
        token: u64,
        endpoint: String,
        rcvhwm: i32,
        max_message_size: i64,
        reconnect_ivl_ms: i32,
        reconnect_ivl_max_ms: i32,
        tcp_keepalive: bool,
        from_seq: u64,
        whole: bool,
        anchor: Option<f64>,
        late_ok: bool,
        consumed: u64,
        applied_seen: u64,
        silent: f64,
        deadline: f64,
        budget: u64,
        max_items: usize,
        max_bytes: usize,
    ) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(PyRuntimeError::new_err("the native receiver is closed"));
        }
        if id >= 1 << 62 {
            return Err(PyRuntimeError::new_err("replay id out of range"));
        }
        let armed = Arc::new(AtomicBool::new(whole));
        let progress = Arc::new(AtomicU64::new(0));
        self.armed
            .lock()
            .insert(id, (armed.clone(), progress.clone()));
        self.shared.command(Command::Replay(Box::new(ReplayRequest {
            id,
            token,
            endpoint,
            opts: SubOptions {
                rcvhwm,
                max_message_size,
                reconnect_ivl: reconnect_ivl_ms,
                reconnect_ivl_max: reconnect_ivl_max_ms,
                tcp_keepalive,
            },
            from_seq,
            terms: whole.then_some(Terms { anchor, late_ok }),
            armed,
            progress,
            consumed,
            applied_seen,
            silent: seconds(silent),
            deadline: seconds(deadline),
            budget,
            max_items: max_items.max(1),
            max_bytes: max_bytes.max(1),
        })));
        Ok(())
    }

    /// The thread applies nothing of replay ``id`` from now on (synchronous: checked under the
    /// index's lock); its replies are handed over instead.
    fn disarm_replay(&self, id: u64) {
        if let Some((armed, _)) = self.armed.lock().get(&id) {
            armed.store(false, Ordering::SeqCst);
        }
    }

    /// Decodable replies of replay ``id`` so far; 0 once it ended.
    fn replay_progress(&self, id: u64) -> u64 {
        self.armed
            .lock()
            .get(&id)
            .map_or(0, |(_, p)| p.load(Ordering::Relaxed))
    }

    /// End replay ``id`` now, applying nothing; its outcome (``cancelled``) is still handed over.
    fn cancel_replay(&self, id: u64) {
        self.disarm_replay(id);
        self.shared.command(Command::CancelReplay { id });
    }

    /// Everything waiting: ``(plain, applied, handovers, logs, dead)``. ``plain``: the records
    /// of every source with nothing skipped and no payload kept (nearly every source of a
    /// drain), in chunks of at most `PLAIN_CHUNK` sources, each two byte strings of native-endian
    /// numbers: u64 ``token, n, elided, blocks`` then its ``n`` seqs in the first, f64 its ``n``
    /// ts then ``n`` lags in the second, a source after another. Not a tuple and three lists a
    /// source (thousands of those a drain kept the cyclic GC busy), nor a Python number each
    /// here: Python reads a chunk as it feeds it to the drivers, a chunk between two turns of
    /// its event loop's other tasks, where building them all in this call held it ~2.5 ms;
    /// ``applied``: every other source's ``(token, seqs, ts, lags, elided, blocks, skipped,
    /// payloads)`` (``skipped`` None when no event was left out; ``payloads`` None unless the
    /// source keeps them: ``(seq, ts, blocks, payload)`` for every applied batch, in order);
    /// a source is in one of the two, never both; ``handovers`` in order: ``(0,
    /// token, frames)`` a message, ``(1, token, event, value, endpoint)`` a monitor event,
    /// ``(2, token)`` a quiet tick, ``(3, token, id, applied, items, complete, cut, cancelled,
    /// good, junk_frames, bad, bad_count, skipped, replies)`` a replay request's end (`replay_outcome`);
    /// ``dead``: why the thread stopped, or None.
    #[allow(clippy::type_complexity)]
    fn drain<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Bound<'py, PyList>,
        Vec<String>,
        Option<String>,
    )> {
        let out = py.detach(|| self.shared.drain());
        let plain = PyList::empty(py);
        let mut ints: Vec<u8> = Vec::new();
        let mut floats: Vec<u8> = Vec::new();
        let mut chunked = 0;
        let applied = PyList::empty(py);
        for (token, a) in out.applied {
            if a.skipped.is_empty() && a.payloads.is_empty() {
                let r = &a.records;
                for x in [token, r.len() as u64, a.elided, a.blocks] {
                    ints.extend_from_slice(&x.to_ne_bytes());
                }
                for x in r {
                    ints.extend_from_slice(&x.0.to_ne_bytes());
                }
                for x in r {
                    floats.extend_from_slice(&x.1.to_ne_bytes());
                }
                for x in r {
                    floats.extend_from_slice(&x.2.to_ne_bytes());
                }
                chunked += 1;
                if chunked == PLAIN_CHUNK || ints.len() >= 8 * PLAIN_CHUNK_NUMBERS {
                    plain.append((PyBytes::new(py, &ints), PyBytes::new(py, &floats)))?;
                    (chunked, ints, floats) = (0, Vec::new(), Vec::new());
                }
                continue;
            }
            let r = &a.records;
            let seqs = PyList::new(py, r.iter().map(|x| x.0))?;
            let ts = PyList::new(py, r.iter().map(|x| x.1))?;
            let lags = PyList::new(py, r.iter().map(|x| x.2))?;
            let skipped = if a.skipped.is_empty() {
                None
            } else {
                let d = PyDict::new(py);
                for (why, k) in a.skipped {
                    d.set_item(why, k)?;
                }
                Some(d)
            };
            // A kept source's payloads: one tuple per batch, the only Python objects they cost.
            let payloads = if a.payloads.is_empty() {
                None
            } else {
                let items = a.payloads.iter().map(|(seq, ts, stored, p)| {
                    (*seq, *ts, *stored, PyBytes::new(py, p)).into_pyobject(py)
                });
                Some(PyList::new(py, items.collect::<PyResult<Vec<_>>>()?)?)
            };
            applied.append((token, seqs, ts, lags, a.elided, a.blocks, skipped, payloads))?;
        }
        let handovers = PyList::empty(py);
        for h in out.handovers {
            let item = match h {
                Handover::Message { token, frames } => {
                    let frames = PyList::new(py, frames.iter().map(|f| PyBytes::new(py, f)))?;
                    PyTuple::new(
                        py,
                        [
                            0u64.into_pyobject(py)?.into_any(),
                            token.into_pyobject(py)?.into_any(),
                            frames.into_any(),
                        ],
                    )?
                }
                Handover::Monitor {
                    token,
                    event,
                    value,
                    endpoint,
                } => (1u64, token, event, value, endpoint).into_pyobject(py)?,
                Handover::Quiet { token } => (2u64, token).into_pyobject(py)?,
                Handover::Replay(outcome) => {
                    self.armed.lock().remove(&outcome.id);
                    replay_outcome(py, *outcome)?
                }
            };
            handovers.append(item)?;
        }
        if chunked > 0 {
            plain.append((PyBytes::new(py, &ints), PyBytes::new(py, &floats)))?;
        }
        Ok((plain, applied, handovers, out.logs, out.dead))
    }

    /// Hold the thread between two visits (the GIL released while it gets there): until
    /// `release`, it applies nothing, so after a `drain` the index holds exactly what the
    /// drained records say the thread applied (a snapshot's positions match its entries).
    fn hold(&self, py: Python<'_>) {
        py.detach(|| self.shared.hold());
    }

    /// Let a held thread apply again.
    fn release(&self) {
        self.shared.release();
    }

    /// End the thread and close every socket (idempotent).
    fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.shared.command(Command::Stop);
            // A thread still held would never see the Stop.
            self.shared.release();
        }
    }
}

/// A duration from Python's seconds: negative or NaN is none, past a day (or infinite) a day.
fn seconds(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_nan() {
        0.0
    } else {
        s.clamp(0.0, 86_400.0)
    })
}

/// A replay request's end as `drain` hands it: ``applied`` None, or ``(first, last, seqs, ts,
/// count, blocks)`` when the thread applied the answer whole; ``items`` its replies otherwise,
/// ``(seq, ts, payload or None)``; ``bad`` the first few ``(kind, detail)`` of payloads that
/// did not decode or were untrusted, ``bad_count`` all of them; ``skipped`` events left out.
fn replay_outcome<'py>(py: Python<'py>, o: ReplayOutcome) -> PyResult<Bound<'py, PyTuple>> {
    let applied = match o.applied {
        Some(a) => {
            let (seqs, ts): (Vec<u64>, Vec<f64>) = a.records.into_iter().unzip();
            Some((a.first, a.last, seqs, ts, a.count, a.blocks))
        }
        None => None,
    };
    let items = PyList::empty(py);
    for (seq, ts, payload) in o.items {
        let payload = payload.map(|p| PyBytes::new(py, &p));
        items.append((seq, ts, payload))?;
    }
    let skipped = PyDict::new(py);
    let c = o.counts;
    for (why, k) in c.skipped {
        skipped.set_item(why, k)?;
    }
    let bad: Vec<(&str, String)> = c.bad;
    PyTuple::new(
        py,
        [
            3u64.into_pyobject(py)?.into_any(),
            o.token.into_pyobject(py)?.into_any(),
            o.id.into_pyobject(py)?.into_any(),
            applied.into_pyobject(py)?.into_any(),
            items.into_any(),
            o.complete.into_pyobject(py)?.to_owned().into_any(),
            o.cut.into_pyobject(py)?.into_any(),
            o.cancelled.into_pyobject(py)?.to_owned().into_any(),
            c.good.into_pyobject(py)?.into_any(),
            c.junk_frames.into_pyobject(py)?.into_any(),
            bad.into_pyobject(py)?.into_any(),
            c.bad_count.into_pyobject(py)?.into_any(),
            skipped.into_any(),
            c.replies.into_pyobject(py)?.into_any(),
        ],
    )
}

impl Drop for PyNativeReceiver {
    fn drop(&mut self) {
        self.close();
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNativeReceiver>()?;
    Ok(())
}
