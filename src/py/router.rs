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

/// One `CandidateScore` (positional: the class's field order).
#[allow(clippy::too_many_arguments)]
fn candidate<'py>(
    cls: &Bound<'py, PyType>,
    worker: Bound<'py, PyAny>,
    claimed: i64,
    overlap: i64,
    block_size: Option<i64>,
    prefill: f64,
    load: f64,
    cost: f64,
    overlap_tokens: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let py = cls.py();
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
    ];
    // A tuple call: `PyObject_Vectorcall` would spare the tuple, but CPython 3.10 (the abi3
    // wheel's floor) does not export it.
    cls.call1(PyTuple::new(py, args)?)
}

/// Match ``token_ids`` (checked as `find_matches` checks them) and price the candidates for
/// `Router.select` with the built-in cost model ``model``. ``universe``: the candidate set;
/// ``states``: the worker-state provider or None; ``loads`` / ``scale``: load per worker and the
/// factor to cost blocks; ``busy``: ``loads.keys() & universe`` (None when nothing is loaded).
/// Returns ``(entries, idle_count, idle_cost, tied, idle_tied, query_tokens)``: the
/// `CandidateScore`s in the Python path's order, the idle workers and their cost, and the
/// indices of the entries tied at the least cost with the number of idle workers tied with them.
#[pyfunction]
#[pyo3(signature = (index, token_ids, lora_name, cache_salt, mm_items, extra_keys, model, unit, universe, states, trust_partial, loads, scale, busy))]
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
    busy: Option<&Bound<'py, PySet>>,
) -> PyResult<(Bound<'py, PyList>, usize, f64, Vec<usize>, usize, usize)> {
    let input = convert::query_input(token_ids, lora_name, cache_salt, mm_items, extra_keys)?;
    let ntok = input.tokens.len();
    let params = CostParams {
        overlap_weight: weight(model, intern!(py, "overlap_weight"))?,
        cpu_credit: weight(model, intern!(py, "cpu_credit"))?,
        disk_credit: weight(model, intern!(py, "disk_credit"))?,
        external_credit: weight(model, intern!(py, "external_credit"))?,
    };
    let Some(cls) = CANDIDATE.get(py) else {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "kvroute._router is not imported",
        ));
    };
    let cls = cls.bind(py);
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
    let entries = PyList::empty(py);
    let mut costs: Vec<f64> = Vec::new();
    // the scored workers, for the load-only pass to skip (only kept when there is one)
    let seen = busy.map(|_| PySet::empty(py)).transpose()?;
    let loaded = loads.len()? > 0;
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
        let p = scoring::price(&params, &claim, ntok_i, unit, load);
        if let Some(seen) = &seen {
            seen.add(&w)?;
        }
        costs.push(p.cost);
        entries.append(candidate(
            cls,
            w,
            s.blocks,
            p.overlap_blocks,
            Some(s.block_size),
            p.prefill_blocks,
            load,
            p.cost,
            p.overlap_tokens,
        )?)?;
    }

    // Load-only workers: nothing claimed, the whole prompt to prefill.
    let idle_cost = params.cost(idle_prefill, 0.0);
    if let (Some(busy), Some(seen)) = (busy, &seen) {
        for w in busy.iter() {
            if seen.contains(&w)? {
                continue;
            }
            let t = loads.get_item(&w)?;
            if !t.is_truthy()? {
                continue;
            }
            let load = t.extract::<f64>()? * scale;
            let cost = idle_cost + load;
            costs.push(cost);
            entries.append(candidate(cls, w, 0, 0, None, idle_prefill, load, cost, 0)?)?;
        }
    }
    let idle_count = universe.len() - costs.len();
    let (tied, idle_tied) = scoring::ties(&costs, idle_count, idle_cost);
    Ok((entries, idle_count, idle_cost, tied, idle_tied, ntok))
}

/// Add the router's functions to `kvroute._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(set_candidate_type, m)?)?;
    m.add_function(wrap_pyfunction!(select, m)?)?;
    Ok(())
}
