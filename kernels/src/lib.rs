//! tandem-kernels: devices, buffers and the op set the engine writes its model against.
//!
//! Owns: the CPU implementations of matmul (dense f32 through `gemm`; quantized weights kept
//! quantized in memory and dequantized on the fly; on CPUs with AMX, products of many rows on the
//! tiles at f32 accuracy, [`amx`] and [`Linear`]), rms_norm, rotary embedding, silu·mul, embedding
//! gather, writes into the paged KV cache, paged attention (packed variable-length prefill over a
//! cached prefix, and single-query decode), and logits helpers. Every hot kernel exists at each
//! kernel level ([`isa`]: AVX-512, AVX2+FMA, and portable SIMD that is NEON on aarch64), picked at
//! run time and capped by `TANDEM_ISA`. Activations are f32 throughout so the CPU path is the
//! numerical reference the GPU kernels are checked against.
//!
//! Does not own: model structure (tandem-engine) or file formats (tandem-model).
//!
//! Main types: [`Weight`] (a matrix in its storage format), [`KvLayout`] (how one layer's KV
//! blocks are laid out), [`SeqAttn`] (one sequence's slice of a packed batch).

pub mod amx;
pub mod attention;
pub mod cuda;
pub mod isa;
pub mod matmul;
pub mod ops;
pub mod simd;
mod weight;

pub use attention::{
    paged_attention, reference_attention, write_kv, KvLayout, KvSlab, KvSlabMut, SeqAttn,
};
pub use matmul::matmul;
pub use weight::{Linear, Weight};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("shape mismatch: {0}")]
    Shape(String),
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
