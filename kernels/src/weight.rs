//! A weight matrix in the format it is stored in.

use tandem_model::{GgmlType, TensorData};

use crate::amx;
use crate::matmul::{silu_rows, MATMUL_SILU_MIN_ROWS};
use crate::simd::PANEL;
use crate::KernelError;

/// A `[rows, cols]` matrix used as `y = x · Wᵀ` (PyTorch's Linear layout: one row per output).
#[derive(Clone, Debug)]
pub enum Weight {
    /// Dense f32, row-major.
    F32 {
        /// rows × cols values.
        data: Vec<f32>,
        /// Output features.
        rows: usize,
        /// Input features (values per row).
        cols: usize,
    },
    /// GGML-quantized rows, kept quantized in memory, every type in the kernels' panels of
    /// sixteen rows ([`crate::simd::to_panels`]; the last panel padded with zero rows); build
    /// with [`Weight::quant`] from GGML bytes.
    Quant {
        /// The quantization type.
        ty: GgmlType,
        /// The panels (`rows` rounded up to sixteen, × the bytes of `cols` values of `ty`), or
        /// `rows` GGML rows.
        data: Vec<u8>,
        /// Output features.
        rows: usize,
        /// Input features (elements per row, a whole number of blocks).
        cols: usize,
    },
    /// Weights of different types stacked by rows (a fused projection of a mixed file: Q4_K_M
    /// quantizes v apart from q and k), each kept in its own type; every part but the last has
    /// whole panels of rows. Build with [`Weight::stack`].
    Parts {
        /// The parts, their rows one after another.
        parts: Vec<Weight>,
        /// Input features.
        cols: usize,
    },
}

impl Weight {
    /// Builds a weight from a loaded tensor. Dense f16/bf16 become f32; quantized types stay as they
    /// are unless `force_f32`.
    pub fn from_tensor(t: &TensorData, force_f32: bool) -> Result<Self, KernelError> {
        let (rows, cols) = match t.shape[..] {
            [r, c] => (r, c),
            [c] => (1, c),
            _ => {
                return Err(KernelError::Shape(format!(
                    "weight of rank {} ({:?})",
                    t.shape.len(),
                    t.shape
                )))
            }
        };
        if t.ty.is_quantized() && !force_f32 {
            if cols % t.ty.block_elems() != 0 {
                return Err(KernelError::Shape(format!(
                    "{} columns is not a whole number of {} blocks",
                    cols, t.ty
                )));
            }
            return Self::quant(t.ty, &t.data, rows, cols);
        }
        Ok(Self::F32 {
            data: t.to_f32()?,
            rows,
            cols,
        })
    }

    /// A quantized weight from GGML-layout bytes (`rows` rows of `cols` values of `ty`).
    pub fn quant(ty: GgmlType, ggml: &[u8], rows: usize, cols: usize) -> Result<Self, KernelError> {
        let rb = ty.bytes_for(cols).ok_or_else(|| {
            KernelError::Shape(format!(
                "{cols} columns is not a whole number of {ty} blocks"
            ))
        })?;
        if ggml.len() != rb * rows {
            return Err(KernelError::Shape(format!(
                "{rows}×{cols} {ty} needs {} bytes, got {}",
                rb * rows,
                ggml.len()
            )));
        }
        if !crate::simd::is_paneled(ty) {
            return Err(KernelError::Shape(format!("{ty} is not a quantized type")));
        }
        Ok(Self::Quant {
            ty,
            data: crate::simd::to_panels(ty, ggml, rows, cols),
            rows,
            cols,
        })
    }

    /// Number of rows: output features.
    pub fn rows(&self) -> usize {
        match self {
            Self::F32 { rows, .. } | Self::Quant { rows, .. } => *rows,
            Self::Parts { parts, .. } => parts.iter().map(Weight::rows).sum(),
        }
    }

    /// Number of columns: input features.
    pub fn cols(&self) -> usize {
        match self {
            Self::F32 { cols, .. } | Self::Quant { cols, .. } | Self::Parts { cols, .. } => *cols,
        }
    }

    /// Bytes held in memory: what one full pass over the matrix must read.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32 { data, .. } => data.len() * 4,
            Self::Quant { data, .. } => data.len(),
            Self::Parts { parts, .. } => parts.iter().map(Weight::bytes).sum(),
        }
    }

    /// Storage type of the weights (of the first part, for parts of several types).
    pub fn dtype(&self) -> GgmlType {
        match self {
            Self::F32 { .. } => GgmlType::F32,
            Self::Quant { ty, .. } => *ty,
            Self::Parts { parts, .. } => parts[0].dtype(),
        }
    }

    /// The parts of a weight stacked from several types, each with its first row; a weight of
    /// one type is its own one part.
    pub fn parts(&self) -> Vec<(usize, &Weight)> {
        match self {
            Self::Parts { parts, .. } => {
                let mut r0 = 0;
                parts
                    .iter()
                    .map(|p| {
                        r0 += p.rows();
                        (r0 - p.rows(), p)
                    })
                    .collect()
            }
            w => vec![(0, w)],
        }
    }

    /// The part of a stacked weight that row `r` is in, and the row's place in it.
    fn part_of(parts: &[Weight], mut r: usize) -> (&Weight, usize) {
        for p in parts {
            if r < p.rows() {
                return (p, r);
            }
            r -= p.rows();
        }
        panic!("row {r} past the stacked weight's rows")
    }

    /// Decodes row `r` into `out` (length `cols`).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Self::F32 { data, cols, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            Self::Quant { ty, data, cols, .. } => {
                crate::simd::dequant_panel_row(*ty, data, *cols, r, out);
            }
            Self::Parts { parts, .. } => {
                let (p, r) = Self::part_of(parts, r);
                p.row_f32(r, out);
            }
        }
    }

    /// Rows `r0.. +rows` decoded into `out` (`rows × cols` values, row-major): whole panels at
    /// a time with the level's decoding where the weight is in panels, then written out row by
    /// row (faster than [`Weight::row_f32`] one row at a time, which picks each value from its
    /// panel).
    pub fn rows_f32(&self, r0: usize, rows: usize, out: &mut [f32]) {
        let k = self.cols();
        let out = &mut out[..rows * k];
        match self {
            Self::Quant { .. } => {}
            Self::F32 { .. } => {
                for (r, o) in out.chunks_exact_mut(k.max(1)).enumerate() {
                    self.row_f32(r0 + r, o);
                }
                return;
            }
            Self::Parts { .. } => {
                for (p0, p) in self.parts() {
                    let (a, b) = (r0.max(p0), (r0 + rows).min(p0 + p.rows()));
                    if a < b {
                        p.rows_f32(a - p0, b - a, &mut out[(a - r0) * k..(b - r0) * k]);
                    }
                }
                return;
            }
        }
        let mut panel = vec![0f32; k * PANEL];
        for p in r0 / PANEL..(r0 + rows).div_ceil(PANEL) {
            self.panel_f32(p, 0, k, &mut panel);
            for j in 0..PANEL {
                let r = p * PANEL + j;
                if r < r0 || r >= r0 + rows {
                    continue;
                }
                let o = &mut out[(r - r0) * k..(r - r0 + 1) * k];
                for (t, v) in o.iter_mut().enumerate() {
                    *v = panel[t * PANEL + j];
                }
            }
        }
    }

    /// Columns `t0..t1` of rows `16p .. 16p + 16` as f32, column after column: column `t`'s
    /// sixteen rows at `out[16·(t − t0)..]` (rows past the last are zeros), the layout
    /// [`crate::simd::panel_product`] multiplies. `t0` and `t1` are multiples of 32 or `t1` is
    /// `cols` for quantized weights.
    pub fn panel_f32(&self, p: usize, t0: usize, t1: usize, out: &mut [f32]) {
        let span = t1 - t0;
        let out = &mut out[..span * PANEL];
        match self {
            Self::F32 { data, rows, cols } => {
                let (r0, n) = (p * PANEL, rows.saturating_sub(p * PANEL).min(PANEL));
                let src = &data[(r0 * cols + t0).min(data.len())..];
                crate::simd::transpose_panel(src, *cols, n, span, out);
            }
            Self::Quant {
                ty,
                data,
                rows,
                cols,
            } => {
                crate::simd::dequant_panel(
                    *ty,
                    data,
                    *rows,
                    *cols,
                    p,
                    t0 / 32,
                    t1.div_ceil(32),
                    out,
                );
            }
            Self::Parts { parts, .. } => {
                // Every part but the last has whole panels, so a panel is in one part.
                let (part, r) = Self::part_of(parts, p * PANEL);
                part.panel_f32(r / PANEL, t0, t1, out);
            }
        }
    }

    /// The GGML bytes of a quantized weight's rows (as [`Weight::quant`] took them).
    pub fn ggml_bytes(&self) -> Option<Vec<u8>> {
        let Self::Quant {
            ty,
            data,
            rows,
            cols,
        } = self
        else {
            return None;
        };
        let rb = ty.bytes_for(*cols).expect("validated at construction");
        let mut out = vec![0u8; rows * rb];
        for (r, row) in out.chunks_exact_mut(rb.max(1)).enumerate().take(*rows) {
            crate::simd::panel_row_ggml(*ty, data, *cols, r, row);
        }
        Some(out)
    }

    /// The rows of `parts` one after another, as one weight (fused projections: q|k|v, gate|up).
    /// Parts of one quantized type stay one weight of that type; parts of several types (GGUF
    /// mixes quantize v apart from q and k) stay parts, each in its own type, where every part
    /// but the last has whole panels of rows (else they are decoded to f32).
    /// One part is returned as it is (no copy).
    pub fn stack(mut parts: Vec<Weight>) -> Result<Weight, KernelError> {
        let Some(first) = parts.first() else {
            return Err(KernelError::Shape("no weights to stack".into()));
        };
        let cols = first.cols();
        if let Some(p) = parts.iter().find(|p| p.cols() != cols) {
            return Err(KernelError::Shape(format!(
                "stacking weights of {cols} and {} columns",
                p.cols()
            )));
        }
        let rows = parts.iter().map(Weight::rows).sum();
        let ty = first.dtype();
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        let whole = |p: &Weight| p.rows().is_multiple_of(PANEL);
        let quant = |p: &Weight| matches!(p, Self::Quant { .. });
        if ty != GgmlType::F32 && parts.iter().all(|p| p.dtype() == ty && quant(p)) {
            // Whole panels up to the last part: their bytes one after another.
            if parts[..parts.len() - 1].iter().all(whole) {
                let mut data = Vec::new();
                for p in &parts {
                    if let Self::Quant { data: d, .. } = p {
                        data.extend_from_slice(d);
                    }
                }
                return Ok(Self::Quant {
                    ty,
                    data,
                    rows,
                    cols,
                });
            }
            let mut ggml = Vec::new();
            for p in parts {
                ggml.extend(p.ggml_bytes().expect("a quantized part"));
            }
            return Self::quant(ty, &ggml, rows, cols);
        }
        // Several types: each part in its own, where the parts' panels do not straddle them.
        if parts.iter().any(|p| p.dtype() != ty)
            && parts[..parts.len() - 1].iter().all(whole)
            && parts.iter().all(|p| !matches!(p, Self::Parts { .. }))
        {
            // Neighbours of one type as one part: fewer, longer runs of panels.
            let mut merged: Vec<Vec<Weight>> = Vec::new();
            for p in parts {
                match merged.last_mut() {
                    Some(run) if run[0].dtype() == p.dtype() => run.push(p),
                    _ => merged.push(vec![p]),
                }
            }
            let parts = merged
                .into_iter()
                .map(Weight::stack)
                .collect::<Result<Vec<_>, _>>()?;
            if parts.len() == 1 {
                return Ok(parts.into_iter().next().expect("one part"));
            }
            return Ok(Self::Parts { parts, cols });
        }
        let mut data = vec![0f32; rows * cols];
        let mut r0 = 0;
        for p in parts {
            for r in 0..p.rows() {
                p.row_f32(r, &mut data[(r0 + r) * cols..(r0 + r + 1) * cols]);
            }
            r0 += p.rows();
        }
        Ok(Self::F32 { data, rows, cols })
    }
}

/// Activation rows from which a product takes the AMX tiles (when they fit and are active). Below
/// it, the AVX-512 kernels do as well: the tiles work on pairs of 16-row tiles, and six limb
/// products per output.
pub const AMX_MIN_ROWS: usize = 16;

/// A weight used as a linear layer: the matrix as stored, and whether its products can run on
/// the AMX tiles (switched on, see [`amx::active`]; this CPU has them and the shape tiles, see
/// [`amx::fits`]).
#[derive(Debug)]
pub struct Linear {
    weight: Weight,
    tiles: bool,
}

impl Linear {
    /// Wraps `weight`, deciding once whether its products may use the AMX tiles (only where they
    /// are switched on: they are not batch-invariant).
    pub fn new(weight: Weight) -> Self {
        let tiles = amx::active() && amx::fits(&weight);
        Self { weight, tiles }
    }

    /// The matrix as stored.
    pub fn weight(&self) -> &Weight {
        &self.weight
    }

    /// Whether products of `AMX_MIN_ROWS` (16) or more rows run on the AMX tiles.
    pub fn tiles(&self) -> bool {
        self.tiles
    }

    /// `out[m×n] = x[m×k] · Wᵀ`, on the AMX tiles from `AMX_MIN_ROWS` (16) rows when available.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if !(self.tiles && m >= AMX_MIN_ROWS && amx::active()) {
            return crate::matmul(x, m, &self.weight, out);
        }
        let (n, k) = (self.weight.rows(), self.weight.cols());
        if x.len() != m * k || out.len() != m * n {
            return Err(KernelError::Shape(format!(
                "matmul: x has {} values for {m}×{k}, out has {} for {m}×{n}",
                x.len(),
                out.len()
            )));
        }
        amx::matmul(x, m, &self.weight, out);
        Ok(())
    }

    /// `out[m×ff] = silu(x·Gᵀ) · (x·Uᵀ)` of a weight that stacks `ff` gate rows over `ff` up
    /// rows: in one pass ([`crate::matmul_silu`]) from [`MATMUL_SILU_MIN_ROWS`] rows, else (and
    /// on the AMX tiles, where [`Linear::matmul`] would use them) the product into `gate_up` (room
    /// for `m × 2ff` values; left as it was after one pass) and silu·mul of its rows. The same
    /// bits either way.
    pub fn matmul_silu(
        &self,
        x: &[f32],
        m: usize,
        gate_up: &mut [f32],
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let tiles = self.tiles && m >= AMX_MIN_ROWS && amx::active();
        if m >= MATMUL_SILU_MIN_ROWS && !tiles {
            return crate::matmul_silu(x, m, &self.weight, out);
        }
        let n = self.weight.rows();
        let ff = n / 2;
        if !n.is_multiple_of(2) || out.len() != m * ff || gate_up.len() < m * n {
            return Err(KernelError::Shape(format!(
                "matmul_silu: out has {} values for {m}×{ff} and gate|up room for {}, the weight {n} rows",
                out.len(),
                gate_up.len()
            )));
        }
        let gate_up = &mut gate_up[..m * n];
        self.matmul(x, m, gate_up)?;
        silu_rows(gate_up, ff, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::{quantize_q4_1, quantize_q8_0};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn rows_of(w: &Weight) -> Vec<f32> {
        let k = w.cols();
        let mut d = vec![f32::NAN; w.rows() * k];
        for r in 0..w.rows() {
            w.row_f32(r, &mut d[r * k..(r + 1) * k]);
        }
        d
    }

    /// Every quantized type decodes to exactly what GGML's decoder gives for the file's bytes
    /// (random blocks: every code, every scale bit) and its products are the f32 products of
    /// those values, bit for bit, at one row (decoded in registers) and at many (the panel
    /// product), in its own type.
    #[test]
    fn every_type_multiplies_as_its_decoded_values() {
        let (n, k) = (37, 512);
        for ty in crate::simd::fmt::tests::TYPES {
            let ggml = crate::simd::fmt::tests::random_ggml(ty, n * k, 45 + ty as u64);
            let mut want = vec![f32::NAN; n * k];
            tandem_model::dequantize(ty, &ggml, &mut want).unwrap();
            let w = Weight::quant(ty, &ggml, n, k).unwrap();
            assert_eq!(w.dtype(), ty);
            let got = rows_of(&w);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{ty}");
            let dense = Weight::F32 {
                data: want.clone(),
                rows: n,
                cols: k,
            };
            for m in [1usize, 3, 24] {
                let x = rnd(m * k, m as u64);
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                crate::matmul(&x, m, &w, &mut a).unwrap();
                crate::matmul(&x, m, &dense, &mut b).unwrap();
                assert_eq!(bits(&a), bits(&b), "{ty} at {m} rows");
            }
        }
    }

    /// A fused projection of parts of several types (q and k Q5_0, v Q8_0, as Q4_K_M files
    /// have) keeps each part in its own type and multiplies as the parts' decoded rows.
    #[test]
    fn parts_of_several_types_stay_in_their_types() {
        let k = 256;
        let part = |ty: GgmlType, n: usize| {
            let g = crate::simd::fmt::tests::random_ggml(ty, n * k, n as u64);
            Weight::quant(ty, &g, n, k).unwrap()
        };
        let parts = vec![
            part(GgmlType::Q5_0, 48),
            part(GgmlType::Q5_0, 16),
            part(GgmlType::Q8_0, 21),
        ];
        let bytes: usize = parts.iter().map(Weight::bytes).sum();
        let want: Vec<f32> = parts.iter().flat_map(rows_of).collect();
        let w = Weight::stack(parts).unwrap();
        assert!(matches!(&w, Weight::Parts { parts, .. } if parts.len() == 2));
        assert_eq!((w.rows(), w.bytes()), (85, bytes));
        assert_eq!(rows_of(&w), want);
        let mut runs = vec![f32::NAN; 30 * k];
        w.rows_f32(40, 30, &mut runs);
        assert_eq!(runs, want[40 * k..70 * k]);
        let dense = Weight::F32 {
            data: want,
            rows: 85,
            cols: k,
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for m in [1usize, 2, 20] {
            let x = rnd(m * k, m as u64);
            let (mut a, mut b) = (vec![f32::NAN; m * 85], vec![0.0; m * 85]);
            crate::matmul(&x, m, &w, &mut a).unwrap();
            crate::matmul(&x, m, &dense, &mut b).unwrap();
            assert_eq!(bits(&a), bits(&b), "{m} rows");
        }
        // A part cut mid-panel before another type: decoded to f32.
        let cut = Weight::stack(vec![part(GgmlType::Q5_0, 20), part(GgmlType::Q8_0, 16)]).unwrap();
        assert_eq!(cut.dtype(), GgmlType::F32);
    }

    /// Stacked weights hold their parts' rows in order: panels whole or cut mid-panel (rebuilt
    /// from GGML bytes), one type or mixed (decoded to f32), and the GGML bytes come back as given.
    #[test]
    fn stacks_keep_every_row_and_the_ggml_bytes() {
        let k = 64;
        let part = |ty: GgmlType, n: usize, seed: u64| {
            let wf = rnd(n * k, seed);
            let ggml = match ty {
                GgmlType::Q4_1 => quantize_q4_1(&wf),
                GgmlType::Q8_0 => quantize_q8_0(&wf),
                _ => {
                    return Weight::F32 {
                        data: wf,
                        rows: n,
                        cols: k,
                    }
                }
            };
            let w = Weight::quant(ty, &ggml, n, k).unwrap();
            assert_eq!(w.ggml_bytes().unwrap(), ggml, "{ty} bytes back");
            w
        };
        for (types, rows) in [
            ([GgmlType::Q4_1; 3], [32, 16, 48]),
            ([GgmlType::Q4_1; 3], [37, 16, 5]),
            ([GgmlType::Q8_0; 3], [16, 21, 9]),
            ([GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F32], [20, 16, 3]),
        ] {
            let parts: Vec<Weight> = (0..3)
                .map(|i| part(types[i], rows[i], i as u64 + 1))
                .collect();
            let want: Vec<f32> = parts.iter().flat_map(rows_of).collect();
            let stacked = Weight::stack(parts).unwrap();
            assert_eq!(stacked.rows(), rows.iter().sum::<usize>());
            assert_eq!(rows_of(&stacked), want, "{types:?} {rows:?}");
            let mixed = types.iter().any(|t| *t != types[0]);
            assert_eq!(
                stacked.dtype(),
                if mixed { GgmlType::F32 } else { types[0] }
            );
            assert!(!matches!(stacked, Weight::Parts { .. }));
        }
        let wide = Weight::F32 {
            data: vec![0.0; 2 * (k + 1)],
            rows: 2,
            cols: k + 1,
        };
        assert!(Weight::stack(vec![part(GgmlType::F32, 2, 9), wide]).is_err());
        assert!(Weight::stack(Vec::new()).is_err());
    }

    /// Rows decoded in runs are the rows decoded one at a time, from any row to any row.
    #[test]
    fn runs_of_rows_decode_as_single_rows() {
        let (n, k) = (53, 96);
        let wf = rnd(n * k, 11);
        for w in [
            Weight::quant(GgmlType::Q4_1, &quantize_q4_1(&wf), n, k).unwrap(),
            Weight::quant(GgmlType::Q8_0, &quantize_q8_0(&wf), n, k).unwrap(),
            Weight::F32 {
                data: wf.clone(),
                rows: n,
                cols: k,
            },
        ] {
            let all = rows_of(&w);
            for (r0, rows) in [(0, 53), (0, 16), (16, 37), (5, 30), (48, 5), (52, 1)] {
                let mut got = vec![f32::NAN; rows * k];
                w.rows_f32(r0, rows, &mut got);
                assert_eq!(
                    got,
                    all[r0 * k..(r0 + rows) * k],
                    "{:?} {r0}+{rows}",
                    w.dtype()
                );
            }
        }
    }
}
