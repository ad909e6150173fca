//! The PyO3 face of the index: `kvroute._core.Index` (the state behind `kvroute.PrefixIndex`)
//! and `kvroute._core.Match` (one query's lazily computed tier answers).
//!
//! Threads: the index sits behind a `parking_lot::RwLock`; applying takes the write lock and
//! queries the read lock, each inside `py.detach` (the GIL released), so concurrent queries run
//! in parallel and ingest does not stall Python threads. The lock is never held while the GIL is
//! re-acquired: Python objects are converted before and built after the locked section.

pub(crate) mod convert;

use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use crate::index::{Index, Limits, Query, Score, SnapKey, WorkerName};

pub(crate) use convert::event;

/// A worker as Python names it (a `WorkerKey`: worker_id, dp_rank), with the object itself so
/// answers hand back the caller's own key.
#[derive(Clone)]
pub struct PyKey(Arc<PyKeyInner>);

struct PyKeyInner {
    worker_id: String,
    dp_rank: i64,
    /// the key's hash, computed once: `select` looks every loaded worker up in the router's
    /// load table and the index, and hashing the string each time was most of a lookup
    hash: u64,
    obj: Py<PyAny>,
}

impl PartialEq for PyKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.hash == other.0.hash
                && self.0.dp_rank == other.0.dp_rank
                && self.0.worker_id == other.0.worker_id)
    }
}

impl Eq for PyKey {}

/// Key order, as Python orders `WorkerKey` tuples (UTF-8 byte order is code point order): the
/// footprint draws among tied workers in it (`crate::scoring::Footprint::pick`).
impl Ord for PyKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0.worker_id.as_str(), self.0.dp_rank)
            .cmp(&(other.0.worker_id.as_str(), other.0.dp_rank))
    }
}

impl PartialOrd for PyKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Hash for PyKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

impl WorkerName for PyKey {
    fn label(&self) -> String {
        format!("{}/{}", self.0.worker_id, self.0.dp_rank)
    }

    /// The shared record a clone counts a reference in.
    #[inline]
    fn prefetch(&self) {
        crate::index::prefetch(Arc::as_ptr(&self.0).cast());
    }
}

impl PyKey {
    /// A (worker_id: str, dp_rank: int) pair, as `WorkerKey` is.
    pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<PyKey> {
        let bad = || {
            let shown = obj.repr().map_or_else(|_| "?".into(), |r| r.to_string());
            PyTypeError::new_err(format!("not a WorkerKey (worker_id, dp_rank): {shown}"))
        };
        let t = obj.cast::<PyTuple>().map_err(|_| bad())?;
        if t.len() != 2 {
            return Err(bad());
        }
        let worker_id: String = t.get_item(0)?.extract().map_err(|_| bad())?;
        let dp_rank: i64 = t.get_item(1)?.extract().map_err(|_| bad())?;
        let mut h = rustc_hash::FxHasher::default();
        worker_id.hash(&mut h);
        dp_rank.hash(&mut h);
        Ok(PyKey(Arc::new(PyKeyInner {
            hash: h.finish(),
            worker_id,
            dp_rank,
            obj: obj.clone().unbind(),
        })))
    }

    /// Whether `self` and `other` are the same key object (not merely equal).
    pub(crate) fn same(&self, other: &PyKey) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    pub(crate) fn obj<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        self.0.obj.bind(py).clone()
    }
}

type Shared = Arc<RwLock<Index<PyKey>>>;

/// Queries of at most this many tokens run with the GIL held (`PyIndex::with_query`): an 8k-token
/// prompt matched against 1,024 workers takes tens of microseconds; 32k tokens still under ~0.2 ms.
const HOLD_GIL_TOKENS: usize = 32_768;

/// How long a short query waits, the GIL held, for an apply in progress before it releases the
/// GIL and waits without it (one `apply_payload` of a large batch takes about this long).
const HOLD_GIL_WAIT: Duration = Duration::from_micros(200);

/// The compiled prefix index (`kvroute.PrefixIndex` wraps it; see kvroute/_index.py).
#[pyclass(frozen, module = "kvroute._core", name = "Index")]
pub struct PyIndex {
    inner: Shared,
}

/// Log the core's refusal warnings on "kvroute.index" (once per worker and kind, as before).
fn flush_logs(py: Python<'_>, logs: Vec<String>) -> PyResult<()> {
    if logs.is_empty() {
        return Ok(());
    }
    let log = py
        .import("logging")?
        .call_method1("getLogger", ("kvroute.index",))?;
    for msg in logs {
        log.call_method1("warning", ("%s", msg))?;
    }
    Ok(())
}

fn score_dicts<'py>(
    py: Python<'py>,
    scores: &[Score<PyKey>],
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let blocks = PyDict::new(py);
    let sizes = PyDict::new(py);
    for s in scores {
        let k = s.worker.obj(py);
        blocks.set_item(&k, s.blocks)?;
        sizes.set_item(&k, s.block_size)?;
    }
    Ok((blocks, sizes))
}

/// A snapshot key as the file holds it (b"": held, never claimable).
fn key_bytes<'py>(py: Python<'py>, k: &SnapKey) -> Bound<'py, PyBytes> {
    match k {
        SnapKey::Key(k) => PyBytes::new(py, k),
        _ => PyBytes::new(py, b""),
    }
}

impl PyIndex {
    /// The locked index itself, for the native receive loop (`crate::py::recv`), which applies
    /// to it from its own thread.
    pub(crate) fn shared(&self) -> Shared {
        self.inner.clone()
    }

    /// Run `f` on the index under the write lock with the GIL released, then log its warnings.
    /// The integrator's `apply_payload` is `wire::decode` + `Index::apply_batch` inside `f`.
    pub fn with_write<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Index<PyKey>) -> R + Send,
    ) -> PyResult<R> {
        let (out, logs) = py.detach(|| {
            let mut idx = self.inner.write();
            let out = f(&mut idx);
            (out, idx.take_logs())
        });
        flush_logs(py, logs)?;
        Ok(out)
    }

    fn with_read<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&Index<PyKey>) -> R + Send) -> R {
        py.detach(|| f(&self.inner.read()))
    }

    /// Run query `f` (a prompt of `tokens` tokens) under the read lock. A short query keeps the
    /// GIL: releasing it for microseconds of work costs a wait of up to the interpreter's switch
    /// interval to get it back whenever other threads (ingest between its payloads) want it — a
    /// convoy that multiplied `select`'s p99 while two threads ingest (bench/bench_select.py). So
    /// below `HOLD_GIL_TOKENS` the lock is taken with the GIL held, waiting at most
    /// `HOLD_GIL_WAIT` for an apply in progress (writers never take the GIL under the lock, so
    /// this cannot deadlock); a long prompt, or a lock not free in time, releases the GIL.
    pub(crate) fn with_query<R: Send>(
        &self,
        py: Python<'_>,
        tokens: usize,
        f: impl FnOnce(&Index<PyKey>) -> R + Send,
    ) -> R {
        if tokens <= HOLD_GIL_TOKENS {
            if let Some(idx) = self.inner.try_read_for(HOLD_GIL_WAIT) {
                return f(&idx);
            }
        }
        self.with_read(py, f)
    }
}

#[pymethods]
impl PyIndex {
    #[new]
    fn new(
        max_block_sizes: usize,
        max_entries_per_worker: usize,
        max_groups_per_worker: usize,
        max_cached_roots: usize,
    ) -> Self {
        let limits = Limits {
            max_block_sizes,
            max_entries_per_worker,
            max_groups_per_worker,
            max_cached_roots,
        };
        PyIndex {
            inner: Arc::new(RwLock::new(Index::new(limits))),
        }
    }

    /// The raw-bytes ingest: decode one payload (`crate::wire`) and apply it to ``worker`` in one
    /// call with the GIL released, no Python object per event. Returns ``(ts, error_kind, error,
    /// stored_blocks, skipped)``: ``error_kind`` "" when applied, else why nothing was (an
    /// undecodable payload, a ts that is not finite, an untrusted batch) with the detail the
    /// subscriber logs; ``skipped`` the decoder's per-reason counts (for any decoded batch).
    #[allow(clippy::type_complexity)]
    fn apply_payload(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        payload: &[u8],
        max_events_per_batch: &Bound<'_, PyAny>,
        max_blocks_per_event: &Bound<'_, PyAny>,
        max_block_size: &Bound<'_, PyAny>,
    ) -> PyResult<(f64, &'static str, String, u64, Vec<(String, u64)>)> {
        let key = PyKey::extract(worker)?;
        let lim = super::wire::limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
        let inner = &self.inner;
        let (out, logs) = py.detach(|| {
            let batch = match crate::wire::decode(payload, &lim) {
                Ok(b) => b,
                Err(e) => {
                    return (
                        (f64::NAN, "undecodable payload", e.message, 0, Vec::new()),
                        Vec::new(),
                    )
                }
            };
            if let Some((kind, detail)) = crate::wire::verdict(&batch) {
                return ((f64::NAN, kind, detail, 0, batch.skipped), Vec::new());
            }
            let ts = batch.ts;
            let mut idx = inner.write();
            let counts = idx.apply_batch(&key, &batch);
            let logs = idx.take_logs();
            (
                (ts, "", String::new(), counts.stored_blocks, batch.skipped),
                logs,
            )
        });
        flush_logs(py, logs)?;
        Ok(out)
    }

    /// Apply payloads the recovery machine took as applicable (`kvroute._core.judge` passed each
    /// with the same limits) to ``worker`` in order: the raw-bytes ingest for a replay answer's
    /// run, no Python object per event, the GIL released. Each chunk is decoded before the write
    /// lock is taken, so queries wait only for the applying. Returns the blocks stored. A payload
    /// the verdict refuses now raises RuntimeError, after the ones before it were applied: the
    /// judge and the apply disagreeing is kvroute's bug, never the engine's doing.
    fn apply_payloads(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        payloads: Vec<PyBackedBytes>,
        max_events_per_batch: &Bound<'_, PyAny>,
        max_blocks_per_event: &Bound<'_, PyAny>,
        max_block_size: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        // Decoded batches waiting for the lock: bounded, as a replay answer may hold 100,000.
        const CHUNK: usize = 64;
        let key = PyKey::extract(worker)?;
        let lim = super::wire::limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
        let inner = &self.inner;
        let n = payloads.len();
        let (out, logs) = py.detach(|| {
            let mut stored = 0u64;
            let mut logs = Vec::new();
            for (c, chunk) in payloads.chunks(CHUNK).enumerate() {
                let mut batches = Vec::with_capacity(chunk.len());
                let mut refused = None;
                for (i, p) in chunk.iter().enumerate() {
                    let why = match crate::wire::decode(p, &lim) {
                        Ok(batch) => match crate::wire::verdict(&batch) {
                            None => {
                                batches.push(batch);
                                continue;
                            }
                            Some((kind, detail)) => format!("{kind}: {detail}"),
                        },
                        Err(e) => e.message,
                    };
                    refused = Some(format!(
                        "payload {} of {n} was judged applicable, then refused: {why}",
                        c * CHUNK + i
                    ));
                    break;
                }
                let mut idx = inner.write();
                for batch in &batches {
                    stored += idx.apply_batch(&key, batch).stored_blocks;
                }
                logs.extend(idx.take_logs());
                drop(idx);
                if let Some(why) = refused {
                    return (Err(why), logs);
                }
            }
            (Ok(stored), logs)
        });
        flush_logs(py, logs)?;
        out.map_err(PyRuntimeError::new_err)
    }

    /// Apply engine events (kvroute._wire Structs) of ``worker`` in order.
    fn apply_events(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        events: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let key = PyKey::extract(worker)?;
        let evs = if let Ok(list) = events.cast::<PyList>() {
            list.iter()
                .map(|e| event(&e))
                .collect::<PyResult<Vec<_>>>()?
        } else {
            events
                .try_iter()?
                .map(|e| event(&e?))
                .collect::<PyResult<Vec<_>>>()?
        };
        self.with_write(py, |idx| {
            for ev in &evs {
                idx.apply(&key, ev);
            }
        })
    }

    /// Apply one engine event of ``worker``.
    fn apply_event(
        &self,
        py: Python<'_>,
        worker: &Bound<'_, PyAny>,
        ev: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let key = PyKey::extract(worker)?;
        let ev = event(ev)?;
        self.with_write(py, |idx| idx.apply(&key, &ev))
    }

    /// Forget everything ``worker`` holds.
    fn remove_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let key = PyKey::extract(worker)?;
        self.with_write(py, |idx| idx.remove_worker(&key))
    }

    /// Workers holding at least one block.
    fn workers<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyAny>> {
        // `Router.select` asks on every call: keep the GIL (see `with_query`)
        let keys = self.with_query(py, 0, |idx| idx.workers());
        keys.iter().map(|k| k.obj(py)).collect()
    }

    /// Blocks of ``worker`` (None: (block, worker) entries over all workers).
    #[pyo3(signature = (worker=None))]
    fn num_blocks(&self, py: Python<'_>, worker: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let key = worker.map(PyKey::extract).transpose()?;
        Ok(self.with_read(py, |idx| idx.num_blocks(key.as_ref())))
    }

    /// The largest block size ``worker`` uses (None: none).
    fn block_size(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
        let key = PyKey::extract(worker)?;
        Ok(self.with_read(py, |idx| idx.block_size(&key)))
    }

    /// The (block size, lookahead) classes ``worker`` stores under.
    fn classes_of(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<Vec<(i64, i64)>> {
        let key = PyKey::extract(worker)?;
        Ok(self.with_read(py, |idx| idx.classes_of(&key)))
    }

    /// Whether the engines may publish reuse reports (`PrefixIndex(reuse_reports=...)`).
    fn set_reuse_reports(&self, py: Python<'_>, on: bool) {
        py.detach(|| self.inner.write().set_reuse_reports(on));
    }

    /// The counters, in `IndexStats` field order.
    fn stats(&self, py: Python<'_>) -> [u64; 12] {
        let s = self.with_read(py, |idx| idx.stats());
        [
            s.workers,
            s.entries,
            s.distinct_keys,
            s.unknown_parent_blocks,
            s.unhashable_blocks,
            s.unknown_removals,
            s.ignored_group_events,
            s.remote_blocks,
            s.repeated_stores,
            s.refused_block_sizes,
            s.refused_entries,
            s.uncached_roots,
        ]
    }

    /// Bytes the index's tables have allocated, from their capacities (`Index::memory_bytes`).
    fn memory_bytes(&self, py: Python<'_>) -> usize {
        self.with_read(py, |idx| idx.memory_bytes())
    }

    /// Introspection for tests: the tables the pure-Python index kept, by its names
    /// (content keys per table, classes -> member slots, worker -> slot, cached roots).
    fn tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let t = self.with_read(py, |idx| idx.tables());
        let out = PyDict::new(py);
        let names = ["holders", "gpu_missing", "CPU", "DISK", "EXTERNAL"];
        for (name, keys) in names.iter().zip(&t.flagged) {
            out.set_item(
                *name,
                PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?,
            )?;
        }
        let classes = PyDict::new(py);
        for (cls, members) in &t.classes {
            classes.set_item(*cls, members.clone())?;
        }
        out.set_item("bs_members", classes)?;
        let workers = PyDict::new(py);
        for (k, slot) in &t.workers {
            workers.set_item(k.obj(py), *slot)?;
        }
        out.set_item("workers", workers)?;
        out.set_item("roots", t.roots)?;
        Ok(out)
    }

    /// `find_matches`: (scores, block sizes, GPU scores or None, the `Match` for tiers).
    #[allow(clippy::type_complexity)]
    fn find_matches<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        lora_name: &Bound<'py, PyAny>,
        cache_salt: &Bound<'py, PyAny>,
        mm_items: &Bound<'py, PyAny>,
        extra_keys: &Bound<'py, PyAny>,
    ) -> PyResult<(
        Bound<'py, PyDict>,
        Bound<'py, PyDict>,
        Option<Bound<'py, PyDict>>,
        Bound<'py, PyMatch>,
    )> {
        let input = convert::query_input(token_ids, lora_name, cache_salt, mm_items, extra_keys)?;
        let (query, result) = self.with_query(py, input.tokens.len(), move |idx| {
            let mut q = idx.query(input);
            let r = idx.find_matches(&mut q);
            (q, r)
        });
        let (scores, sizes) = score_dicts(py, &result.scores)?;
        let gpu = match &result.gpu {
            Some(g) => Some(score_dicts(py, g)?.0),
            None => None,
        };
        let any = result
            .scores
            .into_iter()
            .map(|s| (s.worker, s.blocks, s.block_size))
            .collect();
        let m = PyMatch {
            index: self.inner.clone(),
            query: Mutex::new(query),
            any,
        };
        Ok((scores, sizes, gpu, Bound::new(py, m)?))
    }

    /// Every worker's tables: (worker, classes, primary, lookahead, hashes, keys, special, groups,
    /// bigram).
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let workers = self.with_read(py, |idx| idx.export());
        let out = PyList::empty(py);
        for (k, sw) in workers {
            let hashes = hash_list(py, &sw.hashes)?;
            let keys = PyList::new(py, sw.keys.iter().map(|k| key_bytes(py, k)))?;
            let special = PyList::empty(py);
            for (h, c) in &sw.special {
                special.append((hash_obj(py, h)?, c.clone()))?;
            }
            let groups = PyList::empty(py);
            for g in &sw.groups {
                groups.append((
                    g.group_idx,
                    g.kind.as_str(),
                    g.window,
                    g.block_size,
                    hash_list(py, &g.hashes)?,
                    PyList::new(py, g.keys.iter().map(|k| key_bytes(py, k)))?,
                    g.masks.clone(),
                ))?;
            }
            out.append((
                k.obj(py),
                sw.classes,
                sw.primary,
                sw.lookahead,
                hashes,
                keys,
                special,
                groups,
                sw.bigram,
            ))?;
        }
        Ok(out)
    }

    /// Restore a snapshot file (``data``, the whole file) into this empty index: read and rebuilt
    /// here with the GIL released, no Python object per entry. ``check_header(format, version,
    /// hash_version)`` is called once the file is read, before anything is restored (it raises
    /// to refuse the file); ``key_type(worker_id, dp_rank)`` makes each worker's key. Returns
    /// ``(cursors, dropped)``: every saved (worker_id, dp_rank, seq, ts), and the workers refused
    /// as (key, reason). Raises ValueError (why) when the file is unreadable; nothing is restored.
    /// ``only`` (a collection of keys): restore just those workers, each replacing whatever the
    /// index held for it, and only their cursors.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (data, key_type, check_header, only=None))]
    fn restore<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyBytes>,
        key_type: &Bound<'py, PyAny>,
        check_header: &Bound<'py, PyAny>,
        only: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(
        Vec<(String, i64, i128, f64)>,
        Vec<(Bound<'py, PyAny>, String)>,
    )> {
        let bytes = data.as_bytes();
        let mut file = py
            .detach(|| crate::index::read_snapshot(bytes))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        check_header.call1((&file.format, file.version, file.hash_version))?;
        // `only`: import just these workers into an index that already holds others (a JetStream
        // client taking a snapshot); each replaces that worker's state whole.
        let mut keys = Vec::with_capacity(file.workers.len());
        let mut kept = Vec::with_capacity(file.workers.len());
        for (id, rank, sw) in std::mem::take(&mut file.workers) {
            let obj = key_type.call1((&id, rank))?;
            if let Some(only) = only {
                if !only.contains(&obj)? {
                    continue;
                }
            }
            keys.push(PyKey::extract(&obj)?);
            kept.push((id, rank, sw));
        }
        let replace = only.is_some();
        if replace {
            file.cursors
                .retain(|(id, rank, _, _)| kept.iter().any(|(i, r, _)| i == id && r == rank));
        }
        let refused = self.with_write(py, |idx| {
            let mut refused = Vec::new();
            for (key, (_, _, sw)) in keys.iter().zip(&kept) {
                if replace {
                    idx.remove_worker(key);
                }
                if let Err(why) = idx.import_worker(key, sw) {
                    refused.push((key.clone(), why));
                }
            }
            refused
        })?;
        let dropped = refused
            .into_iter()
            .map(|(k, why)| (k.obj(py), why))
            .collect();
        Ok((file.cursors, dropped))
    }

    // --- snapshot bytes (the JetStream relay's and replica's; kvroute/_snapshot.py) -------------

    /// The index as a snapshot file's bytes (what `restore` reads), no file and no Python object
    /// per entry: every worker's tables taken under one read lock, then encoded, both with the GIL
    /// released. ``cursors``: (worker_id, dp_rank, seq, ts) each; ``header``: (format, version,
    /// hash_version, created). Raises ValueError when a seq does not fit msgpack's int64/uint64.
    fn snapshot_bytes<'py>(
        &self,
        py: Python<'py>,
        cursors: Vec<(String, i64, i128, f64)>,
        header: (String, i64, i64, f64),
    ) -> PyResult<Bound<'py, PyBytes>> {
        let (format, version, hash_version, created) = header;
        let workers = self.with_read(py, |idx| {
            idx.export()
                .into_iter()
                .map(|(k, sw)| (k.0.worker_id.clone(), k.0.dp_rank, sw))
                .collect()
        });
        let file = crate::index::SnapFile {
            format,
            version: version.into(),
            hash_version: hash_version.into(),
            workers,
            cursors,
        };
        let data = py
            .detach(|| file.to_bytes(created))
            .ok_or_else(|| PyValueError::new_err("a cursor's seq is outside int64 and uint64"))?;
        Ok(PyBytes::new(py, &data))
    }
    // --- end of snapshot bytes ------------------------------------------------------------------
}

fn hash_obj<'py>(py: Python<'py>, h: &crate::protocols::BlockHash) -> PyResult<Bound<'py, PyAny>> {
    Ok(match h {
        crate::protocols::BlockHash::Int(i) => i.into_pyobject(py)?.into_any(),
        crate::protocols::BlockHash::Bytes(b) => PyBytes::new(py, b).into_any(),
    })
}

fn hash_list<'py>(
    py: Python<'py>,
    hs: &[crate::protocols::BlockHash],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for h in hs {
        out.append(hash_obj(py, h)?)?;
    }
    Ok(out)
}

/// One query's state after `find_matches`: off-GPU tier answers are computed on first access,
/// from the index as it is then (`OverlapScores.tier`).
#[pyclass(frozen, module = "kvroute._core", name = "Match")]
pub struct PyMatch {
    index: Shared,
    query: Mutex<Query>,
    any: Vec<(PyKey, i64, i64)>,
}

#[pymethods]
impl PyMatch {
    /// Leading blocks on tier ``pos`` (1 CPU, 2 DISK, 3 EXTERNAL) per worker.
    fn tier<'py>(&self, py: Python<'py>, pos: usize) -> PyResult<Bound<'py, PyDict>> {
        if !(1..=3).contains(&pos) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "tier position must be 1, 2 or 3",
            ));
        }
        let found = py.detach(|| {
            let idx = self.index.read();
            let mut q = self.query.lock();
            idx.tier_scores(&mut q, pos, &self.any)
        });
        let out = PyDict::new(py);
        for (k, n) in found {
            out.set_item(k.obj(py), n)?;
        }
        Ok(out)
    }

    /// The query's content keys hashed so far, per (block size, lookahead) class (for tests:
    /// hashing is lazy).
    fn hashed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (cls, keys) in self.query.lock().hashed() {
            out.set_item(
                *cls,
                PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?,
            )?;
        }
        Ok(out)
    }

    /// Full blocks of the query at ``worker``'s block sizes (0 when the index has none for it).
    fn query_blocks(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<usize> {
        let key = PyKey::extract(worker)?;
        Ok(py.detach(|| {
            let classes = self.index.read().classes_of(&key);
            self.query.lock().query_blocks(&classes)
        }))
    }
}

/// Register the exception a bad query raises (kvroute._index.QueryError).
#[pyfunction]
fn set_query_error(py: Python<'_>, cls: Bound<'_, PyType>) {
    let _ = convert::QUERY_ERROR.set(py, cls.unbind());
}

/// Content keys of `n` blocks chained on `parent` (for the differential tests against
/// kvroute._hashing.block_keys): per-block extras (lists of values) and lookahead token lists.
#[pyfunction]
#[pyo3(signature = (parent, tokens, block_size, n, extra_keys=None, lookahead=None))]
fn block_keys<'py>(
    py: Python<'py>,
    parent: &[u8],
    tokens: Vec<u32>,
    block_size: usize,
    n: usize,
    extra_keys: Option<Vec<Option<Bound<'py, PyAny>>>>,
    lookahead: Option<Vec<Vec<u32>>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let parent: crate::keys::Key = parent
        .try_into()
        .map_err(|_| pyo3::exceptions::PyValueError::new_err("parent must be 16 bytes"))?;
    if tokens.len() < n * block_size || lookahead.as_ref().is_some_and(|l| l.len() < n) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "fewer tokens or lookahead rows than blocks",
        ));
    }
    let extras: Vec<Option<Vec<u8>>> = match &extra_keys {
        None => Vec::new(),
        Some(ek) => ek
            .iter()
            .map(|e| -> PyResult<Option<Vec<u8>>> {
                let vals = match e {
                    None => None,
                    Some(v) => Some(
                        v.try_iter()?
                            .map(|x| convert::value(&x?))
                            .collect::<PyResult<Vec<_>>>()?,
                    ),
                };
                crate::keys::encode_extras(vals.as_deref()).map_err(|_| {
                    pyo3::exceptions::PyOverflowError::new_err("an int outside 64 bits")
                })
            })
            .collect::<PyResult<_>>()?,
    };
    let mut out = Vec::with_capacity(n);
    crate::keys::chain_into(
        &mut out,
        &parent,
        &tokens,
        block_size,
        n,
        |i| extras.get(i).and_then(|x| x.as_deref()),
        |i| lookahead.as_ref().map(|l| l[i].as_slice()),
    );
    Ok(out.iter().map(|k| PyBytes::new(py, k)).collect())
}

/// The chain's root key for an adapter and a cache salt (kvroute._hashing.root_key).
#[pyfunction]
#[pyo3(signature = (lora_name, cache_salt=None))]
fn root_key<'py>(
    py: Python<'py>,
    lora_name: Option<&str>,
    cache_salt: Option<&str>,
) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &crate::keys::root_key(lora_name, cache_salt))
}

/// Add the index's classes and functions to `kvroute._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyIndex>()?;
    m.add_class::<PyMatch>()?;
    m.add_function(wrap_pyfunction!(set_query_error, m)?)?;
    m.add_function(wrap_pyfunction!(block_keys, m)?)?;
    m.add_function(wrap_pyfunction!(root_key, m)?)?;
    Ok(())
}
