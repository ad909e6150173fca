//! The Router's compiled path: `kvroute._core.select` matches the prompt, prices every candidate
//! the index claims overlap for and every load-only one with the built-in `CostModel`
//! (`crate::scoring`), and finds the zero-temperature ties, in one call. `Router.select`
//! (kvroute/_router.py) takes it when its model is exactly `CostModel` and no worker is
//! approximate; the Python path stays the reference and serves subclasses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use indexmap::map::MutableKeys;
use indexmap::IndexMap;
use parking_lot::Mutex;
use pyo3::exceptions::PyKeyError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFrozenSet, PyList, PySet, PyString, PyTuple, PyType};
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use super::index::{convert, PyIndex, PyKey};
use crate::index::Index;
use crate::scoring::{self, Claim, CostParams, EngineFigures, LoadMode, Placed};

/// `kvroute._router.CandidateScore`, registered when kvroute._router is imported.
static CANDIDATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Register the class `select` builds its candidates with.
#[pyfunction]
fn set_candidate_type(py: Python<'_>, cls: Bound<'_, PyType>) {
    let _ = CANDIDATE.set(py, cls.unbind());
}

/// A float attribute of the cost model.
fn weight(model: &Bound<'_, PyAny>, name: &Bound<'_, PyString>) -> PyResult<f64> {
    model.getattr(name)?.extract()
}

/// A super-linear term of the model (`long_prefix`, `long_move`): None while its flag is off (the
/// default: one attribute read), else its floor and scale.
fn floored(
    model: &Bound<'_, PyAny>,
    on: &Bound<'_, PyString>,
    floor: &Bound<'_, PyString>,
    scale: &Bound<'_, PyString>,
) -> PyResult<Option<scoring::Floored>> {
    if !model.getattr(on)?.is_truthy()? {
        return Ok(None);
    }
    Ok(Some(scoring::Floored {
        floor: weight(model, floor)?,
        scale: weight(model, scale)?,
    }))
}

/// The load of `w` in cost blocks: ``loads.get(w, 0) * scale``.
fn load_of(loads: &Bound<'_, PyAny>, w: &Bound<'_, PyAny>, scale: f64) -> PyResult<f64> {
    let v = match loads.cast::<PyDict>() {
        Ok(d) => d.get_item(w)?,
        Err(_) => {
            let v = loads.call_method1(intern!(loads.py(), "get"), (w,))?;
            (!v.is_none()).then_some(v)
        }
    };
    Ok(match v {
        Some(v) => v.extract::<f64>()? * scale,
        None => 0.0,
    })
}

/// Engine-reported KV usage per worker (`Router` passes only reports above 0), and how many of
/// its workers the passes over the candidates priced: when that is all of them, the usage-only
/// pass has nothing to add and is skipped (it builds a set of every candidate, ~30 µs at 1,024).
struct Usage<'a, 'py> {
    dict: Option<&'a Bound<'py, PyDict>>,
    priced: usize,
}

impl Usage<'_, '_> {
    /// `w`'s usage (none: 0), counting a reported worker as priced: call it once per candidate.
    fn of(&mut self, w: &Bound<'_, PyAny>) -> PyResult<f64> {
        let Some(u) = self.dict else {
            return Ok(0.0);
        };
        Ok(match u.get_item(w)? {
            Some(v) => {
                self.priced += 1;
                v.extract()?
            }
            None => 0.0,
        })
    }
}

/// The routing hint's tokens for `w` (0: none).
fn routed_of(routed: &Bound<'_, PyDict>, w: &Bound<'_, PyAny>) -> PyResult<i64> {
    Ok(match routed.get_item(w)? {
        Some(v) => v.extract()?,
        None => 0,
    })
}

/// The router's tracked load: tokens per worker (`Router.on_start` / `on_finish`), a mapping in
/// insertion order as the dict it replaces was (the load-only candidates come in this order).
/// `select` reads it without a Python call per worker: at 1,024 loaded workers the dict's
/// `get` per candidate and the pass over its items cost ~150 µs, the table's lookups a few.
///
/// Threads: one Router serves several threads, so the table is frozen (no PyO3 borrow flag,
/// whose "Already mutably borrowed" error a `select` holding the table across its GIL-released
/// match used to raise in a thread calling `on_start`) and copy-on-write (`CowTable`): a
/// `select` scores from the table as it was when it started, and a thread holding the table's
/// mutex never waits for the GIL.
#[pyclass(frozen, module = "kvroute._core", name = "Loads", mapping)]
#[derive(Default)]
pub struct Loads {
    table: CowTable<i64>,
}

/// A worker's entry in a `CowTable`: its value, and a note `select` keeps on it through a shared
/// table: atomic, so concurrent `select`s write it without copying the table (`Loads`: the index
/// slot where `select` last found the worker; `EngineTable`: its membership in the kept live set).
struct Entry<V> {
    value: V,
    note: AtomicU64,
}

impl<V: Copy> Clone for Entry<V> {
    fn clone(&self) -> Self {
        Entry::new(self.value, self.note.load(Ordering::Relaxed))
    }
}

impl<V> Entry<V> {
    fn new(value: V, note: u64) -> Self {
        Entry {
            value,
            note: AtomicU64::new(note),
        }
    }
}

/// Entries by worker key, in the order they were first put (the dict each table mirrors).
type Map<V> = IndexMap<PyKey, Entry<V>, FxBuildHasher>;

/// The router's own tokens per worker (`Loads`). A worker's note is the index slot where `select`
/// last found it: while that slot still holds this worker, it is found without hashing its name
/// (at 1,024 loaded workers the lookups by name were ~100 instructions a worker, a third of
/// `select`'s cost on a loaded fleet).
type Table = Map<i64>;

impl Entry<i64> {
    /// The worker's tracked tokens.
    fn tokens(&self) -> i64 {
        self.value
    }

    /// This entry's worker (`key`) in the index: its slot, whether it holds blocks, and the
    /// index's own key object for it.
    fn locate<'i>(&self, idx: &'i Index<PyKey>, key: &PyKey) -> Option<(u32, bool, &'i PyKey)> {
        locate(&self.note, idx, key)
    }
}

/// `key`'s worker in the index, tried first at the slot `hint` kept (and kept again when it
/// moved): its slot, whether it holds blocks, and the index's own key object for it.
fn locate<'i>(
    hint: &AtomicU64,
    idx: &'i Index<PyKey>,
    key: &PyKey,
) -> Option<(u32, bool, &'i PyKey)> {
    // a hint is a slot (u32) or `NONE`, stored widened
    let kept = hint.load(Ordering::Relaxed) as u32;
    if let Some((at, holds)) = idx.at_slot(kept) {
        // the slot may have been freed and reused by another worker: compare the keys (the
        // same object once `CowTable::adopt` gave the table the index's, without reading either)
        if at == key {
            return Some((kept, holds, at));
        }
    }
    let slot = idx.slot_of(key)?;
    hint.store(u64::from(slot), Ordering::Relaxed);
    idx.at_slot(slot).map(|(at, holds)| (slot, holds, at))
}

/// A copy-on-write table of per-worker entries, shared by the threads of one router (`Loads`,
/// `EngineTable`): `select` takes the current table (an `Arc`) under the mutex and reads it with
/// the mutex released; a write copies the table only while some `select` still holds the old one
/// (`Arc::make_mut`). The mutex is never held while Python code can run: keys are converted
/// before it is taken, and keys a write replaces or removes are returned to be dropped after it
/// is released (dropping a key may drop its Python object).
struct CowTable<V> {
    map: Mutex<Shared<V>>,
}

/// A `CowTable`'s current table, and its keys in table order once a reader asked for them
/// (`keyed`), kept while the table holds the same keys at the same positions.
struct Shared<V> {
    map: Arc<Map<V>>,
    keys: Option<Arc<[PyKey]>>,
}

impl<V> Default for CowTable<V> {
    fn default() -> Self {
        CowTable {
            map: Mutex::new(Shared {
                map: Arc::default(),
                keys: None,
            }),
        }
    }
}

impl<V: Copy> CowTable<V> {
    /// The current table, for a reader to use with the mutex released.
    fn snapshot(&self) -> Arc<Map<V>> {
        self.map.lock().map.clone()
    }

    /// The current table with its keys in table order: a reader lists a worker by position
    /// in them (`Who::Listed`) instead of cloning its key (an atomic increment on a line of
    /// its own, and a decrement when the decision goes: ~1,000 of each per `select` when every
    /// engine of a 1,024-worker fleet reports load). The keys are built once per change of the
    /// table's keys, not per value written (an engine's report rewrites its record only).
    fn keyed(&self) -> (Arc<Map<V>>, Arc<[PyKey]>) {
        let mut guard = self.map.lock();
        let sh = &mut *guard;
        let keys = sh
            .keys
            .get_or_insert_with(|| sh.map.keys().cloned().collect())
            .clone();
        (sh.map.clone(), keys)
    }

    /// Read the current table under the mutex.
    fn read<R>(&self, f: impl FnOnce(&Map<V>) -> R) -> R {
        f(&self.map.lock().map)
    }

    fn len(&self) -> usize {
        self.map.lock().map.len()
    }

    /// Change the table under the mutex (its kept keys forgotten: `f` may move or remove
    /// entries); what `f` returns is dropped by the caller, after the mutex is released.
    fn write<R>(&self, f: impl FnOnce(&mut Map<V>) -> R) -> R {
        let (got, stale) = {
            let mut guard = self.map.lock();
            let stale = guard.keys.take();
            (f(Arc::make_mut(&mut guard.map)), stale)
        };
        drop(stale); // may hold the last references to keys: the mutex released
        got
    }

    /// Set `k`'s value (a worker already present keeps its place and its note; a new one goes
    /// last with `note`). Returns `k` when it was not inserted, for the caller to drop after
    /// the mutex is released.
    fn put(&self, k: PyKey, value: V, note: u64) -> Option<PyKey> {
        let mut guard = self.map.lock();
        let t = Arc::make_mut(&mut guard.map);
        if let Some(e) = t.get_mut(&k) {
            // the same keys at the same places: the kept keys stay
            e.value = value;
            return Some(k);
        }
        t.insert(k, Entry::new(value, note));
        let stale = guard.keys.take();
        drop(guard);
        drop(stale); // the mutex released
        None
    }

    /// Give the entries the index's own key objects (`adopt`: table position, the index's key
    /// equal to the one there), so that lookups by key (`locate`, the membership of a record)
    /// recognise a worker by identity, not by reading and comparing two names in two
    /// allocations (at 1,024 loaded workers ~13 µs a `select`). Only while the table is still
    /// `seen` (the one `select` read); else the next `select` tries again.
    fn adopt(&self, seen: Arc<Map<V>>, adopt: Vec<(usize, PyKey)>) {
        let mut replaced = Vec::with_capacity(adopt.len());
        let stale = {
            let mut guard = self.map.lock();
            if !Arc::ptr_eq(&guard.map, &seen) {
                return;
            }
            drop(seen); // not the last reference (the mutex holds one): make_mut need not copy
            let t = Arc::make_mut(&mut guard.map);
            for (pos, key) in adopt {
                if let Some((k, _)) = t.get_index_mut2(pos) {
                    if *k == key {
                        replaced.push(std::mem::replace(k, key));
                    }
                }
            }
            // the kept keys are rebuilt with the index's objects too
            guard.keys.take()
        };
        // the table's former keys may hold the last reference to their objects: dropped here,
        // the mutex released
        drop(replaced);
        drop(stale);
    }
}

impl Loads {
    fn key_error(w: &Bound<'_, PyAny>) -> PyErr {
        PyKeyError::new_err(w.clone().unbind())
    }

    /// `w`'s tokens, None when `w` is not a worker key (a dict would hold no such key either)
    /// or holds none.
    fn find(&self, w: &Bound<'_, PyAny>) -> Option<i64> {
        let k = PyKey::extract(w).ok()?;
        self.table.read(|t| t.get(&k).map(|e| e.value))
    }
}

#[pymethods]
impl Loads {
    #[new]
    fn new() -> Self {
        Loads::default()
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    fn __contains__(&self, w: &Bound<'_, PyAny>) -> bool {
        self.find(w).is_some()
    }

    fn __getitem__(&self, w: &Bound<'_, PyAny>) -> PyResult<i64> {
        self.find(w).ok_or_else(|| Loads::key_error(w))
    }

    /// Set ``w``'s tokens; a worker already present keeps its place.
    fn __setitem__(&self, w: &Bound<'_, PyAny>, tokens: i64) -> PyResult<()> {
        let k = PyKey::extract(w)?;
        // the key not inserted (the worker was present) is dropped after the mutex is released
        drop(self.table.put(k, tokens, u64::from(NONE)));
        Ok(())
    }

    fn __delitem__(&self, w: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = PyKey::extract(w).map_err(|_| Loads::key_error(w))?;
        // shift: the order of the rest is the dict's (a worker re-added goes last)
        let removed = self.table.write(|t| t.shift_remove_entry(&k));
        removed.map(|_| ()).ok_or_else(|| Loads::key_error(w))
    }

    /// ``w``'s tokens, or ``default``.
    #[pyo3(signature = (w, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        w: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self.find(w) {
            Some(v) => v.into_pyobject(py)?.into_any(),
            None => default.unwrap_or_else(|| py.None().into_bound(py)),
        })
    }

    /// Remove ``w`` and return its tokens, or ``default`` when absent (`dict.pop`).
    #[pyo3(signature = (w, *default))]
    fn pop<'py>(
        &self,
        py: Python<'py>,
        w: &Bound<'py, PyAny>,
        default: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let got = match PyKey::extract(w) {
            Ok(k) => self.table.write(|t| t.shift_remove_entry(&k)),
            Err(_) => None,
        };
        match got {
            Some((_, e)) => Ok(e.value.into_pyobject(py)?.into_any()),
            None if !default.is_empty() => default.get_item(0),
            None => Err(Loads::key_error(w)),
        }
    }

    /// The workers, in order.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.table.snapshot().keys().map(|k| k.obj(py)))
    }

    /// The tokens, in order.
    fn values(&self) -> Vec<i64> {
        self.table.read(|t| t.values().map(|e| e.value).collect())
    }

    /// (worker, tokens) pairs, in order.
    fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let t = self.table.snapshot();
        PyList::new(py, t.iter().map(|(k, v)| (k.obj(py), v.value)))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.keys(py)?.try_iter().map(Bound::into_any)
    }
}

/// The engines' newest load records (`EngineLoads`, kvroute/_load.py), one per worker in the
/// order the records first arrived, as the dict they mirror orders them. `EngineLoads.update`
/// writes a record here as it arrives (a few hundred ns, not re-read per `select`), and the
/// compiled `select` blends it with the router's own load in the pass that prices the
/// candidates, with no Python call per worker (`EngineLoads.blend` is the reference it equals).
///
/// Threads: the rules of `Loads` (frozen, a `CowTable` whose mutex is never held while Python
/// code can run).
#[pyclass(frozen, module = "kvroute._core", name = "EngineTable")]
pub struct EngineTable {
    table: CowTable<EngineFigures>,
    /// tokens a request that an engine reports by count only is priced at: the mean of the
    /// router's own in-flight requests when it last had any (`LoadPolicy.request_tokens` until
    /// then), as `f64` bits; both scoring paths learn and read it here
    per_request: AtomicU64,
    /// index slot -> position of that worker's record, where the last `select` found it
    /// (`EngineView::at_slot`; `NONE`: none known): a hint, believed only while the record there
    /// holds the index's own key object for that slot's worker. Taken by a `select` and given
    /// back when it is done (a `select` finding none taken does without, lookup by key)
    slots: Mutex<Vec<u32>>,
}

/// A worker's record, its note whether the worker is in the live set a router last kept
/// (`Members`): that set's generation shifted left by one, or'd with the answer (0: not asked).
/// The answer never changes for one generation (a kept set is immutable), so a `select` reads
/// it here instead of looking the worker up in the set (a hash lookup per record, most of
/// the engine pass at 1,024 workers).
type EngMap = Map<EngineFigures>;

impl Entry<EngineFigures> {
    /// The worker's newest record.
    fn figures(&self) -> &EngineFigures {
        &self.value
    }
}

impl EngineTable {
    fn per_request(&self) -> f64 {
        f64::from_bits(self.per_request.load(Ordering::Relaxed))
    }

    /// The records' positions by index slot, for this `select` (`EngineTable::slots`).
    fn take_slots(&self) -> Vec<u32> {
        std::mem::take(&mut *self.slots.lock())
    }

    /// Give back the positions a `select` took (and updated).
    fn keep_slots(&self, slots: Vec<u32>) {
        *self.slots.lock() = slots;
    }
}

#[pymethods]
impl EngineTable {
    #[new]
    fn new(request_tokens: f64) -> Self {
        EngineTable {
            table: CowTable::default(),
            per_request: AtomicU64::new(request_tokens.to_bits()),
            slots: Mutex::default(),
        }
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    /// Keep ``worker``'s newest record (a worker already present keeps its place): ``received``
    /// (monotonic s), ``queued`` tokens, ``requests`` (> 0: priced by request count), engine
    /// ``silence`` ms (-1: none), the ``allowance`` ms before a veto, KV ``usage``.
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        worker: &Bound<'_, PyAny>,
        received: f64,
        queued: f64,
        requests: f64,
        silence: f64,
        allowance: f64,
        usage: f64,
    ) -> PyResult<()> {
        let k = PyKey::extract(worker)?;
        let figures = EngineFigures {
            received,
            queued,
            requests,
            silence,
            allowance,
            usage,
        };
        // the key not inserted (the worker was present) is dropped after the mutex is released
        let spare = self.table.put(k, figures, 0);
        drop(spare);
        Ok(())
    }

    /// Forget ``worker``'s record (the rest keep their order; a worker reporting again goes last).
    fn remove(&self, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = PyKey::extract(worker)?;
        let gone = self.table.write(|t| t.shift_remove_entry(&k));
        drop(gone);
        Ok(())
    }

    /// Tokens a request reported by count only is priced at (see `EngineTable`).
    #[getter(per_request)]
    fn get_per_request(&self) -> f64 {
        self.per_request()
    }

    #[setter(per_request)]
    fn set_per_request(&self, tokens: f64) {
        self.per_request.store(tokens.to_bits(), Ordering::Relaxed);
    }
}

/// A router's copy of its states provider's live set, as keys: `select` asks whether each of up
/// to 1,024 candidates is a member, and a Python set lookup per candidate (hashing a `WorkerKey`
/// tuple) cost ~60 ns each. Only an exact frozenset is kept (immutable: the same object always
/// holds the same workers), and only once the same object came twice in a row: a set built per
/// call is never copied. Each entry holds its set, so no other set can take its address.
#[pyclass(frozen, module = "kvroute._core", name = "Members")]
#[derive(Default)]
pub struct Members {
    state: Mutex<MembersState>,
}

#[derive(Default)]
struct MembersState {
    /// the set the last call was given, not copied (yet)
    last: Option<Py<PyAny>>,
    /// the set copied, its keys, whether they are the index's own key objects yet (`adopt`),
    /// and its generation (its `Entry` note)
    kept: Option<(Py<PyAny>, KeptKeys)>,
}

/// The keys of a kept live set (`Members::keys_of`): the set, whether its keys are the index's
/// own objects (else `select` gives it those, `Members::adopt`), and its generation.
type KeptKeys = (Arc<FxHashSet<PyKey>>, bool, u64);

/// The next kept set's generation, unique in the process (0 is "none").
static MEMBER_GEN: AtomicU64 = AtomicU64::new(1);

impl Members {
    /// The keys of `u` when they are (or now become) kept; None: ask `u` itself.
    fn keys_of(&self, u: &Bound<'_, PyAny>) -> Option<KeptKeys> {
        if !u.is_exact_instance_of::<PyFrozenSet>() {
            return None;
        }
        let seen_before = {
            let st = self.state.lock();
            if let Some((obj, keys)) = &st.kept {
                if obj.is(u) {
                    return Some(keys.clone());
                }
            }
            st.last.as_ref().is_some_and(|o| o.is(u))
        };
        if !seen_before {
            let old = self.state.lock().last.replace(u.clone().unbind());
            drop(old); // the mutex released: it may hold the last reference to its set
            return None;
        }
        // read with the mutex released (a name is read from Python objects); a member that is no
        // worker key leaves the set unkept (Python's lookup answers for it)
        let keys: FxHashSet<PyKey> = u
            .try_iter()
            .ok()?
            .map(|w| w.ok().and_then(|w| PyKey::extract(&w).ok()))
            .collect::<Option<_>>()?;
        let keys = Arc::new(keys);
        let gen = MEMBER_GEN.fetch_add(1, Ordering::Relaxed);
        let old = {
            let mut st = self.state.lock();
            let old = st
                .kept
                .replace((u.clone().unbind(), (keys.clone(), false, gen)));
            (old, st.last.take())
        };
        drop(old);
        Some((keys, false, gen))
    }

    /// Keep `keys`, the index's own key objects for the members of `u`, while `u` is still the set
    /// kept: a lookup of an index worker then compares two pointers, not two names (~25 ns a
    /// candidate at 1,024 workers).
    fn adopt(&self, u: &Bound<'_, PyAny>, keys: Arc<FxHashSet<PyKey>>) {
        let old = {
            let mut st = self.state.lock();
            match &mut st.kept {
                Some((obj, (kept, adopted, _))) if obj.is(u) => {
                    *adopted = true;
                    Some(std::mem::replace(kept, keys))
                }
                _ => None,
            }
        };
        drop(old); // the mutex released: a key may hold the last reference to its object
    }
}

/// `keys` with each member the index holds replaced by the index's own key object for it.
fn index_keys(idx: &Index<PyKey>, keys: &FxHashSet<PyKey>) -> FxHashSet<PyKey> {
    let mut out = keys.clone();
    for slot in 0..idx.workers.len() as u32 {
        if let Some((k, _)) = idx.at_slot(slot) {
            if out.contains(k) {
                out.replace(k.clone());
            }
        }
    }
    out
}

#[pymethods]
impl Members {
    #[new]
    fn new() -> Self {
        Members::default()
    }
}

/// The router's footprint (`CostModel.footprint`, kvroute/_footprint.py): decayed new-placement
/// counts per worker (`crate::scoring::Footprint`), kept beside the load table and under its rules
/// (`Loads`): frozen, copy-on-write behind a mutex that is never held while Python code can run.
/// `select` picks from its own copy of the table and counts its placement afterwards (two threads
/// placing at once may both pick the same worker, as two routers would); a write copies the table
/// only while some `select` still holds the old one.
#[pyclass(frozen, module = "kvroute._core", name = "Footprint")]
#[derive(Default)]
pub struct Footprint {
    table: Mutex<Arc<scoring::Footprint<PyKey>>>,
    /// The keys of the worker objects candidate sets held, by object address: a states provider's
    /// ``live_workers()`` is a new set of the same key objects each call, and reading each one's
    /// name again (`PyKey::extract`) cost ~10x a copy of the set at 1,024 workers. Each entry
    /// holds its object, so no other object can take its address while it is here.
    keys: Mutex<FxHashMap<usize, PyKey>>,
}

/// `Footprint::keys` is emptied when it would grow past this (objects no longer in any set are
/// dropped with it; the next call reads the names again).
const KEYS_KEPT: usize = 1 << 16;

impl Footprint {
    /// The keys of `objs` (worker keys), in order, from `keys` where the same object was read before.
    fn keys_of(&self, objs: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<PyKey>> {
        let found: Vec<Option<PyKey>> = {
            let kept = self.keys.lock();
            objs.iter()
                .map(|o| kept.get(&(o.as_ptr() as usize)).cloned())
                .collect()
        };
        let mut new = Vec::new();
        let mut out = Vec::with_capacity(objs.len());
        // names read with the mutex released (reading one may run Python code)
        for (o, k) in objs.iter().zip(found) {
            let k = match k {
                Some(k) => k,
                None => {
                    let k = PyKey::extract(o)?;
                    new.push((o.as_ptr() as usize, k.clone()));
                    k
                }
            };
            out.push(k);
        }
        if !new.is_empty() {
            let dropped = {
                let mut kept = self.keys.lock();
                let dropped = if kept.len() + new.len() > KEYS_KEPT {
                    std::mem::take(&mut *kept)
                } else {
                    FxHashMap::default()
                };
                kept.extend(new);
                dropped
            };
            drop(dropped); // the mutex released: a key may hold the last reference to its object
        }
        Ok(out)
    }

    /// The current table, for a reader to use with the mutex released.
    fn snapshot(&self) -> Arc<scoring::Footprint<PyKey>> {
        self.table.lock().clone()
    }

    /// Count a new placement on `worker`; the keys the table let go of are dropped after the
    /// mutex is released (a key may hold the last reference to its object).
    fn place(&self, worker: PyKey, half_life: f64) {
        let gone = Arc::make_mut(&mut self.table.lock()).add(worker, half_life);
        drop(gone);
    }
}

#[pymethods]
impl Footprint {
    #[new]
    fn new() -> Self {
        Footprint::default()
    }

    fn __len__(&self) -> usize {
        self.table.lock().len()
    }

    /// ``worker``'s decayed count of new placements (1.0 for one made just now).
    fn count(&self, worker: &Bound<'_, PyAny>) -> PyResult<f64> {
        let k = PyKey::extract(worker)?;
        Ok(self.table.lock().count(&k))
    }

    /// Count one new placement on ``worker``; every count decays by ``2 ** (-1 / half_life)``.
    fn add(&self, worker: &Bound<'_, PyAny>, half_life: f64) -> PyResult<()> {
        if half_life.is_nan() || half_life <= 0.0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "half_life must be > 0, got {half_life}"
            )));
        }
        self.place(PyKey::extract(worker)?, half_life);
        Ok(())
    }

    /// Forget ``worker``'s count (it left the fleet).
    fn discard(&self, worker: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = PyKey::extract(worker)?;
        let gone = Arc::make_mut(&mut self.table.lock()).discard(&k);
        drop(gone); // the mutex released (see `place`)
        Ok(())
    }

    /// The new placement's worker for the Python scoring path (`crate::scoring::Footprint::pick`,
    /// the compiled `select` picks with the same function): ``costs`` / ``loads`` / ``workers``
    /// the priced candidates (load in cost blocks), ``idle`` returns the idle workers (all at
    /// ``idle_cost`` and no load; None: there are none), ``limit`` the band's bound for the
    /// cheapest cost (`CostModel.footprint_limit`), ``rng`` draws among ties (``randrange``).
    /// Returns ``(position in costs or None for an idle worker, worker)``, or None when the idle
    /// group was the cheapest and ``idle`` found none.
    #[allow(clippy::too_many_arguments)]
    fn pick<'py>(
        &self,
        py: Python<'py>,
        costs: Vec<f64>,
        loads: Vec<f64>,
        workers: Vec<Bound<'py, PyAny>>,
        idle_cost: f64,
        idle: Option<Bound<'py, PyAny>>,
        limit: Bound<'py, PyAny>,
        rng: Bound<'py, PyAny>,
    ) -> PyResult<Option<(Option<usize>, Bound<'py, PyAny>)>> {
        if costs.len() != workers.len() || loads.len() != workers.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "costs, loads and workers differ in length",
            ));
        }
        let keys = self.keys_of(workers.clone())?;
        let listed: Vec<(f64, f64, &PyKey)> = costs
            .iter()
            .zip(&loads)
            .zip(&keys)
            .map(|((&c, &x), k)| (c, x, k))
            .collect();
        let idle = idle.map(|f| {
            move || -> PyResult<Vec<PyKey>> {
                let pool = f.call0()?.try_iter()?.collect::<PyResult<Vec<_>>>()?;
                self.keys_of(pool)
            }
        });
        let table = self.snapshot();
        let got = table.pick(
            &listed,
            idle_cost,
            idle,
            |c| limit.call1((c,))?.extract(),
            |n| draw(&rng, n),
        )?;
        Ok(got.map(|p| match p {
            Placed::Listed(i) => (Some(i), workers[i].clone()),
            Placed::Idle(k) => (None, k.obj(py)),
        }))
    }
}

/// ``rng.randrange(n)``: the router's own generator draws, so both paths consume it alike.
fn draw(rng: &Bound<'_, PyAny>, n: usize) -> PyResult<usize> {
    rng.call_method1(intern!(rng.py(), "randrange"), (n,))?
        .extract()
}

/// Whether the router believes a worker's index claim (`Router._scored`'s rule: its status is
/// "synced" and, unless `trust_partial`, not partial). From the set of unvouched workers the
/// router read once for this call (`ReferenceScoring._unvouched`): none in it, as on a synced
/// fleet, costs nothing per worker. A states provider that keeps no such set is asked
/// `worker_status` per worker with overlap, its method looked up once per `select`.
struct Trust<'py> {
    /// the unvouched workers (Some: the rule is "not in it"; an empty set is None here)
    unvouched: Option<&'py Bound<'py, PyAny>>,
    /// the provider to ask per worker when it keeps no such set (None: every claim is believed)
    states: Option<&'py Bound<'py, PyAny>>,
    /// its bound `worker_status`, looked up at the first worker with overlap
    status: std::cell::OnceCell<Bound<'py, PyAny>>,
    trust_partial: bool,
}

impl<'py> Trust<'py> {
    /// `unvouched`: the set (None: ask `states` per worker, or believe every claim without it).
    fn new(
        unvouched: Option<&'py Bound<'py, PyAny>>,
        states: Option<&'py Bound<'py, PyAny>>,
        trust_partial: bool,
    ) -> PyResult<Self> {
        let (unvouched, states) = match unvouched {
            Some(u) => (if u.len()? > 0 { Some(u) } else { None }, None),
            None => (None, states),
        };
        Ok(Trust {
            unvouched,
            states,
            status: std::cell::OnceCell::new(),
            trust_partial,
        })
    }

    /// Every claim is believed (no unvouched worker, no provider to ask): `of` need not be called.
    fn believes_all(&self) -> bool {
        self.unvouched.is_none() && self.states.is_none()
    }

    fn of(&self, w: &Bound<'py, PyAny>) -> PyResult<bool> {
        if let Some(u) = self.unvouched {
            return Ok(!u.contains(w)?);
        }
        let Some(states) = self.states else {
            return Ok(true);
        };
        let status_of = match self.status.get() {
            Some(f) => f,
            None => {
                let f = states.getattr(intern!(states.py(), "worker_status"))?;
                self.status.get_or_init(|| f)
            }
        };
        let py = w.py();
        let status = status_of.call1((w,))?;
        if status.is_none() {
            return Ok(false);
        }
        let state = status.getattr(intern!(py, "state"))?;
        let synced = intern!(py, "synced");
        // the provider's literal is the interned "synced" itself: an identity check first
        if !(state.is(synced) || state.eq(synced)?) {
            return Ok(false);
        }
        Ok(self.trust_partial || !status.getattr(intern!(py, "partial"))?.is_truthy()?)
    }
}

/// One candidate's figures (`CandidateScore` less the worker and source, always "index" here).
#[derive(Clone, Copy, Debug)]
struct Row {
    claimed: i64,
    overlap: i64,
    block_size: Option<i64>,
    prefill: f64,
    load: f64,
    cost: f64,
    overlap_tokens: i64,
    routed_tokens: i64,
}

/// The candidates `select` priced, kept compact: a `CandidateScore` costs ~220 ns to build, and a
/// loaded fleet of 1,024 workers has one per worker, so `RoutingDecision.candidates` builds them
/// only when it is read.
#[pyclass(frozen, module = "kvroute._core", name = "Scored")]
pub struct Scored {
    workers: Vec<Who>,
    rows: Vec<Row>,
    /// the engine records' keys `Who::Listed` positions name (None: no engine records)
    listed: Option<Arc<[PyKey]>>,
}

/// A candidate's worker: a key (the index's or the load table's, holding its object), or an
/// object from a mapping the caller gave. Keys are dropped without pyo3's deferred-decref check
/// (a thread-local read per object, ~20 instructions: 1,024 of them per loaded-fleet decision).
enum Who {
    Key(PyKey),
    Obj(Py<PyAny>),
    /// the worker at this position of the engine records' keys (`Scored::listed`), which
    /// `CowTable::keyed` keeps: a load-only candidate costs no reference count of its own
    Listed(u32),
}

impl Who {
    /// The worker's object; `listed` the keys a `Listed` position names.
    fn bind<'py>(&self, py: Python<'py>, listed: &[PyKey]) -> Bound<'py, PyAny> {
        match self {
            Who::Key(k) => k.obj(py),
            Who::Obj(o) => o.bind(py).clone(),
            Who::Listed(i) => listed[*i as usize].obj(py),
        }
    }
}

impl Scored {
    /// The keys `Who::Listed` positions name.
    fn listed(&self) -> &[PyKey] {
        self.listed.as_deref().unwrap_or(&[])
    }
}

#[pymethods]
impl Scored {
    fn __len__(&self) -> usize {
        self.rows.len()
    }

    /// Candidate ``i`` as a `CandidateScore`.
    fn candidate<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let (Some(w), Some(r)) = (self.workers.get(i), self.rows.get(i)) else {
            return Err(pyo3::exceptions::PyIndexError::new_err(
                "candidate index out of range",
            ));
        };
        candidate(&candidate_type(py)?, w.bind(py, self.listed()), r)
    }

    /// Every candidate as a `CandidateScore`, in order.
    fn build<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let cls = candidate_type(py)?;
        let out = PyList::empty(py);
        for (w, r) in self.workers.iter().zip(&self.rows) {
            out.append(candidate(&cls, w.bind(py, self.listed()), r)?)?;
        }
        Ok(out)
    }

    /// The candidates' workers, in order.
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.workers.iter().map(|w| w.bind(py, self.listed())))
    }

    /// The candidates' costs, in order.
    fn costs(&self) -> Vec<f64> {
        self.rows.iter().map(|r| r.cost).collect()
    }
}

/// The registered `CandidateScore` class.
fn candidate_type(py: Python<'_>) -> PyResult<Bound<'_, PyType>> {
    match CANDIDATE.get(py) {
        Some(cls) => Ok(cls.bind(py).clone()),
        None => Err(pyo3::exceptions::PyRuntimeError::new_err(
            "kvroute._router is not imported",
        )),
    }
}

/// One `CandidateScore` (positional: the class's field order).
fn candidate<'py>(
    cls: &Bound<'py, PyType>,
    worker: Bound<'py, PyAny>,
    row: &Row,
) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
    let Row {
        claimed,
        overlap,
        block_size,
        prefill,
        load,
        cost,
        overlap_tokens,
        routed_tokens,
    } = *row;
    // Equal figures share one object (immutable): a trusted claim's overlap is the claim, and an
    // unloaded candidate at weight 1 costs its prefill.
    let claimed_obj = claimed.into_pyobject(py)?.into_any();
    let overlap_obj = if overlap == claimed {
        claimed_obj.clone()
    } else {
        overlap.into_pyobject(py)?.into_any()
    };
    let prefill_obj = prefill.into_pyobject(py)?.into_any();
    let cost_obj = if cost.to_bits() == prefill.to_bits() {
        prefill_obj.clone()
    } else {
        cost.into_pyobject(py)?.into_any()
    };
    let args = [
        worker,
        intern!(py, "index").clone().into_any(),
        claimed_obj,
        overlap_obj,
        block_size.into_pyobject(py)?.into_any(),
        prefill_obj,
        load.into_pyobject(py)?.into_any(),
        cost_obj,
        overlap_tokens.into_pyobject(py)?.into_any(),
        routed_tokens.into_pyobject(py)?.into_any(),
    ];
    // A tuple call: `PyObject_Vectorcall` would spare the tuple, but CPython 3.10 (the abi3
    // wheel's floor) does not export it.
    cls.call1(PyTuple::new(py, args)?)
}

/// Where a worker's load comes from: the router's own table (no Python call per worker), a
/// mapping the caller or the engine-load blend built, or nobody (every load 0).
enum LoadSource<'a, 'py> {
    None,
    Table(&'a Table),
    Mapping(&'a Bound<'py, PyAny>),
}

/// Per-call state of the load pass: which table entries a candidate already took.
struct LoadPass<'a, 'py> {
    source: LoadSource<'a, 'py>,
    scale: f64,
    /// table positions priced already (scored or hint-only), for the load-only pass to skip
    taken: Vec<bool>,
    /// index slot -> position of that worker's entry in the table (`NONE`: no entry with
    /// tokens), from the entries' kept slots: a scored worker's load without a lookup by name
    pos_of_slot: Vec<u32>,
    /// the engines' records blended with the table (`EngineLoads.blend`; None: not blended)
    engine: Option<EngineView>,
}

/// No table position.
const NONE: u32 = u32::MAX;

/// This call's reading of the engines' records (`EngineTable`) and how each blends with the
/// router's own tokens (`crate::scoring::blend`), by record position.
struct EngineView {
    records: Arc<EngMap>,
    /// the records' keys in order (`CowTable::keyed`)
    keys: Arc<[PyKey]>,
    mode: LoadMode,
    unit: f64,
    /// per record: the engine's load in blocks when the record is fresh (None: stale)
    fresh: Vec<Option<f64>>,
    /// per record: the KV usage the eviction term prices (0: none); empty when the term is off
    usage: Vec<f64>,
    /// the fresh records whose engines are silent past their allowance (`vetoed`), by position
    wedged: Vec<u32>,
    /// whether some fresh record counts requests (else no record is listed in the blend's
    /// second, counted, group)
    counted: bool,
    /// per record: its worker priced already
    taken: Vec<bool>,
    /// per record: the position of its worker's entry in the router's table (`NONE`: none)
    own_of: Vec<u32>,
    /// per router-table entry with tokens: the position of its worker's record (`NONE`: none)
    record_of: Vec<u32>,
    /// records found by an equal key that is the index's own object: (position, that key), for
    /// `CowTable::adopt`
    adopt: Vec<(usize, PyKey)>,
    /// index slot -> record position, as last found (`EngineTable::slots`)
    slots: Vec<u32>,
}

impl EngineView {
    /// The blended load of a worker with record `at` and the router's own `tokens` there
    /// (0: none), in blocks; `EngineLoads.blend`'s value, division for division.
    #[inline]
    fn load(&self, at: Option<usize>, tokens: i64) -> f64 {
        let mine = (tokens != 0).then(|| tokens as f64 / self.unit);
        scoring::blend(self.mode, at.and_then(|i| self.fresh[i]), mine)
    }

    /// The KV usage of record `i` the eviction term prices (0: none, or the term is off).
    #[inline]
    fn usage(&self, i: usize) -> f64 {
        self.usage.get(i).copied().unwrap_or(0.0)
    }

    /// The position of the record of the worker at index slot `slot` (`key`, the index's own key
    /// object for it; None: no record). Tried first where the slot's hint says (`slots`): a
    /// record holding that very object is that worker's, found without hashing (a lookup by key
    /// was ~120 instructions a scored worker at 1,024 reporting engines, most of them missing
    /// the cache); else by key, and the hint kept for the next `select`.
    fn at_slot(&mut self, slot: u32, key: &PyKey) -> Option<usize> {
        let s = slot as usize;
        if let Some(&i) = self.slots.get(s) {
            if self
                .records
                .get_index(i as usize)
                .is_some_and(|(k, _)| k.same(key))
            {
                return Some(i as usize);
            }
        }
        let found = self.find(key, true);
        if self.slots.len() <= s {
            self.slots.resize(s + 1, NONE);
        }
        self.slots[s] = found.map_or(NONE, |i| i as u32);
        found
    }

    /// The position of `key`'s record (None: none); `index_key`: `key` is the index's own object,
    /// to be adopted by a record holding another.
    fn find(&mut self, key: &PyKey, index_key: bool) -> Option<usize> {
        let (i, k, _) = self.records.get_full(key)?;
        if index_key && !k.same(key) {
            self.adopt.push((i, key.clone()));
        }
        Some(i)
    }
}

impl EngineView {
    /// The workers to veto (`EngineLoads.blend`): a fresh record's engine silent past its
    /// allowance, and a worker holding the router's requests (`own`) whose records went stale.
    fn vetoed(&self, own: &Table) -> Vec<PyKey> {
        if self.mode == LoadMode::Router {
            return Vec::new();
        }
        let wedged = self
            .wedged
            .iter()
            .filter_map(|&i| self.records.get_index(i as usize).map(|(k, _)| k.clone()));
        let stale = own
            .iter()
            .enumerate()
            .filter(|(p, (_, e))| {
                e.tokens() != 0 && pos(self.record_of[*p]).is_some_and(|i| self.fresh[i].is_none())
            })
            .map(|(_, (k, _))| k.clone());
        wedged.chain(stale).collect()
    }
}

/// This call's `EngineView`: `records` (``table``'s, read once, with their keys and the slot
/// hints taken from ``table``, `EngineTable::slots`) at ``(now, stale_after, mode,
/// requests in flight)``, `own` the router's table and `own_located` which of its entries hold
/// the index's key object; the usage read only when `eviction` is priced. Learns the mean request
/// (`EngineTable::per_request`) as `EngineLoads.blend` does: when a fresh record counts requests
/// and the router has some.
fn engine_view(
    table: &EngineTable,
    (records, keys, slots): (Arc<EngMap>, Arc<[PyKey]>, Vec<u32>),
    (now, stale_after, mode, requests): (f64, f64, LoadMode, usize),
    own: Option<&Table>,
    own_located: &[bool],
    unit: i64,
    eviction: bool,
) -> EngineView {
    let blends = mode != LoadMode::Router;
    let unit_f = unit as f64;
    let n = records.len();
    // One pass over the records (was four: the counted check, the fresh loads, the usage and
    // the wedged records, ~60k instructions a `select` at 1,024 records), the usage read only
    // when the eviction term is priced. A counted record's load needs the mean request, known
    // only once every record was read: its count is kept here and turned into blocks after.
    let mut fresh = Vec::with_capacity(n);
    let mut usage = Vec::with_capacity(if eviction { n } else { 0 });
    let mut wedged = Vec::new();
    let mut counted = false;
    for e in records.values() {
        let f = e.figures();
        let load = if blends && f.fresh(now, stale_after) {
            if f.wedged() {
                wedged.push(fresh.len() as u32);
            }
            if f.by_count() {
                counted = true;
                Some(f.requests)
            } else {
                Some(f.blocks(unit_f, 0.0))
            }
        } else {
            None
        };
        fresh.push(load);
        if eviction {
            usage.push(f.usage_at(now, stale_after));
        }
    }
    let per = if counted && requests > 0 {
        let sum: i64 = own.map_or(0, |t| t.values().map(|e| e.tokens()).sum());
        let mean = sum as f64 / requests as f64;
        table.set_per_request(mean);
        mean
    } else {
        table.per_request()
    };
    if counted {
        for (load, e) in fresh.iter_mut().zip(records.values()) {
            if let Some(l) = load {
                if e.figures().by_count() {
                    *l = e.figures().blocks(unit_f, per);
                }
            }
        }
    }
    let mut view = EngineView {
        taken: vec![false; n],
        own_of: vec![NONE; n],
        record_of: Vec::new(),
        adopt: Vec::new(),
        records,
        keys,
        mode,
        unit: unit_f,
        fresh,
        usage,
        wedged,
        counted,
        slots,
    };
    // each loaded worker's record, found by key (a key the index's own object once adopted)
    if let Some(t) = own {
        let mut record_of = vec![NONE; t.len()];
        for (p, (k, e)) in t.iter().enumerate() {
            if e.tokens() == 0 {
                continue;
            }
            if let Some(i) = view.find(k, own_located.get(p).copied().unwrap_or(false)) {
                record_of[p] = i as u32;
                view.own_of[i] = p as u32;
            }
        }
        view.record_of = record_of;
    }
    view
}

/// `u32` position to `Option<usize>` (`NONE`: None).
fn pos(p: u32) -> Option<usize> {
    (p != NONE).then_some(p as usize)
}

impl LoadPass<'_, '_> {
    /// The router's own tokens at table position `at` (None: 0), that entry taken.
    fn own_tokens(&mut self, at: Option<usize>) -> i64 {
        match (&self.source, at) {
            (LoadSource::Table(t), Some(p)) => {
                self.taken[p] = true;
                t.get_index(p).map_or(0, |(_, e)| e.tokens())
            }
            _ => 0,
        }
    }

    /// The engine usage of `w` (None: the records are not blended here).
    fn key_usage(&self, w: &Bound<'_, PyAny>) -> Option<f64> {
        let v = self.engine.as_ref()?;
        let at = PyKey::extract(w)
            .ok()
            .and_then(|k| v.records.get_index_of(&k));
        Some(at.map_or(0.0, |i| v.usage(i)))
    }

    /// The load of the worker at index slot `slot` (`key` the index's key for it) when it takes
    /// no Python object to find (the router's table, the engines' records, or no load at all),
    /// with its engine usage when the records are blended here (`at`: the worker's record,
    /// `EngineView::at_slot`); None for a mapping (then `of`).
    fn by_slot(&mut self, slot: u32, at: Option<usize>) -> Option<(f64, Option<f64>)> {
        if self.engine.is_some() {
            let own = self.pos_of_slot.get(slot as usize).copied().and_then(pos);
            let tokens = self.own_tokens(own);
            let v = self.engine.as_mut()?;
            if let Some(i) = at {
                v.taken[i] = true;
            }
            return Some((v.load(at, tokens), Some(at.map_or(0.0, |i| v.usage(i)))));
        }
        let load = match &self.source {
            LoadSource::None => Some(0.0),
            LoadSource::Mapping(_) => None,
            LoadSource::Table(t) => Some(match self.pos_of_slot.get(slot as usize) {
                Some(&pos) if pos != NONE => match t.get_index(pos as usize) {
                    Some((_, e)) => {
                        self.taken[pos as usize] = true;
                        e.tokens() as f64 * self.scale
                    }
                    None => 0.0,
                },
                _ => 0.0,
            }),
        };
        load.map(|l| (l, None))
    }

    /// `w`'s load in cost blocks (``loads.get(w, 0) * scale``), `w` not an index-scored worker
    /// (those: `by_slot`, then this only for a mapping).
    fn of(&mut self, w: &Bound<'_, PyAny>) -> PyResult<f64> {
        if self.engine.is_some() {
            let key = PyKey::extract(w).ok();
            let own = match (&self.source, &key) {
                (LoadSource::Table(t), Some(k)) => t.get_index_of(k),
                _ => None,
            };
            let tokens = self.own_tokens(own);
            let Some(v) = self.engine.as_mut() else {
                return Ok(0.0);
            };
            let at = key.and_then(|k| v.records.get_index_of(&k));
            if let Some(i) = at {
                v.taken[i] = true;
            }
            return Ok(v.load(at, tokens));
        }
        match &self.source {
            LoadSource::None => Ok(0.0),
            LoadSource::Mapping(loads) => load_of(loads, w, self.scale),
            LoadSource::Table(t) => {
                let found = match PyKey::extract(w) {
                    Ok(k) => t.get_full(&k),
                    Err(_) => None,
                };
                Ok(match found {
                    Some((pos, _, e)) => {
                        self.taken[pos] = true;
                        e.tokens() as f64 * self.scale
                    }
                    None => 0.0,
                })
            }
        }
    }
}

/// The load-only candidates when the engines' records are blended (`EngineLoads.blend`), in
/// its order: the engines' queues (records in order), the requests records count, then the
/// router's own workers (`t`) no fresh queue covers, then the usage-only workers; `taken` the
/// router's entries priced already. Apart from `select` so that the compiler inlines the
/// per-record helpers here (in `select`'s body it called them, ~30 instructions a record).
fn list_reported(
    t: &Table,
    v: &mut EngineView,
    u: &Universe<'_, '_>,
    taken: &mut [bool],
    (workers, rows): (&mut Vec<Who>, &mut Vec<Row>),
    idle_row: impl Fn(f64, f64) -> Row,
) -> PyResult<()> {
    // `EngineLoads.blend`'s order: the engines' queues (records in order), the requests
    // records count, then the router's own workers no fresh queue covers
    if v.mode != LoadMode::Router {
        // the counted group only when some fresh record counts requests
        let groups = if v.counted { 2 } else { 1 };
        for counted in [false, true].into_iter().take(groups) {
            for (i, (k, e)) in v.records.iter().enumerate() {
                let Some(queue) = v.fresh[i] else { continue };
                // a zero queue is no entry of the blend (the router's own count may be)
                if v.taken[i] || e.figures().by_count() != counted || (!counted && queue == 0.0) {
                    continue;
                }
                let own = pos(v.own_of[i]);
                let load = v.load(Some(i), own.map_or(0, |p| t[p].tokens()));
                if load != 0.0 && u.has_record(e, k)? {
                    v.taken[i] = true;
                    if let Some(p) = own {
                        taken[p] = true;
                    }
                    workers.push(Who::Listed(i as u32));
                    rows.push(idle_row(load, v.usage(i)));
                }
            }
        }
    }
    for (p, (k, e)) in t.iter().enumerate() {
        if e.tokens() == 0 || taken[p] {
            continue;
        }
        let at = pos(v.record_of[p]);
        let uncovered = match at.map(|i| (i, v.fresh[i])) {
            None | Some((_, None)) => true,
            Some((i, Some(queue))) => {
                v.mode == LoadMode::Router
                    || (v.mode == LoadMode::Blend
                        && !v.records[i].figures().by_count()
                        && queue == 0.0)
            }
        };
        let load = v.load(at, e.tokens());
        if uncovered && load != 0.0 && u.has_key(k)? {
            taken[p] = true;
            if let Some(i) = at {
                v.taken[i] = true;
            }
            workers.push(Who::Key(k.clone()));
            rows.push(idle_row(load, at.map_or(0.0, |i| v.usage(i))));
        }
    }
    // usage-only workers: a report above 0, nothing claimed, no load
    // (none when the eviction term is off: no usage read)
    for (i, (k, e)) in v.records.iter().enumerate().take(v.usage.len()) {
        if v.usage[i] > 0.0 && !v.taken[i] && u.has_record(e, k)? {
            v.taken[i] = true;
            workers.push(Who::Listed(i as u32));
            rows.push(idle_row(0.0, v.usage[i]));
        }
    }
    Ok(())
}

/// Who is a candidate when `select` is given a universe set: its members (from the kept copy of
/// a provider's live set when there is one, `Members`), less the vetoed workers.
struct Universe<'a, 'py> {
    set: &'a Bound<'py, PyAny>,
    keys: Option<Arc<FxHashSet<PyKey>>>,
    /// the kept set's generation (0: `keys` is None)
    gen: u64,
    /// the workers the engines' records veto this call (empty: none, or none applied)
    vetoed: FxHashSet<PyKey>,
}

impl Universe<'_, '_> {
    /// Whether `k`'s worker is a member, ignoring vetoes.
    fn holds_key(&self, k: &PyKey) -> PyResult<bool> {
        match &self.keys {
            Some(keys) => Ok(keys.contains(k)),
            None => self.set.contains(k.obj(self.set.py())),
        }
    }

    /// Whether `k`'s worker is a candidate.
    fn has_key(&self, k: &PyKey) -> PyResult<bool> {
        Ok(self.holds_key(k)? && (self.vetoed.is_empty() || !self.vetoed.contains(k)))
    }

    /// Whether the worker of record `e` (key `k`) is a candidate, its membership read from the
    /// record when it was found for this generation of the kept set (its `Entry` note).
    #[inline(always)]
    fn has_record(&self, e: &Entry<EngineFigures>, k: &PyKey) -> PyResult<bool> {
        // the common case inline (a kept set, no veto, the note read for this generation): the
        // call it was cost ~25 instructions a record, ~1,000 records a `select`
        if self.gen != 0 && self.vetoed.is_empty() {
            let m = e.note.load(Ordering::Relaxed);
            if m >> 1 == self.gen {
                return Ok(m & 1 == 1);
            }
        }
        self.has_record_read(e, k)
    }

    /// `has_record`, its note read or written here.
    #[inline(never)]
    fn has_record_read(&self, e: &Entry<EngineFigures>, k: &PyKey) -> PyResult<bool> {
        let held = if self.gen == 0 {
            self.holds_key(k)?
        } else {
            let m = e.note.load(Ordering::Relaxed);
            if m >> 1 == self.gen {
                m & 1 == 1
            } else {
                let held = self.holds_key(k)?;
                e.note
                    .store(self.gen << 1 | u64::from(held), Ordering::Relaxed);
                held
            }
        };
        Ok(held && (self.vetoed.is_empty() || !self.vetoed.contains(k)))
    }

    /// Whether `w` is a candidate.
    fn has(&self, w: &Bound<'_, PyAny>) -> PyResult<bool> {
        if !self.set.contains(w)? {
            return Ok(false);
        }
        Ok(self.vetoed.is_empty() || PyKey::extract(w).map_or(true, |k| !self.vetoed.contains(&k)))
    }
}

/// The engine-load arguments of `select`: the records, the clock's `now`, `stale_after`, the
/// policy's mode, and how many requests the router has in flight.
type EngineArgs<'py> = (Bound<'py, EngineTable>, f64, f64, String, usize);

/// Match ``token_ids`` (checked as `find_matches` checks them) and price the candidates for
/// `Router.select` with the built-in cost model ``model``. ``universe``: the candidate set, or
/// None for every worker the index holds blocks for plus ``registered`` (`Router.workers()`
/// without states, read here under the index's lock instead of built as a set per call);
/// ``states``: the worker-state provider or None; ``loads`` / ``scale``: load per worker (a
/// `Loads` table or a mapping) and the factor to cost blocks (the load-only candidates come in
/// ``loads``' order); ``routed``: the routing hint's credit in tokens per worker
/// (kvroute/_routed.py; None: none); ``usage``: engine-reported KV usage per worker, above 0
/// (`CostModel.eviction`; None: none), a usage-only worker listed after the load-only ones;
/// ``footprint``: the router's footprint when the model spreads new sessions at temperature 0
/// (None: it does not), ``rng`` draws among the footprint's ties, and ``record`` counts the
/// placement (the request is started); ``unvouched``: the workers whose claims are not believed
/// (`Trust`; None: ask ``states`` per worker); ``engine``: ``(table, now, stale_after, mode,
/// requests)``, the engines' load records (`EngineTable`) to blend with ``loads`` (the router's
/// `Loads`) as `EngineLoads.blend` does, ``requests`` the router's requests in flight (None:
/// ``loads`` and ``usage`` are used as given); ``members``: the router's copy of its provider's
/// live set (`Members`; None: ``universe`` is asked per candidate).
/// Returns ``(scored, idle_count, idle_cost, tied, idle_tied, query_tokens, placed, vetoed,
/// vetoes)``: the
/// candidates (`Scored`) in the Python path's order, the idle workers and their cost, the
/// indices of the entries tied at the least cost with the number of idle workers tied with them,
/// and the footprint's pick for a new placement (None: not one): ``(position, worker)`` of a
/// listed candidate, ``(None, worker)`` of an idle one, ``(None, None)`` when the idle group won
/// but another thread emptied it meanwhile; the workers the engines' records vetoed out of the
/// universe (none while that would leave it empty), and how many they vetoed (applied or not).
/// No candidate and no idle worker: the universe is empty.
#[pyfunction]
#[pyo3(signature = (index, token_ids, lora_name, cache_salt, mm_items, extra_keys, model, unit, universe, registered, states, trust_partial, loads, scale, routed, usage=None, footprint=None, rng=None, record=false, unvouched=None, engine=None, members=None))]
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn select<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyIndex>,
    token_ids: &Bound<'py, PyAny>,
    lora_name: &Bound<'py, PyAny>,
    cache_salt: &Bound<'py, PyAny>,
    mm_items: &Bound<'py, PyAny>,
    extra_keys: &Bound<'py, PyAny>,
    model: &Bound<'py, PyAny>,
    unit: i64,
    universe: Option<&Bound<'py, PyAny>>,
    registered: &Bound<'py, PySet>,
    states: Option<&Bound<'py, PyAny>>,
    trust_partial: bool,
    loads: &Bound<'py, PyAny>,
    scale: f64,
    routed: Option<&Bound<'py, PyDict>>,
    usage: Option<&Bound<'py, PyDict>>,
    footprint: Option<&Bound<'py, Footprint>>,
    rng: Option<&Bound<'py, PyAny>>,
    record: bool,
    unvouched: Option<&Bound<'py, PyAny>>,
    engine: Option<EngineArgs<'py>>,
    members: Option<&Bound<'py, Members>>,
) -> PyResult<(
    Scored,
    usize,
    f64,
    Vec<usize>,
    usize,
    usize,
    Option<PlacedPy>,
    Vec<Py<PyAny>>,
    usize,
)> {
    let input = convert::query_input(token_ids, lora_name, cache_salt, mm_items, extra_keys)?;
    let trust = Trust::new(unvouched, states, trust_partial)?;
    let ntok = input.tokens.len();
    let params = CostParams {
        overlap_weight: weight(model, intern!(py, "overlap_weight"))?,
        cpu_credit: weight(model, intern!(py, "cpu_credit"))?,
        disk_credit: weight(model, intern!(py, "disk_credit"))?,
        external_credit: weight(model, intern!(py, "external_credit"))?,
        eviction_weight: weight(model, intern!(py, "eviction_weight"))?,
        long_prefix: floored(
            model,
            intern!(py, "long_prefix"),
            intern!(py, "long_prefix_floor"),
            intern!(py, "long_prefix_scale"),
        )?,
        long_move: floored(
            model,
            intern!(py, "long_move"),
            intern!(py, "long_move_floor"),
            intern!(py, "long_move_scale"),
        )?,
    };
    let want_tiers = !params.full_credit();
    // this call's copy of the router's table (`Loads`: other threads may change it meanwhile)
    let table = loads.cast::<Loads>().ok().map(|t| t.get().table.snapshot());
    let mapping_has_items = table.is_none() && loads.len()? > 0;
    // the engines' records as of now (another thread's reports may change them meanwhile)
    let engine = match engine {
        Some((et, now, stale_after, mode, requests)) => {
            let mode = match mode.as_str() {
                "blend" => LoadMode::Blend,
                "engine" => LoadMode::Engine,
                "router" => LoadMode::Router,
                _ => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "mode must be 'blend', 'engine' or 'router', not {mode:?}"
                    )))
                }
            };
            if universe.is_none() || table.is_none() {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "engine loads are blended with a universe set and the router's Loads",
                ));
            }
            let (records, keys) = et.get().table.keyed();
            let slots = et.get().take_slots();
            Some((et, (records, keys, slots), now, stale_after, mode, requests))
        }
        None => None,
    };
    // the provider's live set as keys, when the router keeps them (`Members`)
    let kept = match (universe, members) {
        (Some(u), Some(m)) => m.get().keys_of(u),
        _ => None,
    };
    let unadopted = kept.as_ref().filter(|k| !k.1).map(|k| &*k.0);
    // Without a universe set, membership is the index's (a worker holding blocks) or the
    // registration: the keys whose membership the index decides are read before the lock.
    let (reg_keys, routed_keys): (Vec<PyKey>, Vec<Option<PyKey>>) = if universe.is_none() {
        let reg = registered
            .iter()
            .map(|w| PyKey::extract(&w))
            .collect::<PyResult<_>>()?;
        let routed_keys = match routed {
            Some(r) => r.keys().iter().map(|w| PyKey::extract(&w).ok()).collect(),
            None => Vec::new(),
        };
        (reg, routed_keys)
    } else {
        (Vec::new(), Vec::new())
    };
    let table_ref = table.as_deref();
    let whole = universe.is_none();
    let reg_ref = &reg_keys;
    // Match and, when some held block is off GPU and tiers are priced below GPU, the tier runs
    // too: one locked section, one consistent view of the index.
    let (result, tiers, held, pos_of_slot, adopt, adopted) =
        index.get().with_query(py, ntok, move |idx| {
            let mut q = idx.query(input);
            let r = idx.find_matches(&mut q);
            let mut tiers: [FxHashMap<PyKey, i64>; 3] = Default::default();
            if want_tiers && r.gpu.is_some() {
                let any: Vec<(PyKey, i64, i64)> = r
                    .scores
                    .iter()
                    .map(|s| (s.worker.clone(), s.blocks, s.block_size))
                    .collect();
                for (pos, t) in tiers.iter_mut().enumerate() {
                    *t = idx.tier_scores(&mut q, pos + 1, &any).into_iter().collect();
                }
            }
            // Each loaded worker's slot (a worker without load is never a load-only candidate
            // and its load is 0 wherever it is scored: no lookup for it), and whether it holds blocks.
            let mut table_holds = Vec::new();
            let mut pos_of_slot = Vec::new();
            let mut adopt = Vec::new();
            if let Some(m) = table_ref {
                table_holds.reserve(m.len());
                pos_of_slot = vec![NONE; idx.workers.len()];
                for (pos, (k, e)) in m.iter().enumerate() {
                    let found = if e.tokens() != 0 {
                        e.locate(idx, k)
                    } else {
                        None
                    };
                    if let Some((slot, _, at)) = found {
                        pos_of_slot[slot as usize] = pos as u32;
                        if !at.same(k) {
                            adopt.push((pos, at.clone()));
                        }
                    }
                    table_holds.push(found.is_some_and(|(_, holds, _)| holds));
                }
            }
            let adopted = unadopted.map(|keys| Arc::new(index_keys(idx, keys)));
            let held = whole.then(|| Held {
                count: idx.holding_count(),
                registered_elsewhere: reg_ref.iter().filter(|k| !idx.holds(k)).count(),
                table: table_holds,
                routed: routed_keys
                    .iter()
                    .map(|k| k.as_ref().is_some_and(|k| idx.holds(k)))
                    .collect(),
            });
            (r, tiers, held, pos_of_slot, adopt, adopted)
        });
    let table_map = table.as_deref();
    let source = match table_map {
        Some(t) => LoadSource::Table(t),
        None if mapping_has_items => LoadSource::Mapping(loads),
        None => LoadSource::None,
    };
    let engine_table = engine.as_ref().map(|e| e.0.clone());
    let view = match engine {
        Some((et, records, now, stale_after, mode, requests)) => {
            // the router's entries the index holds (their keys are the index's, once adopted)
            let mut own_located = vec![false; table_map.map_or(0, IndexMap::len)];
            for &p in pos_of_slot.iter().filter(|&&p| p != NONE) {
                own_located[p as usize] = true;
            }
            Some(engine_view(
                et.get(),
                records,
                (now, stale_after, mode, requests),
                table_map,
                &own_located,
                unit,
                params.eviction_weight != 0.0,
            ))
        }
        None => None,
    };
    let mut uni = universe.map(|u| Universe {
        set: u,
        // the index's key objects once adopted (kept for the next calls), else the set's
        keys: match (adopted, members) {
            (Some(keys), Some(m)) => {
                m.get().adopt(u, keys.clone());
                Some(keys)
            }
            _ => kept.as_ref().map(|k| k.0.clone()),
        },
        gen: kept.as_ref().map_or(0, |k| k.2),
        vetoed: FxHashSet::default(),
    });
    // Vetoes (`EngineLoads.blend`): wedged engines, and workers whose records stopped while they
    // hold this router's requests; applied only while another candidate is left.
    let (mut vetoed_in, mut applied, mut vetoes) = (0usize, Vec::new(), 0usize);
    if let (Some(v), Some(t), Some(u)) = (&view, table_map, &mut uni) {
        let vetoed = v.vetoed(t);
        vetoes = vetoed.len();
        if !vetoed.is_empty() {
            let mut inside = 0;
            for k in &vetoed {
                inside += usize::from(u.holds_key(k)?);
            }
            if inside < u.set.len()? {
                vetoed_in = inside;
                u.vetoed = vetoed.iter().cloned().collect();
                applied = vetoed;
            }
        }
    }
    let uni = uni;
    // Is `w` a candidate? `by_index`: whether the index holds it (known when `universe` is None).
    let member = |w: &Bound<'py, PyAny>, by_index: bool| -> PyResult<bool> {
        match &uni {
            Some(u) => u.has(w),
            None => Ok(by_index || registered.contains(w)?),
        }
    };

    let ntok_i = ntok as i64;
    let idle_prefill = ntok_i as f64 / unit as f64;
    // every record may list a candidate too: room for them up front (growing the rows by
    // doubling copied ~70k instructions' worth a `select` at 1,024 reporting engines)
    let most = result.scores.len()
        + table_map.map_or(0, IndexMap::len)
        + view.as_ref().map_or(0, |v| v.records.len());
    let mut workers: Vec<Who> = Vec::with_capacity(most);
    let mut rows: Vec<Row> = Vec::with_capacity(most);
    let mut pass = LoadPass {
        taken: vec![false; table_map.map_or(0, IndexMap::len)],
        source,
        scale,
        pos_of_slot,
        engine: view,
    };
    // the scored workers, for the hint-only pass to skip (only kept when there is a hint)
    let seen = match routed {
        Some(_) => Some(PySet::empty(py)?),
        None => None,
    };
    let mut usage_in = Usage {
        dict: usage,
        priced: 0,
    };
    let gpu_of: Option<FxHashMap<u32, i64>> = result
        .gpu
        .as_ref()
        .map(|g| g.iter().map(|s| (s.slot, s.blocks)).collect());
    // by value: each scored worker's key moves into its candidate (no reference count touched)
    for s in result.scores {
        // The worker's object only when something asks for it (a universe set, a mapping, an
        // unvouched worker, a hint, usage): on a fleet with none, 256 candidates touched 256
        // scattered objects' reference counts for nothing (~6 % of an idle-fleet `select`).
        let obj = std::cell::OnceCell::new();
        let w = || obj.get_or_init(|| s.worker.obj(py));
        // the worker's engine record, when the records are blended here
        let rec = match pass.engine.as_mut() {
            Some(v) => v.at_slot(s.slot, &s.worker),
            None => None,
        };
        // a worker the index scores holds blocks; its membership read from its record's note
        // when it has one (as the load-only pass reads it), else looked up
        if let Some(u) = &uni {
            let member = match (rec, &pass.engine) {
                (Some(i), Some(v)) => u.has_record(&v.records[i], &s.worker)?,
                _ => u.has_key(&s.worker)?,
            };
            if !member {
                continue;
            }
        }
        let (load, engine_usage) = match pass.by_slot(s.slot, rec) {
            Some(found) => found,
            None => (pass.of(w())?, None),
        };
        let claim = Claim {
            claimed: s.blocks,
            block_size: s.block_size,
            gpu: match &gpu_of {
                Some(g) => g.get(&s.slot).copied().unwrap_or(0),
                None => s.blocks,
            },
            cpu: tiers[0].get(&s.worker).copied().unwrap_or(0),
            disk: tiers[1].get(&s.worker).copied().unwrap_or(0),
            external: tiers[2].get(&s.worker).copied().unwrap_or(0),
            trusted: trust.believes_all() || trust.of(w())?,
        };
        let hint = match routed {
            Some(r) => routed_of(r, w())?,
            None => 0,
        };
        let u = match (engine_usage, usage) {
            (Some(u), _) => u,
            (None, Some(_)) => usage_in.of(w())?,
            (None, None) => 0.0,
        };
        let p = scoring::price(&params, &claim, ntok_i, unit, load, hint, u);
        if let Some(seen) = &seen {
            seen.add(w())?;
        }
        workers.push(Who::Key(s.worker));
        rows.push(Row {
            claimed: s.blocks,
            overlap: p.overlap_blocks,
            block_size: Some(s.block_size),
            prefill: p.prefill_blocks,
            load,
            cost: p.cost,
            overlap_tokens: p.overlap_tokens,
            routed_tokens: hint,
        });
    }

    // Workers only the routing hint credits, in its order (`Router._routed_only`).
    if let (Some(routed), Some(seen)) = (routed, &seen) {
        for (i, (w, hint)) in routed.iter().enumerate() {
            let by_index = held.as_ref().is_some_and(|h| h.routed[i]);
            if seen.contains(&w)? || !member(&w, by_index)? {
                continue;
            }
            let hint: i64 = hint.extract()?;
            let load = pass.of(&w)?;
            let prefill = scoring::routed_prefill(ntok_i, unit, hint);
            let u = match pass.key_usage(&w) {
                Some(u) => u,
                None => usage_in.of(&w)?,
            };
            let cost = params.cost_at(prefill, load, u);
            seen.add(&w)?;
            workers.push(Who::Obj(w.unbind()));
            rows.push(Row {
                claimed: 0,
                overlap: 0,
                block_size: None,
                prefill,
                load,
                cost,
                overlap_tokens: 0,
                routed_tokens: hint,
            });
        }
    }

    // Load-only workers: nothing claimed, the whole prompt to prefill.
    let idle_cost = params.cost(idle_prefill, 0.0);
    // a worker with nothing claimed: the whole prompt to prefill, its load and what that evicts
    let idle_row = |load: f64, u: f64| Row {
        claimed: 0,
        overlap: 0,
        block_size: None,
        prefill: idle_prefill,
        load,
        cost: if u > 0.0 {
            idle_cost + load + params.eviction(idle_prefill, u)
        } else {
            idle_cost + load
        },
        overlap_tokens: 0,
        routed_tokens: 0,
    };
    // the engine records' keys a load-only candidate is listed by (`Who::Listed`)
    let listed: Option<Arc<[PyKey]>> = pass.engine.as_ref().map(|v| v.keys.clone());
    let listed_keys = listed.as_deref().unwrap_or(&[]);
    match (&pass.source, pass.engine.as_mut(), &uni) {
        (LoadSource::Table(t), Some(v), Some(u)) => {
            list_reported(
                t,
                v,
                u,
                &mut pass.taken,
                (&mut workers, &mut rows),
                idle_row,
            )?;
        }
        (_, Some(_), _) => unreachable!("checked above: a universe set and a `Loads` table"),
        (LoadSource::None, ..) => {}
        (LoadSource::Table(t), None, _) => {
            for (pos, (k, e)) in t.iter().enumerate() {
                if e.tokens() == 0 || pass.taken[pos] {
                    continue;
                }
                let by_index = held.as_ref().is_some_and(|h| h.table[pos]);
                // the index or the registration vouches for it without a Python call
                let known = universe.is_none() && by_index;
                let listed = match &uni {
                    Some(u) => u.has_key(k)?,
                    None => known || member(&k.obj(py), by_index)?,
                };
                if listed {
                    let u = match usage {
                        Some(_) => usage_in.of(&k.obj(py))?,
                        None => 0.0,
                    };
                    workers.push(Who::Key(k.clone()));
                    rows.push(idle_row(e.tokens() as f64 * scale, u));
                }
            }
        }
        (LoadSource::Mapping(loads), None, _) => {
            // the scored and hint-only workers, for this pass to skip
            let priced = PySet::new(py, workers.iter().map(|w| w.bind(py, listed_keys)))?;
            let mut visit = |w: Bound<'py, PyAny>, t: Bound<'py, PyAny>| -> PyResult<()> {
                if !t.is_truthy()? || priced.contains(&w)? {
                    return Ok(());
                }
                let by_index = universe.is_none() && index_holds(py, index, &w);
                if member(&w, by_index)? {
                    let load = t.extract::<f64>()? * scale;
                    let u = usage_in.of(&w)?;
                    workers.push(Who::Obj(w.unbind()));
                    rows.push(idle_row(load, u));
                }
                Ok(())
            };
            match loads.cast::<PyDict>() {
                Ok(d) => {
                    for (w, t) in d.iter() {
                        visit(w, t)?;
                    }
                }
                Err(_) => {
                    for item in loads.call_method0(intern!(py, "items"))?.try_iter()? {
                        let (w, t): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item?.extract()?;
                        visit(w, t)?;
                    }
                }
            }
        }
    }
    // Usage-only workers (a report above 0, nothing claimed, no load): priced apart from the idle
    // group; none when every reporting worker was priced above.
    let unpriced = usage.filter(|u| u.len() > usage_in.priced);
    if let Some(usage) = unpriced {
        let priced = PySet::new(py, workers.iter().map(|w| w.bind(py, listed_keys)))?;
        // a list of the items, not the dict's iterator: the GIL may be released below
        // (`index_holds`), and an engine's report may change the dict meanwhile
        for item in usage.items().iter() {
            let (w, u): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item.extract()?;
            if priced.contains(&w)? {
                continue;
            }
            let by_index = universe.is_none() && index_holds(py, index, &w);
            if member(&w, by_index)? {
                let u: f64 = u.extract()?;
                workers.push(Who::Obj(w.unbind()));
                rows.push(idle_row(0.0, u));
            }
        }
    }
    let universe_len = match (universe, &held) {
        (Some(u), _) => u.len()? - vetoed_in,
        (None, Some(h)) => h.count + h.registered_elsewhere,
        (None, None) => 0, // unreachable: `held` is read whenever `universe` is None
    };
    // The long-move term (`CostModel.long_move`, `_price_moves` in kvroute/_scoring.py): what each
    // candidate recomputes over the least prefill, added after every other term, as Python adds it.
    let idle_cost = if params.long_move.is_some() {
        let best = scoring::least_prefill(rows.iter().map(|r| r.prefill), idle_prefill);
        for r in rows.iter_mut() {
            let extra = params.move_price(r.prefill - best);
            if extra != 0.0 {
                r.cost += extra;
            }
        }
        idle_cost + params.move_price(idle_prefill - best)
    } else {
        idle_cost
    };
    let idle_count = universe_len.saturating_sub(rows.len());
    let (tied, idle_tied) = scoring::ties_of(rows.iter().map(|r| r.cost), idle_count, idle_cost);
    // the view's reference to the records moved in: the table is then copied only if another
    // thread holds it
    if let (Some(v), Some(e)) = (pass.engine.take(), &engine_table) {
        let EngineView {
            records,
            adopt,
            slots,
            ..
        } = v;
        e.get().keep_slots(slots);
        if !adopt.is_empty() {
            e.get().table.adopt(records, adopt);
        }
    }
    if let (Some(seen), false) = (table, adopt.is_empty()) {
        if let Ok(t) = loads.cast::<Loads>() {
            t.get().table.adopt(seen, adopt);
        }
    }
    let placed = match (footprint, rng) {
        (Some(fp), Some(rng)) => {
            let new_share: f64 = weight(model, intern!(py, "footprint_new_share"))?;
            let best_overlap = rows
                .iter()
                .map(|r| r.overlap_tokens.max(r.routed_tokens))
                .max()
                .unwrap_or(0);
            // exact as Python's int-to-float comparison below 2^53
            if (best_overlap as f64) < new_share * ntok_i as f64 {
                let place = NewPlacement {
                    index,
                    universe,
                    vetoed: uni.as_ref().map(|u| &u.vetoed),
                    registered: &reg_keys,
                    idle_count,
                    idle_cost,
                };
                Some(place.pick(model, fp.get(), (&workers, listed_keys), &rows, rng, record)?)
            } else {
                None
            }
        }
        _ => None,
    };
    Ok((
        Scored {
            workers,
            rows,
            listed,
        },
        idle_count,
        idle_cost,
        tied,
        idle_tied,
        ntok,
        placed,
        applied.iter().map(|k| k.obj(py).unbind()).collect(),
        vetoes,
    ))
}

/// The footprint's pick as `select` returns it: ``(position, worker)``, ``(None, worker)`` or
/// ``(None, None)`` (see `select`).
type PlacedPy = (Option<usize>, Option<Py<PyAny>>);

/// What the footprint's pick in `select` needs beside the priced candidates: where the idle
/// workers come from.
struct NewPlacement<'a, 'py> {
    index: &'a Bound<'py, PyIndex>,
    /// the candidate set (None: the index's workers plus `registered`)
    universe: Option<&'a Bound<'py, PyAny>>,
    /// the workers vetoed out of `universe` (None or empty: none)
    vetoed: Option<&'a FxHashSet<PyKey>>,
    registered: &'a [PyKey],
    idle_count: usize,
    idle_cost: f64,
}

impl NewPlacement<'_, '_> {
    /// Pick with the footprint's table (`crate::scoring::Footprint::pick`, from this call's copy of
    /// it) among `workers` / `rows` (`listed`: the keys `Who::Listed` names) and the idle workers,
    /// and count the placement when `record`.
    fn pick(
        &self,
        model: &Bound<'_, PyAny>,
        fp: &Footprint,
        (workers, listed): (&[Who], &[PyKey]),
        rows: &[Row],
        rng: &Bound<'_, PyAny>,
        record: bool,
    ) -> PyResult<PlacedPy> {
        let py = model.py();
        let band: f64 = weight(model, intern!(py, "footprint_band"))?;
        let keys = workers
            .iter()
            .map(|w| match w {
                Who::Key(k) => Ok(k.clone()),
                Who::Listed(i) => Ok(listed[*i as usize].clone()),
                Who::Obj(o) => PyKey::extract(o.bind(py)),
            })
            .collect::<PyResult<Vec<PyKey>>>()?;
        let listed: Vec<(f64, f64, &PyKey)> = rows
            .iter()
            .zip(&keys)
            .map(|(r, k)| (r.cost, r.load, k))
            .collect();
        let idle = (self.idle_count > 0).then_some(|| self.idle_pool(fp, &keys));
        let table = fp.snapshot();
        let got = table.pick(
            &listed,
            self.idle_cost,
            idle,
            // `CostModel.footprint_limit`, float operation for float operation
            |c| Ok((1.0 + band) * c),
            |n| draw(rng, n),
        )?;
        drop(table); // before counting: a write copies the table while a reader holds it
        let Some(got) = got else {
            return Ok((None, None));
        };
        let (at, key) = match got {
            Placed::Listed(i) => (Some(i), keys[i].clone()),
            Placed::Idle(k) => (None, k),
        };
        let obj = key.obj(py).unbind();
        if record {
            let half_life: f64 = weight(model, intern!(py, "footprint_half_life"))?;
            fp.place(key, half_life);
        }
        Ok((at, Some(obj)))
    }

    /// The idle workers: the candidate set less the `listed` ones. Without a universe set, the
    /// workers the index holds (read under its lock) and the registered ones.
    fn idle_pool(&self, fp: &Footprint, listed: &[PyKey]) -> PyResult<Vec<PyKey>> {
        let listed: FxHashSet<&PyKey> = listed.iter().collect();
        match self.universe {
            Some(u) => {
                let mut pool = fp.keys_of(u.try_iter()?.collect::<PyResult<_>>()?)?;
                let vetoed = self.vetoed.filter(|v| !v.is_empty());
                pool.retain(|k| !listed.contains(k) && vetoed.is_none_or(|v| !v.contains(k)));
                Ok(pool)
            }
            None => {
                let (listed, registered) = (&listed, self.registered);
                let idx = self.index.get();
                Ok(idx.with_query(self.index.py(), 0, move |idx| {
                    let held = (0..idx.workers.len() as u32)
                        .filter_map(|s| idx.at_slot(s))
                        .filter(|&(k, holds)| holds && !listed.contains(k))
                        .map(|(k, _)| k);
                    // a registered worker the index holds is in `held` already
                    let elsewhere = registered
                        .iter()
                        .filter(|k| !listed.contains(k) && !idx.holds(k));
                    held.chain(elsewhere).cloned().collect()
                }))
            }
        }
    }
}

/// What the index held when `select` ran without a universe set.
struct Held {
    /// workers holding blocks
    count: usize,
    /// registered workers the index does not hold
    registered_elsewhere: usize,
    /// per `Loads` entry, per routing-hint entry: whether the index holds it
    table: Vec<bool>,
    routed: Vec<bool>,
}

/// Whether the index holds blocks for `w` (a mapping's key; not a worker key: no).
fn index_holds(py: Python<'_>, index: &Bound<'_, PyIndex>, w: &Bound<'_, PyAny>) -> bool {
    match PyKey::extract(w) {
        Ok(k) => index.get().with_query(py, 0, move |idx| idx.holds(&k)),
        Err(_) => false,
    }
}

/// `Router.select`'s call count and latency histogram (`RouterStats`), kept with atomics: a
/// `select` records its time without the router's lock. With that lock, threads selecting on one
/// Router queued behind a holder the interpreter had switched away from, each waiter then waiting
/// a switch interval (5 ms) for the GIL back: p99 ms (bench_select.py figure 3, same Router).
#[pyclass(frozen, module = "kvroute._core", name = "SelectTimes")]
pub struct SelectTimes {
    /// upper bounds of the buckets, ascending
    bounds: Vec<f64>,
    /// per bound, then one for slower calls
    counts: Vec<AtomicU64>,
    /// the sum of the recorded seconds, as `f64` bits
    sum: AtomicU64,
}

#[pymethods]
impl SelectTimes {
    #[new]
    fn new(bounds: Vec<f64>) -> Self {
        SelectTimes {
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            bounds,
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Count one call of ``seconds``: in the first bucket whose bound is at least that
    /// (`bisect.bisect_left`), and in the sum.
    fn record(&self, seconds: f64) {
        let at = self.bounds.partition_point(|b| *b < seconds);
        self.counts[at].fetch_add(1, Ordering::Relaxed);
        // a float add, retried while another thread's add came first
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + seconds).to_bits())
            });
    }

    /// ``(calls, seconds, counts per bucket with the slower calls last)``.
    fn read(&self) -> (u64, f64, Vec<u64>) {
        let counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let sum = f64::from_bits(self.sum.load(Ordering::Relaxed));
        (counts.iter().sum(), sum, counts)
    }
}

/// `object.__new__` and `object.__setattr__`, looked up once.
static OBJECT_NEW_SETATTR: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// An instance of ``cls`` with each of ``names`` set to the value at its position in ``values``,
/// through `object.__setattr__`: neither ``cls.__init__`` nor its refusing ``__setattr__`` runs.
/// `Router.select` builds its `RoutingDecision` (a class with ``__slots__``, immutable) so:
/// keywords into ``__init__`` and a call of `object.__setattr__` per slot from Python cost
/// microseconds a decision, this call a fraction of one.
#[pyfunction]
fn new_frozen<'py>(
    cls: &Bound<'py, PyType>,
    names: &Bound<'py, PyTuple>,
    values: &Bound<'py, PyTuple>,
) -> PyResult<Bound<'py, PyAny>> {
    if names.len() != values.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{} names for {} values",
            names.len(),
            values.len()
        )));
    }
    let py = cls.py();
    let (new, setattr) = OBJECT_NEW_SETATTR.get_or_try_init(py, || -> PyResult<_> {
        let object = py.get_type::<pyo3::types::PyAny>();
        Ok((
            object.getattr("__new__")?.unbind(),
            object.getattr("__setattr__")?.unbind(),
        ))
    })?;
    let obj = new.bind(py).call1((cls,))?;
    let setattr = setattr.bind(py);
    for (name, value) in names.iter().zip(values.iter()) {
        setattr.call1((&obj, name, value))?;
    }
    Ok(obj)
}

/// Add the router's functions to `kvroute._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_candidate_type, m)?)?;
    m.add_function(wrap_pyfunction!(select, m)?)?;
    m.add_function(wrap_pyfunction!(new_frozen, m)?)?;
    m.add_class::<Scored>()?;
    m.add_class::<Loads>()?;
    m.add_class::<EngineTable>()?;
    m.add_class::<Members>()?;
    m.add_class::<Footprint>()?;
    m.add_class::<SelectTimes>()?;
    Ok(())
}
