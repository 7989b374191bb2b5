//! A weight matrix in the format it is stored in.

use tandem_model::{GgmlType, TensorData};

use crate::amx;
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
    /// GGML-quantized rows, kept quantized in memory. Q4_1 and Q8_0 rows are in the kernels'
    /// split layout (each row's block scales, and Q4_1 mins, before its quants); build with
    /// [`Weight::quant`] from GGML bytes.
    Quant {
        /// The quantization type.
        ty: GgmlType,
        /// rows × (bytes of `cols` elements of `ty`) bytes.
        data: Vec<u8>,
        /// Output features.
        rows: usize,
        /// Input features (elements per row, a whole number of blocks).
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
        let mut data = vec![0u8; ggml.len()];
        if rb > 0 {
            for (src, dst) in ggml.chunks_exact(rb).zip(data.chunks_exact_mut(rb)) {
                crate::simd::split_row(ty, src, dst);
            }
        }
        Ok(Self::Quant {
            ty,
            data,
            rows,
            cols,
        })
    }

    /// Number of rows: output features.
    pub fn rows(&self) -> usize {
        match self {
            Self::F32 { rows, .. } | Self::Quant { rows, .. } => *rows,
        }
    }

    /// Number of columns: input features.
    pub fn cols(&self) -> usize {
        match self {
            Self::F32 { cols, .. } | Self::Quant { cols, .. } => *cols,
        }
    }

    /// Bytes held in memory: what one full pass over the matrix must read.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32 { data, .. } => data.len() * 4,
            Self::Quant { data, .. } => data.len(),
        }
    }

    /// Storage type of the weights.
    pub fn dtype(&self) -> GgmlType {
        match self {
            Self::F32 { .. } => GgmlType::F32,
            Self::Quant { ty, .. } => *ty,
        }
    }

    /// Decodes row `r` into `out` (length `cols`).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Self::F32 { data, cols, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            Self::Quant { ty, data, cols, .. } => {
                let rb = ty.bytes_for(*cols).expect("validated at construction");
                crate::simd::dequant_row(*ty, &data[r * rb..(r + 1) * rb], out);
            }
        }
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
}
