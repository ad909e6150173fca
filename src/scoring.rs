//! The Router's per-candidate scoring for the built-in `CostModel` (kvroute/_router.py's
//! `CostModel.credited_blocks` / `CostModel.cost`, `Router._scored` and the zero-temperature half
//! of `Router._pick`), float operation for float operation, so the compiled path prices and ties
//! exactly as the Python path does (tests/test_router_scoring.py holds them to it).
//!
//! Nothing here knows Python: src/py/router.rs reads the model's weights off the Python object
//! and hands the index's answer in.

/// The built-in cost model's weights (read from the Python `CostModel` each call).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    pub overlap_weight: f64,
    pub cpu_credit: f64,
    pub disk_credit: f64,
    pub external_credit: f64,
    /// weight of what a candidate's prefill evicts on a cache under pressure (`CostModel.eviction_weight`)
    pub eviction_weight: f64,
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

    /// A candidate's cost: ``overlap_weight * prefill_blocks + load_blocks``.
    pub fn cost(&self, prefill_blocks: f64, load_blocks: f64) -> f64 {
        self.overlap_weight * prefill_blocks + load_blocks
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

/// The zero-temperature choice (`Router._pick`): the entries within the tie margin of the least
/// cost, and how many idle workers tie with them. The caller draws one uniformly.
pub fn ties(costs: &[f64], idle_count: usize, idle_cost: f64) -> (Vec<usize>, usize) {
    let mut best = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if idle_count > 0 {
        best = best.min(idle_cost);
    }
    let margin = TIE_EPS * best.abs().max(1.0);
    let tied = costs
        .iter()
        .enumerate()
        .filter(|(_, &c)| c - best <= margin)
        .map(|(i, _)| i)
        .collect();
    let idle_tied = if idle_count > 0 && idle_cost - best <= margin {
        idle_count
    } else {
        0
    };
    (tied, idle_tied)
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
    fn ties_within_the_margin_include_idle_workers() {
        let (tied, idle) = ties(&[3.0, 2.0, 2.0 + 1e-12, 5.0], 4, 2.0);
        assert_eq!((tied, idle), (vec![1, 2], 4));
        let (tied, idle) = ties(&[1.0], 4, 2.0);
        assert_eq!((tied, idle), (vec![0], 0));
    }
}
