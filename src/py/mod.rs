//! The PyO3 surface: `kvroute._core`. Python-facing types live here; the core modules stay pure Rust.

pub mod index;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

mod recv;
mod router;
mod wire;

/// XXH3-128 of ``data`` as 16 big-endian bytes (the `xxhash.xxh3_128_digest` convention).
#[pyfunction]
fn xxh128<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &crate::keys::xxh128(data))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HASH_VERSION", crate::keys::HASH_VERSION)?;
    m.add_function(wrap_pyfunction!(xxh128, m)?)?;
    wire::register(m)?;
    index::register(m)?;
    router::register(m)?;
    recv::register(m)?;
    Ok(())
}
