//! Matrix products on Intel AMX tiles at f32 accuracy.
//!
//! AMX multiplies bf16 tiles into f32 accumulators (16×16 outputs, 32 products deep, per
//! instruction) about twenty times faster than AVX-512 FMAs on the same core. bf16 keeps only 8
//! significant bits, so both operands are split into three bf16 *limbs* by truncation: `v = v0 +
//! v1 + v2`, exact for any f32 (8 + 8 + 8 bits). Products of bf16 numbers are exact in f32, and the
//! limb products below f32's precision (`i + j ≥ 3`, each under 2⁻²⁴ of the leading one) are
//! skipped, which leaves six tile products per output tile and step of 32: the result is as close
//! to the exact dot product as an f32 FMA loop is. So the engine stays token-exact against its f32
//! reference while prefill and batched decode run several times faster.
//!
//! Nothing is packed at load: a product reads the weights as stored (4-8 bits per weight when
//! quantized), and each task decodes and splits its 64 weight rows into a small buffer that stays
//! in cache while the task's tokens pass over it. The weights are the A operand (row-major limb
//! planes, as decoded), the activations the B operand (split and laid out in the tiles' pair
//! layout once per call), so neither side needs a transpose on the way in; the 16×16 results are
//! transposed on the way out. The tile registers are driven by inline assembly (the intrinsics are
//! not stable Rust). Linux hands AMX state to a process only after
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)`, which [`available`] asks for once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::isa::{self, Isa};
use crate::Weight;

/// Rows and columns of a tile as used here: 16 rows of 64 bytes (32 bf16 or 16 f32).
const TILE: usize = 16;
/// Depth of one tile product: 32 bf16 values per row.
const DEPTH: usize = 32;
/// u16 elements of one bf16 tile.
const TILE_ELEMS: usize = TILE * DEPTH;
/// Limbs per operand.
const LIMBS: usize = 3;
/// Activation rows one task covers: its weight rows are decoded once per this many tokens.
const TOKEN_BLOCK: usize = 256;
/// Weight rows (output columns) per rayon task: two tiles per kernel call.
const COLS_PER_TASK: usize = 64;

/// Whether [`set_enabled`] has spoken, and what it said (else `TANDEM_AMX` decides).
static SET: AtomicBool = AtomicBool::new(false);
static ENABLED: AtomicBool = AtomicBool::new(false);

/// The variable that turns the tiles on: `TANDEM_AMX=1`.
pub const ENV: &str = "TANDEM_AMX";

/// Whether products may take the tiles in this process: the kernel level is [`Isa::Amx`] (the
/// CPU has the tiles and `TANDEM_ISA` does not cap below them) and the OS granted the tile state
/// (asked once).
pub fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    isa::active() >= Isa::Amx && *GRANTED.get_or_init(request_tile_state)
}

/// Whether products take the AMX path now: [`available`] and switched on, by [`set_enabled`] or
/// else by `TANDEM_AMX=1`.
///
/// Off by default: the tiles sum their limb products in another order than the vector kernels'
/// one order ([`crate::simd::panel_product`]), and they only pay from 16 rows up, so a row's bits would
/// depend on whether its batch reached 16 rows: a seeded request would no longer give the same
/// samples whatever else runs. Turning them on trades that promise for prefill throughput.
pub fn active() -> bool {
    static FROM_ENV: OnceLock<bool> = OnceLock::new();
    let on = if SET.load(Ordering::Relaxed) {
        ENABLED.load(Ordering::Relaxed)
    } else {
        *FROM_ENV.get_or_init(|| std::env::var(ENV).is_ok_and(|v| v.trim() == "1"))
    };
    on && available()
}

/// Switches the AMX path on or off for the whole process, over `TANDEM_AMX`: layers built after
/// it follow ([`crate::Linear`] decides at construction), and products of layers built with the
/// tiles stop taking them while it is off.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
    SET.store(true, Ordering::Relaxed);
}

/// Whether the CPU has the AMX bf16 tiles and AVX512-BF16 (whose conversion the limb split
/// uses; every CPU with AMX has it). The caller has checked AVX-512 F/BW/VL.
#[cfg(target_arch = "x86_64")]
pub(crate) fn cpu_has_tiles() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if !is_x86_feature_detected!("avx512bf16") {
        return false;
    }
    // SAFETY: cpuid is available on every x86-64 CPU (the call is safe in newer Rust).
    #[allow(unused_unsafe)]
    let leaf7 = unsafe { __cpuid_count(7, 0) };
    leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0
}

/// Linux hands the tile state to a process only when asked.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: asks the kernel for permission to use the tile data state; no memory is passed.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_state() -> bool {
    false
}

/// `v` as three bf16 limbs (raw bits) whose exact sum is `v`: each is the top 8 significant bits
/// of what the ones before it left.
#[inline]
fn limbs(v: f32) -> [u16; LIMBS] {
    let l0 = v.to_bits() & 0xFFFF_0000;
    let r1 = v - f32::from_bits(l0);
    let l1 = r1.to_bits() & 0xFFFF_0000;
    let r2 = r1 - f32::from_bits(l1);
    [
        (l0 >> 16) as u16,
        (l1 >> 16) as u16,
        (r2.to_bits() >> 16) as u16,
    ]
}

/// One 64-byte-aligned bf16 tile (what `tileloadd` reads fastest).
#[derive(Clone)]
#[repr(C, align(64))]
struct Tile([u16; TILE_ELEMS]);

/// Whether the tile kernels take `w`: rows a multiple of 32 (two tiles per kernel call) and
/// columns a multiple of 32 (the depth of one tile product).
pub fn fits(w: &Weight) -> bool {
    let (rows, cols) = (w.rows(), w.cols());
    rows > 0 && rows.is_multiple_of(2 * TILE) && cols.is_multiple_of(DEPTH)
}

/// Activation rows `x` (`rows × k`) split into limbs and laid out as B tiles, padded with zero
/// rows to `padded`: for each group of 16 rows and each 32 columns, three tiles (one per limb)
/// whose row `p` holds the pairs `(x[r][2p], x[r][2p+1])` of the group's 16 rows.
fn pack_b(x: &[f32], rows: usize, padded: usize, k: usize) -> Vec<Tile> {
    let per_group = k / DEPTH * LIMBS;
    let mut tiles = vec![Tile([0; TILE_ELEMS]); padded / TILE * per_group];
    tiles
        .par_chunks_mut(per_group)
        .enumerate()
        .for_each(|(g, group)| {
            let mut l = [[0u16; DEPTH]; LIMBS];
            for r in 0..TILE.min(rows.saturating_sub(g * TILE)) {
                let i = g * TILE + r;
                for (c, vals) in x[i * k..(i + 1) * k].chunks_exact(DEPTH).enumerate() {
                    let [l0, l1, l2] = &mut l;
                    split_limbs(vals, l0, l1, l2);
                    // Pair p of this row goes to row p, column r of each limb's tile.
                    for (li, limb) in l.iter().enumerate() {
                        let tile = &mut group[c * LIMBS + li].0;
                        for p in 0..DEPTH / 2 {
                            tile[p * DEPTH + 2 * r] = limb[2 * p];
                            tile[p * DEPTH + 2 * r + 1] = limb[2 * p + 1];
                        }
                    }
                }
            }
        });
    tiles
}

/// `v` split into three limb planes (bf16 bits): `l0[i] + l1[i] + l2[i] = v[i]` exactly.
fn split_limbs(v: &[f32], l0: &mut [u16], l1: &mut [u16], l2: &mut [u16]) {
    assert!(l0.len() >= v.len() && l1.len() >= v.len() && l2.len() >= v.len());
    #[cfg(target_arch = "x86_64")]
    if available() {
        let n = v.len() / 32 * 32;
        // SAFETY: `available` checked AVX-512F and AVX512-BF16; each plane holds `n` values
        // (asserted above).
        unsafe { split_limbs_bf16(&v[..n], l0, l1, l2) };
        for i in n..v.len() {
            [l0[i], l1[i], l2[i]] = limbs(v[i]);
        }
        return;
    }
    for (i, &x) in v.iter().enumerate() {
        [l0[i], l1[i], l2[i]] = limbs(x);
    }
}

/// [`split_limbs`] for a multiple of 32 values.
///
/// # Safety
/// AVX-512F and AVX512-BF16 are available; each plane holds `v.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn split_limbs_bf16(v: &[f32], l0: &mut [u16], l1: &mut [u16], l2: &mut [u16]) {
    use std::arch::x86_64::*;
    for i in (0..v.len()).step_by(32) {
        let (lo, hi) = (
            _mm512_loadu_ps(v.as_ptr().add(i)),
            _mm512_loadu_ps(v.as_ptr().add(i + 16)),
        );
        let (p0, p1, p2) = (l0.as_mut_ptr(), l1.as_mut_ptr(), l2.as_mut_ptr());
        store_limbs32(lo, hi, p0.add(i), p1.add(i), p2.add(i));
    }
}

/// Splits 32 values (`lo` then `hi`) into limbs, as [`limbs`] does, and stores each limb's 32
/// bf16 at its pointer. The bf16 conversion is exact: the first two limbs have their low 16 bits
/// clear, and the last has at most 8 significant bits.
///
/// # Safety
/// AVX-512F and AVX512-BF16 are available; each pointer is valid for 32 u16 writes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn store_limbs32(
    lo: std::arch::x86_64::__m512,
    hi: std::arch::x86_64::__m512,
    p0: *mut u16,
    p1: *mut u16,
    p2: *mut u16,
) {
    use std::arch::x86_64::*;
    let (a0, a1, a2) = split3(lo);
    let (b0, b1, b2) = split3(hi);
    for (p, l, h) in [(p0, a0, b0), (p1, a1, b1), (p2, a2, b2)] {
        let packed: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(h, l));
        _mm512_storeu_si512(p.cast(), packed);
    }
}

/// The three limbs of sixteen values, as f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn split3(
    x: std::arch::x86_64::__m512,
) -> (
    std::arch::x86_64::__m512,
    std::arch::x86_64::__m512,
    std::arch::x86_64::__m512,
) {
    use std::arch::x86_64::*;
    let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let h0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), mask));
    let r1 = _mm512_sub_ps(x, h0);
    let h1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), mask));
    (h0, h1, _mm512_sub_ps(r1, h1))
}

/// Tile configuration (palette 1): tiles 0-7 all 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    reserved2: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    reserved2: [0; 16],
};

/// `out[m×n] = x[m×k] · Wᵀ` on the tiles. The caller checked shapes, [`fits`] and [`active`].
pub(crate) fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    debug_assert!(x.len() == m * k && out.len() == m * n && fits(w));
    // Token tiles go in pairs.
    let mp = m.div_ceil(2 * TILE) * 2 * TILE;
    let xt = pack_b(x, m, mp, k);
    let dst = crate::matmul::OutPtr(out.as_mut_ptr());
    let chunks = k / DEPTH;
    let plane = COLS_PER_TASK * k;
    let tasks = n.div_ceil(COLS_PER_TASK);
    let blocks = mp.div_ceil(TOKEN_BLOCK);
    (0..tasks * blocks).into_par_iter().for_each(|task| {
        TASK_BUFFERS.with_borrow_mut(|(row, wbuf)| {
            row.resize(COLS_PER_TASK * k, 0.0);
            let tiles = (LIMBS * plane).div_ceil(TILE_ELEMS);
            if wbuf.len() < tiles {
                wbuf.resize(tiles, Tile([0; TILE_ELEMS]));
            }
            let (tb, tc) = (task / tasks, task % tasks);
            let r0 = tc * COLS_PER_TASK;
            let rows = COLS_PER_TASK.min(n - r0);
            // This task's weight rows as limb planes `[limb][row][k]`.
            // SAFETY: `Tile` is plain u16s; the buffer holds LIMBS·plane of them.
            let wl: &mut [u16] = unsafe {
                std::slice::from_raw_parts_mut(wbuf.as_mut_ptr().cast(), wbuf.len() * TILE_ELEMS)
            };
            let (p0, rest) = wl.split_at_mut(plane);
            let (p1, p2) = rest.split_at_mut(plane);
            w.rows_f32(r0, rows, row);
            for r in 0..rows {
                let at = r * k..(r + 1) * k;
                split_limbs(
                    &row[at.clone()],
                    &mut p0[at.clone()],
                    &mut p1[at.clone()],
                    &mut p2[at],
                );
            }
            let t_end = ((tb + 1) * TOKEN_BLOCK).min(mp) / TILE;
            // SAFETY: `available` established AMX support and permission; the tile config
            // is loaded before and released after this task's tile instructions.
            unsafe { tile_config() };
            for p in (0..rows).step_by(2 * TILE) {
                let a = wl[p * k..].as_ptr();
                for t in (tb * TOKEN_BLOCK / TILE..t_end).step_by(2) {
                    let b0 = xt[t * chunks * LIMBS..].as_ptr().cast::<u16>();
                    let b1 = xt[(t + 1) * chunks * LIMBS..].as_ptr().cast::<u16>();
                    let mut c = std::mem::MaybeUninit::<Scratch>::uninit();
                    // SAFETY: `a` starts 32 rows of three limb planes of `plane` values; b0/b1
                    // start `chunks` × 3 tiles each; the scratch holds four 16×16 f32 tiles.
                    // The kernel stores all four tiles.
                    let c = unsafe {
                        kernel(a, plane, 2 * k, b0, b1, chunks, c.as_mut_ptr().cast());
                        c.assume_init()
                    };
                    for (i, tile) in c.0.chunks_exact(TILE * TILE).enumerate() {
                        // Tile i: weight rows p + 16·(i/2).., tokens (t + i%2)·16.. .
                        let (col, tt) = (r0 + p + TILE * (i / 2), t + i % 2);
                        for tok in 0..TILE.min(m.saturating_sub(tt * TILE)) {
                            let mut line = [0f32; TILE];
                            for (r, v) in line.iter_mut().enumerate() {
                                *v = tile[r * TILE + tok];
                            }
                            // SAFETY: token tt·16+tok < m; columns col..col+16 ≤ n are this
                            // task's weight rows, which no other task writes for this token block.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    line.as_ptr(),
                                    dst.at((tt * TILE + tok) * n + col),
                                    TILE,
                                )
                            };
                        }
                    }
                }
            }
            // SAFETY: releases this thread's tile state (configured above).
            unsafe { tile_release() };
        })
    });
}

/// Other architectures have no tiles: [`available`] is false there, so nothing calls these.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_config() {
    unreachable!("AMX tiles exist on x86-64 only")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_release() {}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(
    _: *const u16,
    _: usize,
    _: usize,
    _: *const u16,
    _: *const u16,
    _: usize,
    _: *mut f32,
) {
    unreachable!("AMX tiles exist on x86-64 only")
}

thread_local! {
    /// A task's f32 row scratch and weight limb planes, kept per thread across calls.
    static TASK_BUFFERS: std::cell::RefCell<(Vec<f32>, Vec<Tile>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Four f32 output tiles of one kernel call, 64-byte aligned.
#[repr(C, align(64))]
struct Scratch([f32; 4 * TILE * TILE]);

/// # Safety
/// AMX is available and permitted for this process.
#[cfg(target_arch = "x86_64")]
unsafe fn tile_config() {
    std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack));
}

/// # Safety
/// As [`tile_config`].
#[cfg(target_arch = "x86_64")]
unsafe fn tile_release() {
    std::arch::asm!("tilerelease", options(nostack, nomem));
}

/// Two A tiles (`a` and 16 rows further) times two B tiles (`b0`, `b1`) over every 32-deep chunk,
/// with the six limb products `i + j ≤ 2`; the four 16×16 results go to `c` in order (a,b0)
/// (a,b1) (a+16,b0) (a+16,b1).
///
/// `a` is limb 0 of the first A tile; limb `l` is `plane · l` elements further; rows are `stride`
/// bytes apart. Each of b0/b1 is `chunks` runs of three limb tiles.
///
/// # Safety
/// The tile config is loaded; every tile read and the 4 KiB at `c` are inside their buffers.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    a: *const u16,
    plane: usize,
    stride: usize,
    b0: *const u16,
    b1: *const u16,
    chunks: usize,
    c: *mut f32,
) {
    use std::arch::asm;
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
    // Second A tile: 16 rows further.
    let a_next = a.add(TILE * stride / 2);
    for ch in 0..chunks {
        let a0 = a.add(ch * DEPTH);
        let (a1, a2) = (a0.add(plane), a0.add(2 * plane));
        let (n0, n1, n2) = (
            a_next.add(ch * DEPTH),
            a_next.add(ch * DEPTH + plane),
            a_next.add(ch * DEPTH + 2 * plane),
        );
        let (w0, w1) = (
            b0.add(ch * LIMBS * TILE_ELEMS),
            b1.add(ch * LIMBS * TILE_ELEMS),
        );
        asm!(
            // (0,0)
            "tileloadd tmm4, [{a0} + {s}*1]",
            "tileloadd tmm5, [{n0} + {s}*1]",
            "tileloadd tmm6, [{w0} + {t}*1]",
            "tileloadd tmm7, [{w1} + {t}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // (0,1)
            "tileloadd tmm6, [{w0} + {t}*1 + 1024]",
            "tileloadd tmm7, [{w1} + {t}*1 + 1024]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // (0,2)
            "tileloadd tmm6, [{w0} + {t}*1 + 2048]",
            "tileloadd tmm7, [{w1} + {t}*1 + 2048]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // (1,1)
            "tileloadd tmm4, [{a1} + {s}*1]",
            "tileloadd tmm5, [{n1} + {s}*1]",
            "tileloadd tmm6, [{w0} + {t}*1 + 1024]",
            "tileloadd tmm7, [{w1} + {t}*1 + 1024]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // (1,0)
            "tileloadd tmm6, [{w0} + {t}*1]",
            "tileloadd tmm7, [{w1} + {t}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            // (2,0)
            "tileloadd tmm4, [{a2} + {s}*1]",
            "tileloadd tmm5, [{n2} + {s}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            a0 = in(reg) a0,
            a1 = in(reg) a1,
            a2 = in(reg) a2,
            n0 = in(reg) n0,
            n1 = in(reg) n1,
            n2 = in(reg) n2,
            w0 = in(reg) w0,
            w1 = in(reg) w1,
            s = in(reg) stride,
            t = in(reg) 64usize,
            options(nostack, readonly)
        );
    }
    asm!(
        "tilestored [{c} + {t}*1], tmm0",
        "tilestored [{c} + {t}*1 + 1024], tmm1",
        "tilestored [{c} + {t}*1 + 2048], tmm2",
        "tilestored [{c} + {t}*1 + 3072], tmm3",
        c = in(reg) c,
        t = in(reg) 64usize,
        options(nostack)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::{quantize_q4_1, quantize_q8_0, GgmlType};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    proptest! {
        #[test]
        fn limbs_add_up_to_the_value_exactly(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            // Normal numbers well inside the range (activations and weights are).
            prop_assume!(v.is_normal() && v.abs() > 1e-30 && v.abs() < 1e30);
            let [a, b, c] = limbs(v).map(|l| f32::from_bits((l as u32) << 16));
            prop_assert_eq!((a as f64) + (b as f64) + (c as f64), v as f64);
        }
    }

    /// Every output within f32 accumulation error of the exact product (f64 over the weights as
    /// decoded), on shapes with partial token tiles and an odd tile count.
    #[test]
    fn tile_products_match_the_exact_ones() {
        if !available() {
            eprintln!("AMX is not available on this CPU: the tile kernels were not run");
            return;
        }
        let (n, k) = (96, 160);
        let wf = rnd(n * k, 3);
        let weights = [
            Weight::F32 {
                data: wf.clone(),
                rows: n,
                cols: k,
            },
            Weight::quant(GgmlType::Q4_1, &quantize_q4_1(&wf), n, k).unwrap(),
            Weight::quant(GgmlType::Q8_0, &quantize_q8_0(&wf), n, k).unwrap(),
        ];
        for w in &weights {
            assert!(fits(w));
            let mut dense = vec![0f32; n * k];
            for r in 0..n {
                w.row_f32(r, &mut dense[r * k..(r + 1) * k]);
            }
            for m in [1, 15, 16, 17, 40, 300] {
                let x = rnd(m * k, m as u64 + 10);
                let mut out = vec![f32::NAN; m * n];
                matmul(&x, m, w, &mut out);
                for i in 0..m {
                    for j in 0..n {
                        let (mut exact, mut mag) = (0f64, 0f64);
                        for t in 0..k {
                            let p = x[i * k + t] as f64 * dense[j * k + t] as f64;
                            exact += p;
                            mag += p.abs();
                        }
                        let got = out[i * n + j] as f64;
                        assert!(
                            (got - exact).abs() <= 4e-7 * mag,
                            "{:?} m={m} ({i},{j}): {got} vs {exact} (Σ|xw| {mag})",
                            w.dtype()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn only_shapes_that_tile_fit() {
        let w = |rows, cols| Weight::F32 {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        };
        assert!(!fits(&w(48, 64)));
        assert!(!fits(&w(64, 48)));
        assert!(!fits(&w(0, 64)));
        assert!(fits(&w(64, 64)));
        assert!(fits(&w(96, 160)));
    }

    proptest! {
        /// The vector split gives the scalar limbs, bit for bit.
        #[test]
        fn vector_limbs_equal_scalar_ones(seed in any::<u64>(), len in 0usize..8) {
            let v: Vec<f32> = rnd(len * 16, seed).iter().map(|x| x * 1e3).collect();
            let mut planes = vec![vec![0u16; v.len()]; 3];
            let [l0, l1, l2] = &mut planes[..] else { unreachable!() };
            split_limbs(&v, l0, l1, l2);
            for (i, &x) in v.iter().enumerate() {
                prop_assert_eq!([l0[i], l1[i], l2[i]], limbs(x));
            }
        }
    }
}
