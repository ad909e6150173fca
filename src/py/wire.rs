//! `kvroute._core`'s wire functions: payload bytes decoded by `crate::wire` into the msgspec
//! Structs of kvroute/_wire.py (`EventBatch` and its events), or into counts only.

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PyTuple, PyType};

use crate::protocols::{Batch, BlockHash, Event, Value};
use crate::wire::{self, Limits, Wide, WideField};

/// Payloads at least this long are decoded with the GIL released: below it, releasing and taking
/// the GIL back costs more than the decode.
const DETACH_BYTES: usize = 16 * 1024;

static DECODE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_STORED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BLOCK_REMOVED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static ALL_CLEARED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static EVENT_BATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static EXT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static EPOCH: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static TIMEDELTA: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn decode_error(py: Python<'_>, msg: String) -> PyErr {
    match DECODE_ERROR.import(py, "kvroute._errors", "DecodeError") {
        Ok(cls) => PyErr::from_type(cls.clone(), msg),
        Err(e) => e,
    }
}

/// A cap as Python holds it (any int): clamped to i128, which every msgpack integer fits in, so
/// comparisons come out as Python's did. An i64 first: pyo3 reads a 128-bit int through a slow
/// path, and three caps come with every `apply_payload` call.
fn cap(v: &Bound<'_, PyAny>) -> PyResult<i128> {
    if let Ok(n) = v.extract::<i64>() {
        return Ok(n.into());
    }
    match v.extract::<i128>() {
        Ok(n) => Ok(n),
        Err(_) if v.lt(0)? => Ok(i128::MIN),
        Err(_) if v.gt(0)? => Ok(i128::MAX),
        Err(e) => Err(e),
    }
}

pub(crate) fn limits(
    max_events: &Bound<'_, PyAny>,
    max_blocks: &Bound<'_, PyAny>,
    max_bs: &Bound<'_, PyAny>,
) -> PyResult<Limits> {
    Ok(Limits {
        max_events_per_batch: cap(max_events)?,
        max_blocks_per_event: cap(max_blocks)?,
        max_block_size: cap(max_bs)?,
    })
}

/// Decode `payload` (bytes, or any buffer: copied once) with the GIL released when it is large.
fn run(py: Python<'_>, payload: &Bound<'_, PyAny>, lim: &Limits) -> PyResult<wire::Decoded> {
    let owned;
    let data: &[u8] = if let Ok(b) = payload.downcast::<PyBytes>() {
        b.as_bytes()
    } else {
        let view = PyMemoryView::from(payload).map_err(|_| {
            decode_error(
                py,
                format!("expected a bytes-like payload, got {}", type_name(payload)),
            )
        })?;
        owned = view
            .call_method0(intern!(py, "tobytes"))?
            .downcast_into::<PyBytes>()
            .map_err(PyErr::from)?;
        owned.as_bytes()
    };
    let res = if data.len() >= DETACH_BYTES {
        py.detach(|| wire::decode_full(data, lim))
    } else {
        wire::decode_full(data, lim)
    };
    res.map_err(|e| decode_error(py, e.message))
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".to_owned())
}

/// Decode one payload into kvroute's `EventBatch` (the Structs of kvroute/_wire.py), exactly as
/// the msgspec decoder it replaces did; raises `DecodeError`.
#[pyfunction]
#[pyo3(signature = (payload, max_events_per_batch, max_blocks_per_event, max_block_size))]
fn decode_batch<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    max_events_per_batch: &Bound<'py, PyAny>,
    max_blocks_per_event: &Bound<'py, PyAny>,
    max_block_size: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let lim = limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
    let decoded = run(py, payload, &lim)?;
    to_python(py, &decoded.batch, &decoded.wide)
}

/// Decode one payload and judge it as the raw-bytes ingest does (`wire::verdict`, the one rule):
/// ``(batch, kind, detail)``: ``kind`` "" when the batch may be applied, else "undecodable payload"
/// (``batch`` None when the bytes did not decode; a ts that is not finite) or "untrusted batch",
/// with the detail the subscriber logs. A decoded batch is returned even when refused, for its
/// skip counts. Never raises for the payload's content.
#[pyfunction]
#[pyo3(signature = (payload, max_events_per_batch, max_blocks_per_event, max_block_size))]
fn decode_checked<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    max_events_per_batch: &Bound<'py, PyAny>,
    max_blocks_per_event: &Bound<'py, PyAny>,
    max_block_size: &Bound<'py, PyAny>,
) -> PyResult<(Option<Bound<'py, PyAny>>, &'static str, String)> {
    let lim = limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
    let decoded = match run_checked(py, payload, &lim)? {
        Ok(d) => d,
        Err(why) => return Ok((None, "undecodable payload", why)),
    };
    let (kind, detail) = wire::verdict(&decoded.batch).unwrap_or(("", String::new()));
    let batch = to_python(py, &decoded.batch, &decoded.wide)?;
    Ok((Some(batch), kind, detail))
}

/// Judge one payload as ``decode_checked`` does, building no Python object per event (a replay
/// answer's batches are applied later through ``Index.apply_payloads``): ``(ts, kind, detail,
/// skipped)``, ``kind`` "" when the batch may be applied (then ``ts`` is its finite ts), else
/// "undecodable payload" or "untrusted batch" with the detail the subscriber logs; ``skipped``
/// the decoder's per-reason counts (empty when the bytes did not decode). Never raises for the
/// payload's content.
#[pyfunction]
#[pyo3(signature = (payload, max_events_per_batch, max_blocks_per_event, max_block_size))]
fn judge<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    max_events_per_batch: &Bound<'py, PyAny>,
    max_blocks_per_event: &Bound<'py, PyAny>,
    max_block_size: &Bound<'py, PyAny>,
) -> PyResult<(f64, &'static str, String, Bound<'py, PyDict>)> {
    let lim = limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
    let batch = match run_checked(py, payload, &lim)? {
        Ok(d) => d.batch,
        Err(why) => return Ok((f64::NAN, "undecodable payload", why, PyDict::new(py))),
    };
    let (kind, detail) = wire::verdict(&batch).unwrap_or(("", String::new()));
    Ok((batch.ts, kind, detail, skipped(py, &batch)?))
}

/// `run`, with a payload that does not decode as ``Ok(Err(why))``: only a failure that is not the
/// payload's (an exception raised while reading it) is an error.
fn run_checked(
    py: Python<'_>,
    payload: &Bound<'_, PyAny>,
    lim: &Limits,
) -> PyResult<Result<wire::Decoded, String>> {
    match run(py, payload, lim) {
        Ok(d) => Ok(Ok(d)),
        Err(e)
            if e.is_instance(
                py,
                DECODE_ERROR.import(py, "kvroute._errors", "DecodeError")?,
            ) =>
        {
            Ok(Err(e.value(py).to_string()))
        }
        Err(e) => Err(e),
    }
}

/// Decode one payload and return only what the recovery machine needs, with no object per event:
/// ``(ts, events, stored_blocks, removed_blocks, clears, untrusted, skipped)``; raises `DecodeError`.
#[pyfunction]
#[pyo3(signature = (payload, max_events_per_batch, max_blocks_per_event, max_block_size))]
fn decode_count<'py>(
    py: Python<'py>,
    payload: &Bound<'py, PyAny>,
    max_events_per_batch: &Bound<'py, PyAny>,
    max_blocks_per_event: &Bound<'py, PyAny>,
    max_block_size: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyTuple>> {
    let lim = limits(max_events_per_batch, max_blocks_per_event, max_block_size)?;
    let batch = run(py, payload, &lim)?.batch;
    let s = wire::Summary::of(&batch);
    let skipped = skipped(py, &batch)?;
    (
        batch.ts,
        s.events,
        s.stored_blocks,
        s.removed_blocks,
        s.clears,
        batch.untrusted,
        skipped,
    )
        .into_pyobject(py)
}

fn skipped<'py>(py: Python<'py>, batch: &Batch) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (reason, n) in &batch.skipped {
        d.set_item(reason, n)?;
    }
    Ok(d)
}

fn hash<'py>(py: Python<'py>, h: &BlockHash) -> PyResult<Bound<'py, PyAny>> {
    Ok(match h {
        BlockHash::Int(v) => v.into_pyobject(py)?.into_any(),
        BlockHash::Bytes(b) => PyBytes::new(py, b).into_any(),
    })
}

fn hashes<'py>(py: Python<'py>, hs: &[BlockHash]) -> PyResult<Bound<'py, PyList>> {
    let items: Vec<Bound<'py, PyAny>> = hs.iter().map(|h| hash(py, h)).collect::<PyResult<_>>()?;
    PyList::new(py, items)
}

fn opt_hash<'py>(py: Python<'py>, h: &Option<BlockHash>) -> PyResult<Bound<'py, PyAny>> {
    match h {
        Some(h) => hash(py, h),
        None => Ok(py.None().into_bound(py)),
    }
}

/// A value of an untyped field as msgspec built it: arrays are lists, or tuples inside map keys.
fn value<'py>(py: Python<'py>, v: &Value, key: bool) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Nil => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::Float(f) => f.into_pyobject(py)?.into_any(),
        Value::Str(s) => s.into_pyobject(py)?.into_any(),
        Value::Bytes(b) => PyBytes::new(py, b).into_any(),
        Value::Array(items) => {
            let objs: Vec<Bound<'py, PyAny>> = items
                .iter()
                .map(|x| value(py, x, key))
                .collect::<PyResult<_>>()?;
            if key {
                PyTuple::new(py, objs)?.into_any()
            } else {
                PyList::new(py, objs)?.into_any()
            }
        }
        Value::Map(pairs) => {
            let d = PyDict::new(py);
            for (k, x) in pairs {
                d.set_item(value(py, k, true)?, value(py, x, false)?)?;
            }
            d.into_any()
        }
        Value::Ext(-1, data) => {
            let (secs, micros) =
                wire::timestamp_parts(data).map_err(|e| decode_error(py, e.to_owned()))?;
            let epoch = EPOCH.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
                let dt = py.import("datetime")?;
                let utc = dt.getattr("timezone")?.getattr("utc")?;
                Ok(dt
                    .getattr("datetime")?
                    .call1((1970, 1, 1, 0, 0, 0, 0, utc))?
                    .unbind())
            })?;
            let td = TIMEDELTA.import(py, "datetime", "timedelta")?;
            epoch.bind(py).add(td.call1((0, secs, micros))?)?
        }
        Value::Ext(code, data) => EXT
            .import(py, "msgspec.msgpack", "Ext")?
            .call1((code, PyBytes::new(py, data)))?,
    })
}

fn opt<'py, T>(
    py: Python<'py>,
    v: &Option<T>,
    f: impl FnOnce(&T) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    match v {
        Some(x) => f(x),
        None => Ok(py.None().into_bound(py)),
    }
}

fn ints<'py>(py: Python<'py>, xs: &[i64]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, xs)
}

fn to_python<'py>(py: Python<'py>, batch: &Batch, wide: &[Wide]) -> PyResult<Bound<'py, PyAny>> {
    let stored_cls = BLOCK_STORED.import(py, "kvroute._wire", "BlockStored")?;
    let removed_cls = BLOCK_REMOVED.import(py, "kvroute._wire", "BlockRemoved")?;
    let cleared_cls = ALL_CLEARED.import(py, "kvroute._wire", "AllBlocksCleared")?;
    let batch_cls = EVENT_BATCH.import(py, "kvroute._wire", "EventBatch")?;
    let mut events = Vec::with_capacity(batch.events.len());
    for (i, ev) in batch.events.iter().enumerate() {
        let obj = match ev {
            Event::Stored(s) => {
                let kw = PyDict::new(py);
                kw.set_item(intern!(py, "block_hashes"), hashes(py, &s.block_hashes)?)?;
                kw.set_item(
                    intern!(py, "parent_block_hash"),
                    opt_hash(py, &s.parent_block_hash)?,
                )?;
                kw.set_item(intern!(py, "token_ids"), ints(py, &s.token_ids)?)?;
                kw.set_item(intern!(py, "block_size"), s.block_size)?;
                kw.set_item(intern!(py, "lora_id"), s.lora_id)?;
                kw.set_item(intern!(py, "medium"), &s.medium)?;
                kw.set_item(intern!(py, "lora_name"), &s.lora_name)?;
                let extra = opt(py, &s.extra_keys, |rows| {
                    let items: Vec<Bound<'py, PyAny>> = rows
                        .iter()
                        .map(|row| {
                            opt(py, row, |vals| {
                                let objs: Vec<Bound<'py, PyAny>> = vals
                                    .iter()
                                    .map(|x| value(py, x, false))
                                    .collect::<PyResult<_>>()?;
                                Ok(PyList::new(py, objs)?.into_any())
                            })
                        })
                        .collect::<PyResult<_>>()?;
                    Ok(PyList::new(py, items)?.into_any())
                })?;
                kw.set_item(intern!(py, "extra_keys"), extra)?;
                kw.set_item(intern!(py, "group_idx"), s.group_idx)?;
                kw.set_item(intern!(py, "kv_cache_spec_kind"), &s.kv_cache_spec_kind)?;
                kw.set_item(
                    intern!(py, "kv_cache_spec_sliding_window"),
                    s.kv_cache_spec_sliding_window,
                )?;
                kw.set_item(intern!(py, "locality"), value(py, &s.locality, false)?)?;
                kw.set_item(intern!(py, "ownership"), value(py, &s.ownership, false)?)?;
                kw.set_item(intern!(py, "session_id"), value(py, &s.session_id, false)?)?;
                let la = opt(py, &s.lookahead_token_ids, |rows| {
                    let items: Vec<Bound<'py, PyList>> =
                        rows.iter().map(|r| ints(py, r)).collect::<PyResult<_>>()?;
                    Ok(PyList::new(py, items)?.into_any())
                })?;
                kw.set_item(intern!(py, "lookahead_token_ids"), la)?;
                kw.set_item(intern!(py, "cache_salt"), value(py, &s.cache_salt, false)?)?;
                kw.set_item(intern!(py, "origin"), value(py, &s.origin, false)?)?;
                if s.bigram {
                    kw.set_item(intern!(py, "bigram"), true)?;
                }
                apply_wide(py, &kw, wide, i)?;
                stored_cls.call((), Some(&kw))?
            }
            Event::Removed(r) => {
                let kw = PyDict::new(py);
                kw.set_item(intern!(py, "block_hashes"), hashes(py, &r.block_hashes)?)?;
                kw.set_item(intern!(py, "medium"), &r.medium)?;
                kw.set_item(intern!(py, "group_idx"), r.group_idx)?;
                kw.set_item(intern!(py, "locality"), value(py, &r.locality, false)?)?;
                kw.set_item(intern!(py, "ownership"), value(py, &r.ownership, false)?)?;
                apply_wide(py, &kw, wide, i)?;
                removed_cls.call((), Some(&kw))?
            }
            Event::Cleared => cleared_cls.call0()?,
        };
        events.push(obj);
    }
    let mut dpr = batch.data_parallel_rank.into_pyobject(py)?.into_any();
    if let Some(w) = wide.iter().find(|w| w.field == WideField::DataParallelRank) {
        dpr = w.value.into_pyobject(py)?.into_any();
    }
    let untrusted = batch.untrusted.as_deref();
    batch_cls.call1((
        batch.ts,
        PyList::new(py, events)?,
        dpr,
        skipped(py, batch)?,
        untrusted,
    ))
}

/// Put back the exact value of event `i`'s ints that were past i64 (saturated in the Rust batch).
fn apply_wide(py: Python<'_>, kw: &Bound<'_, PyDict>, wide: &[Wide], i: usize) -> PyResult<()> {
    for w in wide.iter().filter(|w| w.event == i) {
        let v = w.value.into_pyobject(py)?;
        let name = match w.field {
            WideField::DataParallelRank => continue,
            WideField::BlockSize => intern!(py, "block_size"),
            WideField::LoraId => intern!(py, "lora_id"),
            WideField::GroupIdx => intern!(py, "group_idx"),
            WideField::SlidingWindow => intern!(py, "kv_cache_spec_sliding_window"),
            WideField::Token(t) => {
                item(kw, intern!(py, "token_ids"))?.set_item(t, v)?;
                continue;
            }
            WideField::Lookahead(r, t) => {
                item(kw, intern!(py, "lookahead_token_ids"))?
                    .get_item(r)?
                    .set_item(t, v)?;
                continue;
            }
        };
        kw.set_item(name, v)?;
    }
    Ok(())
}

fn item<'py>(
    kw: &Bound<'py, PyDict>,
    name: &Bound<'py, pyo3::types::PyString>,
) -> PyResult<Bound<'py, PyAny>> {
    kw.get_item(name)?
        .ok_or_else(|| PyTypeError::new_err("missing field"))
}

/// Register the wire functions on `kvroute._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(decode_count, m)?)?;
    m.add_function(wrap_pyfunction!(decode_checked, m)?)?;
    m.add_function(wrap_pyfunction!(judge, m)?)?;
    m.add("MAX_DEPTH", wire::MAX_DEPTH)?;
    Ok(())
}
