//! `cargo fuzz run token_ids`: a store's token ids read by the vector reader (where the CPU has it)
//! and by the window walk give the same items and bytes, and both are rmp's reading of them: the
//! items are the leading uint-form items (fixint, uint 8 / 16 / 32) up to the cap.
//!
//! Input: the first byte picks the mode, the next two the cap. In the built mode each three input
//! bytes become one id of the form the first of them picks (mostly uint 16 / 32, as a vocabulary
//! sends them; an id below 256 or a raw byte now and then); in the raw mode the bytes are read as
//! they are.
#![no_main]

use kvroute_core::wire::both_readers;
use libfuzzer_sys::fuzz_target;
use rmp::decode::{self as rd, Bytes};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let Some((cap, rest)) = rest.split_first_chunk::<2>() else {
        return;
    };
    let max = usize::from(u16::from_le_bytes(*cap)) % 2048;
    let built;
    let buf: &[u8] = if mode & 1 == 0 {
        rest
    } else {
        let mut b = Vec::with_capacity(rest.len() * 3);
        for item in rest.chunks(3) {
            let v = item.iter().skip(1).fold(0u32, |a, &x| (a << 8) | u32::from(x));
            match item[0] % 16 {
                0 => {
                    rmp::encode::write_uint(&mut b, u64::from(v % 256)).unwrap();
                }
                1 => b.push(item[item.len() - 1]),
                2 => rmp::encode::write_u32(&mut b, v).unwrap(),
                3..=8 => rmp::encode::write_u16(&mut b, v as u16 | 0x100).unwrap(),
                _ => rmp::encode::write_u32(&mut b, v | 0x1_0000).unwrap(),
            }
        }
        built = b;
        &built
    };
    let [walk, vector] = both_readers(buf, max);
    assert_eq!(walk, vector);
    let (items, p) = walk;
    let mut r = Bytes::new(buf);
    let mut at = 0;
    for &v in &items {
        assert_eq!(rd::read_int::<i64, _>(&mut r).ok(), Some(v));
        at = buf.len() - r.remaining_slice().len();
    }
    assert_eq!(p, at);
    // Short of the cap, it stopped at an item it does not read or one the end cuts.
    if items.len() < max {
        if let Some(&m) = buf.get(p) {
            let body = match m {
                0..=0x7f => Some(0),
                0xcc => Some(1),
                0xcd => Some(2),
                0xce => Some(4),
                _ => None,
            };
            if let Some(w) = body {
                assert!(p + 1 + w > buf.len(), "stopped before a whole uint item at {p}");
            }
        }
    }
});
