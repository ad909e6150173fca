//! Python objects -> the core's types: engine events (kvroute._wire Structs) -> `protocols`
//! events, a query's arguments -> a checked `QueryInput`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};

use crate::index::QueryInput;
use crate::keys::{self, MmItem};
use crate::protocols::{medium_of, BlockHash, BlockRemoved, BlockStored, Event, Value};

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

/// An int of an event, saturated onto int64 as the wire decoder reads one (`wire::sat`): a token
/// outside int64 is outside uint32 either way (the block stays unhashable, as in the Python
/// index), and a uint64 `group_idx` or sliding window decodes from msgpack (`0xcf`) as well.
fn saturating_i64(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
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
            out.push(saturating_i64(&t)?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|t| saturating_i64(&t?)).collect()
}

fn opt_i64(obj: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if obj.is_none() {
        Ok(None)
    } else {
        saturating_i64(obj).map(Some)
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
        block_size: saturating_i64(&get(intern!(py, "block_size"))?)?,
        lora_id: None,
        medium: opt_str(&get(intern!(py, "medium"))?)?
            .as_deref()
            .map(medium_of),
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
        bigram: get(intern!(py, "bigram"))?.is_truthy()?,
    })
}

fn removed(ev: &Bound<'_, PyAny>) -> PyResult<BlockRemoved> {
    let py = ev.py();
    Ok(BlockRemoved {
        block_hashes: hashes(&ev.getattr(intern!(py, "block_hashes"))?)?.into(),
        medium: opt_str(&ev.getattr(intern!(py, "medium"))?)?
            .as_deref()
            .map(medium_of),
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

/// How CPython lays out the objects a query's tokens come in, detected once and self-tested, so
/// the hot loops read lists and ints directly instead of two C-API calls per token: 8,192 ints
/// took ~45 µs through `PyList_GetItem` + `PyLong_AsUnsignedLongLong`, a few µs read directly
/// (bench/bench_vs_dynamo.py, bench/bench_core.py). Layouts outside the known ones (a future
/// CPython, a 15-bit-digit build) leave `ints` None and the C-API path serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum IntLayout {
    /// 3.10, 3.11: `ob_size` holds the signed digit count.
    Size,
    /// 3.12 to 3.14: `lv_tag` holds the digit count above 3 flag bits, the sign in the low 2.
    Tag,
}

struct Layouts {
    ints: Option<IntLayout>,
}

static LAYOUTS: PyOnceLock<Layouts> = PyOnceLock::new();

/// The head of every variable-size object (`PyObject_VAR_HEAD`, a GIL build).
#[repr(C)]
struct VarHead {
    ob_refcnt: ffi::Py_ssize_t,
    ob_type: *mut ffi::PyTypeObject,
    ob_size: ffi::Py_ssize_t,
}

/// `PyListObject` (unchanged from 3.0 to 3.14 in GIL builds).
#[repr(C)]
struct ListLayout {
    head: VarHead,
    ob_item: *mut *mut ffi::PyObject,
}

/// The word after the object head of an int (`ob_size` before 3.12, `lv_tag` since), then its
/// 30-bit digits.
#[repr(C)]
struct IntHead {
    ob_refcnt: ffi::Py_ssize_t,
    ob_type: *mut ffi::PyTypeObject,
    word: isize,
    digits: [u32; 1],
}

/// An exact int's value if it is in [0, 2^32); None for anything else (then the C-API path
/// decides, and names the position when it is bad).
///
/// # Safety
/// The GIL is held, `item` is a live object and `layout` was verified by `layouts`.
#[inline(always)]
unsafe fn read_u32(layout: IntLayout, item: *mut ffi::PyObject) -> Option<u32> {
    if (*item).ob_type != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
        return None;
    }
    let int = item as *const IntHead;
    let word = (*int).word;
    let digits = std::ptr::addr_of!((*int).digits) as *const u32;
    let (negative, n) = match layout {
        IntLayout::Size => (word < 0, word.unsigned_abs()),
        IntLayout::Tag => {
            let tag = word as usize;
            (tag & 3 == 2, if tag & 3 == 1 { 0 } else { tag >> 3 })
        }
    };
    if negative {
        return None;
    }
    match n {
        0 => Some(0),
        1 => Some(*digits),
        // two digits: below 2^60; in range when the high digit has at most 2 bits
        2 => {
            let hi = *digits.add(1);
            (hi < 4).then(|| *digits | (hi << 30))
        }
        _ => None,
    }
}

/// Detect the layouts and check them on known values; any mismatch disables the direct reads.
fn layouts(py: Python<'_>) -> &'static Layouts {
    LAYOUTS.get_or_init(py, || {
        let detect = || -> PyResult<Option<IntLayout>> {
            let sys = py.import("sys")?;
            let name: String = sys.getattr("implementation")?.getattr("name")?.extract()?;
            let (major, minor): (u32, u32) = sys
                .getattr("version_info")?
                .extract::<(u32, u32, u32, String, u32)>()
                .map(|v| (v.0, v.1))?;
            let bits: u32 = sys
                .getattr("int_info")?
                .getattr("bits_per_digit")?
                .extract()?;
            let layout = match (name.as_str(), major, minor, bits) {
                ("cpython", 3, 10..=11, 30) => IntLayout::Size,
                ("cpython", 3, 12..=14, 30) => IntLayout::Tag,
                _ => return Ok(None),
            };
            let probes: [(i128, Option<u32>); 9] = [
                (0, Some(0)),
                (1, Some(1)),
                (255, Some(255)),
                (70_000, Some(70_000)),
                ((1 << 30) + 5, Some((1 << 30) + 5)),
                (u32::MAX as i128, Some(u32::MAX)),
                (1 << 32, None),
                (-1, None),
                (1 << 62, None),
            ];
            let list = PyList::empty(py);
            for (v, _) in probes {
                list.append(v)?;
            }
            for (i, (_, want)) in probes.iter().enumerate() {
                // SAFETY: the GIL is held; `list` is a list of `probes.len()` ints, read through
                // the layout under test only after `ob_size` confirms the length.
                let got = unsafe {
                    let l = list.as_ptr() as *const ListLayout;
                    if (*l).head.ob_size != probes.len() as ffi::Py_ssize_t {
                        return Ok(None);
                    }
                    read_u32(layout, *(*l).ob_item.add(i))
                };
                if got != *want {
                    return Ok(None);
                }
            }
            // The small-int run reads the first four (one digit or zero) and stops at 2^30 + 5.
            let mut small = Vec::new();
            // SAFETY: as above; the length was confirmed in the loop.
            let stop = unsafe {
                let l = list.as_ptr() as *const ListLayout;
                read_small_run(layout, (*l).ob_item, 0, probes.len(), &mut small)
            };
            if stop != 4 || small != [0, 1, 255, 70_000] {
                return Ok(None);
            }
            Ok(Some(layout))
        };
        Layouts {
            ints: detect().ok().flatten(),
        }
    })
}

// The buffer protocol: in the limited API only from 3.11, but exported by every CPython 3 (the
// wheel is abi3 for 3.10 and up), with the struct below unchanged since 3.3.
#[repr(C)]
struct PyBuffer {
    buf: *mut std::ffi::c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: std::ffi::c_int,
    ndim: std::ffi::c_int,
    format: *mut std::ffi::c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut std::ffi::c_void,
}

extern "C" {
    fn PyObject_GetBuffer(
        obj: *mut ffi::PyObject,
        view: *mut PyBuffer,
        flags: std::ffi::c_int,
    ) -> std::ffi::c_int;
    fn PyBuffer_Release(view: *mut PyBuffer);
}

/// PyBUF_C_CONTIGUOUS | PyBUF_FORMAT: a contiguous buffer and its struct format.
const BUF_FLAGS: std::ffi::c_int = 0x38 | 0x04;

/// A typed buffer of uint32 in native byte order (array('I'), numpy uint32, ...): its tokens,
/// copied once from the exporter's memory. None: not a buffer, or not of uint32.
fn u32_buffer(obj: &Bound<'_, PyAny>) -> Option<Vec<u32>> {
    // SAFETY: the GIL is held; a zeroed Py_buffer is what PyObject_GetBuffer fills in.
    let mut view: PyBuffer = unsafe { std::mem::zeroed() };
    // SAFETY: `obj` is live; on failure the call sets an error, cleared here (not a buffer).
    if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut view, BUF_FLAGS) } != 0 {
        // SAFETY: the GIL is held.
        unsafe { ffi::PyErr_Clear() };
        return None;
    }
    // SAFETY: the view is filled in: `format` is a C string (PyBUF_FORMAT asked for it) and
    // `buf` holds `len` bytes, contiguous, until the view is released below.
    let out = unsafe {
        let format = std::ffi::CStr::from_ptr(view.format).to_bytes();
        let native: &[u8] = if cfg!(target_endian = "little") {
            b"<"
        } else {
            b">"
        };
        let code = format
            .strip_prefix(b"@")
            .or_else(|| format.strip_prefix(b"="))
            .or_else(|| format.strip_prefix(native))
            .unwrap_or(format);
        let ok = view.itemsize == 4 && view.ndim == 1 && (code == b"I" || code == b"L");
        let out = ok.then(|| {
            // native-endian uint32s: one memcpy into the tokens (the exporter's memory may be
            // unaligned, so it is copied as bytes)
            let n = view.len as usize / 4;
            let mut v: Vec<u32> = Vec::with_capacity(n);
            std::ptr::copy_nonoverlapping(view.buf as *const u8, v.as_mut_ptr() as *mut u8, n * 4);
            v.set_len(n);
            v
        });
        PyBuffer_Release(&mut view);
        out
    };
    out
}

/// The one-word tag of an exact int below 2^30 (one digit, positive) and of zero, per layout:
/// the common token id is read with two compares instead of `read_u32`'s general decode.
const fn small_tags(layout: IntLayout) -> (isize, isize) {
    match layout {
        IntLayout::Size => (1, 0),
        // ndigits << 3 | sign (0 positive, 1 zero)
        IntLayout::Tag => (1 << 3, 1),
    }
}

/// Read exact ints from `items[from..n]` into `out` until one is not a one-digit positive int
/// or zero; returns where it stopped. Written for the common case (token ids < 2^30): one type
/// compare, one tag compare and a store per token, no capacity check (reserved up front). At
/// 8,192 tokens this loop is the whole cost of checking a list (~23 instructions a token through
/// `read_u32` and `Vec::push`, ~8 here: callgrind, bench/bench_select.py).
///
/// # Safety
/// The GIL is held, no Python code runs while this reads, `items` is the list's item array of
/// at least `n` live objects, and `layout` was verified by `layouts`.
#[inline(always)]
unsafe fn read_small_run(
    layout: IntLayout,
    items: *mut *mut ffi::PyObject,
    from: usize,
    n: usize,
    out: &mut Vec<u32>,
) -> usize {
    let (one, zero) = small_tags(layout);
    let long = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    out.reserve(n - from);
    let base = out.len();
    let dst = out.as_mut_ptr().add(base);
    let mut i = from;
    loop {
        // Four at a time: one branch for four type checks and one for four tags (the compares
        // are combined without short-circuiting), the digits read only once both pass.
        while i + 4 <= n {
            let it = [
                *items.add(i),
                *items.add(i + 1),
                *items.add(i + 2),
                *items.add(i + 3),
            ];
            let ints = ((*it[0]).ob_type == long)
                & ((*it[1]).ob_type == long)
                & ((*it[2]).ob_type == long)
                & ((*it[3]).ob_type == long);
            if !ints {
                break;
            }
            let h = it.map(|x| x as *const IntHead);
            if !(((*h[0]).word == one)
                & ((*h[1]).word == one)
                & ((*h[2]).word == one)
                & ((*h[3]).word == one))
            {
                break;
            }
            for (k, &hk) in h.iter().enumerate() {
                *dst.add(i + k - from) = *(std::ptr::addr_of!((*hk).digits) as *const u32);
            }
            i += 4;
        }
        // One at a time (a zero, the tail, or where the four stopped), back to four after it.
        if i >= n {
            break;
        }
        let item = *items.add(i);
        if (*item).ob_type != long {
            break;
        }
        let int = item as *const IntHead;
        let word = (*int).word;
        let v = if word == one {
            // the digit is read only once the tag says the int has one
            *(std::ptr::addr_of!((*int).digits) as *const u32)
        } else if word == zero {
            0
        } else {
            break;
        };
        *dst.add(i - from) = v;
        i += 1;
    }
    out.set_len(base + (i - from));
    i
}

/// A list's tokens, checked. Exact ints in range are read directly (`read_small_run`, then
/// `read_u32` for two-digit ones); anything else goes through `extract` (int subclasses,
/// `__index__`), which names the first bad position.
fn list_tokens(list: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
    let py = list.py();
    let fast = layouts(py).ints;
    let mut out = Vec::with_capacity(list.len());
    let mut i = 0usize;
    loop {
        if let Some(layout) = fast {
            // SAFETY: the GIL is held and no Python code runs in this loop, so the list's item
            // array and length stay as read; every item below the length is a live object.
            unsafe {
                let l = list.as_ptr() as *const ListLayout;
                let n = (*l).head.ob_size as usize;
                let items = (*l).ob_item;
                while i < n {
                    i = read_small_run(layout, items, i, n, &mut out);
                    if i >= n {
                        break;
                    }
                    match read_u32(layout, *items.add(i)) {
                        Some(v) => out.push(v),
                        None => break,
                    }
                    i += 1;
                }
            }
        }
        // The length is read each time: `extract` below may run Python code (`__index__`).
        if i >= list.len() {
            return Ok(out);
        }
        let t = list.get_item(i)?;
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
    if let Some(v) = u32_buffer(obj) {
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
