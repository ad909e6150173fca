//! The Router's per-candidate scoring for the built-in `CostModel` (kvroute/_router.py's
//! `CostModel.credited_blocks` / `CostModel.cost`, `Router._scored` and the zero-temperature half
//! of `Router._pick`), float operation for float operation, so the compiled path prices and ties
//! exactly as the Python path does (tests/test_router_scoring.py holds them to it).
//!
//! Also the footprint (`Footprint`, `CostModel.footprint`): the decayed count of new placements
//! per worker and the pick of a new session's worker from it, for both scoring paths.
//!
//! Nothing here knows Python: src/py/router.rs reads the model's weights off the Python object
//! and hands the index's answer in.

use std::hash::Hash;

use rustc_hash::FxHashMap;

/// The built-in cost model's weights (read from the Python `CostModel` each call).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    pub overlap_weight: f64,
    pub cpu_credit: f64,
    pub disk_credit: f64,
    pub external_credit: f64,
    /// weight of what a candidate's prefill evicts on a cache under pressure (`CostModel.eviction_weight`)
    pub eviction_weight: f64,
    /// the long-prefix term (`CostModel.long_prefix`): a prefill above `floor` blocks is priced
    /// super-linearly, `scale` blocks setting how fast; None: off
    pub long_prefix: Option<Floored>,
    /// the long-move term (`CostModel.long_move`): what a candidate's prefill recomputes over the
    /// least prefill of any candidate, above `floor` blocks, priced super-linearly; None: off
    pub long_move: Option<Floored>,
}

/// A super-linear term's two figures (`CostModel.long_prefix_floor` / `long_prefix_scale`, or
/// `long_move_floor` / `long_move_scale`), in blocks of the router's `block_size`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Floored {
    /// blocks (of prefill, or of recompute over the best candidate) up to which the term adds nothing
    pub floor: f64,
    /// blocks above the floor that add the linear price once more (at least 1: `CostModel` checks it)
    pub scale: f64,
}

/// Costs closer than this relative margin are a tie (`_TIE_EPS`).
pub const TIE_EPS: f64 = 1e-9;

impl CostParams {
    /// Every tier counts as a GPU hit (`CostModel.full_credit`).
    pub fn full_credit(&self) -> bool {
        self.cpu_credit == 1.0 && self.disk_credit == 1.0 && self.external_credit == 1.0
    }

    /// Cached blocks as GPU-hit equivalents (`CostModel.credited_blocks`): each block of the run
    /// at the best credit among the tiers whose own leading run covers it, the rest at the
    /// lowest off-GPU credit.
    pub fn credited_blocks(
        &self,
        overlap: i64,
        gpu: i64,
        cpu: i64,
        disk: i64,
        external: i64,
    ) -> f64 {
        let mut runs = [
            (1.0, gpu),
            (self.cpu_credit, cpu),
            (self.disk_credit, disk),
            (self.external_credit, external),
        ];
        // Python's `sorted(..., reverse=True)` on (credit, run) tuples: credits are finite.
        runs.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)));
        let mut credited = 0.0;
        let mut covered = 0i64;
        for (credit, run) in runs {
            let run = run.min(overlap);
            if run > covered {
                credited += (run - covered) as f64 * credit;
                covered = run;
            }
        }
        if covered < overlap {
            let low = self
                .cpu_credit
                .min(self.disk_credit)
                .min(self.external_credit);
            credited += (overlap - covered) as f64 * low;
        }
        credited
    }

    /// A candidate's cost: ``overlap_weight * prefill_blocks + load_blocks``; with the long-prefix
    /// term on and the prefill above its floor, ``overlap_weight * prefill_blocks * (1 +
    /// (prefill_blocks - floor) / scale) + load_blocks`` (`CostModel.cost`, operation for operation).
    pub fn cost(&self, prefill_blocks: f64, load_blocks: f64) -> f64 {
        if let Some(lp) = self.long_prefix {
            let above = prefill_blocks - lp.floor;
            // at or below the floor the branch below prices exactly as without the term
            if above > 0.0 {
                return self.overlap_weight * prefill_blocks * (1.0 + above / lp.scale)
                    + load_blocks;
            }
        }
        self.overlap_weight * prefill_blocks + load_blocks
    }

    /// What a candidate adds for recomputing `extra_blocks` more than the best candidate
    /// (`CostModel.move`, operation for operation): ``overlap_weight * extra_blocks * (extra_blocks -
    /// floor) / scale`` above the floor, 0 at or below it, and 0 with the term off.
    pub fn move_price(&self, extra_blocks: f64) -> f64 {
        if let Some(m) = self.long_move {
            let above = extra_blocks - m.floor;
            if above > 0.0 {
                return self.overlap_weight * extra_blocks * above / m.scale;
            }
        }
        0.0
    }

    /// What the prefill's copy evicts (`CostModel.eviction`): ``eviction_weight * usage *
    /// prefill_blocks``, `usage` the worker's engine-reported KV usage in [0, 1]; 0 without a report.
    pub fn eviction(&self, prefill_blocks: f64, usage: f64) -> f64 {
        self.eviction_weight * usage * prefill_blocks
    }

    /// `cost` plus `eviction`, the latter added only where the worker reports usage (so a fleet
    /// without reports prices exactly as before the term existed).
    pub fn cost_at(&self, prefill_blocks: f64, load_blocks: f64, usage: f64) -> f64 {
        let cost = self.cost(prefill_blocks, load_blocks);
        if usage > 0.0 {
            cost + self.eviction(prefill_blocks, usage)
        } else {
            cost
        }
    }
}

/// What the index says of one candidate, and whether its state lets the router believe it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Claim {
    /// leading blocks on any tier, in `block_size`
    pub claimed: i64,
    pub block_size: i64,
    /// leading blocks on GPU, CPU, DISK, EXTERNAL
    pub gpu: i64,
    pub cpu: i64,
    pub disk: i64,
    pub external: i64,
    pub trusted: bool,
}

/// One candidate's figures (`CandidateScore` less the worker and source).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Priced {
    pub overlap_blocks: i64,
    pub prefill_blocks: f64,
    pub cost: f64,
    pub overlap_tokens: i64,
}

/// Does pricing `c` need the off-GPU tiers (its run is not all on GPU and they count less)?
pub fn needs_tiers(p: &CostParams, c: &Claim) -> bool {
    c.trusted && !p.full_credit() && c.gpu < c.claimed
}

/// Price one candidate the index claims overlap for (`Router._scored`'s loop body):
/// `ntok` the prompt's tokens, `unit` the router's block size, `load` in cost blocks, `routed`
/// the routing hint's tokens (kvroute/_routed.py), credited where they exceed the index's;
/// `usage` the worker's engine-reported KV usage (0: none reported).
pub fn price(
    p: &CostParams,
    c: &Claim,
    ntok: i64,
    unit: i64,
    load: f64,
    routed: i64,
    usage: f64,
) -> Priced {
    let unit_f = unit as f64;
    let (overlap, prefill) = if c.trusted {
        let prefill = if p.full_credit() || c.gpu >= c.claimed {
            // int arithmetic in Python, then a true division: exact below 2^53
            (ntok - c.claimed * c.block_size).max(0) as f64 / unit_f
        } else {
            let credited = p.credited_blocks(c.claimed, c.gpu, c.cpu, c.disk, c.external);
            (ntok as f64 - credited * c.block_size as f64).max(0.0) / unit_f
        };
        (c.claimed, prefill)
    } else {
        (0, ntok as f64 / unit_f)
    };
    let prefill = if routed > 0 {
        prefill.min(routed_prefill(ntok, unit, routed))
    } else {
        prefill
    };
    Priced {
        overlap_blocks: overlap,
        prefill_blocks: prefill,
        cost: p.cost_at(prefill, load, usage),
        overlap_tokens: ntok.min(overlap * c.block_size),
    }
}

/// The prefill left when only the routing hint's `routed` tokens are credited (`Router._routed_only`).
pub fn routed_prefill(ntok: i64, unit: i64, routed: i64) -> f64 {
    // int arithmetic in Python, then a true division: exact below 2^53
    (ntok - routed) as f64 / unit as f64
}

/// The least prefill the long-move term measures moves from (`_price_moves` in kvroute/_scoring.py):
/// the least of the candidates' `prefills` and the idle group's whole prompt (`idle_prefill`, never
/// below a candidate's, so the figure is the same whether idle workers exist or not).
pub fn least_prefill(prefills: impl IntoIterator<Item = f64>, idle_prefill: f64) -> f64 {
    let mut best: Option<f64> = None;
    for p in prefills {
        // Python's `min`: the first of equal values, a later one only when strictly less
        if best.is_none_or(|b| p < b) {
            best = Some(p);
        }
    }
    match best {
        Some(b) if idle_prefill >= b => b,
        _ => idle_prefill,
    }
}

/// The zero-temperature choice (`Router._pick`): the entries within the tie margin of the least
/// cost, and how many idle workers tie with them. The caller draws one uniformly.
pub fn ties(costs: &[f64], idle_count: usize, idle_cost: f64) -> (Vec<usize>, usize) {
    ties_of(costs.iter().copied(), idle_count, idle_cost)
}

/// `ties` over the costs as an iterator (read twice): a caller holding them in its own rows
/// need not copy them out first.
pub fn ties_of(
    costs: impl Iterator<Item = f64> + Clone,
    idle_count: usize,
    idle_cost: f64,
) -> (Vec<usize>, usize) {
    let mut best = costs.clone().fold(f64::INFINITY, f64::min);
    if idle_count > 0 {
        best = best.min(idle_cost);
    }
    let margin = TIE_EPS * best.abs().max(1.0);
    let tied = costs
        .enumerate()
        .filter(|&(_, c)| c - best <= margin)
        .map(|(i, _)| i)
        .collect();
    let idle_tied = if idle_count > 0 && idle_cost - best <= margin {
        idle_count
    } else {
        0
    };
    (tied, idle_tied)
}

/// How engine-reported load is priced (`LoadPolicy.mode`, kvroute/_load.py).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMode {
    /// the larger of the engine's queue and the router's own in-flight tokens
    Blend,
    /// the engine's queue where a fresh record exists, the router's own tokens elsewhere
    Engine,
    /// the router's own tokens only: records are ignored (and veto nobody)
    Router,
}

/// One worker's newest engine load record, as `EngineLoads.update` reduces it (its `_figures`
/// plus the KV usage): what the blend and the eviction term read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineFigures {
    /// the local monotonic time it arrived
    pub received: f64,
    /// prefill work queued at the engine, in tokens (`EngineLoad.queued_tokens`)
    pub queued: f64,
    /// requests held when the record counts requests only (a `/metrics` scrape); <= 0: priced
    /// in tokens (`queued`)
    pub requests: f64,
    /// engine silence in ms (-1: none reported)
    pub silence: f64,
    /// the silence allowed in ms before a veto (wedge_after plus the pending prefill's time)
    pub allowance: f64,
    /// the reported KV-cache usage, as reported (`EngineLoad.token_usage`)
    pub usage: f64,
}

impl EngineFigures {
    /// Whether the blend may use the record at `now` (`EngineLoads._engine_part`: stale once
    /// ``received + stale_after < now``, that expression exactly).
    pub fn fresh(&self, now: f64, stale_after: f64) -> bool {
        self.received + stale_after >= now
    }

    /// Whether it counts requests only (priced at the router's mean request, `EngineLoads.blend`).
    pub fn by_count(&self) -> bool {
        self.requests > 0.0
    }

    /// The engine's load in blocks of `unit` tokens, `per_request` tokens a counted request.
    pub fn blocks(&self, unit: f64, per_request: f64) -> f64 {
        if self.by_count() {
            self.requests * (per_request / unit)
        } else {
            self.queued / unit
        }
    }

    /// Whether the engine has been silent for longer than it may be (a fresh record's veto).
    pub fn wedged(&self) -> bool {
        self.silence > self.allowance
    }

    /// The KV usage `CostModel.eviction` prices at `now` (`EngineLoads.usage`: fresh while
    /// ``now - received <= stale_after``, above 0, capped at 1; NaN is none); 0: none.
    pub fn usage_at(&self, now: f64, stale_after: f64) -> f64 {
        if now - self.received <= stale_after && self.usage > 0.0 {
            self.usage.min(1.0)
        } else {
            0.0
        }
    }
}

/// One worker's load in blocks as `EngineLoads.blend` prices it: `engine` its fresh record's
/// figure (`EngineFigures::blocks`; None: no fresh record), `mine` the router's own in-flight
/// tokens there divided by the unit (None: none).
pub fn blend(mode: LoadMode, engine: Option<f64>, mine: Option<f64>) -> f64 {
    match (mode, engine, mine) {
        (LoadMode::Router, _, m) | (_, None, m) => m.unwrap_or(0.0),
        (LoadMode::Blend, Some(e), Some(m)) if m > e => m,
        (_, Some(e), _) => e,
    }
}

/// Raw footprint counts grow by the decay's inverse on every placement; past this they are
/// rescaled (an `f64` holds up to ~1e308, and the ratio between workers is all that is compared).
pub const RESCALE_AT: f64 = 1e100;

/// Where the router recently placed new sessions: a decayed count of new placements per worker,
/// so the next new session goes where fewest went (kvroute/_footprint.py says why).
///
/// Counts are kept unscaled: a placement adds `unit`, which grows by ``2 ** (1 / half_life)`` per
/// placement, so every older count decays relative to it without touching the others (decay by
/// placements, not by time: the count compares workers, and a clock-free count means the same at
/// any request rate). `count` divides `unit` out.
#[derive(Clone, Debug)]
pub struct Footprint<K> {
    raw: FxHashMap<K, f64>,
    unit: f64,
}

impl<K> Default for Footprint<K> {
    fn default() -> Self {
        Footprint {
            raw: FxHashMap::default(),
            unit: 1.0,
        }
    }
}

/// The footprint's choice (`Footprint::pick`): a listed candidate by position, or an idle worker.
#[derive(Clone, Debug, PartialEq)]
pub enum Placed<K> {
    Listed(usize),
    Idle(K),
}

impl<K: Hash + Eq + Ord + Clone> Footprint<K> {
    /// `worker`'s decayed count of new placements (1.0 for one made just now).
    pub fn count(&self, worker: &K) -> f64 {
        self.raw.get(worker).copied().unwrap_or(0.0) / self.unit
    }

    /// How many workers have a count.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether no worker has a count.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// Count one new placement on `worker`; every count decays by ``2 ** (-1 / half_life)``.
    /// Returns the keys the table let go of (`worker` itself when it was counted already, the
    /// entries a rescale dropped), for the caller to drop where that is safe (a key may hold
    /// the last reference to a Python object).
    pub fn add(&mut self, worker: K, half_life: f64) -> Vec<K> {
        let mut gone = Vec::new();
        self.unit *= 2f64.powf(1.0 / half_life);
        let unit = self.unit;
        match self.raw.get_mut(&worker) {
            Some(v) => {
                *v += unit;
                gone.push(worker);
            }
            None => {
                self.raw.insert(worker, unit);
            }
        }
        if self.unit > RESCALE_AT {
            let unit = self.unit;
            let old = std::mem::take(&mut self.raw);
            for (w, v) in old {
                if v / unit > 1e-12 {
                    self.raw.insert(w, v / unit);
                } else {
                    gone.push(w);
                }
            }
            self.unit = 1.0;
        }
        gone
    }

    /// Forget `worker`'s count (it left the fleet); the entry removed, for the caller to drop.
    pub fn discard(&mut self, worker: &K) -> Option<(K, f64)> {
        self.raw.remove_entry(worker)
    }

    /// The new placement's worker: fewest recent new placements among the candidates whose cost
    /// is within `limit(cheapest)` and whose load is no more than the cheapest's; ties go to the
    /// cheaper, then to the `draw(n)`-th (uniform in `0..n`) of the tied workers in key order.
    ///
    /// The band trades what the cost adds beside load (prefill still to do: a short cached
    /// prefix; what the prefill evicts), never load: a new session never goes to a busier worker
    /// than cost alone would send it to. `listed`: the priced candidates as (cost, load in cost
    /// blocks, worker); `idle`: the idle workers, all at `idle_cost` and no load (None: there are
    /// none), called only when eligible. None when no worker is left (the idle group was the
    /// cheapest and `idle` found none: another thread changed the fleet meanwhile).
    ///
    /// Key order, not the order either path lists or stores its candidates in, makes the draw the
    /// same in both scoring paths (src/py/router.rs and kvroute/_scoring.py call this alike).
    pub fn pick<E>(
        &self,
        listed: &[(f64, f64, &K)],
        idle_cost: f64,
        idle: Option<impl FnOnce() -> Result<Vec<K>, E>>,
        limit: impl FnOnce(f64) -> Result<f64, E>,
        draw: impl FnOnce(usize) -> Result<usize, E>,
    ) -> Result<Option<Placed<K>>, E> {
        let mut cheapest = listed.iter().map(|l| l.0).fold(f64::INFINITY, f64::min);
        if idle.is_some() {
            cheapest = cheapest.min(idle_cost);
        }
        // Costs from different paths can differ in the last bits (`TIE_EPS`).
        let tie = cheapest * (1.0 + TIE_EPS);
        // The cheapest's load (of several at that cost, the largest: each was eligible without the footprint).
        let load_cap = listed
            .iter()
            .filter(|l| l.0 <= tie)
            .map(|l| l.1)
            .fold(0.0, f64::max);
        let bound = limit(cheapest)? * (1.0 + TIE_EPS);
        let raw = &self.raw;
        let mut best: Option<(f64, f64)> = None;
        let mut tied: Vec<usize> = Vec::new();
        for (i, &(c, x, w)) in listed.iter().enumerate() {
            if c <= bound && x <= load_cap {
                let key = (raw.get(w).copied().unwrap_or(0.0), c);
                match best {
                    Some(b) if key > b => {}
                    Some(b) if key == b => tied.push(i),
                    _ => {
                        best = Some(key);
                        tied.clear();
                        tied.push(i);
                    }
                }
            }
        }
        let mut group: Vec<K> = Vec::new();
        if let Some(idle) = idle.filter(|_| idle_cost <= bound) {
            let pool = idle()?;
            let low = pool
                .iter()
                .map(|w| raw.get(w).copied().unwrap_or(0.0))
                .fold(f64::INFINITY, f64::min);
            if low.is_finite() {
                let key = (low, idle_cost);
                match best {
                    Some(b) if key > b => {}
                    b => {
                        // cheaper than the listed ties (or none): the idle group alone
                        if b != Some(key) {
                            tied.clear();
                        }
                        group = pool
                            .into_iter()
                            .filter(|w| raw.get(w).copied().unwrap_or(0.0) == low)
                            .collect();
                    }
                }
            }
        }
        let n = tied.len() + group.len();
        if n == 0 {
            return Ok(None);
        }
        let r = draw(n)?;
        // The r-th of the tied workers, listed and idle together, in key order.
        let mut all: Vec<(&K, Option<usize>)> = tied
            .iter()
            .map(|&i| (listed[i].2, Some(i)))
            .chain(group.iter().map(|w| (w, None)))
            .collect();
        let (_, &mut (w, at), _) = all.select_nth_unstable_by(r.min(n - 1), |a, b| a.0.cmp(b.0));
        Ok(Some(match at {
            Some(i) => Placed::Listed(i),
            None => Placed::Idle(w.clone()),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STOCK: CostParams = CostParams {
        overlap_weight: 1.0,
        cpu_credit: 0.8,
        disk_credit: 0.5,
        external_credit: 0.5,
        eviction_weight: 8.0,
        long_prefix: None,
        long_move: None,
    };

    #[test]
    fn credit_takes_the_best_tier_covering_each_block() {
        // 10 blocks: 4 on GPU, 8 on CPU, all 10 on DISK: 4 + 4 * 0.8 + 2 * 0.5
        assert_eq!(
            STOCK.credited_blocks(10, 4, 8, 10, 0),
            4.0 + 4.0 * 0.8 + 2.0 * 0.5
        );
        // a run on no single tier gets the lowest off-GPU credit
        assert_eq!(STOCK.credited_blocks(6, 2, 0, 0, 0), 2.0 + 4.0 * 0.5);
    }

    /// `blocks` leading blocks of 16 tokens, all on GPU.
    fn on_gpu(blocks: i64, trusted: bool) -> Claim {
        Claim {
            claimed: blocks,
            block_size: 16,
            gpu: blocks,
            trusted,
            ..Claim::default()
        }
    }

    #[test]
    fn untrusted_claims_price_the_whole_prompt() {
        let c = on_gpu(5, false);
        let got = price(&STOCK, &c, 100, 16, 2.0, 0, 0.0);
        assert_eq!(got.overlap_blocks, 0);
        assert_eq!(got.prefill_blocks, 100.0 / 16.0);
        assert_eq!(got.cost, 100.0 / 16.0 + 2.0);
        assert_eq!(got.overlap_tokens, 0);
    }

    #[test]
    fn a_claim_never_prices_below_zero_prefill() {
        let c = on_gpu(8, true);
        let got = price(&STOCK, &c, 100, 16, 0.0, 0, 0.0);
        assert_eq!((got.prefill_blocks, got.overlap_tokens), (0.0, 100));
    }

    #[test]
    fn the_routing_hint_counts_only_beyond_the_index() {
        let c = on_gpu(2, true);
        // the hint's 64 tokens beat the index's 32: 36 left to prefill
        let got = price(&STOCK, &c, 100, 16, 0.0, 64, 0.0);
        assert_eq!(got.prefill_blocks, 36.0 / 16.0);
        // the index claim is unchanged: the hint is not a claim
        assert_eq!((got.overlap_blocks, got.overlap_tokens), (2, 32));
        // a smaller hint changes nothing
        assert_eq!(
            price(&STOCK, &c, 100, 16, 0.0, 16, 0.0),
            price(&STOCK, &c, 100, 16, 0.0, 0, 0.0)
        );
    }

    #[test]
    fn a_move_onto_a_busy_cache_pays_for_what_it_evicts() {
        let c = on_gpu(2, true);
        // 100 tokens, 32 held: 68 / 16 blocks to prefill; at usage 0.25 they cost 8 * 0.25 more each
        let got = price(&STOCK, &c, 100, 16, 1.0, 0, 0.25);
        let prefill = 68.0 / 16.0;
        assert_eq!(got.prefill_blocks, prefill);
        assert_eq!(got.cost, (prefill + 1.0) + 8.0 * 0.25 * prefill);
        // no report (usage 0): exactly the cost without the term
        assert_eq!(
            price(&STOCK, &c, 100, 16, 1.0, 0, 0.0).cost,
            STOCK.cost(prefill, 1.0)
        );
        // nothing to prefill evicts nothing, however full the cache
        let whole = Claim {
            claimed: 7,
            gpu: 7,
            ..c
        };
        assert_eq!(price(&STOCK, &whole, 100, 16, 0.0, 0, 1.0).cost, 0.0);
    }

    #[test]
    fn a_long_prefill_is_priced_super_linearly_above_the_floor_only() {
        let long = CostParams {
            overlap_weight: 2.0,
            long_prefix: Some(Floored {
                floor: 128.0,
                scale: 1024.0,
            }),
            ..STOCK
        };
        let plain = CostParams {
            overlap_weight: 2.0,
            ..STOCK
        };
        // at and below the floor: bit for bit the cost without the term
        for p in [0.0, 1.5, 127.0, 128.0] {
            assert_eq!(long.cost(p, 3.0), plain.cost(p, 3.0));
        }
        // 640 blocks, 512 above the floor: 2 * 640 * (1 + 0.5) + 3
        assert_eq!(long.cost(640.0, 3.0), 2.0 * 640.0 * 1.5 + 3.0);
        // load stays additive: the idle group's `idle_cost + load` is the same figure
        assert_eq!(long.cost(640.0, 3.0), long.cost(640.0, 0.0) + 3.0);
        // the eviction term prices the prefill as before, on top
        assert_eq!(
            long.cost_at(640.0, 3.0, 0.5),
            long.cost(640.0, 3.0) + 8.0 * 0.5 * 640.0
        );
    }

    #[test]
    fn a_move_pays_super_linearly_for_what_it_recomputes_over_the_best_candidate() {
        let moving = CostParams {
            overlap_weight: 2.0,
            long_move: Some(Floored {
                floor: 64.0,
                scale: 8.0,
            }),
            ..STOCK
        };
        // off: nothing, whatever the difference
        assert_eq!(STOCK.move_price(1_000.0), 0.0);
        // at and below the floor: nothing, so a shared system prompt held here and not there moves as before
        for d in [0.0, 1.5, 32.0, 64.0] {
            assert_eq!(moving.move_price(d), 0.0);
        }
        // 264 blocks more than the holder, 200 above the floor: 2 * 264 * 200 / 8
        assert_eq!(moving.move_price(264.0), 2.0 * 264.0 * 200.0 / 8.0);
        // super-linear: twice the difference costs more than twice as much
        assert!(moving.move_price(528.0) > 2.0 * moving.move_price(264.0));
        // the cost itself (prefill and load) is not touched by the term: it is added beside it
        assert_eq!(
            moving.cost(300.0, 5.0),
            CostParams {
                long_move: None,
                ..moving
            }
            .cost(300.0, 5.0)
        );
    }

    #[test]
    fn the_least_prefill_is_the_first_least_and_never_above_the_whole_prompt() {
        assert_eq!(least_prefill([5.0, 2.0, 2.0, 9.0], 10.0), 2.0);
        // no candidate listed: the idle group's whole prompt, so an idle worker adds nothing
        assert_eq!(least_prefill([], 10.0), 10.0);
        // every listed candidate at the whole prompt (load only): the same figure
        assert_eq!(least_prefill([10.0, 10.0], 10.0), 10.0);
    }

    #[test]
    fn ties_within_the_margin_include_idle_workers() {
        let (tied, idle) = ties(&[3.0, 2.0, 2.0 + 1e-12, 5.0], 4, 2.0);
        assert_eq!((tied, idle), (vec![1, 2], 4));
        let (tied, idle) = ties(&[1.0], 4, 2.0);
        assert_eq!((tied, idle), (vec![0], 0));
    }

    fn record(received: f64, queued: f64, requests: f64, silence: f64) -> EngineFigures {
        EngineFigures {
            received,
            queued,
            requests,
            silence,
            allowance: 30_000.0,
            usage: 0.5,
        }
    }

    #[test]
    fn the_blend_takes_the_larger_figure_and_only_fresh_records() {
        let r = record(100.0, 640.0, -1.0, -1.0);
        assert!(r.fresh(115.0, 15.0) && !r.fresh(115.5, 15.0));
        assert_eq!(r.blocks(16.0, 1024.0), 40.0);
        // counted requests are priced at the router's mean request
        assert_eq!(
            record(100.0, 0.0, 3.0, -1.0).blocks(16.0, 320.0),
            3.0 * 20.0
        );
        assert_eq!(blend(LoadMode::Blend, Some(40.0), Some(50.0)), 50.0);
        assert_eq!(blend(LoadMode::Blend, Some(40.0), Some(30.0)), 40.0);
        assert_eq!(blend(LoadMode::Engine, Some(40.0), Some(50.0)), 40.0);
        assert_eq!(blend(LoadMode::Router, Some(40.0), Some(5.0)), 5.0);
        assert_eq!(blend(LoadMode::Blend, None, Some(5.0)), 5.0);
        assert_eq!(blend(LoadMode::Engine, None, None), 0.0);
    }

    #[test]
    fn usage_is_fresh_positive_and_capped() {
        let mut r = record(100.0, 0.0, -1.0, -1.0);
        assert_eq!(r.usage_at(110.0, 15.0), 0.5);
        assert_eq!(r.usage_at(116.0, 15.0), 0.0);
        r.usage = 2.0;
        assert_eq!(r.usage_at(110.0, 15.0), 1.0);
        r.usage = f64::NAN;
        assert_eq!(r.usage_at(110.0, 15.0), 0.0);
        assert!(
            record(0.0, 0.0, -1.0, 30_001.0).wedged() && !record(0.0, 0.0, -1.0, -1.0).wedged()
        );
    }

    /// (cost, load, worker) of a listed candidate.
    type Row<'a> = (f64, f64, &'a &'static str);
    /// No idle workers.
    type NoIdle = Option<fn() -> Result<Vec<&'static str>, ()>>;

    /// A pick with no idle worker and `draw` always the first of the tied.
    fn pick_listed(fp: &Footprint<&'static str>, listed: &[Row<'_>]) -> Placed<&'static str> {
        let none: NoIdle = None;
        fp.pick(listed, 0.0, none, |c| Ok(1.5 * c), |_| Ok(0))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn footprint_counts_decay_by_half_every_half_life_and_survive_rescaling() {
        let mut fp = Footprint::default();
        fp.add("a", 4.0);
        assert!((fp.count(&"a") - 1.0).abs() < 1e-12);
        for _ in 0..4 {
            fp.add("b", 4.0);
        }
        assert!((fp.count(&"a") - 0.5).abs() < 1e-12);
        // past the rescaling point the ratio holds, and a count decayed to nothing is dropped
        let mut gone = Vec::new();
        for _ in 0..2_000 {
            gone.extend(fp.add("b", 4.0));
        }
        assert!(gone.contains(&"a") && fp.len() == 1);
        let steady = 1.0 / (1.0 - 2f64.powf(-0.25));
        assert!((fp.count(&"b") / steady - 1.0).abs() < 1e-9);
        assert_eq!(fp.discard(&"b").map(|e| e.0), Some("b"));
        assert_eq!(fp.count(&"b"), 0.0);
    }

    #[test]
    fn the_pick_takes_the_fewest_placements_within_the_band_and_no_busier() {
        let mut fp = Footprint::default();
        for w in ["a", "a", "b"] {
            fp.add(w, 64.0);
        }
        // c is cheapest; a and b within 1.5x of it; d outside the band; all unloaded
        let listed = [
            (10.0, 0.0, &"a"),
            (12.0, 0.0, &"b"),
            (10.0, 0.0, &"c"),
            (16.0, 0.0, &"d"),
        ];
        assert_eq!(pick_listed(&fp, &listed), Placed::Listed(2));
        // c busier than the cheapest (a): never chosen, whatever its count
        let listed = [(10.0, 0.0, &"a"), (12.0, 1.0, &"c")];
        assert_eq!(pick_listed(&fp, &listed), Placed::Listed(0));
        // equal counts: the cheaper
        let listed = [(12.0, 0.0, &"c"), (10.0, 0.0, &"d")];
        assert_eq!(pick_listed(&fp, &listed), Placed::Listed(1));
    }

    #[test]
    fn ties_are_drawn_in_key_order_across_listed_and_idle_workers() {
        let mut fp = Footprint::default();
        fp.add("z", 64.0);
        // tied at count 0 and cost 5: listed "m" and "b", idle "a" and "q" (idle "z" has a count)
        let listed = [(5.0, 0.0, &"m"), (5.0, 0.0, &"z"), (5.0, 0.0, &"b")];
        let order: Vec<Placed<&str>> = (0..4)
            .map(|r| {
                let idle = Some(|| Ok::<_, ()>(vec!["q", "z", "a"]));
                fp.pick(&listed, 5.0, idle, Ok, |n| {
                    assert_eq!(n, 4);
                    Ok(r)
                })
                .unwrap()
                .unwrap()
            })
            .collect();
        let want = [
            Placed::Idle("a"),
            Placed::Listed(2),
            Placed::Listed(0),
            Placed::Idle("q"),
        ];
        assert_eq!(order, want);
        // an idle group dearer than the tied listed ones is not drawn from
        let idle = Some(|| Ok::<_, ()>(vec!["a"]));
        let got = fp.pick(&listed, 6.0, idle, |c| Ok(2.0 * c), |n| Ok(n - 1));
        assert_eq!(got, Ok(Some(Placed::Listed(0))));
        // the idle group eligible but empty (the fleet changed): nothing to pick
        let idle = Some(|| Ok::<_, ()>(Vec::new()));
        assert_eq!(fp.pick(&[], 6.0, idle, Ok, |_| Ok(0)), Ok(None));
    }
}
