//! Python objects -> the core's types: engine events (kvroute._wire Structs) -> `protocols`
//! events, a query's arguments -> a checked `QueryInput`, snapshot Structs -> `SnapWorker`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::index::{QueryInput, SnapGroup, SnapWorker};
use crate::keys::{self, MmItem};
use crate::protocols::{BlockHash, BlockRemoved, BlockStored, Event, Value};

/// The event classes of kvroute._wire, looked up once.
struct EventTypes {
    stored: Py<PyType>,
    removed: Py<PyType>,
    cleared: Py<PyType>,
}

static EVENT_TYPES: PyOnceLock<EventTypes> = PyOnceLock::new();

/// The exception a bad query raises (`kvroute._index.QueryError`, registered at import).
pub(crate) static QUERY_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn event_types(py: Python<'_>) -> PyResult<&EventTypes> {
    EVENT_TYPES.get_or_try_init(py, || {
        let m = py.import("kvroute._wire")?;
        Ok(EventTypes {
            stored: m.getattr("BlockStored")?.cast_into::<PyType>()?.unbind(),
            removed: m.getattr("BlockRemoved")?.cast_into::<PyType>()?.unbind(),
            cleared: m
                .getattr("AllBlocksCleared")?
                .cast_into::<PyType>()?
                .unbind(),
        })
    })
}

/// A block hash: bytes kept, ints folded onto uint64 (a negative int64 as SGLang sends it).
pub(crate) fn block_hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(BlockHash::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(BlockHash::Int(v));
    }
    match obj.extract::<i64>() {
        Ok(v) => Ok(BlockHash::Int(v as u64)),
        Err(_) => Err(PyTypeError::new_err(format!(
            "block hash must be bytes or a 64-bit int, got {}",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))),
    }
}

fn hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().map(|h| block_hash(&h)).collect();
    }
    obj.try_iter()?.map(|h| block_hash(&h?)).collect()
}

fn opt_hash(obj: &Bound<'_, PyAny>) -> PyResult<Option<BlockHash>> {
    if obj.is_none() {
        Ok(None)
    } else {
        block_hash(obj).map(Some)
    }
}

/// One token of an event: ints outside int64 saturate (they are outside uint32 either way, so
/// the block stays unhashable, as in the Python index).
fn event_token(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) => {
            let i = obj.cast::<PyInt>().map_err(|_| e)?;
            Ok(if i.lt(0)? { i64::MIN } else { i64::MAX })
        }
    }
}

fn event_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(list) = obj.cast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for t in list.iter() {
            out.push(event_token(&t)?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|t| event_token(&t?)).collect()
}

fn opt_i64(obj: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if obj.is_none() {
        Ok(None)
    } else {
        obj.extract::<i64>().map(Some)
    }
}

fn opt_str(obj: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if obj.is_none() {
        Ok(None)
    } else {
        obj.extract::<String>().map(Some)
    }
}

/// A str stays a str; anything else reads as nil (the index only asks "is it this string").
fn str_or_nil(obj: &Bound<'_, PyAny>) -> Value {
    match obj.cast::<PyString>() {
        Ok(s) => s.to_str().map_or(Value::Nil, |s| Value::Str(s.to_owned())),
        Err(_) => Value::Nil,
    }
}

/// A Python value as msgspec would encode it (None, bool, int, float, str, bytes, list, tuple, dict).
pub(crate) fn value(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::Nil);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj
            .extract::<i128>()
            .map(Value::Int)
            .map_err(|_| PyValueError::new_err("an int in extra keys is outside 64 bits"));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Value::Float(f.value()));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::Str(s.to_str()?.to_owned()));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj
            .try_iter()?
            .map(|v| value(&v?))
            .collect::<PyResult<_>>()
            .map(Value::Array);
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        return d
            .iter()
            .map(|(k, v)| Ok((value(&k)?, value(&v)?)))
            .collect::<PyResult<_>>()
            .map(Value::Map);
    }
    // What the decoder makes of a msgpack extension: a `msgspec.msgpack.Ext` keeps its code and
    // bytes (keyed as msgspec re-encodes it), a timestamp became a `datetime` (never keyed: see
    // `keys::encode_value`). Anything else cannot have come off the wire.
    let type_name = obj
        .get_type()
        .name()
        .map_or_else(|_| String::new(), |n| n.to_string());
    if type_name == "Ext" {
        if let (Ok(code), Ok(data)) = (obj.getattr("code"), obj.getattr("data")) {
            if let (Ok(code), Ok(data)) = (code.extract::<i8>(), data.cast::<PyBytes>()) {
                return Ok(Value::Ext(code, data.as_bytes().to_vec()));
            }
        }
    }
    if type_name == "datetime" {
        return Ok(Value::Ext(-1, Vec::new()));
    }
    Err(PyTypeError::new_err(format!(
        "cannot use a {type_name} in extra keys"
    )))
}

fn extra_keys(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<Option<Vec<Value>>>>> {
    if obj.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for ek in obj.try_iter()? {
        let ek = ek?;
        if ek.is_none() {
            out.push(None);
        } else {
            out.push(Some(
                ek.try_iter()?
                    .map(|v| value(&v?))
                    .collect::<PyResult<_>>()?,
            ));
        }
    }
    Ok(Some(out))
}

fn stored<'py>(ev: &Bound<'py, PyAny>) -> PyResult<BlockStored> {
    let py = ev.py();
    let get = |name: &Bound<'py, PyString>| ev.getattr(name);
    let la = get(intern!(py, "lookahead_token_ids"))?;
    let lookahead_token_ids = if la.is_none() {
        None
    } else {
        Some(
            la.try_iter()?
                .map(|row| event_tokens(&row?))
                .collect::<PyResult<_>>()?,
        )
    };
    Ok(BlockStored {
        block_hashes: hashes(&get(intern!(py, "block_hashes"))?)?,
        parent_block_hash: opt_hash(&get(intern!(py, "parent_block_hash"))?)?,
        token_ids: event_tokens(&get(intern!(py, "token_ids"))?)?,
        block_size: get(intern!(py, "block_size"))?.extract()?,
        lora_id: None,
        medium: opt_str(&get(intern!(py, "medium"))?)?,
        lora_name: opt_str(&get(intern!(py, "lora_name"))?)?,
        extra_keys: extra_keys(&get(intern!(py, "extra_keys"))?)?,
        group_idx: opt_i64(&get(intern!(py, "group_idx"))?)?,
        kv_cache_spec_kind: opt_str(&get(intern!(py, "kv_cache_spec_kind"))?)?,
        kv_cache_spec_sliding_window: opt_i64(&get(intern!(py, "kv_cache_spec_sliding_window"))?)?,
        locality: str_or_nil(&get(intern!(py, "locality"))?),
        ownership: Value::Nil,
        session_id: Value::Nil,
        lookahead_token_ids,
        cache_salt: str_or_nil(&get(intern!(py, "cache_salt"))?),
        origin: Value::Nil,
    })
}

fn removed(ev: &Bound<'_, PyAny>) -> PyResult<BlockRemoved> {
    let py = ev.py();
    Ok(BlockRemoved {
        block_hashes: hashes(&ev.getattr(intern!(py, "block_hashes"))?)?,
        medium: opt_str(&ev.getattr(intern!(py, "medium"))?)?,
        group_idx: opt_i64(&ev.getattr(intern!(py, "group_idx"))?)?,
        locality: str_or_nil(&ev.getattr(intern!(py, "locality"))?),
        ownership: Value::Nil,
    })
}

/// An engine event (kvroute._wire's BlockStored / BlockRemoved / AllBlocksCleared) as the core's.
/// Fields the index never reads (lora_id, ownership, session_id, origin; non-str locality and
/// cache_salt) are left at nil.
pub(crate) fn event(ev: &Bound<'_, PyAny>) -> PyResult<Event> {
    let py = ev.py();
    let types = event_types(py)?;
    if ev.is_instance(types.stored.bind(py))? {
        Ok(Event::Stored(Box::new(stored(ev)?)))
    } else if ev.is_instance(types.removed.bind(py))? {
        Ok(Event::Removed(removed(ev)?))
    } else if ev.is_instance(types.cleared.bind(py))? {
        Ok(Event::Cleared)
    } else {
        let name = ev
            .get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string());
        Err(PyTypeError::new_err(format!("not an engine event: {name}")))
    }
}

fn query_error(py: Python<'_>, msg: String) -> PyErr {
    match QUERY_ERROR.get(py) {
        Some(t) => PyErr::from_type(t.bind(py).clone(), msg),
        None => PyValueError::new_err(msg),
    }
}

fn bad_token(py: Python<'_>, at: usize, item: &Bound<'_, PyAny>) -> PyErr {
    let shown = item.repr().map_or_else(|_| "?".into(), |r| r.to_string());
    let shown: String = if shown.chars().count() > 40 {
        shown.chars().take(40).chain("...".chars()).collect()
    } else {
        shown
    };
    query_error(
        py,
        format!("token_ids[{at}] = {shown} is not an int in [0, 2**32)"),
    )
}

/// A typed buffer of uint32 in native byte order (array('I'), numpy uint32, ...): its tokens,
/// one copy (the abi3-py310 build has no buffer API: `memoryview.tobytes` is the one C-level copy).
fn u32_buffer(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let py = obj.py();
    let builtins = py.import(intern!(py, "builtins"))?;
    let Ok(mv) = builtins.getattr(intern!(py, "memoryview"))?.call1((obj,)) else {
        return Ok(None);
    };
    let itemsize: usize = mv.getattr(intern!(py, "itemsize"))?.extract()?;
    let ndim: usize = mv.getattr(intern!(py, "ndim"))?.extract()?;
    let format: String = mv.getattr(intern!(py, "format"))?.extract()?;
    let native = if cfg!(target_endian = "little") {
        "<"
    } else {
        ">"
    };
    let code = format
        .trim_start_matches(['@', '='])
        .trim_start_matches(native);
    if itemsize != 4 || ndim != 1 || !(code == "I" || code == "L") {
        return Ok(None);
    }
    let raw = mv.call_method0(intern!(py, "tobytes"))?;
    let bytes = raw.cast::<PyBytes>()?.as_bytes();
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// A list's tokens, checked. Exact ints take a C-API path without reference counting or a Python
/// error object per item (bench/bench_core.py: the list form of an 8k-token query costs a few
/// times the typed-buffer form through `extract`); anything else goes through `extract`.
fn list_tokens(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let py = list.py();
    let mut out = Vec::with_capacity(list.len());
    let mut i = 0usize;
    loop {
        // The length is read each time: `extract` below may run Python code (`__index__`).
        if i >= list.len() {
            return Ok(out);
        }
        // SAFETY: the GIL is held; `i` is within the list's current length, so the item exists,
        // and the borrowed reference is used before any Python code can run.
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `item` is a valid object (above).
        if unsafe { ffi::PyLong_CheckExact(item) } != 0 {
            // SAFETY: `item` is an int; on overflow (negative or too large) the call sets an error
            // and returns all ones, which is cleared below.
            let v = unsafe { ffi::PyLong_AsUnsignedLongLong(item) };
            if v <= u64::from(u32::MAX) {
                out.push(v as u32);
                i += 1;
                continue;
            }
            // SAFETY: the GIL is held.
            unsafe { ffi::PyErr_Clear() };
        }
        // SAFETY: `item` is valid (above); the Bound takes its own reference.
        let t = unsafe { Bound::from_borrowed_ptr(py, item) };
        out.push(t.extract::<u32>().map_err(|_| bad_token(py, i, &t))?);
        i += 1;
    }
}

/// The query's token ids, every one checked: an int in [0, 2^32) (what `array('I')` accepts).
/// A typed uint32 buffer is taken as is; str and bytes are refused (not token ids).
pub(crate) fn query_tokens(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        return list_tokens(list);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for (i, t) in tuple.iter().enumerate() {
            out.push(t.extract::<u32>().map_err(|_| bad_token(py, i, &t))?);
        }
        return Ok(out);
    }
    if obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<pyo3::types::PyByteArray>()
    {
        let name = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string());
        return Err(query_error(
            py,
            format!("token_ids must be a sequence of ints, got {name}"),
        ));
    }
    if let Some(v) = u32_buffer(obj)? {
        return Ok(v);
    }
    let Ok(iter) = obj.try_iter() else {
        let name = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".into(), |n| n.to_string());
        return Err(query_error(
            py,
            format!("token_ids must be a sequence of ints, got {name}"),
        ));
    };
    let mut out = Vec::new();
    for (i, t) in iter.enumerate() {
        let t = t?;
        out.push(t.extract::<u32>().map_err(|_| bad_token(py, i, &t))?);
    }
    Ok(out)
}

/// A query's arguments, checked (`find_matches`' signature).
pub(crate) fn query_input<'py>(
    token_ids: &Bound<'py, PyAny>,
    lora_name: &Bound<'py, PyAny>,
    cache_salt: &Bound<'py, PyAny>,
    mm_items: &Bound<'py, PyAny>,
    extra: &Bound<'py, PyAny>,
) -> PyResult<QueryInput> {
    let py = token_ids.py();
    let tokens = query_tokens(token_ids)?;
    let name = |arg: &str, v: &Bound<'_, PyAny>| -> PyResult<Option<String>> {
        if v.is_none() {
            return Ok(None);
        }
        v.extract::<String>()
            .map(Some)
            .map_err(|_| query_error(py, format!("{arg} must be a str or None")))
    };
    let lora = name("lora_name", lora_name)?;
    let salt = name("cache_salt", cache_salt)?;
    let mut items = Vec::new();
    for (i, m) in mm_items.try_iter()?.enumerate() {
        let m = m?;
        let field = |f: &Bound<'py, PyString>| m.getattr(f);
        let item = (|| -> PyResult<MmItem> {
            Ok(MmItem {
                identifier: field(intern!(py, "identifier"))?.extract()?,
                offset: field(intern!(py, "offset"))?.extract()?,
                length: field(intern!(py, "length"))?.extract()?,
            })
        })()
        .map_err(|_| query_error(py, format!("mm_items[{i}] is not a MultimodalItem (identifier str, offset and length ints)")))?;
        items.push(item);
    }
    let extra_keys = if extra.is_none() {
        None
    } else {
        let mut out = Vec::new();
        for (i, ek) in extra.try_iter()?.enumerate() {
            let ek = ek?;
            let vals: Option<Vec<Value>> = if ek.is_none() {
                None
            } else {
                Some(
                    ek.try_iter()
                        .and_then(|it| it.map(|v| value(&v?)).collect::<PyResult<_>>())
                        .map_err(|e| query_error(py, format!("extra_keys[{i}]: {e}")))?,
                )
            };
            let enc = keys::encode_extras(vals.as_deref())
                .map_err(|_| query_error(py, format!("extra_keys[{i}]: an int outside 64 bits")))?;
            out.push(enc);
        }
        Some(out)
    };
    Ok(QueryInput {
        tokens,
        lora,
        salt,
        mm_items: items,
        extra_keys,
    })
}

fn bytes_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    obj.try_iter()?
        .map(|k| Ok(k?.cast::<PyBytes>()?.as_bytes().to_vec()))
        .collect()
}

/// A `SnapWorker` Struct (kvroute/_snapshot.py) as the core's.
pub(crate) fn snap_worker(sw: &Bound<'_, PyAny>) -> PyResult<SnapWorker> {
    let groups = sw
        .getattr("groups")?
        .try_iter()?
        .map(|g| {
            let g = g?;
            Ok(SnapGroup {
                group_idx: g.getattr("group_idx")?.extract()?,
                kind: g.getattr("kind")?.extract()?,
                window: opt_i64(&g.getattr("window")?)?,
                block_size: g.getattr("block_size")?.extract()?,
                hashes: hashes(&g.getattr("hashes")?)?,
                keys: bytes_list(&g.getattr("keys")?)?,
                masks: g.getattr("masks")?.extract()?,
            })
        })
        .collect::<PyResult<_>>()?;
    let special = sw
        .getattr("special")?
        .try_iter()?
        .map(|item| {
            let item = item?;
            Ok((
                block_hash(&item.get_item(0)?)?,
                item.get_item(1)?.extract::<Vec<i64>>()?,
            ))
        })
        .collect::<PyResult<_>>()?;
    Ok(SnapWorker {
        classes: sw.getattr("classes")?.extract()?,
        primary: opt_i64(&sw.getattr("primary")?)?,
        lookahead: sw.getattr("lookahead")?.extract()?,
        hashes: hashes(&sw.getattr("hashes")?)?,
        keys: bytes_list(&sw.getattr("keys")?)?,
        special,
        groups,
    })
}
