//! xxh3-64 (default secret, seed 0) of frame payloads, with the long-input loop vectorized for
//! the CPU it runs on.
//!
//! The `xxhash-rust` crate fixes its SIMD width when it is compiled, so a portable x86-64 build
//! hashes with SSE2: one frame checksum on each side cost the transfer about a fifth of its time
//! (`tandem bench kv-transfer` prints both rates). This module computes the same function with
//! AVX-512 or AVX2, picked at run time (capped by `TANDEM_ISA`), for inputs over 240 bytes (every
//! KV frame); shorter inputs and other CPUs go to the crate. The tests compare the two on every length up to a few blocks
//! and on random inputs.

// Off x86-64 every input goes to the crate: the constants and the merge serve the x86 loops.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use xxhash_rust::xxh3::xxh3_64 as crate_xxh3_64;

/// The xxh3 default secret (the "kSecret" of the xxHash specification).
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

const INITIAL_ACC: [u64; 8] = [
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
];

const STRIPE: usize = 64;
/// Stripes between scrambles: (secret length − stripe) / 8 bytes of secret consumed per stripe.
const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
/// Inputs longer than this take the accumulator loop; shorter ones have their own mixes.
const MIDSIZE_MAX: usize = 240;
/// Secret offsets of the last stripe and of the final merge.
const LAST_STRIPE_SECRET: usize = SECRET.len() - STRIPE - 7;
const MERGE_SECRET: usize = 11;

/// xxh3-64 of `data`, the same value as `xxhash_rust::xxh3::xxh3_64`.
pub fn xxh3_64(data: &[u8]) -> u64 {
    if data.len() > MIDSIZE_MAX {
        #[cfg(target_arch = "x86_64")]
        {
            let cap = level_cap();
            if cap >= 2 && std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked above).
                return merge(unsafe { x86::accumulate_avx512(data) }, data.len());
            }
            if cap >= 1 && std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked above).
                return merge(unsafe { x86::accumulate_avx2(data) }, data.len());
            }
        }
    }
    crate_xxh3_64(data)
}

/// The widest vectors `TANDEM_ISA` allows (0: the crate's portable code, 1: AVX2, 2: AVX-512), so
/// a process capped for testing hashes on that level too. The kernels crate owns the variable and
/// refuses unknown names at startup; this leaf crate only reads the cap (an unknown name: none).
#[cfg(target_arch = "x86_64")]
fn level_cap() -> u8 {
    static CAP: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        match std::env::var("TANDEM_ISA")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .as_str()
        {
            "scalar" | "portable" => 0,
            "avx2" => 1,
            _ => 2,
        }
    })
}

fn read64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The accumulators folded into the hash.
fn merge(acc: [u64; 8], len: usize) -> u64 {
    let mut h = (len as u64).wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let a = acc[2 * i] ^ read64(&SECRET, MERGE_SECRET + 16 * i);
        let b = acc[2 * i + 1] ^ read64(&SECRET, MERGE_SECRET + 16 * i + 8);
        let p = a as u128 * b as u128;
        h = h.wrapping_add(p as u64 ^ (p >> 64) as u64);
    }
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::STRIPES_PER_BLOCK;
    use super::{BLOCK, INITIAL_ACC, LAST_STRIPE_SECRET, PRIME32_1, SECRET, STRIPE};

    /// Every stripe of `data` (longer than [`super::MIDSIZE_MAX`]) into the eight accumulators,
    /// one 512-bit register.
    ///
    /// # Safety
    /// The CPU supports AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate_avx512(data: &[u8]) -> [u64; 8] {
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn stripe(acc: __m512i, input: *const u8, secret: *const u8) -> __m512i {
            let d = _mm512_loadu_si512(input.cast());
            let k = _mm512_xor_si512(d, _mm512_loadu_si512(secret.cast()));
            let product = _mm512_mul_epu32(k, _mm512_srli_epi64::<32>(k));
            // Lane i gets input lane i ^ 1.
            let swapped = _mm512_shuffle_epi32::<0x4E>(d);
            _mm512_add_epi64(product, _mm512_add_epi64(acc, swapped))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn scramble(acc: __m512i, secret: *const u8) -> __m512i {
            let a = _mm512_xor_si512(acc, _mm512_srli_epi64::<47>(acc));
            let a = _mm512_xor_si512(a, _mm512_loadu_si512(secret.cast()));
            let p = _mm512_set1_epi64(PRIME32_1 as i64);
            let lo = _mm512_mul_epu32(a, p);
            let hi = _mm512_mul_epu32(_mm512_srli_epi64::<32>(a), p);
            _mm512_add_epi64(lo, _mm512_slli_epi64::<32>(hi))
        }
        let n = data.len();
        let (input, secret) = (data.as_ptr(), SECRET.as_ptr());
        let mut acc = _mm512_loadu_si512(INITIAL_ACC.as_ptr().cast());
        let blocks = (n - 1) / BLOCK;
        for b in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                acc = stripe(acc, input.add(b * BLOCK + s * STRIPE), secret.add(s * 8));
            }
            acc = scramble(acc, secret.add(SECRET.len() - STRIPE));
        }
        for s in 0..((n - 1) - blocks * BLOCK) / STRIPE {
            acc = stripe(
                acc,
                input.add(blocks * BLOCK + s * STRIPE),
                secret.add(s * 8),
            );
        }
        acc = stripe(acc, input.add(n - STRIPE), secret.add(LAST_STRIPE_SECRET));
        let mut out = [0u64; 8];
        _mm512_storeu_si512(out.as_mut_ptr().cast(), acc);
        out
    }

    /// As [`accumulate_avx512`] in two 256-bit registers.
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn accumulate_avx2(data: &[u8]) -> [u64; 8] {
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn stripe(acc: &mut [__m256i; 2], input: *const u8, secret: *const u8) {
            for (h, a) in acc.iter_mut().enumerate() {
                let d = _mm256_loadu_si256(input.add(32 * h).cast());
                let k = _mm256_xor_si256(d, _mm256_loadu_si256(secret.add(32 * h).cast()));
                let product = _mm256_mul_epu32(k, _mm256_srli_epi64::<32>(k));
                let swapped = _mm256_shuffle_epi32::<0x4E>(d);
                *a = _mm256_add_epi64(product, _mm256_add_epi64(*a, swapped));
            }
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn scramble(acc: &mut [__m256i; 2], secret: *const u8) {
            let p = _mm256_set1_epi64x(PRIME32_1 as i64);
            for (h, a) in acc.iter_mut().enumerate() {
                let x = _mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a));
                let x = _mm256_xor_si256(x, _mm256_loadu_si256(secret.add(32 * h).cast()));
                let lo = _mm256_mul_epu32(x, p);
                let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(x), p);
                *a = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
            }
        }
        let n = data.len();
        let (input, secret) = (data.as_ptr(), SECRET.as_ptr());
        let init = INITIAL_ACC.as_ptr();
        let mut acc = [
            _mm256_loadu_si256(init.cast()),
            _mm256_loadu_si256(init.add(4).cast()),
        ];
        let blocks = (n - 1) / BLOCK;
        for b in 0..blocks {
            for s in 0..STRIPES_PER_BLOCK {
                stripe(
                    &mut acc,
                    input.add(b * BLOCK + s * STRIPE),
                    secret.add(s * 8),
                );
            }
            scramble(&mut acc, secret.add(SECRET.len() - STRIPE));
        }
        for s in 0..((n - 1) - blocks * BLOCK) / STRIPE {
            stripe(
                &mut acc,
                input.add(blocks * BLOCK + s * STRIPE),
                secret.add(s * 8),
            );
        }
        stripe(
            &mut acc,
            input.add(n - STRIPE),
            secret.add(LAST_STRIPE_SECRET),
        );
        let mut out = [0u64; 8];
        _mm256_storeu_si256(out.as_mut_ptr().cast(), acc[0]);
        _mm256_storeu_si256(out.as_mut_ptr().add(4).cast(), acc[1]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{RngCore, SeedableRng};

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; n];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
        v
    }

    #[test]
    fn equals_the_crate_on_every_length_up_to_three_blocks() {
        let data = bytes(3 * BLOCK + 2 * STRIPE, 1);
        for n in 0..=data.len() {
            assert_eq!(xxh3_64(&data[..n]), crate_xxh3_64(&data[..n]), "length {n}");
        }
    }

    #[test]
    fn both_vector_widths_equal_the_crate_on_frame_sizes() {
        // 24576 B: one f32 layer of a 16-token block of SmolLM2 (3 KV heads × 64 × K and V).
        for n in [241, 1024, 1025, 24576, 12288 + 96, 100_003] {
            let data = bytes(n, n as u64);
            let want = crate_xxh3_64(&data);
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: checked just above.
                    assert_eq!(merge(unsafe { x86::accumulate_avx512(&data) }, n), want);
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: checked just above.
                    assert_eq!(merge(unsafe { x86::accumulate_avx2(&data) }, n), want);
                }
            }
            assert_eq!(xxh3_64(&data), want);
        }
    }

    proptest! {
        #[test]
        fn random_inputs_equal_the_crate(data in proptest::collection::vec(any::<u8>(), 0..6000)) {
            prop_assert_eq!(xxh3_64(&data), crate_xxh3_64(&data));
        }
    }
}
