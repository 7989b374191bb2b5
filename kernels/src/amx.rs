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
//! Weights are split and laid out for the tile loads once, at load time ([`AmxWeight`], six bytes
//! per weight); activations are split per call. The tile registers are driven by inline assembly
//! (the intrinsics are not stable Rust). Linux hands AMX state to a process only after
//! `arch_prctl(ARCH_REQ_XCOMP_PERM)`, which [`available`] asks for once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::Weight;

/// Rows and columns of a tile as used here: 16 rows of 64 bytes (32 bf16 or 16 f32).
const TILE: usize = 16;
/// Depth of one tile product: 32 bf16 values per row.
const DEPTH: usize = 32;
/// u16 elements of one bf16 tile.
const TILE_ELEMS: usize = TILE * DEPTH;
/// Limbs per operand.
const LIMBS: usize = 3;
/// Activation rows kept hot in L2 while a task walks its weight rows.
const TOKEN_BLOCK: usize = 256;
/// Output columns (weight rows) per rayon task: two tile columns per kernel call.
const COLS_PER_TASK: usize = 64;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Whether this CPU and OS run AMX bf16 (checked once). `TANDEM_AMX=off` says no.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let off = std::env::var("TANDEM_AMX").is_ok_and(|v| v == "off" || v == "0");
        !off && detect()
    })
}

/// Whether products take the AMX path now: [`available`] and not switched off with
/// [`set_enabled`].
pub fn active() -> bool {
    ENABLED.load(Ordering::Relaxed) && available()
}

/// Switches the AMX path on or off for the whole process (benchmarks compare both in one run).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if !crate::simd::has_avx512() {
        return false;
    }
    // SAFETY: cpuid is available on every x86-64 CPU (the call is safe in newer Rust).
    #[allow(unused_unsafe)]
    let leaf7 = unsafe { __cpuid_count(7, 0) };
    let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    if !(amx_bf16 && amx_tile) {
        return false;
    }
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
fn detect() -> bool {
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

/// A weight matrix (`rows × cols`, used as `x · Wᵀ`) split into bf16 limbs and laid out as AMX
/// B tiles: for each group of 16 rows and each 32 columns, three tiles (one per limb) whose row
/// `p` holds the pairs `(W[r][2p], W[r][2p+1])` of the group's 16 rows.
pub struct AmxWeight {
    rows: usize,
    cols: usize,
    tiles: Vec<Tile>,
}

impl std::fmt::Debug for AmxWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmxWeight")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl AmxWeight {
    /// Packs `w` for the tile kernels: its values exactly as [`Weight::row_f32`] decodes them.
    /// `None` when the shape does not tile (rows not a multiple of 32, columns of 32).
    pub fn new(w: &Weight) -> Option<Self> {
        let (rows, cols) = (w.rows(), w.cols());
        if rows % (2 * TILE) != 0 || cols % DEPTH != 0 || rows == 0 {
            return None;
        }
        let chunks = cols / DEPTH;
        let per_group = chunks * LIMBS;
        let mut tiles = vec![Tile([0; TILE_ELEMS]); rows / TILE * per_group];
        tiles
            .par_chunks_mut(per_group)
            .enumerate()
            .for_each(|(g, group)| {
                let mut row = vec![0f32; cols];
                for r in 0..TILE {
                    w.row_f32(g * TILE + r, &mut row);
                    for (k, &v) in row.iter().enumerate() {
                        let (c, j) = (k / DEPTH, k % DEPTH);
                        let at = (j / 2) * DEPTH + 2 * r + j % 2;
                        for (l, bits) in limbs(v).into_iter().enumerate() {
                            group[c * LIMBS + l].0[at] = bits;
                        }
                    }
                }
            });
        Some(Self { rows, cols, tiles })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the packed tiles take.
    pub fn bytes(&self) -> usize {
        self.tiles.len() * std::mem::size_of::<Tile>()
    }
}

/// Activations split into limbs: `[limb][row][k]` bf16 bits, rows padded with zeros to a multiple
/// of 16.
fn split_activations(x: &[f32], m: usize, k: usize) -> (Vec<u16>, usize) {
    let mp = m.div_ceil(TILE) * TILE;
    let mut out = vec![0u16; LIMBS * mp * k];
    let (l0, rest) = out.split_at_mut(mp * k);
    let (l1, l2) = rest.split_at_mut(mp * k);
    for (i, &v) in x.iter().enumerate() {
        let [a, b, c] = limbs(v);
        l0[i] = a;
        l1[i] = b;
        l2[i] = c;
    }
    (out, mp)
}

/// Tile configuration (palette 1): tiles 0-7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    reserved2: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    reserved2: [0; 16],
};

/// `out[m×n] = x[m×k] · Wᵀ` on the tiles. The caller checked shapes and [`active`].
pub(crate) fn matmul(x: &[f32], m: usize, w: &AmxWeight, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    debug_assert!(x.len() == m * k && out.len() == m * n);
    let (xl, mp) = split_activations(x, m, k);
    let dst = crate::matmul::OutPtr(out.as_mut_ptr());
    let chunks = k / DEPTH;
    let tasks = n.div_ceil(COLS_PER_TASK);
    let blocks = mp.div_ceil(TOKEN_BLOCK);
    (0..tasks * blocks).into_par_iter().for_each(|task| {
        let (tb, tc) = (task / tasks, task % tasks);
        let t_end = ((tb + 1) * TOKEN_BLOCK).min(mp) / TILE;
        let g_end = ((tc + 1) * COLS_PER_TASK).min(n) / TILE;
        // SAFETY: `available` established AMX support and permission; the tile config
        // is loaded before and released after this task's tile instructions.
        unsafe { tile_config() };
        let mut g = tc * COLS_PER_TASK / TILE;
        while g < g_end {
            let b0 = w.tiles[g * chunks * LIMBS..].as_ptr().cast::<u16>();
            let b1 = w.tiles[(g + 1) * chunks * LIMBS..].as_ptr().cast::<u16>();
            let mut t = tb * TOKEN_BLOCK / TILE;
            while t < t_end {
                let pair = t + 1 < t_end;
                let a = xl[t * TILE * k..].as_ptr();
                let mut c = Scratch([0f32; 4 * TILE * TILE]);
                // SAFETY: `a` starts three limb planes of mp×k values (the second token tile,
                // when `pair`, is inside them); b0/b1 start `chunks` × 3 tiles each; the
                // scratch holds four 16×16 f32 tiles.
                unsafe { kernel(a, mp * k, 2 * k, pair, b0, b1, chunks, c.0.as_mut_ptr()) };
                for (i, tile) in c.0.chunks_exact(TILE * TILE).enumerate() {
                    let (tt, gg) = (t + i / 2, g + i % 2);
                    if i / 2 == 1 && !pair {
                        continue;
                    }
                    for r in 0..TILE.min(m.saturating_sub(tt * TILE)) {
                        let row = &tile[r * TILE..(r + 1) * TILE];
                        // SAFETY: row tt·16+r < m, columns gg·16.. +16 ≤ n belong to this
                        // task's weight rows; no other task writes them for this token block.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                row.as_ptr(),
                                dst.at((tt * TILE + r) * n + gg * TILE),
                                TILE,
                            )
                        };
                    }
                }
                t += if pair { 2 } else { 1 };
            }
            g += 2;
        }
        // SAFETY: releases this thread's tile state (configured above).
        unsafe { tile_release() };
    });
}

/// Four f32 output tiles of one kernel call, 64-byte aligned.
#[repr(C, align(64))]
struct Scratch([f32; 4 * TILE * TILE]);

/// # Safety
/// AMX is available and permitted for this process.
unsafe fn tile_config() {
    std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack));
}

/// # Safety
/// As [`tile_config`].
unsafe fn tile_release() {
    std::arch::asm!("tilerelease", options(nostack, nomem));
}

/// One or two token tiles (`a`, and `a + 16` rows when `pair`) times two weight tile columns
/// (`b0`, `b1`) over every 32-deep chunk, with the six limb products `i + j ≤ 2`; the four (or
/// two) 16×16 results go to `c` in order (t,g) (t,g+1) (t+1,g) (t+1,g+1).
///
/// `a` is limb 0 of the first token tile; limb `l` is `plane · l` elements further; rows are
/// `stride` bytes apart. Each of b0/b1 is `chunks` runs of three limb tiles.
///
/// # Safety
/// The tile config is loaded; every tile read and the 4 KiB at `c` are inside their buffers.
#[allow(clippy::too_many_arguments)]
unsafe fn kernel(
    a: *const u16,
    plane: usize,
    stride: usize,
    pair: bool,
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
    // Second token tile: 16 rows further (unused, but in bounds, when not `pair`).
    let a_next = if pair { a.add(TILE * stride / 2) } else { a };
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
        if pair {
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
        } else {
            asm!(
                "tileloadd tmm4, [{a0} + {s}*1]",
                "tileloadd tmm6, [{w0} + {t}*1]",
                "tileloadd tmm7, [{w1} + {t}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm6, [{w0} + {t}*1 + 1024]",
                "tileloadd tmm7, [{w1} + {t}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm6, [{w0} + {t}*1 + 2048]",
                "tileloadd tmm7, [{w1} + {t}*1 + 2048]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a1} + {s}*1]",
                "tileloadd tmm6, [{w0} + {t}*1 + 1024]",
                "tileloadd tmm7, [{w1} + {t}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm6, [{w0} + {t}*1]",
                "tileloadd tmm7, [{w1} + {t}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a2} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a1,
                a2 = in(reg) a2,
                w0 = in(reg) w0,
                w1 = in(reg) w1,
                s = in(reg) stride,
                t = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
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
    use tandem_model::quant::{quantize_q4_1, quantize_q8_0};
    use tandem_model::GgmlType;

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
            let a = AmxWeight::new(w).expect("96×160 tiles");
            let mut dense = vec![0f32; n * k];
            for r in 0..n {
                w.row_f32(r, &mut dense[r * k..(r + 1) * k]);
            }
            for m in [1, 15, 16, 17, 40, 300] {
                let x = rnd(m * k, m as u64 + 10);
                let mut out = vec![f32::NAN; m * n];
                matmul(&x, m, &a, &mut out);
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
    fn shapes_that_do_not_tile_are_not_packed() {
        let w = |rows, cols| Weight::F32 {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        };
        assert!(AmxWeight::new(&w(48, 64)).is_none());
        assert!(AmxWeight::new(&w(64, 48)).is_none());
        if available() {
            assert_eq!(AmxWeight::new(&w(64, 64)).unwrap().bytes(), 64 * 64 * 6);
        }
    }
}
