//! The Router's compiled path: `kvroute._core.select` matches the prompt, prices every candidate
//! the index claims overlap for and every load-only one with the built-in `CostModel`
//! (`crate::scoring`), and finds the zero-temperature ties, in one call. `Router.select`
//! (kvroute/_router.py) takes it when its model is exactly `CostModel` and no worker is
//! approximate; the Python path stays the reference and serves subclasses.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PySet, PyString, PyTuple, PyType};
use rustc_hash::FxHashMap;

use super::index::{convert, PyIndex, PyKey};
use crate::scoring::{self, Claim, CostParams};

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

/// The routing hint's tokens for `w` (0: none).
fn routed_of(routed: &Bound<'_, PyDict>, w: &Bound<'_, PyAny>) -> PyResult<i64> {
    Ok(match routed.get_item(w)? {
        Some(v) => v.extract()?,
        None => 0,
    })
}

/// Whether the router believes `w`'s index claim (`Router._scored`'s rule).
fn trusted(
    states: Option<&Bound<'_, PyAny>>,
    w: &Bound<'_, PyAny>,
    trust_partial: bool,
) -> PyResult<bool> {
    let Some(states) = states else {
        return Ok(true); // no states provider: the index is trusted for every worker
    };
    let py = w.py();
    let status = states.call_method1(intern!(py, "worker_status"), (w,))?;
    if status.is_none()
        || !status
            .getattr(intern!(py, "state"))?
            .eq(intern!(py, "synced"))?
    {
        return Ok(false);
    }
    Ok(trust_partial || !status.getattr(intern!(py, "partial"))?.is_truthy()?)
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
    workers: Vec<Py<PyAny>>,
    rows: Vec<Row>,
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
        candidate(&candidate_type(py)?, w.bind(py).clone(), r)
    }

    /// Every candidate as a `CandidateScore`, in order.
    fn build<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let cls = candidate_type(py)?;
        let out = PyList::empty(py);
        for (w, r) in self.workers.iter().zip(&self.rows) {
            out.append(candidate(&cls, w.bind(py).clone(), r)?)?;
        }
        Ok(out)
    }

    /// The candidates' workers, in order.
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.workers.iter().map(|w| w.bind(py)))
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

/// Match ``token_ids`` (checked as `find_matches` checks them) and price the candidates for
/// `Router.select` with the built-in cost model ``model``. ``universe``: the candidate set;
/// ``states``: the worker-state provider or None; ``loads`` / ``scale``: load per worker and the
/// factor to cost blocks (the load-only candidates come in ``loads``' order);
/// ``routed``: the routing hint's credit in tokens per worker (kvroute/_routed.py; None: none).
/// Returns ``(scored, idle_count, idle_cost, tied, idle_tied, query_tokens)``: the candidates
/// (`Scored`) in the Python path's order, the idle workers and their cost, and the
/// indices of the entries tied at the least cost with the number of idle workers tied with them.
#[pyfunction]
#[pyo3(signature = (index, token_ids, lora_name, cache_salt, mm_items, extra_keys, model, unit, universe, states, trust_partial, loads, scale, routed))]
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
    universe: &Bound<'py, PySet>,
    states: Option<&Bound<'py, PyAny>>,
    trust_partial: bool,
    loads: &Bound<'py, PyAny>,
    scale: f64,
    routed: Option<&Bound<'py, PyDict>>,
) -> PyResult<(Scored, usize, f64, Vec<usize>, usize, usize)> {
    let input = convert::query_input(token_ids, lora_name, cache_salt, mm_items, extra_keys)?;
    let ntok = input.tokens.len();
    let params = CostParams {
        overlap_weight: weight(model, intern!(py, "overlap_weight"))?,
        cpu_credit: weight(model, intern!(py, "cpu_credit"))?,
        disk_credit: weight(model, intern!(py, "disk_credit"))?,
        external_credit: weight(model, intern!(py, "external_credit"))?,
    };
    let want_tiers = !params.full_credit();
    // Match and, when some held block is off GPU and tiers are priced below GPU, the tier runs
    // too: one locked section, one consistent view of the index.
    let (result, tiers) = index.get().with_query(py, ntok, move |idx| {
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
        (r, tiers)
    });

    let ntok_i = ntok as i64;
    let unit_f = unit as f64;
    let idle_prefill = ntok_i as f64 / unit_f;
    let mut workers: Vec<Py<PyAny>> = Vec::new();
    let mut rows: Vec<Row> = Vec::new();
    // the scored workers, for the hint-only and load-only passes to skip (only kept when there is one)
    let loaded = loads.len()? > 0;
    let seen = if loaded || routed.is_some() {
        Some(PySet::empty(py)?)
    } else {
        None
    };
    let gpu_of: Option<FxHashMap<u32, i64>> = result
        .gpu
        .as_ref()
        .map(|g| g.iter().map(|s| (s.slot, s.blocks)).collect());
    for s in &result.scores {
        let w = s.worker.obj(py);
        if !universe.contains(&w)? {
            continue;
        }
        let load = if loaded {
            load_of(loads, &w, scale)?
        } else {
            0.0
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
            trusted: trusted(states, &w, trust_partial)?,
        };
        let hint = match routed {
            Some(r) => routed_of(r, &w)?,
            None => 0,
        };
        let p = scoring::price(&params, &claim, ntok_i, unit, load, hint);
        if let Some(seen) = &seen {
            seen.add(&w)?;
        }
        workers.push(w.unbind());
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
        for (w, hint) in routed.iter() {
            if seen.contains(&w)? || !universe.contains(&w)? {
                continue;
            }
            let hint: i64 = hint.extract()?;
            let load = if loaded {
                load_of(loads, &w, scale)?
            } else {
                0.0
            };
            let prefill = scoring::routed_prefill(ntok_i, unit, hint);
            let cost = params.cost(prefill, load);
            seen.add(&w)?;
            workers.push(w.unbind());
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
    if let (true, Some(seen)) = (loaded, &seen) {
        let mut load_only = |w: Bound<'py, PyAny>, t: Bound<'py, PyAny>| -> PyResult<()> {
            if !t.is_truthy()? || !universe.contains(&w)? || seen.contains(&w)? {
                return Ok(());
            }
            let load = t.extract::<f64>()? * scale;
            workers.push(w.unbind());
            rows.push(Row {
                claimed: 0,
                overlap: 0,
                block_size: None,
                prefill: idle_prefill,
                load,
                cost: idle_cost + load,
                overlap_tokens: 0,
                routed_tokens: 0,
            });
            Ok(())
        };
        match loads.cast::<PyDict>() {
            Ok(d) => {
                for (w, t) in d.iter() {
                    load_only(w, t)?;
                }
            }
            Err(_) => {
                for item in loads.call_method0(intern!(py, "items"))?.try_iter()? {
                    let (w, t): (Bound<'py, PyAny>, Bound<'py, PyAny>) = item?.extract()?;
                    load_only(w, t)?;
                }
            }
        }
    }
    let idle_count = universe.len() - rows.len();
    let costs: Vec<f64> = rows.iter().map(|r| r.cost).collect();
    let (tied, idle_tied) = scoring::ties(&costs, idle_count, idle_cost);
    Ok((
        Scored { workers, rows },
        idle_count,
        idle_cost,
        tied,
        idle_tied,
        ntok,
    ))
}

/// Add the router's functions to `kvroute._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_candidate_type, m)?)?;
    m.add_function(wrap_pyfunction!(select, m)?)?;
    m.add_class::<Scored>()?;
    Ok(())
}
