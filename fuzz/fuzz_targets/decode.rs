//! `cargo fuzz run decode`: any bytes through `wire::decode` give a batch or a DecodeError, never a
//! panic; under default and tight limits (the first byte picks them, so the corpus explores both).
#![no_main]

use kvroute_core::wire::{decode, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tight = Limits {
        max_events_per_batch: 2,
        max_blocks_per_event: 3,
        max_block_size: 4,
    };
    let (lim, payload) = match data.split_first() {
        Some((&b, rest)) if b & 1 == 1 => (tight, rest),
        _ => (Limits::default(), data),
    };
    if let Ok(batch) = decode(payload, &lim) {
        // Whatever decoded respects the caps it was decoded under.
        assert!(batch.events.len() as i128 <= lim.max_events_per_batch);
        let s = kvroute_core::wire::Summary::of(&batch);
        assert!(s.events == batch.events.len());
    }
});
