//! A weight matrix in the format it is stored in.

use tandem_model::{GgmlType, TensorData};

use crate::KernelError;

/// A `[rows, cols]` matrix used as `y = x · Wᵀ` (PyTorch's Linear layout: one row per output).
#[derive(Clone, Debug)]
pub enum Weight {
    /// Dense f32, row-major.
    F32 {
        data: Vec<f32>,
        rows: usize,
        cols: usize,
    },
    /// GGML-quantized rows, kept quantized in memory.
    Quant {
        ty: GgmlType,
        data: Vec<u8>,
        rows: usize,
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
            return Ok(Self::Quant {
                ty: t.ty,
                data: t.data.clone(),
                rows,
                cols,
            });
        }
        Ok(Self::F32 {
            data: t.to_f32()?,
            rows,
            cols,
        })
    }

    pub fn rows(&self) -> usize {
        match self {
            Self::F32 { rows, .. } | Self::Quant { rows, .. } => *rows,
        }
    }

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
