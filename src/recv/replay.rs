//! Replay requests on the native thread (docs/architecture.md, "The native loop"): the thread
//! opens the DEALER, sends the request the recovery machine asked for, reads and judges every
//! reply (one decode each), and, when the answer is one the machine's rules take whole, applies
//! it itself and hands Python one summary (`Applied`); any other answer is handed over reply by
//! reply (`Outcome::items`) for the machine to judge as before.
//!
//! What "taken whole" means is the machine's (kvroute/_replay_answers.py, `ReplayAnswers.replay_terms`):
//! Python sends it as `Terms` with the request, and only while nothing is held, no listener wants
//! the events and the answer will not be moot. The thread then applies an answer only when it is
//! complete (end marker), every reply decoded and was trusted, and its seqs run without a hole from
//! the request's start (after the anchor, for an identity check, whose seq and ts must match), or
//! from a later first seq where `Terms::late_ok` says that loss resets nothing. It also applies
//! nothing once the source handed Python anything since the request that may change the machine's
//! mind (`consumed`: a message, a disconnect), nor when its fast path applied a batch Python had
//! not recorded when it asked (`applied_seen`), nor once Python disarmed the request (`armed`,
//! checked under the index's write lock, as `alive` is). A request closes its source's fast path,
//! as the machine's `in_order` does while a replay is in flight.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocols::Batch;
use crate::wire;

use super::SubOptions;

/// (seq, ts) records kept per applied answer: as many as the machine's ts ring holds.
const KEEP_RECORDS: usize = 4096;
/// Bad-payload details kept per answer for Python's rate-limited log (the rest are counted).
const KEEP_BAD: usize = 4;

/// The rule by which the recovery machine would take an answer whole (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Terms {
    /// An identity check or probe: the first reply must be `from_seq` with exactly this ts.
    pub anchor: Option<f64>,
    /// A first reply past `from_seq` (the buffer no longer reaches back) is a loss the machine
    /// takes without resetting the worker (nothing applied yet): the run may start there.
    pub late_ok: bool,
}

/// One replay request, as Python asks it (`Command::Replay`).
pub struct Request {
    /// This request's id (its hand-over names it).
    pub id: u64,
    /// The source (SUB token) whose worker an applied answer goes to.
    pub token: u64,
    pub endpoint: String,
    pub opts: SubOptions,
    pub from_seq: u64,
    /// None: hand every reply over, apply nothing.
    pub terms: Option<Terms>,
    /// Cleared by Python when the machine would no longer take the answer whole.
    pub armed: Arc<AtomicBool>,
    /// Decodable replies so far (Python reads it while the request runs: whether its slot's
    /// turn is productive, and the source's counters move as replies come).
    pub progress: Arc<AtomicU64>,
    /// The source's risky hand-overs (`Source::risky`) Python had taken when it asked: the
    /// answer is applied only if no other came since.
    pub consumed: u64,
    /// The source's fast-path applies (`Source::applied`) Python had recorded when it asked:
    /// the answer is applied only if the fast path applied nothing it had not (its terms came
    /// from the machine's `last_seq` then).
    pub applied_seen: u64,
    /// Ends the request when no decodable reply came for this long.
    pub silent: Duration,
    /// Ends it (cut short) this long after it was sent.
    pub deadline: Duration,
    /// Ends it (cut short) after this many replies, malformed ones and the end marker included.
    pub budget: u64,
    /// Ends it after this many batches or payload bytes (what the machine may hold of one answer).
    pub max_items: usize,
    pub max_bytes: usize,
}

/// A reply kept: its seq, ts, payload (for a hand-over) and decoded batch (None: undecodable
/// or untrusted, a hole for the machine).
struct Item {
    seq: u64,
    ts: f64,
    payload: Vec<u8>,
    batch: Option<Batch>,
}

/// What the thread applied of a whole answer.
pub struct Applied {
    /// First and last seq applied (first > last: nothing, the anchor alone answered).
    pub first: u64,
    pub last: u64,
    /// (seq, ts) of the applied run, newest last; at most the ts ring's worth.
    pub records: VecDeque<(u64, f64)>,
    pub count: u64,
    pub blocks: u64,
}

/// How one request ended, for Python.
pub struct Outcome {
    pub id: u64,
    pub token: u64,
    /// Some: applied whole by the thread (then `items` is empty).
    pub applied: Option<Applied>,
    /// Every kept reply in arrival order, when not applied: (seq, ts, payload or None).
    pub items: Vec<(u64, f64, Option<Vec<u8>>)>,
    /// The end marker came.
    pub complete: bool,
    /// Why it ended before the end marker, if a limit or failure ended it (logged, counted).
    pub cut: Option<String>,
    /// Python cancelled it.
    pub cancelled: bool,
    pub counts: Counts,
}

/// What a request's replies were, counted as they are read (a running request's and its outcome's).
#[derive(Default)]
pub struct Counts {
    /// Replies read, malformed ones and the end marker included (the request's budget).
    pub replies: u64,
    /// Replies decoded and trusted.
    pub good: u64,
    /// Replies that were not [b"", (topic,) seq8, payload] (skipped).
    pub junk_frames: u64,
    /// Payloads that did not decode or were untrusted: the first few (kind, detail), and how many.
    pub bad: Vec<(&'static str, String)>,
    pub bad_count: u64,
    /// Events left out of decoded replies, per reason.
    pub skipped: HashMap<String, u64>,
}

impl Outcome {
    /// `req`'s outcome with nothing applied and no reply handed over (yet): the one place an
    /// outcome is made, for a request that never ran and for one that ended.
    fn new(
        req: &Request,
        complete: bool,
        cut: Option<String>,
        cancelled: bool,
        counts: Counts,
    ) -> Outcome {
        Outcome {
            id: req.id,
            token: req.token,
            applied: None,
            items: Vec::new(),
            complete,
            cut,
            cancelled,
            counts,
        }
    }
}

/// A request being carried out.
pub struct Running {
    pub req: Request,
    pub dealer: zmq::Socket,
    pub fd: i32,
    sent: Instant,
    /// The last decodable reply (or the send): `silent` counts from here.
    last_good: Instant,
    items: Vec<Item>,
    bytes: usize,
    complete: bool,
    counts: Counts,
}

/// Whether a running request has ended, and why.
pub enum Step {
    Going,
    /// Ended: cut short (with why) or not.
    Ended(Option<String>),
}

/// Open `req`'s DEALER (a fresh `socket`) and send the request; Err: its outcome, as it ended
/// at once (no socket, or the request refused).
pub fn begin(
    req: Request,
    socket: impl FnOnce() -> Result<zmq::Socket, String>,
) -> Result<Running, Box<Outcome>> {
    let dealer = match socket().and_then(|s| configure(s, &req)) {
        Ok(s) => s,
        Err(e) => return Err(failed(&req, format!("cannot open the replay socket: {e}"))),
    };
    let fd = match dealer.get_fd() {
        Ok(fd) => fd,
        Err(e) => return Err(failed(&req, format!("cannot open the replay socket: {e}"))),
    };
    let seq8 = req.from_seq.to_be_bytes();
    if dealer
        .send_multipart([&b""[..], &seq8[..]], zmq::DONTWAIT)
        .is_err()
    {
        return Err(failed(&req, "replay request refused (queue full)".into()));
    }
    let now = Instant::now();
    Ok(Running {
        req,
        dealer,
        fd,
        sent: now,
        last_good: now,
        items: Vec::new(),
        bytes: 0,
        complete: false,
        counts: Counts::default(),
    })
}

fn configure(sock: zmq::Socket, req: &Request) -> Result<zmq::Socket, String> {
    let err = |e: zmq::Error| e.to_string();
    let o = &req.opts;
    sock.set_rcvhwm(o.rcvhwm).map_err(err)?;
    sock.set_maxmsgsize(o.max_message_size).map_err(err)?;
    sock.set_reconnect_ivl(o.reconnect_ivl).map_err(err)?;
    sock.set_reconnect_ivl_max(o.reconnect_ivl_max)
        .map_err(err)?;
    if o.tcp_keepalive {
        sock.set_tcp_keepalive(1).map_err(err)?;
    }
    sock.set_ipv6(true).map_err(err)?;
    sock.connect(&req.endpoint)
        .map_err(|e| format!("cannot connect to {:?}: {e}", req.endpoint))?;
    Ok(sock)
}

/// An outcome for a request that never ran (its socket could not be opened, or was refused).
fn failed(req: &Request, why: String) -> Box<Outcome> {
    Box::new(Outcome::new(
        req,
        false,
        Some(why),
        false,
        Counts::default(),
    ))
}

impl Running {
    /// When the request ends if nothing more comes.
    pub fn due(&self) -> Instant {
        (self.last_good + self.req.silent).min(self.sent + self.req.deadline)
    }

    /// Read what has come (at most `visit` replies), judging each; then whether it ended.
    pub fn read(&mut self, visit: usize, limits: &wire::Limits) -> Step {
        let mut taken = 0;
        loop {
            let now = Instant::now();
            if self.complete {
                return Step::Ended(None);
            }
            if self.items.len() >= self.req.max_items || self.bytes >= self.req.max_bytes {
                // The machine holds no more of one answer; it asks for the rest (rule 4).
                return Step::Ended(None);
            }
            if now >= self.sent + self.req.deadline {
                return Step::Ended(Some(format!(
                    "past the replay deadline ({} s)",
                    self.req.deadline.as_secs_f64()
                )));
            }
            if self.counts.replies >= self.req.budget {
                return Step::Ended(Some(format!(
                    "past the reply budget ({} replies)",
                    self.req.budget
                )));
            }
            if now >= self.last_good + self.req.silent {
                return Step::Ended(None);
            }
            if taken >= visit {
                return Step::Going;
            }
            let Ok(frames) = self.dealer.recv_multipart(zmq::DONTWAIT) else {
                return Step::Going;
            };
            taken += 1;
            self.counts.replies += 1;
            self.reply(frames, limits);
        }
    }

    /// One reply: newer engines send [b"", topic, seq8, payload], older [b"", seq8, payload]
    /// (docs/protocol.md §4); the end marker is seq 0xFF x 8.
    fn reply(&mut self, mut frames: Vec<Vec<u8>>, limits: &wire::Limits) {
        let n = frames.len();
        let ok_shape = (n == 4 || n == 3) && frames[0].is_empty() && frames[n - 2].len() == 8;
        if !ok_shape {
            self.counts.junk_frames += 1;
            return;
        }
        let payload = frames.pop().unwrap_or_default();
        let seq8 = frames.pop().unwrap_or_default();
        let mut b = [0u8; 8];
        b.copy_from_slice(&seq8);
        let seq = u64::from_be_bytes(b);
        if seq == u64::MAX {
            self.complete = true;
            return;
        }
        self.bytes += payload.len();
        let (ts, batch) = match wire::decode(&payload, limits) {
            Ok(batch) => match wire::verdict(&batch) {
                None => (batch.ts, Some(batch)),
                Some((kind, detail)) => {
                    self.bad_payload(kind, detail);
                    (f64::NAN, None)
                }
            },
            Err(e) => {
                self.bad_payload("undecodable payload", e.message);
                (f64::NAN, None)
            }
        };
        if let Some(batch) = &batch {
            self.counts.good += 1;
            self.req.progress.fetch_add(1, Ordering::Relaxed);
            self.last_good = Instant::now();
            for (why, k) in &batch.skipped {
                *self.counts.skipped.entry(why.clone()).or_default() += k;
            }
        }
        self.items.push(Item {
            seq,
            ts,
            payload,
            batch,
        });
    }

    fn bad_payload(&mut self, kind: &'static str, detail: String) {
        self.counts.bad_count += 1;
        if self.counts.bad.len() < KEEP_BAD {
            self.counts.bad.push((kind, detail));
        }
    }

    /// Whether the answer is one the machine takes whole under `terms`: complete, every reply
    /// decodable, seqs without a hole from where `terms` let it start.
    fn whole(&self, terms: &Terms) -> bool {
        if !self.complete || self.counts.junk_frames > 0 || self.items.is_empty() {
            return false;
        }
        let from = self.req.from_seq;
        let mut items = self.items.iter();
        let Some(first) = items.next() else {
            return false;
        };
        if first.batch.is_none() {
            return false;
        }
        let mut prev = match terms.anchor {
            // Rule 7: the anchor seq with the ts it was applied with.
            Some(ts) if first.seq == from && first.ts == ts => first.seq,
            Some(_) => return false,
            None if first.seq == from || (terms.late_ok && first.seq > from) => first.seq,
            None => return false,
        };
        for it in items {
            // Rules 3-4: contiguous and decodable, or the machine must judge it.
            if it.batch.is_none() || it.seq != prev + 1 {
                return false;
            }
            prev = it.seq;
        }
        true
    }

    /// The request's end: apply the answer with `apply` when the machine takes it whole (given
    /// the batches and the request's `armed` flag, it returns the stored blocks, or None when it
    /// may not: stopped, disarmed, or the source handed something over since), else hand every
    /// reply over. `apply` is the one place `armed` is checked: under the index's write lock, so
    /// a disarm either comes before the check or after the answer is in the index.
    pub fn finish(
        self,
        cut: Option<String>,
        cancelled: bool,
        apply: impl FnOnce(&[&Batch], &AtomicBool) -> Option<u64>,
    ) -> Outcome {
        let terms = self.req.terms.filter(|_| !cancelled);
        let whole = terms.is_some_and(|t| self.whole(&t));
        let Running {
            req,
            items,
            complete,
            counts,
            ..
        } = self;
        let mut out = Outcome::new(&req, complete, cut, cancelled, counts);
        // `armed` is `apply`'s to check, under the index's lock: a check here could go stale.
        if whole {
            let skip = usize::from(terms.is_some_and(|t| t.anchor.is_some()));
            let run: Vec<&Batch> = items[skip..]
                .iter()
                .filter_map(|it| it.batch.as_ref())
                .collect();
            if let Some(blocks) = apply(&run, &req.armed) {
                let applied = &items[skip..];
                let mut records = VecDeque::with_capacity(applied.len().min(KEEP_RECORDS));
                for it in applied.iter().rev().take(KEEP_RECORDS).rev() {
                    records.push_back((it.seq, it.ts));
                }
                let (first, last) = match (applied.first(), applied.last()) {
                    (Some(f), Some(l)) => (f.seq, l.seq),
                    // The anchor alone: nothing applied (first > last says so).
                    _ => (req.from_seq + 1, req.from_seq),
                };
                out.applied = Some(Applied {
                    first,
                    last,
                    records,
                    count: applied.len() as u64,
                    blocks,
                });
                return out;
            }
        }
        out.items = items
            .into_iter()
            .map(|it| {
                let payload = it.batch.is_some().then_some(it.payload);
                (it.seq, it.ts, payload)
            })
            .collect();
        out
    }
}
