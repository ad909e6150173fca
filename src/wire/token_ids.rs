//! Token ids: the leading run of uint-form items of a store's `token_ids`, the hot loop of a store's
//! decoding. A real vocabulary's ids from 256 up come as uint 16 or uint 32 at random, so a
//! store's ids are mostly those two forms, 3 or 5 bytes, in random order: where an item starts
//! depends on every item before it. Two readers, held to each other and to rmp by the tests:
//!
//! - `vbmi::Vbmi::step`, on CPUs with AVX-512 VBMI (Ice Lake, Sapphire Rapids, Zen 4 and later): all
//!   the items of a 64-byte window found and read with byte permutes;
//! - the window walk (`walk_window`, `exact_items`) everywhere, and for the windows the first
//!   refuses (an id below 256, the array's end, the payload's end).

use std::mem::MaybeUninit;

/// `UINT_WIDTH[marker]` when the marker is not a uint form a token id takes.
const NOT_UINT: u8 = u8::MAX;

/// Bytes after the marker for the uint forms token ids take (0: a positive fixint), by marker
/// byte; `NOT_UINT` for every other marker. msgpack's markers: 0x00-0x7f positive fixint, 0xcc
/// uint 8, 0xcd uint 16, 0xce uint 32 (the tests hold the table to rmp's `Marker::from_u8`).
const UINT_WIDTH: [u8; 256] = {
    let mut t = [NOT_UINT; 256];
    let mut b = 0;
    while b < 0x80 {
        t[b] = 0;
        b += 1;
    }
    t[0xcc] = 1;
    t[0xcd] = 2;
    t[0xce] = 4;
    t
};

/// Slots past a run's last item that a window read may write (its items are counted, the slots
/// after them are not): a caller that reserves them lets the run's last window go through the
/// vector reader too.
pub(super) const WRITE_SLACK: usize = 15;

/// Decode the leading run of uint-form items of `buf` (`UINT_WIDTH`'s forms) into `dst`'s spare
/// capacity, at most `max`, as many as fit: returns the bytes read (`dst`'s length grows by the
/// items). It stops at the cap, at any other marker, or at an item cut short by `buf`'s end.
///
/// Measured (session 25, 8,192 ids of a 150k vocabulary): the window walk 2.2 ns an id with the
/// payload in cache, 2.7 out of it; the vector reader 1.5 / 1.7. Into an index at its working
/// size the vector reader alone gained nothing: its windows waited on the payload's cache
/// misses, which the walk's longer chain had hidden. With the payload prefetched 512 bytes
/// ahead, a store's ingest into that index fell from ~112 to ~86 ns a block; the prefetch
/// alone, on the walk, changed nothing (docs/performance.md, "Session 25").
#[inline(never)]
pub(super) fn uint_run(buf: &[u8], dst: &mut Vec<i64>, max: usize) -> usize {
    read_run(buf, dst, max, true)
}

/// `uint_run`, the vector reader used where the CPU has it if `vector` (the tests run both).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn read_run(buf: &[u8], dst: &mut Vec<i64>, max: usize, vector: bool) -> usize {
    let spare = dst.spare_capacity_mut();
    let count = max.min(spare.len());
    let (mut p, mut i) = (0usize, 0usize);
    #[cfg(target_arch = "x86_64")]
    let vbmi = vbmi::Vbmi::detect().filter(|_| vector);
    while i < count {
        #[cfg(target_arch = "x86_64")]
        if let Some(vbmi) = vbmi {
            if let Some((q, k)) = vbmi.step(&buf[p..], &mut spare[i..], count - i) {
                p += q;
                i += k;
                continue;
            }
        }
        let walked = buf
            .get(p..p + WALK_BYTES)
            .and_then(|w| walk_window(w.try_into().ok()?, &mut spare[i..count]));
        let (q, k, stopped) = match walked {
            Some((q, k)) => (q, k, false),
            None => exact_items(&buf[p..], &mut spare[i..count]),
        };
        p += q;
        i += k;
        if stopped {
            break;
        }
    }
    // SAFETY: the readers initialised the first `i` slots of the spare capacity, in order, and
    // `i` cannot exceed it (a window read may write slots past its items, and a window a check
    // refused may have written past `i`, but `i` counts only the items taken). Filling the
    // buffer in place instead of zeroing it first (`vec![0; n]`) saves a memset of 8 bytes per
    // token id (64 KB for a 512-block store): callgrind, ~130 instructions per block of a
    // 512-block store.
    unsafe { dst.set_len(dst.len() + i) };
    p
}

/// Both readers' reading of `buf`, at most `max` items (into room for `max` and the slack, so
/// the vector reader runs wherever it can): `cargo fuzz run token_ids` holds them to each other
/// and to rmp. Built only for the fuzz targets.
#[cfg(fuzzing)]
pub fn both_readers(buf: &[u8], max: usize) -> [(Vec<i64>, usize); 2] {
    [false, true].map(|vector| {
        let mut out = Vec::with_capacity(max + WRITE_SLACK);
        let p = read_run(buf, &mut out, max, vector);
        (out, p)
    })
}

/// Items `walk_window` starts: those that start in a window's first 60 bytes (their marker bit
/// is in the window's 64, their 8-byte read in `WALK_BYTES`).
const WALK_ITEMS_BEFORE: usize = 60;
/// Bytes `walk_window` reads: a window of 64 and the reach of an 8-byte read at byte 59.
const WALK_BYTES: usize = 72;

/// Read the uint 16 / uint 32 items that start in `win`'s first 60 bytes into `out` (at most
/// its length): the bytes and items taken, or None (nothing taken) if any of them is another
/// form. Each item's place is the one before it plus 3, plus 2 if the uint 32 markers' bit there
/// is set: a shift, a mask and an add in registers. The places walked are checked against both
/// markers' bits once, after the walk, off that chain; the one window in which any is neither is
/// read again by `exact_items`.
#[inline(always)]
fn walk_window(win: &[u8; WALK_BYTES], out: &mut [MaybeUninit<i64>]) -> Option<(usize, usize)> {
    let (ce, cd) = marker_masks(win);
    let (mut q, mut k) = (0usize, 0usize);
    let mut walked = 0u64;
    while q < WALK_ITEMS_BEFORE && k < out.len() {
        let w = u64::from_be_bytes(win[q..q + 8].try_into().ok()?);
        // uint 16 (0xcd, `f` 0) or uint 32 (0xce, `f` 1): 3 or 5 bytes, the value the 16 or
        // 32 bits after the marker.
        let f = (ce >> q) & 1;
        walked |= 1 << q;
        out[k].write(((w << 8) >> (48 - 16 * f)) as i64);
        q += 3 + 2 * f as usize;
        k += 1;
    }
    (walked & !(ce | cd) == 0).then_some((q, k))
}

/// Where the uint 32 (0xce) and uint 16 (0xcd) markers are among `win`'s first 64 bytes: bit j
/// of each set where byte j is that marker. SSE2 (part of x86-64's baseline) compares 16 bytes
/// at a time, against `marker_bits`' 8: 2.2 against 2.6 ns an id (session 24).
#[inline(always)]
fn marker_masks(win: &[u8; WALK_BYTES]) -> (u64, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8,
        };
        let (mut ce, mut cd) = (0u64, 0u64);
        for k in 0..4 {
            // SAFETY: SSE2 is enabled on every x86-64 target; the unaligned load reads bytes
            // 16k..16k+16 of `win`, inside its 72.
            let bits = unsafe {
                let x = _mm_loadu_si128(win.as_ptr().add(16 * k).cast());
                (
                    _mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8(0xceu8 as i8))),
                    _mm_movemask_epi8(_mm_cmpeq_epi8(x, _mm_set1_epi8(0xcdu8 as i8))),
                )
            };
            // (each mask is 16 bits in the low half of an i32)
            ce |= u64::from(bits.0 as u16) << (16 * k);
            cd |= u64::from(bits.1 as u16) << (16 * k);
        }
        (ce, cd)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        (marker_bits(&win[..64], 0xce), marker_bits(&win[..64], 0xcd))
    }
}

/// Bit j set where `bytes[j]` (j < 64) is `marker`: a zero-byte test on 8 bytes at a time, each
/// byte's result gathered into one bit by a multiply (the bits land in distinct places). The
/// portable form of `marker_masks` (on x86-64 the tests hold the two to each other).
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline(always)]
fn marker_bits(bytes: &[u8], marker: u8) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let mut bits = 0u64;
    for (k, chunk) in bytes.chunks_exact(8).take(8).enumerate() {
        let mut le = [0u8; 8];
        le.copy_from_slice(chunk);
        let y = u64::from_le_bytes(le) ^ (u64::from(marker) * 0x0101_0101_0101_0101);
        // 0x80 in each byte of `y` that is zero (exact: no borrow from a neighbour).
        let zero = !(((y & LOW7) + LOW7) | y | LOW7);
        bits |= ((zero >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
    }
    bits
}

/// Read `buf`'s leading uint-form items one at a time into `out` (at most its length), until
/// past one window's worth of bytes: the bytes and items taken, and whether it stopped (at
/// another marker or an item cut short by the end).
fn exact_items(buf: &[u8], out: &mut [MaybeUninit<i64>]) -> (usize, usize, bool) {
    let (mut p, mut k) = (0usize, 0usize);
    while k < out.len() && p < WALK_ITEMS_BEFORE {
        let Some(&m) = buf.get(p) else {
            return (p, k, true);
        };
        let w = UINT_WIDTH[usize::from(m)];
        if w == NOT_UINT {
            return (p, k, true);
        }
        let Some(body) = buf.get(p + 1..p + 1 + usize::from(w)) else {
            return (p, k, true);
        };
        let v = if w == 0 {
            u64::from(m)
        } else {
            body.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
        };
        out[k].write(v as i64);
        p += 1 + usize::from(w);
        k += 1;
    }
    (p, k, false)
}

/// The vector reader, for CPUs with AVX-512 F, BW and VBMI.
#[cfg(target_arch = "x86_64")]
mod vbmi {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;
    use std::sync::OnceLock;

    /// Slots a window read writes: 16 items of 3 bytes reach past the 60 bytes a window takes.
    const ITEMS: usize = 16;
    const _: () = assert!(super::WRITE_SLACK == ITEMS - 1);

    /// How far ahead of a window the payload is prefetched. The hardware's own prefetch did not
    /// keep up with this reader (its windows waited on the payload's misses, session 25); 512
    /// and 1,024 bytes measured the same.
    const AHEAD: usize = 512;

    /// Proof that this CPU has the features `walk16` is compiled for: only `detect` makes one,
    /// so a reader holding it asks the CPU once, not once a window.
    #[derive(Clone, Copy)]
    pub(super) struct Vbmi(());

    impl Vbmi {
        /// The proof, where this CPU has AVX-512 F, BW and VBMI (asked once a process).
        pub(super) fn detect() -> Option<Vbmi> {
            static HAS: OnceLock<bool> = OnceLock::new();
            let has = *HAS.get_or_init(|| {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vbmi")
            });
            has.then_some(Vbmi(()))
        }

        /// Read the items that start in `buf`'s first 60 bytes, at most `want`: the bytes and
        /// items taken, or None (nothing taken) when `buf` is shorter than 64 bytes, `out` has
        /// fewer than 16 slots, or any item taken is another form. Writes `out`'s first 16
        /// slots; the first `items` hold the items.
        #[inline(always)]
        pub(super) fn step(
            self,
            buf: &[u8],
            out: &mut [MaybeUninit<i64>],
            want: usize,
        ) -> Option<(usize, usize)> {
            let win: &[u8; 64] = buf.get(..64)?.try_into().ok()?;
            let out: &mut [MaybeUninit<i64>; ITEMS] = out.get_mut(..ITEMS)?.try_into().ok()?;
            // SAFETY: SSE is part of x86-64's baseline, and a prefetch is a hint: it never
            // faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(buf.as_ptr().wrapping_add(AHEAD).cast()) };
            // SAFETY: `self` exists only where `detect` found AVX-512 F, BW and VBMI.
            unsafe { walk16(win, out, want) }
        }
    }

    /// Bytes 0..64 in order.
    const IOTA: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut j = 0;
        while j < 64 {
            t[j] = j as u8;
            j += 1;
        }
        t
    };

    /// `step`'s read of one window. `next[q]`, the place after an item at byte q (q + 3, or
    /// q + 5 at a uint 32 marker), is one vector; composing it with itself three times (a byte
    /// permute each) gives the place 2, 4 and 8 items on, and item j's place is those applied
    /// by j's bits to place 0: four permutes deep, where the walk is one step an item. The
    /// values are one byte permute of the window (each item's big-endian bytes into a
    /// little-endian u32 lane, a uint 16's top two bytes zeroed), widened to i64.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn walk16(
        win: &[u8; 64],
        out: &mut [MaybeUninit<i64>; ITEMS],
        want: usize,
    ) -> Option<(usize, usize)> {
        // SAFETY: 64 bytes from each 64-byte array.
        let (w, iota) = unsafe {
            (
                _mm512_loadu_si512(win.as_ptr().cast()),
                _mm512_loadu_si512(IOTA.as_ptr().cast()),
            )
        };
        let ce = _mm512_cmpeq_epi8_mask(w, _mm512_set1_epi8(0xceu8 as i8));
        let cd = _mm512_cmpeq_epi8_mask(w, _mm512_set1_epi8(0xcdu8 as i8));
        let next3 = _mm512_add_epi8(iota, _mm512_set1_epi8(3));
        // Places from 64 on wrap as permute indices: no item taken is reached through one, as
        // an item's place only grows along the chain that reaches it and a taken one is < 60.
        let n1 = _mm512_mask_add_epi8(next3, ce, next3, _mm512_set1_epi8(2));
        let n2 = _mm512_permutexvar_epi8(n1, n1);
        let n4 = _mm512_permutexvar_epi8(n2, n2);
        let n8 = _mm512_permutexvar_epi8(n4, n4);
        let mut pos = _mm512_setzero_si512();
        pos = _mm512_mask_permutexvar_epi8(pos, 0xaaaa, pos, n1);
        pos = _mm512_mask_permutexvar_epi8(pos, 0xcccc, pos, n2);
        pos = _mm512_mask_permutexvar_epi8(pos, 0xf0f0, pos, n4);
        pos = _mm512_mask_permutexvar_epi8(pos, 0xff00, pos, n8);
        // Taken: the items before the first that starts at byte 60 or later, at most `want`
        // (item 0 starts at 0, so at least one).
        let before = _mm512_cmplt_epu8_mask(pos, _mm512_set1_epi8(60)) & 0xffff;
        let taken = (before.trailing_ones() as usize).min(want);
        let taken_bits = (1u64 << taken) - 1;
        // Each taken item starts at a uint 16 or uint 32 marker; else the walk reads the window.
        let at_marker = _mm512_permutexvar_epi8(pos, _mm512_movm_epi8(ce | cd));
        if _mm512_test_epi8_mask(at_marker, at_marker) & taken_bits != taken_bits {
            return None;
        }
        let wide = _mm512_permutexvar_epi8(pos, _mm512_movm_epi8(ce));
        // Byte b of the values' vector is in u32 lane b / 4 (the shift moves no set bit of a
        // byte's neighbour into its low four): item j's place, and whether it is a uint 32, at
        // each byte of lane j.
        let lane = _mm512_and_si512(_mm512_srli_epi16::<2>(iota), _mm512_set1_epi8(0x0f));
        let place4 = _mm512_permutexvar_epi8(lane, pos);
        let wide4 = _mm512_movepi8_mask(_mm512_permutexvar_epi8(lane, wide));
        // Little-endian byte b of a uint 32 is at place + 4 - b; of a uint 16, at place + 2 - b
        // for b < 2, and zero above.
        let b = _mm512_and_si512(iota, _mm512_set1_epi8(3));
        let back = _mm512_mask_blend_epi8(
            wide4,
            _mm512_sub_epi8(_mm512_set1_epi8(2), b),
            _mm512_sub_epi8(_mm512_set1_epi8(4), b),
        );
        let keep = wide4 | 0x3333_3333_3333_3333;
        let vals = _mm512_maskz_permutexvar_epi8(keep, _mm512_add_epi8(place4, back), w);
        let lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(vals));
        let hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64::<1>(vals));
        // SAFETY: `out` is 16 i64 slots, 128 bytes: two unaligned 64-byte stores.
        unsafe {
            let o = out.as_mut_ptr().cast::<__m512i>();
            _mm512_storeu_si512(o, lo);
            _mm512_storeu_si512(o.add(1), hi);
        }
        // The bytes taken: the place after the last item taken. (Counting the taken uint 32s
        // from a mask instead was slower: it waits on the mask's move to a register.)
        let after = _mm512_permutexvar_epi8(pos, n1);
        let last = _mm512_permutexvar_epi8(_mm512_set1_epi8((taken - 1) as i8), after);
        Some((
            _mm_cvtsi128_si32(_mm512_castsi512_si128(last)) as u8 as usize,
            taken,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmp::decode::{self as rd, Bytes};
    use rmp::Marker;

    #[test]
    fn the_uint_width_table_is_rmps_classification() {
        for b in 0..=255u8 {
            let want = match Marker::from_u8(b) {
                Marker::FixPos(_) => 0,
                Marker::U8 => 1,
                Marker::U16 => 2,
                Marker::U32 => 4,
                _ => NOT_UINT,
            };
            assert_eq!(UINT_WIDTH[usize::from(b)], want, "marker {b:#x}");
        }
    }

    #[test]
    fn uint_run_reads_one_item_of_each_uint_marker_and_stops_at_any_other() {
        for b in 0..=255u8 {
            let mut buf = vec![b, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0];
            buf.resize(17, 0);
            let mut out = Vec::with_capacity(1);
            let p = uint_run(&buf, &mut out, 1);
            if UINT_WIDTH[usize::from(b)] == NOT_UINT {
                assert_eq!((p, out.len()), (0, 0), "marker {b:#x}");
                continue;
            }
            let mut r = Bytes::new(&buf);
            let want = rd::read_int::<i64, _>(&mut r).unwrap();
            assert_eq!(out, vec![want], "marker {b:#x}");
            assert_eq!(p, buf.len() - r.remaining_slice().len(), "marker {b:#x}");
        }
    }

    /// `uint_run` over `buf[..end]`, at most `max` items, by each reader (the vector one where
    /// this CPU has it) into a buffer of exactly `max` slots and one with `WRITE_SLACK` more:
    /// each takes what rmp takes reading every whole uint item up to the cap (`buf` holds uint
    /// items as `write_uint` writes them, then anything but a non-negative int), the same items
    /// (`values`' first ones) in the same bytes.
    fn run_as_rmp_reads(buf: &[u8], end: usize, max: usize, values: &[u64]) {
        let want = whole_items(&buf[..end], max);
        for (vector, slack) in [
            (false, 0),
            (false, WRITE_SLACK),
            (true, 0),
            (true, WRITE_SLACK),
        ] {
            let mut out = Vec::with_capacity(max + slack);
            let p = read_run(&buf[..end], &mut out, max, vector);
            let at = format!("vector {vector} slack {slack} end {end} max {max}");
            assert_eq!((out.len(), p), want, "{at}");
            for (i, &v) in out.iter().enumerate() {
                assert_eq!(v as u64, values[i], "{at} item {i}");
            }
        }
    }

    /// A fixed LCG's draws (the high 31 bits of each state), from `seed`.
    fn lcg(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            state >> 33
        }
    }

    /// rmp's reading of `buf`'s leading uint items (any form), at most `max`: how many, and the
    /// bytes they take.
    fn whole_items(buf: &[u8], max: usize) -> (usize, usize) {
        let mut r = Bytes::new(buf);
        let (mut n, mut at) = (0, 0);
        while n < max && rd::read_int::<u64, _>(&mut r).is_ok() {
            n += 1;
            at = buf.len() - r.remaining_slice().len();
        }
        (n, at)
    }

    #[test]
    fn uint_run_reads_what_rmp_reads_and_stops_short_of_the_end() {
        // Every uint form a token takes (fixint, uint 8/16/32, at their bounds), then a form it
        // does not (int 8); each prefix of the bytes, each cap on the count.
        let values: Vec<u64> = vec![
            0,
            1,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
            5,
        ];
        let mut buf = Vec::new();
        for &v in &values {
            rmp::encode::write_uint(&mut buf, v).unwrap();
        }
        rmp::encode::write_sint(&mut buf, -3).unwrap();
        for end in 0..=buf.len() {
            for max in [0, 1, 4, values.len(), values.len() + 1] {
                // It stops only at the cap, the int 8, or at an item the prefix cuts.
                run_as_rmp_reads(&buf, end, max, &values);
            }
        }
    }

    #[test]
    fn uint_run_reads_every_order_of_forms_as_rmp_does() {
        // Each form a token takes beside each other (uint 16 then 32 and the reverse, a fixint or
        // uint 8 between stretches), in sequences from a fixed LCG, then a form it does not take;
        // each prefix of the bytes, each cap on the count.
        let forms: [u64; 5] = [7, 200, 40_000, 3_000_000_000, 65_536];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200 {
            let mut values = Vec::new();
            let mut buf = Vec::new();
            for _ in 0..9 {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let v = forms[(state >> 33) as usize % forms.len()] + (state >> 60);
                rmp::encode::write_uint(&mut buf, v).unwrap();
                values.push(v);
            }
            rmp::encode::write_sint(&mut buf, -3).unwrap();
            for end in 0..=buf.len() {
                for max in [1, 2, 3, values.len()] {
                    run_as_rmp_reads(&buf, end, max, &values);
                }
            }
        }
    }

    #[test]
    fn marker_masks_agree_with_a_byte_by_byte_reading() {
        // Windows dense in both markers and their neighbours, at every offset of a buffer.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2_000 {
            let mut win = [0u8; WALK_BYTES];
            for b in win.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = [0xcd, 0xce, 0xcc, 0xcf, 0x4d, 0x4e, (state >> 40) as u8]
                    [(state >> 61) as usize % 7];
            }
            let want = |m: u8| (0..64).fold(0u64, |acc, j| acc | (u64::from(win[j] == m) << j));
            assert_eq!(marker_masks(&win), (want(0xce), want(0xcd)));
            assert_eq!(marker_bits(&win[..64], 0xce), want(0xce));
            assert_eq!(marker_bits(&win[..64], 0xcd), want(0xcd));
        }
    }

    #[test]
    fn uint_run_reads_long_runs_as_rmp_does_wherever_a_window_falls() {
        // Runs long enough for the window walk (a window is 72 bytes): mostly uint 16 / 32 at
        // random as a real vocabulary sends them, sometimes an id below 256 (fixint or uint 8)
        // or a value at a form's bound, then a form it does not take (int 8); every prefix of
        // the bytes, and caps that end inside a window.
        let mut next = lcg(0x9e37_79b9_7f4a_7c15);
        for round in 0..60 {
            let len = 20 + next() as usize % 60;
            let mut values = Vec::new();
            let mut buf = Vec::new();
            for _ in 0..len {
                let v = match next() % 40 {
                    0 if round % 3 == 0 => next() % 128,
                    1 if round % 3 == 0 => 128 + next() % 128,
                    2 => 0xce,
                    3 => 65_535,
                    4 => 65_536,
                    5 => u64::from(u32::MAX),
                    r if r < 22 => 256 + next() % 65_280,
                    _ => 65_536 + next() % 100_000,
                };
                rmp::encode::write_uint(&mut buf, v).unwrap();
                values.push(v);
            }
            rmp::encode::write_sint(&mut buf, -3).unwrap();
            for end in 0..=buf.len() {
                for max in [len, len / 2, len + 1, 13] {
                    // It takes every whole item up to the cap: it stops short only at the int 8
                    // or at an item the prefix cuts.
                    run_as_rmp_reads(&buf, end, max, &values);
                }
            }
        }
    }

    #[test]
    fn both_readers_read_long_runs_of_a_vocabulary_as_rmp_does() {
        // Stores' worth of ids (up to 600), mostly uint 16 / 32 with an id below 256 now and
        // then, and ids at each form's bounds, ended by a form a token does not take or by the
        // payload; caps below, at and past the run; the last 80 ends of the bytes (the windows
        // near the end) and a few inside.
        let mut next = lcg(0x2545_f491_4f6c_dd1d);
        for round in 0..40 {
            let len = 1 + next() as usize % 600;
            let small = [0, 50, 400][round % 3];
            let mut values = Vec::new();
            let mut buf = Vec::new();
            for _ in 0..len {
                let v = match next() % 1000 {
                    r if r < small => next() % 256,
                    1 => 255,
                    2 => 256,
                    3 => 65_535,
                    4 => 65_536,
                    5 => u64::from(u32::MAX),
                    _ => next() % 150_000,
                };
                rmp::encode::write_uint(&mut buf, v).unwrap();
                values.push(v);
            }
            if round % 2 == 0 {
                rmp::encode::write_sint(&mut buf, -3).unwrap();
                rmp::encode::write_str(&mut buf, "medium").unwrap();
            }
            let ends =
                (buf.len().saturating_sub(80)..=buf.len()).chain([buf.len() / 3, buf.len() / 2]);
            for end in ends {
                for max in [len, len + 1, len / 2, 17, 16, 15, 1] {
                    run_as_rmp_reads(&buf, end, max, &values);
                }
            }
        }
    }

    #[test]
    fn the_vector_reader_is_what_this_machine_runs() {
        // Which reader the tests above held to rmp: printed, so a run on a CPU without AVX-512
        // VBMI says it tested the walk alone.
        #[cfg(target_arch = "x86_64")]
        println!("vector reader: {}", vbmi::Vbmi::detect().is_some());
    }
}
