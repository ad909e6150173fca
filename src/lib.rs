//! kvroute's compiled core. The modules read as the pipeline:
//! `protocols` (the events, as the wire codec produces them) -> `wire` (msgpack bytes -> events)
//! -> `keys` (HASH_VERSION 2 content keys) -> `index` (store / query / snapshot) -> `scoring`;
//! `recv` is the native receive loop in front of them (ZMQ SUB sockets -> `wire` + `index` off the GIL).
//! `py` is the PyO3 surface, the private module `kvroute._core`.

pub mod index;
pub mod keys;
pub mod protocols;
mod py;
pub mod recv;
pub mod scoring;
pub mod wire;

use pyo3::prelude::*;

/// The extension module `kvroute._core`: private; the public API is the Python package.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    py::register(m)
}
