//! The native receive loop (docs/architecture.md, "The native loop"): one thread owns every
//! source's SUB socket and its monitor, applies in-order batches to the index itself, and hands
//! everything else to the Python recovery machine.
//!
//! Rule 1 is mirrored per source: `next_seq` (the machine's `last_seq + 1`) and `open`, the
//! fast path flag. Only Python opens it (`Command::Open`), and only once it has consumed every
//! hand-over of that source (`consumed == handed`), so the mirror always matches the
//! machine. Every hand-over closes it: a gap, an old seq, a payload that does not decode or is
//! untrusted, a malformed message, a monitor event, a quiet tick, and while it is closed every
//! message. The thread applies exactly what `SourceMachine.in_order` would have let the Python
//! fast path apply, and records `(seq, ts)` for Python to feed `on_applied` in bulk.
//!
//! The hand-over is one `Outbox` per receiver plus one pipe Python's event loop waits on: the
//! pipe is written when a hand-over (or a log line) lands in an empty outbox, so Python wakes per
//! batch of hand-overs. Batches the thread applied itself only need Python's bookkeeping (rule
//! 1's `on_applied`, counters): they wake it `NOTE_DELAY` after the first of them, or, when
//! they are one or two a source of many sources, up to `NOTE_MAX` after it (`note_due_at`), so
//! a source that sends one batch at a time does not cost the event loop a wake per message, nor
//! a fleet of them a drain per batch.
//! Nothing here panics into Python: the thread body runs under `catch_unwind`, and a thread
//! that stops for any reason leaves its reason in `Outbox::dead`.

use std::collections::{HashMap, VecDeque};
use std::os::raw::c_void;
use std::os::unix::io::RawFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use parking_lot::{Condvar, Mutex, RwLock};

use crate::index::{Index, WorkerName};
use crate::wire;

mod replay;
pub use replay::{
    Applied as ReplayApplied, Outcome as ReplayOutcome, Request as ReplayRequest, Terms,
};

/// Monitor events the Python driver acts on (the same mask as kvroute/_subscriber.py).
pub const MONITOR_EVENTS: i32 = (zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED
    | zmq_sys::ZMQ_EVENT_DISCONNECTED
    | zmq_sys::ZMQ_EVENT_CONNECT_RETRIED
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_AUTH
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq_sys::ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) as i32;

/// Seqs kept per source between two drains: the machine's ts ring holds 4,096, so older
/// records would only be overwritten there; they are counted (`Applied::elided`) instead.
const KEEP_RECORDS: usize = 4096;
/// How often the thread looks for quiet sources (and wakes when nothing arrives).
const QUIET_SCAN: Duration = Duration::from_millis(250);
/// Longest a source waits unread after a stale open for Python's next command (see
/// `Source::awaiting_open`; a flood's drain takes far less): a safety net, then it is read again.
const AWAIT_OPEN: Duration = Duration::from_secs(1);
/// Longest an applied batch's record waits in the outbox before Python is woken for it alone.
/// The index has it already (the apply lag is taken at apply); what waits is rule 1's
/// bookkeeping and the counters in `stats()`, far below any interval recovery acts on
/// (`quiet_interval`, replay timeouts). A wake costs the event loop ~25 µs (a drain, anyio's
/// reader re-registered): one per message at 1,024+ ranks, where each rank sends a few a second
/// (docs/performance.md, "Session 15, fleet").
const NOTE_DELAY: Duration = Duration::from_millis(2);
/// The shortest time between the starts of two looks that wait (nothing left to read), while
/// no replay runs. A thread that looked again as soon as it had read what the last look found
/// was woken for nearly every message while it kept up: at 4,096 sources a message is alone on
/// its source, so each cost this thread a wake-up, a switch and a look of its own (issue 19,
/// docs/performance.md "Session 14, fleet"). Waiting first lets what arrives meanwhile queue
/// up, so one look serves every source that sent. The wait ends early on anything Python asks
/// (`Shared::wake`: a command, a hold, room after a stall); messages wait at most this long.
const MIN_LOOK: Duration = Duration::from_millis(1);
/// Sources with applied records waiting, at most, for a wake at `NOTE_DELAY`: Python's work
/// per drain is mostly per source (~3 µs each, a record ~0.25 µs more), and the event loop's
/// other tasks wait behind a drain's chunk of it. Past this many, records wait until there are
/// `NOTE_BATCHING` a source or `NOTE_MAX` ran out: at 4,096 ranks each source sends a few
/// batches a second, so a drain every 2 ms held about one record a source and cost the event
/// loop ~2.9 µs a batch, the wake, the drain and the bookkeeping each paid per batch
/// (bench_fleet.py, docs/performance.md "Session 23").
const NOTE_SOURCES: usize = 64;
/// Records a source, on average, that make a drain of more than `NOTE_SOURCES` sources due.
const NOTE_BATCHING: usize = 8;
/// Longest an applied batch's record waits for Python when many sources send: the staleness
/// of rule 1's bookkeeping and of `stats()` (the index has the batch at once). Recovery reads
/// that bookkeeping only after a drain (every hand-over drains what the thread applied first),
/// and its intervals are seconds (`quiet_interval`, replay timeouts).
const NOTE_MAX: Duration = Duration::from_millis(500);
/// Readiness events taken per poll call (a look repeats the call while the list comes back full).
const POLL_EVENTS: usize = 4096;
const WAKER: Token = Token(usize::MAX);
/// The bit of a poll token that marks a replay DEALER (its request id below it); a source's
/// tokens (`token << 1`, its SUB, `| 1`, its monitor) stay below it (tokens < 2^62).
const REPLAY_BIT: usize = 1 << 63;
static MONITOR_IDS: AtomicU64 = AtomicU64::new(0);

/// The receive loop's settings (from `SubscriberConfig`).
#[derive(Clone, Debug)]
pub struct Settings {
    /// Messages taken from one socket per visit before the next ready socket's turn.
    pub visit: usize,
    /// Payload bytes taken from one socket per visit (at least one message).
    pub wakeup_bytes: usize,
    /// A source whose SUB had nothing to read this long gets a quiet tick.
    pub quiet: Duration,
    /// Bytes of hand-overs waiting for Python past which sources with a closed fast path are
    /// not read (their messages wait in libzmq's queue, bounded by its high-water mark).
    pub outbox_bytes: usize,
    /// Decode caps per batch.
    pub limits: wire::Limits,
    /// Nice steps the receive side's threads (this loop's, libzmq's I/O and reaper threads of
    /// both contexts) run below the thread that starts it (`lower_priority`).
    pub nice: i32,
}

/// Lower the calling thread's CPU priority by `steps` nice values (at most to 19). On Linux a
/// thread's nice is its own, and threads it starts inherit it; a refusal (a sandbox) leaves
/// the priority as it was. Elsewhere nice is per process: nothing is changed.
fn lower_priority(steps: i32) {
    #[cfg(target_os = "linux")]
    if steps > 0 {
        // SAFETY: plain syscalls on the calling thread's own id; errno read right after.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            *libc::__errno_location() = 0;
            let now = libc::getpriority(libc::PRIO_PROCESS, tid);
            if *libc::__errno_location() == 0 {
                libc::setpriority(libc::PRIO_PROCESS, tid, (now + steps).min(19));
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = steps;
}

/// Socket options of one SUB (intervals in ms, as libzmq takes them).
#[derive(Clone, Debug)]
pub struct SubOptions {
    pub rcvhwm: i32,
    pub max_message_size: i64,
    pub reconnect_ivl: i32,
    pub reconnect_ivl_max: i32,
    pub tcp_keepalive: bool,
}

/// What the thread hands to Python, in the order it happened per source.
pub enum Handover {
    /// A live message the fast path did not take, as it came (its frames).
    Message { token: u64, frames: Vec<Vec<u8>> },
    /// A monitor notification of the source's SUB.
    Monitor {
        token: u64,
        event: u16,
        value: u32,
        endpoint: String,
    },
    /// The SUB had nothing to read for the quiet interval.
    Quiet { token: u64 },
    /// A replay request ended (`Command::Replay`): applied whole, or its replies.
    Replay(Box<ReplayOutcome>),
}

/// The batches the thread applied for one source since the last drain.
#[derive(Default)]
pub struct Applied {
    /// (seq, ts, apply lag in s: wall clock at apply minus ts), oldest first; at most 4,096.
    pub records: VecDeque<(u64, f64, f64)>,
    /// Applied batches older than `records` (counted, not listed).
    pub elided: u64,
    /// Blocks the index stored for them.
    pub blocks: u64,
    /// Events left out of decoded batches, per reason.
    pub skipped: HashMap<String, u64>,
    /// Every applied batch's payload, oldest first, while the source keeps them (`Command::Open`'s
    /// `keep`): (seq, ts, stored blocks, the engine's payload bytes). Never elided: a raw tap (the
    /// JetStream relay) republishes each one.
    pub payloads: Vec<(u64, f64, u64, Vec<u8>)>,
}

/// Everything waiting for Python.
#[derive(Default)]
pub struct Outbox {
    pub applied: HashMap<u64, Applied>,
    pub handovers: Vec<Handover>,
    /// The index's refusal warnings (logged on "kvroute.index").
    pub logs: Vec<String>,
    /// Why the thread stopped, when it did other than by `Command::Stop`.
    pub dead: Option<String>,
    bytes: usize,
    signaled: bool,
    /// Applied records are waiting, not yet signaled: when the first of them came (`note_due_at`).
    first_noted: Option<Instant>,
    /// Applied records since the last drain.
    noted: usize,
    /// The thread skipped closed sources for lack of room: wake it once Python drained.
    stalled: bool,
}

/// What Python asks of the thread.
pub enum Command<K> {
    /// Watch a SUB (connected, with its monitor) for the source `token`, applying to `key`.
    Add {
        token: u64,
        key: K,
        sub: zmq::Socket,
        mon: zmq::Socket,
        alive: Arc<AtomicBool>,
    },
    /// Stop watching the source and close its sockets.
    Remove { token: u64 },
    /// Open the fast path at `next_seq`, if Python consumed all `consumed` hand-overs; with
    /// `keep`, each batch applied on it keeps its payload for Python (`Applied::payloads`).
    Open {
        token: u64,
        next_seq: u64,
        consumed: u64,
        keep: bool,
    },
    /// Close the fast path (a listener wants every batch as an event).
    Close { token: u64 },
    /// Park the source (leave its messages in libzmq's queue and the engine's PUB queue while
    /// a replay of it is in flight: Python would only hold them) or read it again.
    Park { token: u64, parked: bool },
    /// Carry out a replay request on a DEALER of the thread's own (`replay`).
    Replay(Box<ReplayRequest>),
    /// End a replay request now with what it got (Python gave up waiting, or gives way to
    /// another source): handed over, never applied.
    CancelReplay { id: u64 },
    /// End the thread, closing every socket.
    Stop,
}

/// A libzmq context of our own (the vendored libzmq, not pyzmq's), with room for the fleet.
pub struct Context(*mut c_void);

// SAFETY: a libzmq context is thread-safe (zmq_ctx_new(3)).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// A context allowing `max_sockets` sockets.
    pub fn new(max_sockets: i32) -> Result<Context, String> {
        // SAFETY: plain libzmq calls on a context this function owns.
        unsafe {
            let ctx = zmq_sys::zmq_ctx_new();
            if ctx.is_null() {
                return Err(zmq_error());
            }
            zmq_sys::zmq_ctx_set(ctx, zmq_sys::ZMQ_BLOCKY as i32, 0);
            if zmq_sys::zmq_ctx_set(ctx, zmq_sys::ZMQ_MAX_SOCKETS as i32, max_sockets) != 0 {
                let e = zmq_error();
                zmq_sys::zmq_ctx_term(ctx);
                return Err(e);
            }
            Ok(Context(ctx))
        }
    }

    /// Another context allowing as many sockets as this one (the replay DEALERs', `start`).
    fn sibling(&self) -> Result<Context, String> {
        // SAFETY: reading an option of a live context this struct owns.
        let max_sockets = unsafe { zmq_sys::zmq_ctx_get(self.0, zmq_sys::ZMQ_MAX_SOCKETS as i32) };
        if max_sockets < 0 {
            return Err(zmq_error());
        }
        Context::new(max_sockets)
    }

    /// A DEALER for one replay request (`replay::begin` sets its options and connects it).
    fn dealer(&self) -> Result<zmq::Socket, String> {
        self.socket(zmq_sys::ZMQ_DEALER as i32)
    }

    fn socket(&self, kind: i32) -> Result<zmq::Socket, String> {
        // SAFETY: the context outlives every socket (the receiver closes them before `Drop`).
        let raw = unsafe { zmq_sys::zmq_socket(self.0, kind) };
        if raw.is_null() {
            return Err(zmq_error());
        }
        // SAFETY: a fresh socket pointer, owned by the returned Socket from here on.
        let sock = unsafe { zmq::Socket::from_raw(raw) };
        sock.set_linger(0).map_err(|e| e.to_string())?;
        Ok(sock)
    }

    /// A SUB with `opts`, monitored, connected to `endpoint`; returns (sub, monitor PAIR).
    pub fn subscribe(
        &self,
        endpoint: &str,
        topic: &[u8],
        opts: &SubOptions,
    ) -> Result<(zmq::Socket, zmq::Socket), String> {
        let err = |e: zmq::Error| e.to_string();
        let mut sub = self.socket(zmq_sys::ZMQ_SUB as i32)?;
        sub.set_rcvhwm(opts.rcvhwm).map_err(err)?;
        sub.set_maxmsgsize(opts.max_message_size).map_err(err)?;
        sub.set_reconnect_ivl(opts.reconnect_ivl).map_err(err)?;
        sub.set_reconnect_ivl_max(opts.reconnect_ivl_max)
            .map_err(err)?;
        if opts.tcp_keepalive {
            sub.set_tcp_keepalive(1).map_err(err)?;
        }
        // Engines may publish on IPv6 ([::1] or a global address); libzmq's default is IPv4 only
        // (the Python receiver's context sets the same, kvroute/_client.py).
        sub.set_ipv6(true).map_err(err)?;
        sub.set_subscribe(topic).map_err(err)?;
        // Monitor before connecting: a loopback handshake can complete at once.
        let addr = format!(
            "inproc://kvroute-native-monitor-{}",
            MONITOR_IDS.fetch_add(1, Ordering::Relaxed)
        );
        sub.monitor(&addr, MONITOR_EVENTS).map_err(err)?;
        let mon = self.socket(zmq_sys::ZMQ_PAIR as i32)?;
        mon.connect(&addr).map_err(err)?;
        if let Err(e) = sub.connect(endpoint) {
            stop_monitor(&mut sub);
            return Err(format!("cannot connect to {endpoint:?}: {e}"));
        }
        Ok((sub, mon))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every socket of this context is closed by now (the thread drops them first).
        unsafe {
            zmq_sys::zmq_ctx_term(self.0);
        }
    }
}

fn zmq_error() -> String {
    // SAFETY: zmq_errno/zmq_strerror are always callable; strerror returns a static string.
    unsafe {
        let e = zmq_sys::zmq_errno();
        std::ffi::CStr::from_ptr(zmq_sys::zmq_strerror(e))
            .to_string_lossy()
            .into_owned()
    }
}

/// A hold on the thread's applying (`Shared::hold`): asked by Python, taken by the thread
/// between two visits, so the index and the records handed to Python agree while it lasts.
#[derive(Default)]
struct Hold {
    /// Python wants the thread held.
    wanted: bool,
    /// The thread is waiting, applying nothing, until `wanted` clears.
    holding: bool,
    /// The thread has ended: it applies nothing more, which is as good as held.
    exited: bool,
}

/// What Python and the thread share.
pub struct Shared<K> {
    pub outbox: Mutex<Outbox>,
    commands: Mutex<Vec<Command<K>>>,
    hold: Mutex<Hold>,
    hold_cv: Condvar,
    /// Python asked something since the thread's last `pause` (ends it early).
    poked: Mutex<bool>,
    poke_cv: Condvar,
    waker: Waker,
    /// The pipe's write end: one byte when the outbox turns non-empty.
    notify_w: RawFd,
    /// The pipe's read end, which Python's event loop waits on.
    pub notify_r: RawFd,
}

impl<K> Shared<K> {
    /// Queue a command and wake the thread.
    pub fn command(&self, cmd: Command<K>) {
        self.commands.lock().push(cmd);
        self.wake();
    }

    /// Wake the thread: out of its poll, and out of a `pause`.
    fn wake(&self) {
        // A failed wake means the thread is gone; its `dead` says why.
        let _ = self.waker.wake();
        *self.poked.lock() = true;
        self.poke_cv.notify_all();
    }

    /// Called by the thread: wait up to `d` unless Python asks something meanwhile.
    fn pause(&self, d: Duration) {
        let mut poked = self.poked.lock();
        if !*poked {
            self.poke_cv.wait_for(&mut poked, d);
        }
        *poked = false;
    }

    /// Stop the thread applying until `release`: returns once it waits between two visits (or
    /// has ended), so everything it applied is in the outbox, and nothing more is applied.
    pub fn hold(&self) {
        let mut h = self.hold.lock();
        h.wanted = true;
        self.wake();
        while !(h.holding || h.exited) {
            // Woken by the thread; the timeout only re-checks (a wake lost to a busy thread).
            self.hold_cv.wait_for(&mut h, Duration::from_millis(50));
            if !(h.holding || h.exited) {
                self.wake();
            }
        }
    }

    /// End a `hold`: the thread applies again.
    pub fn release(&self) {
        let mut h = self.hold.lock();
        h.wanted = false;
        self.hold_cv.notify_all();
    }

    /// Called by the thread between visits: wait while Python holds it. True when it did (the
    /// commands Python sent meanwhile are then carried out before the next visit).
    fn held(&self) -> bool {
        let mut h = self.hold.lock();
        if !h.wanted {
            return false;
        }
        h.holding = true;
        self.hold_cv.notify_all();
        while h.wanted {
            self.hold_cv.wait(&mut h);
        }
        h.holding = false;
        true
    }

    fn exited(&self) {
        let mut h = self.hold.lock();
        h.exited = true;
        self.hold_cv.notify_all();
    }

    /// Take everything waiting; empties the notify pipe first, so a later push signals again.
    pub fn drain(&self) -> Outbox {
        let mut buf = [0u8; 64];
        // SAFETY: reading a non-blocking pipe this struct owns into a local buffer.
        while unsafe { libc::read(self.notify_r, buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
        let mut out = self.outbox.lock();
        let stalled = out.stalled;
        let taken = std::mem::take(&mut *out);
        out.dead.clone_from(&taken.dead);
        drop(out);
        if stalled {
            self.wake();
        }
        taken
    }

    /// `n` applied records joined the outbox: signal when they are due (`note_due_at`).
    fn note(&self, out: &mut Outbox, n: usize, now: Instant) {
        out.noted += n;
        out.first_noted.get_or_insert(now);
        self.signal_notes(out, now);
    }

    /// Signal the applied records waiting unsignaled once they are due (`note_due_at`); else
    /// when they will be, unless more arrive first (None: nothing waits).
    fn signal_notes(&self, out: &mut Outbox, now: Instant) -> Option<Instant> {
        let first = out.first_noted.filter(|_| !out.signaled)?;
        let due = note_due_at(first, out.noted, out.applied.len(), out.bytes);
        if due <= now {
            self.signal(out);
            return None;
        }
        Some(due)
    }

    fn signal(&self, out: &mut Outbox) {
        if !out.signaled {
            out.signaled = true;
            let b = 1u8;
            // SAFETY: a one-byte write to our own non-blocking pipe; a full pipe is already signaled.
            unsafe {
                libc::write(self.notify_w, (&b as *const u8).cast(), 1);
            }
        }
    }
}

impl<K> Drop for Shared<K> {
    fn drop(&mut self) {
        // SAFETY: the pipe's two ends are ours and closed once.
        unsafe {
            libc::close(self.notify_r);
            libc::close(self.notify_w);
        }
    }
}

fn pipe() -> Result<(RawFd, RawFd), String> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe(2) into a local array, then fcntl on the two descriptors it returned.
    unsafe {
        if libc::pipe(fds.as_mut_ptr()) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        for fd in fds {
            libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK);
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
    Ok((fds[0], fds[1]))
}

struct Source<K> {
    key: K,
    /// Cleared by Python (synchronously, before it removes the worker from the index): checked
    /// under the index's write lock, so nothing is applied for a source once it is stopped.
    alive: Arc<AtomicBool>,
    sub: zmq::Socket,
    mon: zmq::Socket,
    sub_fd: RawFd,
    mon_fd: RawFd,
    next_seq: u64,
    open: bool,
    /// The fast path keeps each applied batch's payload (`Command::Open`).
    keep: bool,
    /// Not read while set (its monitor still is): see `Command::Park`.
    parked: bool,
    /// Not read while set (its monitor still is), until Python's next command for it: set by a
    /// stale open (hand-overs Python had not taken when it sent it). In a flood the thread hands
    /// a closed source's messages over faster than the event loop takes them, so every open
    /// Python sent was stale when it landed and the source stayed on the slow path until the
    /// flood ended (23-30 batches a source at a burst's start; never under a profiler). Unread,
    /// its hand-overs stop growing: Python takes the rest, and the open it sends then is exact.
    /// Python follows every open it sent with a command (an open, or a park or unpark where
    /// the machine cannot be followed on the fast path); should none come, the source is read
    /// again after `AWAIT_OPEN` (`Loop::scan`), as before there was this wait. Since when.
    awaiting_open: Option<Instant>,
    /// Hand-overs of this source so far (Python opens the fast path only when it consumed all).
    handed: u64,
    /// Of those, the ones that may change the machine's mind about a replay answer: messages,
    /// quiet ticks and monitor events other than a completed handshake (a first connect changes
    /// nothing; a reconnect comes after a disconnect, which counts). A replay answer is applied
    /// only if none came since the request (`ReplayRequest::consumed`).
    risky: u64,
    /// Batches the fast path applied so far. A replay answer is applied whole only if Python
    /// had recorded all of them when it asked (`ReplayRequest::applied_seen`): the machine's
    /// terms were worked out from its `last_seq`, and a live batch applied meanwhile would put
    /// the answer's first seqs behind the index.
    applied: u64,
    last_read: Instant,
}

impl<K> Drop for Source<K> {
    fn drop(&mut self) {
        stop_monitor(&mut self.sub);
    }
}

/// Detach `sub`'s monitor before the SUB (and the monitor's reading end) close: libzmq's I/O
/// thread reports a SUB's events with a blocking send to the monitor, so an event of a
/// connection still being torn down (a handshake completing, a disconnect) sent once the
/// reading PAIR is gone would block that thread for good, and with it every socket of the
/// context (issue 19). Without a monitor, later events are dropped.
fn stop_monitor(sub: &mut zmq::Socket) {
    // SAFETY: a live socket of this thread; a null endpoint only stops its monitor.
    unsafe {
        zmq_sys::zmq_socket_monitor(sub.as_mut_ptr(), std::ptr::null(), 0);
    }
}

/// Let libzmq carry out the commands `sub`'s own thread owes it, reading no message. On a
/// reconnect libzmq resends a SUB's subscription only once the socket's own thread processes
/// the reconnect (a "hiccup" command), inside some call on that socket (a receive, a
/// getsockopt). A source left unread (parked while its replay runs, as after every reconnect
/// for the identity check, or stalled for room) that skipped this stayed unsubscribed from the
/// new connection: the engine's PUB dropped everything it published until the source was read
/// again (found later as a gap or by the quiet probe, a replay each).
fn process_commands(sub: &zmq::Socket) {
    // ZMQ_EVENTS processes pending commands and takes nothing from the queue; its answer
    // (and an error, on a socket about to be removed) does not matter here.
    let _ = sub.get_events();
}

/// Start the receive thread; returns what Python shares with it.
pub fn start<K: WorkerName + 'static>(
    index: Arc<RwLock<Index<K>>>,
    settings: Settings,
    ctx: Arc<Context>,
) -> Result<Arc<Shared<K>>, String> {
    let poll = Poll::new().map_err(|e| e.to_string())?;
    let waker = Waker::new(poll.registry(), WAKER).map_err(|e| e.to_string())?;
    // Replay DEALERs live in a context of their own, with no inproc endpoint: libzmq 4.3.4's
    // reaper walks its context's whole endpoint map for every socket it closes
    // (`ctx_t::unregister_endpoints`), and the sources' context holds one per SUB (its
    // monitor's). In the SUBs' context a cold sync of 4,096 sources closed 4,096 DEALERs over a
    // 4,096-entry map: 15 % of the client core's time in `std::_Rb_tree_increment`.
    let replay_ctx = Arc::new(ctx.sibling()?);
    if settings.nice > 0 {
        // Ingest yields to the event loop, whose thread serves the router's requests: on a
        // saturated core the loop's lag p99 halved at nice 5 (docs/performance.md, "Session
        // 15, fleet"). libzmq starts a context's I/O and reaper threads with its first socket,
        // on the thread that makes it: each context's first socket is made on a thread
        // already lowered, so they inherit its nice (a context in use keeps its threads).
        let nice = settings.nice;
        std::thread::scope(|s| {
            s.spawn(|| {
                lower_priority(nice);
                drop(ctx.socket(zmq_sys::ZMQ_PAIR as i32)?);
                drop(replay_ctx.socket(zmq_sys::ZMQ_PAIR as i32)?);
                Ok::<(), String>(())
            })
            .join()
            .map_err(|_| "the thread starting libzmq's threads panicked".to_string())?
        })?;
    }
    let (notify_r, notify_w) = pipe()?;
    let shared = Arc::new(Shared {
        outbox: Mutex::new(Outbox::default()),
        commands: Mutex::new(Vec::new()),
        hold: Mutex::new(Hold::default()),
        hold_cv: Condvar::new(),
        poked: Mutex::new(false),
        poke_cv: Condvar::new(),
        waker,
        notify_w,
        notify_r,
    });
    let thread_shared = shared.clone();
    std::thread::Builder::new()
        .name("kvroute-recv".into())
        .spawn(move || {
            lower_priority(settings.nice);
            let sh = thread_shared.clone();
            let result = catch_unwind(AssertUnwindSafe(move || {
                Loop {
                    poll,
                    index,
                    settings,
                    shared: thread_shared,
                    sources: HashMap::new(),
                    backlog: VecDeque::new(),
                    in_backlog: HashMap::new(),
                    stalled: Vec::new(),
                    replays: HashMap::new(),
                    replays_ready: Vec::new(),
                    replay_ctx,
                    _ctx: ctx,
                }
                .run()
            }));
            sh.exited();
            let why = match result {
                Ok(Ok(())) => return,
                Ok(Err(e)) => e,
                Err(panic) => panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into()),
            };
            let mut out = sh.outbox.lock();
            out.dead = Some(why);
            sh.signal(&mut out);
        })
        .map_err(|e| e.to_string())?;
    Ok(shared)
}

/// One applied batch before it reaches the outbox: (seq, ts, stored blocks, skipped events,
/// its payload if the source keeps them).
type Record = (u64, f64, u64, Vec<(String, u64)>, Option<Vec<u8>>);

/// How a visit to a source ended.
enum Visit {
    /// Read to EAGAIN: its descriptor signals the next arrival.
    Done,
    /// Stopped at the visit's cap: read again next round without waiting.
    More,
    /// Not read for lack of room in the outbox: read again once Python drained it.
    Stalled,
}

struct Loop<K: WorkerName> {
    poll: Poll,
    index: Arc<RwLock<Index<K>>>,
    settings: Settings,
    shared: Arc<Shared<K>>,
    sources: HashMap<u64, Source<K>>,
    /// Sources whose SUB (or monitor) may have something to read, oldest first.
    backlog: VecDeque<u64>,
    in_backlog: HashMap<u64, ()>,
    /// Sources with messages waiting for room in the outbox (`Visit::Stalled`).
    stalled: Vec<u64>,
    /// Replay requests being carried out, by id.
    replays: HashMap<u64, replay::Running>,
    /// Replay requests whose DEALER may have something to read.
    replays_ready: Vec<u64>,
    // Last: dropped after `sources` and `replays`, so each context terminates once its sockets
    // are closed. The replay DEALERs' context (see `start`).
    replay_ctx: Arc<Context>,
    _ctx: Arc<Context>,
}

/// When applied records waiting since `first` wake Python: `records` of them from `sources`
/// sources, with `kept` payload bytes. `NOTE_DELAY` after the first while the drain is small
/// (`NOTE_SOURCES`), batches enough a source (`NOTE_BATCHING`) or keeps payloads (a raw tap
/// republishes them: its latency); else `NOTE_MAX` after it, or at the next record that makes
/// it so (`note` checks again).
fn note_due_at(first: Instant, records: usize, sources: usize, kept: usize) -> Instant {
    if sources <= NOTE_SOURCES || records >= NOTE_BATCHING * sources || kept > 0 {
        first + NOTE_DELAY
    } else {
        first + NOTE_MAX
    }
}

fn now_wall() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl<K: WorkerName> Loop<K> {
    fn run(mut self) -> Result<(), String> {
        let mut events = Events::with_capacity(POLL_EVENTS);
        let mut next_scan = Instant::now() + QUIET_SCAN;
        // The newest look taken while kvroute was caught up: every ready socket read to the
        // end and every hand-over taken by Python. Quiet is measured up to it only.
        let mut caught_up_look = Instant::now();
        let mut last_look = Instant::now();
        loop {
            let caught_up = self.backlog.is_empty()
                && self.stalled.is_empty()
                && self.shared.outbox.lock().handovers.is_empty();
            let note_due = self
                .shared
                .signal_notes(&mut self.shared.outbox.lock(), Instant::now());
            let mut timeout = if self.backlog.is_empty() && self.replays_ready.is_empty() {
                // Wake for the next quiet scan, the next replay request's timer, or to signal
                // the applied records waiting.
                let due = self.replays.values().map(replay::Running::due).min();
                let wake = [due, note_due]
                    .into_iter()
                    .flatten()
                    .fold(next_scan, Instant::min);
                wake.saturating_duration_since(Instant::now())
            } else {
                Duration::ZERO
            };
            if !timeout.is_zero() && self.replays.is_empty() {
                // About to wait for readiness: not sooner than MIN_LOOK after the last look
                // began. Not while a replay runs: a cold sync is thousands of request round
                // trips (with this wait in each, session 14's 4,096-rank syncs took 10-17 s
                // against 9-13 s at load 15-19).
                let early = MIN_LOOK.saturating_sub(last_look.elapsed());
                if !early.is_zero() {
                    self.shared.pause(early);
                    timeout = timeout.saturating_sub(early);
                }
            }
            // One look: polls until one returns less than a full list, so every descriptor
            // that turned readable before `looked` is marked (a full list may have left some
            // in the kernel's ready list).
            let looked = loop {
                let start = Instant::now();
                if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(format!("poll failed: {e}"));
                    }
                }
                for ev in events.iter() {
                    let t = ev.token();
                    if t == WAKER {
                        continue;
                    }
                    if t.0 & REPLAY_BIT != 0 {
                        self.replays_ready.push((t.0 & !REPLAY_BIT) as u64);
                    } else {
                        self.mark(t.0 as u64 >> 1);
                    }
                }
                if events.iter().count() < POLL_EVENTS {
                    break start;
                }
                timeout = Duration::ZERO;
            };
            last_look = looked;
            if caught_up {
                caught_up_look = looked;
            }
            self.shared.held();
            if !self.commands()? {
                return Ok(());
            }
            if !self.stalled.is_empty()
                && self.shared.outbox.lock().bytes < self.settings.outbox_bytes
            {
                // Python drained (its drain woke us): the stalled sources' turn again.
                for token in std::mem::take(&mut self.stalled) {
                    if self.sources.contains_key(&token) {
                        self.backlog.push_back(token);
                    } else {
                        self.in_backlog.remove(&token);
                    }
                }
            }
            if !self.round()? {
                return Ok(());
            }
            self.replay_round();
            // Quiet is judged as of a look, never as of the end of the round: a round can
            // last long (a flood, a busy core, the index lock) while sources it already read
            // receive more, which only the next look reports. And only as of a look taken
            // caught up: while the thread (or Python, with hand-overs waiting) is behind,
            // silence is not counted, so kvroute's own slowness probes no one. A source is
            // quiet when that look found nothing for it and it was read last `quiet` before.
            let now = Instant::now();
            if now >= next_scan {
                next_scan = now + QUIET_SCAN;
                self.scan(caught_up_look);
            }
        }
    }

    fn mark(&mut self, token: u64) {
        if self.sources.contains_key(&token) && self.in_backlog.insert(token, ()).is_none() {
            self.backlog.push_back(token);
        }
    }

    /// Carry out Python's commands; false on `Stop`.
    fn commands(&mut self) -> Result<bool, String> {
        let cmds = std::mem::take(&mut *self.shared.commands.lock());
        for cmd in cmds {
            match cmd {
                Command::Add {
                    token,
                    key,
                    sub,
                    mon,
                    alive,
                } => {
                    let sub_fd = sub.get_fd().map_err(|e| e.to_string())?;
                    let mon_fd = mon.get_fd().map_err(|e| e.to_string())?;
                    let reg = self.poll.registry();
                    reg.register(
                        &mut SourceFd(&sub_fd),
                        Token((token << 1) as usize),
                        Interest::READABLE,
                    )
                    .map_err(|e| format!("cannot watch a SUB: {e}"))?;
                    reg.register(
                        &mut SourceFd(&mon_fd),
                        Token(((token << 1) | 1) as usize),
                        Interest::READABLE,
                    )
                    .map_err(|e| format!("cannot watch a monitor: {e}"))?;
                    self.sources.insert(
                        token,
                        Source {
                            key,
                            alive,
                            sub,
                            mon,
                            sub_fd,
                            mon_fd,
                            next_seq: 0,
                            open: false,
                            keep: false,
                            parked: false,
                            awaiting_open: None,
                            handed: 0,
                            risky: 0,
                            applied: 0,
                            last_read: Instant::now(),
                        },
                    );
                    // Something may be queued already: an edge comes only after a read found none.
                    self.mark(token);
                }
                Command::Remove { token } => {
                    if let Some(src) = self.sources.remove(&token) {
                        let reg = self.poll.registry();
                        // Before the sockets close: their descriptor numbers are reused at once.
                        let _ = reg.deregister(&mut SourceFd(&src.sub_fd));
                        let _ = reg.deregister(&mut SourceFd(&src.mon_fd));
                        drop(src);
                    }
                    self.in_backlog.remove(&token);
                    self.backlog.retain(|t| *t != token);
                }
                Command::Open {
                    token,
                    next_seq,
                    consumed,
                    keep,
                } => {
                    if let Some(src) = self.sources.get_mut(&token) {
                        // A stale open (hand-overs Python has not seen yet) is not carried
                        // out, and the source waits unread for Python's next command (see
                        // `Source::awaiting_open`): Python opens again once it has them all.
                        if consumed != src.handed {
                            src.awaiting_open.get_or_insert_with(Instant::now);
                        } else {
                            if next_seq != u64::MAX {
                                src.open = true;
                                src.keep = keep;
                                src.next_seq = next_seq;
                            }
                            if src.awaiting_open.take().is_some() {
                                // Unread since the stale open: no edge will say it has more.
                                src.last_read = Instant::now();
                                self.mark(token);
                            }
                        }
                    }
                }
                Command::Park { token, parked } => {
                    if let Some(src) = self.sources.get_mut(&token) {
                        let awaiting = src.awaiting_open.take().is_some();
                        let was = std::mem::replace(&mut src.parked, parked) || awaiting;
                        if was && !parked {
                            // Silence is measured from here (it was not read while parked), and
                            // it was not read to EAGAIN: no edge will say it has more.
                            src.last_read = Instant::now();
                            self.mark(token);
                        }
                    }
                }
                Command::Close { token } => {
                    if let Some(src) = self.sources.get_mut(&token) {
                        src.open = false;
                        if src.awaiting_open.take().is_some() && !src.parked {
                            src.last_read = Instant::now();
                            self.mark(token);
                        }
                    }
                }
                Command::Replay(req) => self.begin_replay(*req),
                Command::CancelReplay { id } => self.end_replay(id, None, true),
                // The commands after it are dropped with this loop's iterator (their sockets close).
                Command::Stop => return Ok(false),
            }
        }
        Ok(true)
    }

    /// One round: a visit to every source in the backlog, in turn; false on `Stop`.
    fn round(&mut self) -> Result<bool, String> {
        let n = self.backlog.len();
        for _ in 0..n {
            let Some(token) = self.backlog.pop_front() else {
                break;
            };
            self.in_backlog.remove(&token);
            // Python held the thread: what it asked meanwhile (a fast path closed for a new
            // listener, `NativeReceiver.hold`) is carried out before anything more is applied.
            if self.shared.held() && !self.commands()? {
                return Ok(false);
            }
            match self.visit(token) {
                Visit::Done => {}
                Visit::More => {
                    self.in_backlog.insert(token, ());
                    self.backlog.push_back(token);
                }
                Visit::Stalled => {
                    // Still counted as in the backlog: not quiet, and not marked twice.
                    self.in_backlog.insert(token, ());
                    self.stalled.push(token);
                }
            }
        }
        Ok(true)
    }

    /// Open a replay request's DEALER and send it; a request that cannot be sent ends at once.
    ///
    /// The source's fast path closes here, as the machine's `in_order` does while a replay is in
    /// flight: a live batch the thread applied after the answer would go into the index behind
    /// the answer's newer seqs (a store a replayed removal undid, back), and one applied before
    /// it would put the answer's first seqs behind the index. Python opens it again afterwards.
    fn begin_replay(&mut self, req: ReplayRequest) {
        if let Some(src) = self.sources.get_mut(&req.token) {
            src.open = false;
        }
        let ctx = self.replay_ctx.clone();
        match replay::begin(req, || ctx.dealer()) {
            Ok(running) => {
                let id = running.req.id;
                let fd = running.fd;
                let registered = self.poll.registry().register(
                    &mut SourceFd(&fd),
                    Token(REPLAY_BIT | id as usize),
                    Interest::READABLE,
                );
                self.replays.insert(id, running);
                if let Err(e) = registered {
                    self.end_replay(
                        id,
                        Some(format!("cannot watch the replay socket: {e}")),
                        false,
                    );
                    return;
                }
                // Read at once: the descriptor is edge-triggered, and reading resets it.
                self.replays_ready.push(id);
            }
            Err(outcome) => self.hand_over(*outcome, Vec::new()),
        }
    }

    /// Read every replay request that may have something, and end those whose time is up.
    fn replay_round(&mut self) {
        if self.replays.is_empty() {
            self.replays_ready.clear();
            return;
        }
        self.shared.held();
        let now = Instant::now();
        let mut ready = std::mem::take(&mut self.replays_ready);
        ready.extend(
            self.replays
                .iter()
                .filter(|(_, r)| r.due() <= now)
                .map(|(id, _)| *id),
        );
        ready.sort_unstable();
        ready.dedup();
        let visit = self.settings.visit;
        for id in ready {
            let Some(r) = self.replays.get_mut(&id) else {
                continue;
            };
            match r.read(visit, &self.settings.limits) {
                replay::Step::Going => {
                    // Stopped at the visit's cap with more to read: again next round.
                    if r.dealer.get_events().is_ok_and(|e| e.contains(zmq::POLLIN)) {
                        self.replays_ready.push(id);
                    }
                }
                replay::Step::Ended(cut) => self.end_replay(id, cut, false),
            }
        }
    }

    /// End replay request `id` (closing its DEALER): applied whole if the machine's terms and
    /// the source's state allow, else its replies handed over.
    fn end_replay(&mut self, id: u64, cut: Option<String>, cancelled: bool) {
        let Some(r) = self.replays.remove(&id) else {
            return;
        };
        // Before the socket closes: its descriptor number is reused at once.
        let _ = self.poll.registry().deregister(&mut SourceFd(&r.fd));
        let token = r.req.token;
        let consumed = r.req.consumed;
        let applied_seen = r.req.applied_seen;
        let src = self.sources.get(&token);
        let index = &self.index;
        let mut logs = Vec::new();
        let outcome = r.finish(cut, cancelled, |run, armed| {
            // Only if the source handed nothing over since the request that may have changed
            // the machine's mind (a disconnect, a message: `Source::risky`), and the machine had
            // recorded every batch the fast path applied when it worked out the terms
            // (`Source::applied`).
            let src = src.filter(|s| s.risky == consumed && s.applied == applied_seen)?;
            let mut idx = index.write();
            if !src.alive.load(Ordering::SeqCst) || !armed.load(Ordering::SeqCst) {
                return None;
            }
            let mut blocks = 0;
            for batch in run {
                blocks += idx.apply_batch(&src.key, batch).stored_blocks;
            }
            logs.extend(idx.take_logs());
            Some(blocks)
        });
        self.hand_over(outcome, logs);
    }

    fn hand_over(&self, outcome: ReplayOutcome, mut logs: Vec<String>) {
        let mut out = self.shared.outbox.lock();
        out.bytes += outcome
            .items
            .iter()
            .map(|(_, _, p)| p.as_ref().map_or(0, Vec::len))
            .sum::<usize>();
        out.handovers.push(Handover::Replay(Box::new(outcome)));
        out.logs.append(&mut logs);
        self.shared.signal(&mut out);
    }

    /// Read `token`'s monitor, then up to one visit's worth of its messages.
    fn visit(&mut self, token: u64) -> Visit {
        let Some(src) = self.sources.get_mut(&token) else {
            return Visit::Done;
        };
        let shared = &*self.shared;
        // The monitor first: a disconnect must reach Python before any message read after it
        // (a restarted engine's first seqs must not pass for the old one's).
        let mut mon_events = Vec::new();
        while let Ok(frames) = src.mon.recv_multipart(zmq::DONTWAIT) {
            mon_events.push(frames);
        }
        let mut out_pending: Vec<Handover> = Vec::new();
        for frames in mon_events {
            if frames.len() != 2 || frames[0].len() != 6 {
                continue;
            }
            let event = u16::from_ne_bytes([frames[0][0], frames[0][1]]);
            let value =
                u32::from_ne_bytes([frames[0][2], frames[0][3], frames[0][4], frames[0][5]]);
            src.open = false;
            src.handed += 1;
            if u32::from(event) != zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED {
                src.risky += 1;
            }
            out_pending.push(Handover::Monitor {
                token,
                event,
                value,
                endpoint: String::from_utf8_lossy(&frames[1]).into_owned(),
            });
        }
        if (src.parked || src.awaiting_open.is_some()) && !src.open {
            // Its messages wait in libzmq's queue (then the engine's PUB queue); it has
            // something, or will, so it is not quiet: Python asked (a replay is in flight), or
            // has hand-overs of it to take.
            src.last_read = Instant::now();
            process_commands(&src.sub);
            if !out_pending.is_empty() {
                let mut out = shared.outbox.lock();
                out.handovers.append(&mut out_pending);
                shared.signal(&mut out);
            }
            return Visit::Done;
        }
        if (!src.open || src.keep) && shared.outbox.lock().bytes >= self.settings.outbox_bytes {
            // No room for more hand-overs (or kept payloads): leave this source's messages in
            // libzmq's queue until Python drains. It has something, so it is not quiet (kvroute
            // is slow).
            src.last_read = Instant::now();
            process_commands(&src.sub);
            let mut out = shared.outbox.lock();
            out.stalled = true;
            if !out_pending.is_empty() {
                out.handovers.append(&mut out_pending);
                shared.signal(&mut out);
            }
            return Visit::Stalled;
        }
        let wall = now_wall();
        let mut taken = 0usize;
        let mut bytes = 0usize;
        let mut more = false;
        let mut applied: Vec<Record> = Vec::new();
        let mut logs = Vec::new();
        let mut msg = zmq::Message::new();
        while taken < self.settings.visit && bytes < self.settings.wakeup_bytes {
            if src.sub.recv(&mut msg, zmq::DONTWAIT).is_err() {
                break;
            }
            taken += 1;
            src.last_read = Instant::now();
            // [topic, seq8, payload]: read the rest of the message's frames.
            let mut frames: Vec<zmq::Message> = Vec::with_capacity(3);
            let mut has_more = msg.get_more();
            frames.push(std::mem::replace(&mut msg, zmq::Message::new()));
            while has_more {
                let mut part = zmq::Message::new();
                if src.sub.recv(&mut part, zmq::DONTWAIT).is_err() {
                    break;
                }
                has_more = part.get_more();
                frames.push(part);
            }
            bytes += frames.iter().map(|f| f.len()).sum::<usize>();
            let seq = if frames.len() == 3 && frames[1].len() == 8 {
                let mut b = [0u8; 8];
                b.copy_from_slice(&frames[1]);
                Some(u64::from_be_bytes(b))
            } else {
                None
            };
            if let Some(seq) = seq {
                if src.open && seq == src.next_seq && seq != u64::MAX {
                    if let Ok(batch) = wire::decode(&frames[2], &self.settings.limits) {
                        if batch.ts.is_finite() && batch.untrusted.is_none() {
                            let stored = {
                                let mut idx = self.index.write();
                                if !src.alive.load(Ordering::SeqCst) {
                                    src.open = false;
                                    return Visit::Done;
                                }
                                let counts = idx.apply_batch(&src.key, &batch);
                                logs.extend(idx.take_logs());
                                counts.stored_blocks
                            };
                            src.next_seq = seq + 1;
                            src.applied += 1;
                            let payload = src.keep.then(|| frames[2].to_vec());
                            applied.push((seq, batch.ts, stored, batch.skipped, payload));
                            continue;
                        }
                    }
                }
            }
            src.open = false;
            src.handed += 1;
            src.risky += 1;
            out_pending.push(Handover::Message {
                token,
                frames: frames.iter().map(|f| f.to_vec()).collect(),
            });
        }
        if taken == self.settings.visit || bytes >= self.settings.wakeup_bytes {
            more = true;
        }
        let more = if more { Visit::More } else { Visit::Done };
        if applied.is_empty() && out_pending.is_empty() && logs.is_empty() {
            return more;
        }
        let mut out = shared.outbox.lock();
        let n_applied = applied.len();
        if !applied.is_empty() {
            let mut kept = 0;
            let entry = out.applied.entry(token).or_default();
            for (seq, ts, stored, skipped, payload) in applied {
                if entry.records.len() == KEEP_RECORDS {
                    entry.records.pop_front();
                    entry.elided += 1;
                }
                entry.records.push_back((seq, ts, wall - ts));
                entry.blocks += stored;
                for (why, n) in skipped {
                    *entry.skipped.entry(why).or_default() += n;
                }
                if let Some(p) = payload {
                    kept += p.len();
                    entry.payloads.push((seq, ts, stored, p));
                }
            }
            out.bytes += kept;
        }
        for h in &out_pending {
            if let Handover::Message { frames, .. } = h {
                out.bytes += frames.iter().map(Vec::len).sum::<usize>();
            }
        }
        if out_pending.is_empty() && logs.is_empty() {
            shared.note(&mut out, n_applied, Instant::now());
        } else {
            out.handovers.append(&mut out_pending);
            out.logs.append(&mut logs);
            shared.signal(&mut out);
        }
        more
    }

    /// Quiet ticks for sources whose SUB had nothing to read for the quiet interval, as of
    /// the caught-up look at `looked` (every source not marked then had nothing queued).
    fn scan(&mut self, looked: Instant) {
        let quiet = self.settings.quiet;
        let mut ticks = Vec::new();
        let now = Instant::now();
        let mut released = Vec::new();
        let mut logs = Vec::new();
        for (token, src) in self.sources.iter_mut() {
            if let Some(since) = src.awaiting_open {
                // No command came for a stale open: read it again (see `Source::awaiting_open`).
                // Python owes one, so this is a bug of its side: said, not only survived.
                if now.duration_since(since) >= AWAIT_OPEN {
                    src.awaiting_open = None;
                    src.last_read = now;
                    released.push(*token);
                    logs.push(format!(
                        "receive thread: no command for {} {:.1} s after an open it could not carry out; \
                         reading it again",
                        src.key.label(),
                        now.duration_since(since).as_secs_f64()
                    ));
                }
                continue;
            }
            // `duration_since` saturates: a source read after the look is not quiet.
            if src.parked
                || self.in_backlog.contains_key(token)
                || looked.duration_since(src.last_read) < quiet
            {
                continue;
            }
            src.last_read = looked;
            src.open = false;
            src.handed += 1;
            src.risky += 1;
            ticks.push(Handover::Quiet { token: *token });
        }
        if !ticks.is_empty() || !logs.is_empty() {
            let mut out = self.shared.outbox.lock();
            out.handovers.append(&mut ticks);
            out.logs.append(&mut logs);
            self.shared.signal(&mut out);
        }
        for token in released {
            self.mark(token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmp::encode as en;

    #[derive(Clone, PartialEq, Eq, Hash, Debug)]
    struct W(&'static str);

    impl WorkerName for W {
        fn label(&self) -> String {
            format!("{}/0", self.0)
        }
    }

    type Started = (Arc<Context>, Arc<RwLock<Index<W>>>, Arc<Shared<W>>);

    /// A receive thread over a fresh index: `io` libzmq I/O threads, the quiet interval and the
    /// outbox cap each test needs, everything else as the client's defaults.
    fn started(io: i32, quiet: Duration, outbox_bytes: usize) -> Started {
        let ctx = Arc::new(Context::new(io).unwrap());
        let index = Arc::new(RwLock::new(
            Index::<W>::new(crate::index::Limits::default()),
        ));
        let settings = Settings {
            visit: 64,
            wakeup_bytes: 1 << 20,
            quiet,
            outbox_bytes,
            limits: wire::Limits::default(),
            nice: 0,
        };
        let shared = start(index.clone(), settings, ctx.clone()).unwrap();
        (ctx, index, shared)
    }

    /// The SUB options every test subscribes with.
    const OPTS: SubOptions = SubOptions {
        rcvhwm: 1000,
        max_message_size: 1 << 20,
        reconnect_ivl: 20,
        reconnect_ivl_max: 100,
        tcp_keepalive: false,
    };

    /// A map-form batch with ts `ts` storing one block (hash `h`) of 4 tokens.
    fn payload(ts: f64, h: u64) -> Vec<u8> {
        let mut out = Vec::new();
        en::write_array_len(&mut out, 2).unwrap();
        en::write_f64(&mut out, ts).unwrap();
        en::write_array_len(&mut out, 1).unwrap();
        en::write_map_len(&mut out, 4).unwrap();
        en::write_str(&mut out, "type").unwrap();
        en::write_str(&mut out, "BlockStored").unwrap();
        en::write_str(&mut out, "block_hashes").unwrap();
        en::write_array_len(&mut out, 1).unwrap();
        en::write_uint(&mut out, h).unwrap();
        en::write_str(&mut out, "token_ids").unwrap();
        en::write_array_len(&mut out, 4).unwrap();
        for t in 0..4u64 {
            en::write_uint(&mut out, h * 10 + t).unwrap();
        }
        en::write_str(&mut out, "block_size").unwrap();
        en::write_uint(&mut out, 4).unwrap();
        out
    }

    fn send(pub_: &zmq::Socket, seq: u64, body: &[u8]) {
        let seq8 = seq.to_be_bytes();
        pub_.send_multipart([&b"kv"[..], &seq8[..], body], 0)
            .unwrap();
    }

    /// Open `token`'s fast path at seq 0, every hand-over of its subscribing (`got`) taken.
    fn open_at_zero(shared: &Shared<W>, token: u64, got: &[Outbox], keep: bool) {
        let consumed = got.iter().map(|o| o.handovers.len() as u64).sum::<u64>();
        shared.command(Command::Open {
            token,
            next_seq: 0,
            consumed,
            keep,
        });
        std::thread::sleep(Duration::from_millis(100));
    }

    /// A PUB on loopback and source `token` (worker `name`) subscribed to it on the thread,
    /// once its handshake is handed over: the PUB, and the outboxes drained until then.
    fn subscribed(
        ctx: &Context,
        shared: &Shared<W>,
        token: u64,
        name: &'static str,
        alive: Arc<AtomicBool>,
    ) -> (zmq::Socket, Vec<Outbox>) {
        let pub_ = ctx.socket(zmq_sys::ZMQ_PUB as i32).unwrap();
        pub_.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = pub_.get_last_endpoint().unwrap().unwrap();
        let (sub, mon) = ctx.subscribe(&endpoint, b"kv", &OPTS).unwrap();
        shared.command(Command::Add {
            token,
            key: W(name),
            sub,
            mon,
            alive,
        });
        let got = wait(shared, |g| {
            g.iter().flat_map(|o| &o.handovers).any(|h| {
                matches!(h, Handover::Monitor { event, .. }
                    if u32::from(*event) == zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            })
        });
        (pub_, got)
    }

    /// Drain until `done` holds on everything taken so far (at most 10 s).
    fn wait(shared: &Shared<W>, done: impl Fn(&[Outbox]) -> bool) -> Vec<Outbox> {
        let mut got = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            got.push(shared.drain());
            if done(&got) {
                return got;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("timed out");
    }

    fn applied(got: &[Outbox]) -> Vec<u64> {
        got.iter()
            .flat_map(|o| {
                o.applied
                    .values()
                    .flat_map(|a| a.records.iter().map(|r| r.0))
            })
            .collect()
    }

    fn handed(got: &[Outbox]) -> Vec<Option<u64>> {
        got.iter()
            .flat_map(|o| o.handovers.iter())
            .filter_map(|h| match h {
                Handover::Message { frames, .. } if frames.len() == 3 => {
                    Some(Some(u64::from_be_bytes(frames[1][..].try_into().unwrap())))
                }
                Handover::Message { .. } => Some(None),
                _ => None,
            })
            .collect()
    }

    fn quiet_ticks(got: &[Outbox]) -> Vec<u64> {
        got.iter()
            .flat_map(|o| o.handovers.iter())
            .filter_map(|h| match h {
                Handover::Quiet { token } => Some(*token),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_busy_thread_ticks_no_source_that_kept_sending() {
        // The thread is held up (here: the index lock, as a long apply or a busy core would)
        // for several quiet intervals while every source keeps sending every 20 ms. Sources
        // it read before it stalled must not look quiet when it resumes: each had messages
        // waiting all along. Once the sources really stop, every one gets its tick.
        const N: u64 = 8;
        let quiet = Duration::from_millis(500);
        let (ctx, index, shared) = started(256, quiet, 1 << 20);
        const NAMES: [&str; N as usize] = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let mut pubs = Vec::new();
        for token in 0..N {
            let pub_ = ctx.socket(zmq_sys::ZMQ_PUB as i32).unwrap();
            pub_.bind("tcp://127.0.0.1:*").unwrap();
            let endpoint = pub_.get_last_endpoint().unwrap().unwrap();
            let (sub, mon) = ctx.subscribe(&endpoint, b"kv", &OPTS).unwrap();
            shared.command(Command::Add {
                token,
                key: W(NAMES[token as usize]),
                sub,
                mon,
                alive: Arc::new(AtomicBool::new(true)),
            });
            pubs.push(pub_);
        }
        let connected = |g: &[Outbox], token: u64| {
            g.iter().flat_map(|o| &o.handovers).any(|h| {
                matches!(h, Handover::Monitor { token: t, event, .. }
                    if *t == token && u32::from(*event) == zmq_sys::ZMQ_EVENT_HANDSHAKE_SUCCEEDED)
            })
        };
        let got = wait(&shared, |g| (0..N).all(|t| connected(g, t)));
        for token in 0..N {
            let consumed = got
                .iter()
                .flat_map(|o| &o.handovers)
                .filter(|h| matches!(h, Handover::Monitor { token: t, .. } if *t == token))
                .count() as u64;
            shared.command(Command::Open {
                token,
                next_seq: 0,
                consumed,
                keep: false,
            });
        }
        std::thread::sleep(Duration::from_millis(100));
        let sending = Arc::new(AtomicBool::new(true));
        let publisher = {
            let sending = sending.clone();
            std::thread::spawn(move || {
                let mut seq = 0u64;
                while sending.load(Ordering::SeqCst) {
                    for (i, p) in pubs.iter().enumerate() {
                        send(
                            p,
                            seq,
                            &payload(1.0 + seq as f64, (i as u64) << 32 | (seq + 1)),
                        );
                    }
                    seq += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                seq
            })
        };
        let mut got = Vec::new();
        let until = Instant::now() + Duration::from_millis(600);
        while Instant::now() < until {
            got.push(shared.drain());
            std::thread::sleep(Duration::from_millis(10));
        }
        {
            // Four quiet intervals without a chance to apply anything.
            let _held = index.write();
            std::thread::sleep(4 * quiet);
        }
        let until = Instant::now() + 2 * quiet;
        while Instant::now() < until {
            got.push(shared.drain());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(quiet_ticks(&got), Vec::<u64>::new());
        assert!(handed(&got).is_empty());
        // Every source was applied in order throughout.
        for token in 0..N {
            let seqs: Vec<u64> = got
                .iter()
                .filter_map(|o| o.applied.get(&token))
                .flat_map(|a| a.records.iter().map(|r| r.0))
                .collect();
            assert!(seqs.len() > 50, "source {token}: {} applied", seqs.len());
            assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
        }
        // Silent for real now: each source is ticked.
        sending.store(false, Ordering::SeqCst);
        let sent = publisher.join().unwrap();
        assert!(sent > 50);
        let got = wait(&shared, |g| {
            let ticks = quiet_ticks(g);
            (0..N).all(|t| ticks.contains(&t))
        });
        assert!(handed(&got).is_empty());
        shared.command(Command::Stop);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn no_tick_while_python_has_hand_overs_waiting() {
        // Source 1 is silent for real; source 2 keeps sending with its fast path closed, so
        // each message is a hand-over. While Python takes none of them (its event loop behind),
        // silence is not counted: no tick. Once Python drains, source 1 is ticked within a
        // quiet interval or so, and source 2 never.
        let quiet = Duration::from_millis(300);
        let (ctx, _, shared) = started(64, quiet, 16 << 20);
        let mut pubs = Vec::new();
        for (token, name) in [(1u64, "a"), (2, "b")] {
            let pub_ = ctx.socket(zmq_sys::ZMQ_PUB as i32).unwrap();
            pub_.bind("tcp://127.0.0.1:*").unwrap();
            let endpoint = pub_.get_last_endpoint().unwrap().unwrap();
            let (sub, mon) = ctx.subscribe(&endpoint, b"kv", &OPTS).unwrap();
            shared.command(Command::Add {
                token,
                key: W(name),
                sub,
                mon,
                alive: Arc::new(AtomicBool::new(true)),
            });
            pubs.push(pub_);
        }
        std::thread::sleep(Duration::from_millis(200));
        let behind = Instant::now() + 5 * quiet;
        let mut seq = 0;
        while Instant::now() < behind {
            send(&pubs[1], seq, &payload(1.0, seq + 1));
            seq += 1;
            std::thread::sleep(Duration::from_millis(20));
        }
        let first = [shared.drain()];
        assert!(handed(&first).len() > 20);
        assert_eq!(quiet_ticks(&first), Vec::<u64>::new());
        let got = wait(&shared, |g| quiet_ticks(g).contains(&1));
        assert!(!quiet_ticks(&got).contains(&2));
        shared.command(Command::Stop);
        drop(pubs);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn a_source_parked_across_a_reconnect_subscribes_again() {
        // The engine restarts on the same port while the source is parked (Python parks it
        // while a replay runs: after a reconnect, the identity check's). libzmq resends a SUB's
        // subscription on a reconnect only once the socket's own thread processes the
        // reconnect; unread, the parked SUB stayed unsubscribed, and the new engine's PUB
        // dropped all it published until the replay ended. An XPUB sees the subscription.
        let (ctx, _, shared) = started(64, Duration::from_secs(60), 1 << 20);
        let xpub = ctx.socket(zmq_sys::ZMQ_XPUB as i32).unwrap();
        xpub.set_rcvtimeo(10_000).unwrap();
        xpub.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = xpub.get_last_endpoint().unwrap().unwrap();
        let (sub, mon) = ctx.subscribe(&endpoint, b"kv", &OPTS).unwrap();
        shared.command(Command::Add {
            token: 3,
            key: W("a"),
            sub,
            mon,
            alive: Arc::new(AtomicBool::new(true)),
        });
        assert_eq!(xpub.recv_bytes(0).unwrap(), b"\x01kv");
        shared.command(Command::Park {
            token: 3,
            parked: true,
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(xpub);
        // libzmq closes a listener in its I/O thread: the port may be busy for a moment.
        let xpub = ctx.socket(zmq_sys::ZMQ_XPUB as i32).unwrap();
        xpub.set_rcvtimeo(10_000).unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while let Err(e) = xpub.bind(&endpoint) {
            assert!(Instant::now() < until, "cannot bind {endpoint} again: {e}");
            std::thread::sleep(Duration::from_millis(10));
        }
        let joined = xpub
            .recv_bytes(0)
            .expect("the parked SUB never subscribed again");
        assert_eq!(joined, b"\x01kv");
        // What the new engine publishes now waits in the SUB's queue, handed over once read.
        send(&xpub, 0, &payload(1.0, 1));
        std::thread::sleep(Duration::from_millis(200));
        assert!(handed(&[shared.drain()]).is_empty());
        shared.command(Command::Park {
            token: 3,
            parked: false,
        });
        let got = wait(&shared, |g| !handed(g).is_empty());
        assert_eq!(handed(&got), vec![Some(0)]);
        shared.command(Command::Stop);
        drop(xpub);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn applies_in_order_and_hands_over_the_rest_until_reopened() {
        let (ctx, index, shared) = started(64, Duration::from_secs(60), 1 << 20);
        let alive = Arc::new(AtomicBool::new(true));
        // The handshake is handed over (a monitor event): the fast path is still closed.
        let (pub_, got) = subscribed(&ctx, &shared, 7, "a", alive.clone());
        let consumed = got.iter().map(|o| o.handovers.len() as u64).sum::<u64>();
        // A stale open (not every hand-over seen) is ignored; the right one opens at seq 0.
        shared.command(Command::Open {
            token: 7,
            next_seq: 0,
            consumed: consumed + 1,
            keep: false,
        });
        shared.command(Command::Open {
            token: 7,
            next_seq: 0,
            consumed,
            keep: false,
        });
        std::thread::sleep(Duration::from_millis(100));
        for seq in 0..5 {
            send(&pub_, seq, &payload(1.0 + seq as f64, seq + 1));
        }
        let got = wait(&shared, |g| applied(g).len() == 5);
        assert_eq!(applied(&got), vec![0, 1, 2, 3, 4]);
        assert_eq!(index.read().num_blocks(Some(&W("a"))), 5);
        // A gap, then a bad payload and a malformed message: handed over, nothing applied.
        send(&pub_, 7, &payload(8.0, 8));
        send(&pub_, 5, &payload(6.0, 6));
        send(&pub_, 6, b"\x90");
        pub_.send_multipart([&b"kv"[..]], 0).unwrap();
        let got = wait(&shared, |g| handed(g).len() == 4);
        assert_eq!(handed(&got), vec![Some(7), Some(5), Some(6), None]);
        assert!(applied(&got).is_empty());
        assert_eq!(index.read().num_blocks(Some(&W("a"))), 5);
        // Reopened at 8 with every hand-over taken: applied again; stopped: nothing more.
        let consumed = consumed + 4;
        shared.command(Command::Open {
            token: 7,
            next_seq: 8,
            consumed,
            keep: false,
        });
        std::thread::sleep(Duration::from_millis(100));
        send(&pub_, 8, &payload(9.0, 9));
        let got = wait(&shared, |g| applied(g) == vec![8]);
        assert_eq!(got.iter().map(|o| o.handovers.len()).sum::<usize>(), 0);
        alive.store(false, Ordering::SeqCst);
        send(&pub_, 9, &payload(10.0, 10));
        std::thread::sleep(Duration::from_millis(200));
        assert!(applied(&[shared.drain()]).is_empty());
        assert_eq!(index.read().num_blocks(Some(&W("a"))), 6);
        shared.command(Command::Remove { token: 7 });
        shared.command(Command::Stop);
        drop(pub_);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn a_stale_open_leaves_the_source_unread_until_the_next_command() {
        let (ctx, index, shared) = started(64, Duration::from_secs(60), 1 << 20);
        let (pub_, mut got) = subscribed(&ctx, &shared, 7, "a", Arc::new(AtomicBool::new(true)));
        // Closed: seq 0 until one is handed over (a slow joiner drops the first), the copies
        // still on their way taken too; then 1-3, which Python has not taken when it opens.
        while handed(&got).is_empty() {
            send(&pub_, 0, &payload(1.0, 1));
            got.push(shared.drain());
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(200));
        got.push(shared.drain());
        let consumed = got.iter().map(|o| o.handovers.len() as u64).sum::<u64>();
        for seq in 1..4 {
            send(&pub_, seq, &payload(1.0 + seq as f64, seq + 1));
        }
        let got = wait(&shared, |g| handed(g).len() == 3);
        assert_eq!(handed(&got), vec![Some(1), Some(2), Some(3)]);
        // Held while it is sent: carried out before the thread's next visit, whatever the load.
        let command = |cmd: Command<W>| {
            shared.hold();
            shared.command(cmd);
            shared.release();
        };
        command(Command::Open {
            token: 7,
            next_seq: 1,
            consumed,
            keep: false,
        });
        // Stale: not opened, and nothing more read (no hand-over, nothing applied).
        for seq in 4..6 {
            send(&pub_, seq, &payload(1.0 + seq as f64, seq + 1));
        }
        std::thread::sleep(Duration::from_millis(300));
        let idle = shared.drain();
        assert!(idle.handovers.is_empty() && applied(&[idle]).is_empty());
        // Python took the three and opens at 4: exact, and what waited in libzmq is applied.
        command(Command::Open {
            token: 7,
            next_seq: 4,
            consumed: consumed + 3,
            keep: false,
        });
        let got = wait(&shared, |g| applied(g).len() == 2);
        assert_eq!(applied(&got), vec![4, 5]);
        assert_eq!(index.read().num_blocks(Some(&W("a"))), 2);
        // Stale again (a gap handed over after it), then an unpark: read again, handed over.
        send(&pub_, 9, &payload(10.0, 10));
        wait(&shared, |g| handed(g) == vec![Some(9)]);
        command(Command::Open {
            token: 7,
            next_seq: 6,
            consumed: consumed + 3,
            keep: false,
        });
        send(&pub_, 10, &payload(11.0, 11));
        std::thread::sleep(Duration::from_millis(300));
        assert!(shared.drain().handovers.is_empty());
        command(Command::Park {
            token: 7,
            parked: false,
        });
        wait(&shared, |g| handed(g) == vec![Some(10)]);
        // Stale once more, and no command follows: read again after `AWAIT_OPEN`, and said.
        let since = Instant::now();
        command(Command::Open {
            token: 7,
            next_seq: 6,
            consumed: consumed + 4,
            keep: false,
        });
        send(&pub_, 11, &payload(12.0, 12));
        let got = wait(&shared, |g| handed(g) == vec![Some(11)]);
        assert!(since.elapsed() >= AWAIT_OPEN);
        let logs: Vec<&String> = got.iter().flat_map(|o| &o.logs).collect();
        assert!(
            logs.len() == 1 && logs[0].contains("no command for a/0"),
            "{logs:?}"
        );
        shared.command(Command::Remove { token: 7 });
        shared.command(Command::Stop);
        drop(pub_);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn a_kept_source_hands_over_every_applied_payload_and_waits_for_room() {
        // Room for just under three payloads in the outbox (a visit stops only at its start,
        // so the first three are read however visits split them): once Python has not drained
        // three, the next wait in libzmq's queue (applied later, in order) rather than pile up
        // in the outbox.
        let sent: Vec<Vec<u8>> = (0..6).map(|i| payload(1.0 + i as f64, i + 1)).collect();
        let (ctx, index, shared) = started(64, Duration::from_secs(60), 3 * sent[0].len() - 1);
        let alive = Arc::new(AtomicBool::new(true));
        let (pub_, got) = subscribed(&ctx, &shared, 4, "k", alive);
        open_at_zero(&shared, 4, &got, true);
        for (seq, p) in sent.iter().enumerate().take(3) {
            send(&pub_, seq as u64, p);
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(index.read().num_blocks(Some(&W("k"))), 3);
        for (seq, p) in sent.iter().enumerate().skip(3) {
            send(&pub_, seq as u64, p);
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            index.read().num_blocks(Some(&W("k"))),
            3,
            "no room: not read"
        );
        let mut kept = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while kept.len() < 6 && Instant::now() < deadline {
            let out = shared.drain();
            assert!(out.handovers.is_empty());
            for a in out.applied.into_values() {
                assert_eq!(a.records.len(), a.payloads.len());
                kept.extend(a.payloads);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let seqs: Vec<u64> = kept.iter().map(|k| k.0).collect();
        assert_eq!(seqs, vec![0, 1, 2, 3, 4, 5]);
        for (k, p) in kept.iter().zip(&sent) {
            assert_eq!(&k.3, p, "the engine's bytes as sent");
            assert_eq!(k.2, 1, "stored blocks");
        }
        assert_eq!(index.read().num_blocks(Some(&W("k"))), 6);
        shared.command(Command::Stop);
        drop(pub_);
        assert!(shared.drain().dead.is_none());
    }

    #[test]
    fn records_wake_python_at_the_note_delay_unless_many_sources_hold_one_or_two_each() {
        let t = Instant::now();
        assert_eq!(note_due_at(t, 1, 1, 0), t + NOTE_DELAY);
        assert_eq!(
            note_due_at(t, NOTE_SOURCES, NOTE_SOURCES, 0),
            t + NOTE_DELAY
        );
        let many = NOTE_SOURCES + 1;
        assert_eq!(note_due_at(t, many, many, 0), t + NOTE_MAX);
        assert_eq!(
            note_due_at(t, NOTE_BATCHING * many - 1, many, 0),
            t + NOTE_MAX
        );
        assert_eq!(
            note_due_at(t, NOTE_BATCHING * many, many, 0),
            t + NOTE_DELAY
        );
        assert_eq!(
            note_due_at(t, many, many, 1),
            t + NOTE_DELAY,
            "kept payloads: a tap waits"
        );
    }

    #[test]
    fn a_pause_between_looks_ends_when_python_asks_something() {
        // The thread waits up to MIN_LOOK between two looks; a command or a hold must not wait
        // behind it. Here a pause ten thousand times as long, ended by a command.
        let (_ctx, _index, shared) = started(1, Duration::from_secs(60), 1 << 20);
        let asker = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                shared.command(Command::Remove { token: 99 });
            })
        };
        let start = Instant::now();
        shared.pause(MIN_LOOK * 10_000);
        assert!(start.elapsed() < MIN_LOOK * 5_000, "{:?}", start.elapsed());
        asker.join().unwrap();
        shared.command(Command::Stop);
        assert!(shared.drain().dead.is_none());
    }

    /// Whether Python's pipe has a byte waiting (not read).
    fn signaled(shared: &Shared<W>) -> bool {
        let mut fd = libc::pollfd {
            fd: shared.notify_r,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd on the stack, a descriptor the shared state keeps open.
        unsafe { libc::poll(&mut fd, 1, 0) == 1 }
    }

    #[test]
    fn an_applied_batch_wakes_python_within_the_note_delay_and_a_hand_over_at_once() {
        let (ctx, _index, shared) = started(64, Duration::from_secs(60), 1 << 20);
        let (pub_, got) = subscribed(&ctx, &shared, 1, "a", Arc::new(AtomicBool::new(true)));
        open_at_zero(&shared, 1, &got, false);
        // Each try: one batch, stamped with its send time; watched (not drained) until the
        // thread applied it. Seen within half the note delay of its visit's start (the
        // record's wall clock, taken before the apply), Python must not have been woken yet; a
        // slower look (a loaded machine) proves nothing, so the next seq tries again. Either
        // way the wake comes without a drain.
        let mut early = 0;
        for seq in 0..200u64 {
            send(&pub_, seq, &payload(now_wall(), seq + 1));
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                let out = shared.outbox.lock();
                if let Some(rec) = out.applied.get(&1).and_then(|a| a.records.back()) {
                    assert_eq!(rec.0, seq);
                    assert!(out.handovers.is_empty());
                    if now_wall() - (rec.1 + rec.2) < NOTE_DELAY.as_secs_f64() / 2.0 {
                        assert!(!signaled(&shared), "woken at once for an applied batch");
                        early += 1;
                    }
                    break;
                }
                drop(out);
                assert!(Instant::now() < until, "seq {seq} never applied");
                std::hint::spin_loop();
            }
            let until = Instant::now() + Duration::from_secs(10);
            while !signaled(&shared) {
                assert!(Instant::now() < until, "never woken for seq {seq}");
                std::thread::sleep(Duration::from_micros(200));
            }
            assert_eq!(applied(&[shared.drain()]), vec![seq]);
            if early == 3 {
                break;
            }
        }
        assert_eq!(
            early, 3,
            "too few batches were looked at soon after their apply"
        );
        // Records of more than `NOTE_SOURCES` sources, one each (as 4,096 ranks leave them):
        // the thread does not wake Python at the note delay for them, but at `NOTE_MAX`.
        let many = NOTE_SOURCES + 1;
        {
            let mut out = shared.outbox.lock();
            for token in 1000..1000 + many as u64 {
                let a = out.applied.entry(token).or_default();
                a.records.push_back((0, 1.0, 0.0));
            }
            shared.note(&mut out, many, Instant::now());
        }
        // (the thread notes its own records and looks at once; here it is woken to look)
        shared.wake();
        let start = Instant::now();
        std::thread::sleep(NOTE_DELAY * 10);
        assert!(
            !signaled(&shared),
            "woken at the note delay for {many} sources' records"
        );
        let until = Instant::now() + Duration::from_secs(10);
        while !signaled(&shared) {
            assert!(
                Instant::now() < until,
                "never woken for {many} sources' records"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(
            start.elapsed() >= NOTE_MAX - NOTE_DELAY,
            "{:?}",
            start.elapsed()
        );
        assert_eq!(shared.drain().applied.len(), many);
        // The same sources with `NOTE_BATCHING` records each: due at the note delay again.
        {
            let mut out = shared.outbox.lock();
            for token in 1000..1000 + many as u64 {
                let a = out.applied.entry(token).or_default();
                a.records
                    .extend((0..NOTE_BATCHING as u64).map(|s| (s, 1.0, 0.0)));
            }
            shared.note(&mut out, NOTE_BATCHING * many, Instant::now());
        }
        shared.wake();
        let until = Instant::now() + NOTE_MAX / 2;
        while !signaled(&shared) {
            assert!(
                Instant::now() < until,
                "batched records waited for NOTE_MAX"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(shared.drain().applied.len(), many);
        // A gap is a hand-over: the pipe is written with it, under the same lock.
        send(&pub_, 1000, &payload(now_wall(), 1000));
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let out = shared.outbox.lock();
            if !out.handovers.is_empty() {
                assert!(signaled(&shared));
                break;
            }
            drop(out);
            assert!(Instant::now() < until, "the gap was never handed over");
            std::thread::sleep(Duration::from_micros(100));
        }
        shared.command(Command::Stop);
        drop(pub_);
        assert!(shared.drain().dead.is_none());
    }

    /// How a replay test interferes between the request and its answer.
    #[derive(Clone, Copy, PartialEq)]
    enum Meanwhile {
        Nothing,
        /// The source hands a live message over (the machine may change its mind: `risky`).
        Message,
        /// Python disarms the request (`armed`).
        Disarm,
        /// Before the request, the fast path (open at seq 9) applies live seq 9, which Python
        /// had not recorded when it asked (`applied_seen`): the request's terms are stale.
        AppliedUnseen,
        /// The fast path was open at seq 9 when the request came; live seq 9 comes meanwhile.
        LiveInOrder,
    }

    /// One replay of seqs 0..3 from a ROUTER the test plays, with terms the machine would take
    /// whole; `meanwhile` happens after the request is read and before it is answered. The
    /// request's outcome, and the blocks the worker has in the index after it.
    fn replay_answered(meanwhile: Meanwhile) -> (ReplayOutcome, u64) {
        replay_answered_with(meanwhile, 64)
    }

    /// `replay_answered` with the sources' context allowing `max_sockets` sockets.
    fn replay_answered_with(meanwhile: Meanwhile, max_sockets: i32) -> (ReplayOutcome, u64) {
        let (ctx, index, shared) = started(max_sockets, Duration::from_secs(60), 1 << 20);
        // The handshake is handed over but is not risky: the request's `consumed` is 0.
        let (pub_, got) = subscribed(&ctx, &shared, 5, "a", Arc::new(AtomicBool::new(true)));
        if matches!(meanwhile, Meanwhile::AppliedUnseen | Meanwhile::LiveInOrder) {
            let handed = got.iter().map(|o| o.handovers.len() as u64).sum::<u64>();
            shared.command(Command::Open {
                token: 5,
                next_seq: 9,
                consumed: handed,
                keep: false,
            });
            std::thread::sleep(Duration::from_millis(100));
        }
        if meanwhile == Meanwhile::AppliedUnseen {
            send(&pub_, 9, &payload(10.0, 10));
            wait(&shared, |g| applied(g) == vec![9]);
        }
        let router = ctx.socket(zmq_sys::ZMQ_ROUTER as i32).unwrap();
        router.set_rcvtimeo(10_000).unwrap();
        router.bind("tcp://127.0.0.1:*").unwrap();
        let armed = Arc::new(AtomicBool::new(true));
        shared.command(Command::Replay(Box::new(ReplayRequest {
            id: 11,
            token: 5,
            endpoint: router.get_last_endpoint().unwrap().unwrap(),
            opts: OPTS,
            from_seq: 0,
            terms: Some(Terms {
                anchor: None,
                late_ok: false,
            }),
            armed: armed.clone(),
            progress: Arc::new(AtomicU64::new(0)),
            consumed: 0,
            applied_seen: 0,
            silent: Duration::from_secs(10),
            deadline: Duration::from_secs(20),
            budget: 1000,
            max_items: 1000,
            max_bytes: 1 << 20,
        })));
        let request = router.recv_multipart(0).unwrap();
        assert_eq!(request[2], 0u64.to_be_bytes());
        match meanwhile {
            Meanwhile::Nothing => {}
            Meanwhile::Message => {
                // The fast path is closed (never opened): the message is handed over.
                std::thread::sleep(Duration::from_millis(100));
                send(&pub_, 9, &payload(10.0, 10));
                wait(&shared, |g| handed(g) == vec![Some(9)]);
            }
            Meanwhile::Disarm => armed.store(false, Ordering::SeqCst),
            Meanwhile::AppliedUnseen => {}
            Meanwhile::LiveInOrder => {
                // The request closed the fast path: handed over, not applied.
                std::thread::sleep(Duration::from_millis(100));
                send(&pub_, 9, &payload(10.0, 10));
                wait(&shared, |g| handed(g) == vec![Some(9)]);
            }
        }
        let peer = &request[0];
        for seq in 0..3u64 {
            let body = payload(1.0 + seq as f64, seq + 1);
            router
                .send_multipart([&peer[..], b"", &seq.to_be_bytes()[..], &body[..]], 0)
                .unwrap();
        }
        router
            .send_multipart([&peer[..], b"", &u64::MAX.to_be_bytes()[..], b""], 0)
            .unwrap();
        let got = wait(&shared, |g| {
            g.iter()
                .flat_map(|o| &o.handovers)
                .any(|h| matches!(h, Handover::Replay(_)))
        });
        let outcome = got
            .into_iter()
            .flat_map(|o| o.handovers)
            .find_map(|h| match h {
                Handover::Replay(o) => Some(*o),
                _ => None,
            })
            .unwrap();
        let blocks = index.read().num_blocks(Some(&W("a")));
        shared.command(Command::Stop);
        drop((pub_, router));
        assert!(shared.drain().dead.is_none());
        (outcome, blocks)
    }

    #[test]
    fn a_clean_answer_is_applied_whole() {
        let (out, blocks) = replay_answered(Meanwhile::Nothing);
        let applied = out.applied.expect("applied whole");
        assert_eq!((applied.first, applied.last, applied.count), (0, 2, 3));
        assert!(out.items.is_empty() && out.complete);
        assert_eq!((out.counts.replies, out.counts.good), (4, 3));
        assert_eq!(blocks, 3);
    }

    #[test]
    fn replay_sockets_come_from_a_context_of_their_own() {
        // The sources' context is full (the test's PUB and ROUTER, the SUB, its monitor and
        // the monitor's PAIR: 5), yet the request gets its DEALER: it comes from the replay
        // context (`start`), whose reaper never walks the sources' monitor endpoints (in the
        // sources' context a 4,096-source cold sync spent 15 % of its core there).
        let (out, blocks) = replay_answered_with(Meanwhile::Nothing, 5);
        assert_eq!(out.cut, None);
        assert!(out.applied.is_some() && out.complete);
        assert_eq!(blocks, 3);
    }

    #[test]
    fn an_answer_after_a_risky_hand_over_is_handed_over_not_applied() {
        // The machine took a message the thread handed over after the request: it may no
        // longer take the answer whole (`risky` != the request's `consumed`).
        let (out, blocks) = replay_answered(Meanwhile::Message);
        assert!(out.applied.is_none());
        let seqs: Vec<u64> = out.items.iter().map(|it| it.0).collect();
        assert_eq!(seqs, vec![0, 1, 2]);
        assert!(out.items.iter().all(|it| it.2.is_some()));
        assert_eq!(blocks, 0);
    }

    /// `replay_answered` for an answer the thread must hand over whole (all three replies, none
    /// applied); the blocks the worker has after it.
    fn handed_over(meanwhile: Meanwhile) -> u64 {
        let (out, blocks) = replay_answered(meanwhile);
        assert!(out.applied.is_none());
        assert_eq!(out.items.len(), 3);
        blocks
    }

    #[test]
    fn an_answer_to_terms_the_fast_path_overtook_is_handed_over_not_applied() {
        // The thread applied live seq 9 before the request came, and Python had not recorded
        // it when it worked out the terms (issue 19: an anchored probe's answer then looked
        // applied off the machine's terms, and a healthy source was started over).
        assert_eq!(handed_over(Meanwhile::AppliedUnseen), 1);
    }

    #[test]
    fn a_request_closes_the_fast_path() {
        // While a replay is in flight the machine applies no live batch by rule 1: the thread
        // does not either, and the message it handed over makes the answer the machine's.
        assert_eq!(handed_over(Meanwhile::LiveInOrder), 0);
    }

    #[test]
    fn a_disarmed_answer_is_handed_over_not_applied() {
        assert_eq!(handed_over(Meanwhile::Disarm), 0);
    }
}
