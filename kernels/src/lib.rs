//! tandem-kernels: devices, buffers and the op set the engine writes its model against.
//!
//! Owns: the CPU implementations of matmul (batch-invariant: every output one dot product in one
//! order, whatever the batch; quantized weights kept quantized in memory and dequantized on the
//! fly; on CPUs with AMX and `TANDEM_AMX=1`, products of many rows on the tiles at f32 accuracy,
//! [`amx`] and [`Linear`]), rms_norm, rotary embedding, silu·mul, embedding
//! gather, writes into the paged KV cache, paged attention (packed variable-length prefill over a
//! cached prefix, and single-query decode), and logits helpers. Every hot kernel exists at each
//! kernel level ([`isa`]: AVX-512, AVX2+FMA, and portable SIMD that is NEON on aarch64), picked at
//! run time and capped by `TANDEM_ISA`. Activations are f32 throughout so the CPU path is the
//! numerical reference the GPU kernels are checked against.
//!
//! Does not own: model structure (tandem-engine) or file formats (tandem-model).
//!
//! Main types: [`Weight`] (a matrix in its storage format) and [`Linear`] (one used as a layer,
//! on the AMX tiles where they fit), [`KvLayout`] (how one layer's KV blocks are laid out),
//! [`KvSlab`]/[`KvSlabMut`] (one layer's cache in its element type), [`SeqAttn`] (one sequence's
//! slice of a packed batch) and [`KernelError`]. The CPU entry points are [`matmul`],
//! [`write_kv`], [`paged_attention`] and the row-wise [`ops`]; [`isa`] and [`amx`] say which
//! kernels this CPU runs, and [`cuda`] is the GPU backend ([`cuda::runtime::CudaOps`]).

#![deny(missing_docs)]

mod aligned;
pub mod amx;
mod attention;
pub mod cuda;
pub mod isa;
mod matmul;
pub mod ops;
mod simd;
mod weight;

pub use attention::{
    paged_attention, paged_attention_strided, prepare_and_write_kv, reference_attention, write_kv,
    write_kv_strided, AttnSpec, KvLayout, KvSlab, KvSlabMut, SeqAttn,
};
pub use matmul::{matmul, matmul_many, matmul_silu, silu_rows, Product};
pub use simd::fma_burst;
pub use weight::{Linear, Weight};

/// Why a CPU kernel refused its arguments or a weight could not be built.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Buffer lengths or dimensions that do not agree; the message names them.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// Decoding a model tensor failed.
    #[error(transparent)]
    Model(#[from] tandem_model::ModelError),
}

/// Sizes rayon's global pool to `threads` (default: the machine's cores). Call once, early; later
/// calls keep the first size.
pub fn init_threads(threads: Option<usize>) {
    let n = threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
}

/// The kernel level this process runs at (see [`isa`]), by name.
pub fn simd_level() -> &'static str {
    isa::active().name()
}
