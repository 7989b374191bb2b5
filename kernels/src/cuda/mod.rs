//! The CUDA backend's host side: which device to run on, the kernel sources and their NVRTC
//! compilation (a cubin for the device's own architecture, cached on disk), the attention kernels'
//! parameter block, and the batch-size buckets decode steps are captured in as graphs.
//!
//! Everything is loaded at run time (cudarc's dynamic loading): the crate builds on a machine with
//! no CUDA at all, and asking for a GPU there is an error that says what is missing.

pub mod nvrtc;
pub mod runtime;

use std::sync::Arc;

use thiserror::Error;

/// Why opening a GPU, compiling a kernel or a device call failed.
#[derive(Debug, Error)]
pub enum CudaError {
    /// libcuda cannot be loaded.
    #[error(
        "no CUDA driver on this machine (libcuda could not be loaded): install the NVIDIA driver, \
         or run on the CPU"
    )]
    NoDriver,
    /// libnvrtc cannot be loaded.
    #[error(
        "NVRTC (libnvrtc) could not be loaded: install the CUDA runtime compiler (for example \
         `python3 -m pip install nvidia-cuda-nvrtc`) and put its lib folder on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The device ordinal asked for is not on this machine.
    #[error("CUDA device {ordinal} does not exist: this machine has {count}")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        count: usize,
    },
    /// A driver or launch call failed, or a launch's arguments did not fit its shapes.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC rejected a kernel source.
    #[error("compiling {name} for {arch}:\n{log}")]
    Compile {
        /// The source's name (a key of [`SOURCES`]).
        name: String,
        /// The architecture compiled for (`sm_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// Reading or writing the on-disk kernel cache failed.
    #[error("kernel cache {path}: {source}")]
    Cache {
        /// The cache file or directory.
        path: String,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// Where the engine runs: `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU kernels.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device {s:?} (cpu, cuda or cuda:N)")),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A GPU architecture as NVRTC names it (`sm_90` is 9.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability major version (9 for `sm_90`).
    pub major: u32,
    /// Compute capability minor version (0 for `sm_90`).
    pub minor: u32,
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// An opened GPU.
pub struct Gpu {
    /// The device's CUDA ordinal.
    pub ordinal: usize,
    /// The device's name as the driver reports it.
    pub name: String,
    /// The device's compute capability.
    pub arch: Arch,
    /// Total device memory in bytes.
    pub memory_bytes: usize,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// The highest SM clock the driver reports, in kHz.
    pub clock_khz: u32,
    /// Whether the device has stream-ordered memory pools: freeing a buffer then queues its
    /// release behind the stream's work instead of waiting for the stream.
    pub memory_pools: bool,
    /// The device's primary context.
    pub context: Arc<cudarc::driver::CudaContext>,
}

/// Dense bf16 tensor-core FLOPs (f32 accumulation) one SM does per clock: the data-centre
/// parts' published rates (A100 312, H100 SXM 989, L40S 362 TFLOP/s) over their SMs and clocks.
/// None where we have no figure.
pub fn bf16_flops_per_sm_clock(arch: Arch) -> Option<f64> {
    match (arch.major, arch.minor) {
        (8, 0) => Some(2048.0),
        (8, _) => Some(1024.0),
        (9, 0) => Some(4096.0),
        (10, _) => Some(8192.0),
        _ => None,
    }
}

impl Gpu {
    /// The card's dense bf16 peak, TFLOP/s: SMs × the highest clock the driver reports × the
    /// architecture's rate (at the top clock, so at or above the datasheet's figure: a ratio to
    /// it never flatters).
    pub fn peak_bf16_tflops(&self) -> Option<f64> {
        bf16_flops_per_sm_clock(self.arch)
            .map(|r| r * self.sm_count as f64 * self.clock_khz as f64 * 1e3 / 1e12)
    }
}

impl std::fmt::Display for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} ({}, {} GiB)",
            self.ordinal,
            self.name,
            self.arch,
            self.memory_bytes >> 30
        )
    }
}

/// Whether the CUDA driver library can be loaded here. cudarc panics on first use of a library it
/// cannot load, so every entry point asks this first.
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library (no symbol is called).
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// CUDA devices here: 0 without a driver (or where it cannot count them).
pub fn device_count() -> usize {
    if !driver_present() || cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Whether NVRTC can be loaded here.
pub fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn driver_err(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}

/// Opens CUDA device `ordinal`: a clear error (never a panic) when there is no driver or no such
/// device.
pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    cudarc::driver::result::init().map_err(driver_err)?;
    let count = cudarc::driver::CudaContext::device_count().map_err(driver_err)? as usize;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    let context = cudarc::driver::CudaContext::new(ordinal).map_err(driver_err)?;
    let attr = |a| context.attribute(a).map_err(driver_err);
    let arch = Arch {
        major: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
        minor: attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
    };
    let name = context.name().map_err(driver_err)?;
    let memory_bytes = context.total_mem().map_err(driver_err)?;
    let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
    let clock_khz = attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? as u32;
    let memory_pools = attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0;
    Ok(Gpu {
        memory_pools,
        ordinal,
        name,
        arch,
        memory_bytes,
        sm_count,
        clock_khz,
        context,
    })
}

/// Prepended to every kernel source: bf16 as raw bits, reductions, the attention parameter block.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// The kernel sources (`kernels/cuda/*.cu`), by name.
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise", include_str!("../../cuda/elementwise.cu")),
    ("kv_cache", include_str!("../../cuda/kv_cache.cu")),
    ("attention", include_str!("../../cuda/attention.cu")),
    ("sampling", include_str!("../../cuda/sampling.cu")),
    ("gemm", include_str!("../../cuda/gemm.cu")),
];

/// The full text NVRTC compiles for source `body`.
pub fn program_text(body: &str) -> String {
    format!("{COMMON}\n{body}")
}

/// The attention kernels' parameter block, passed by value: field for field the `AttnParams` of
/// `common.cuh` (device pointers as 64-bit addresses). [`layout_probe`] and [`probe_offsets`]
/// check this struct's layout against the device compiler's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams {
    /// bf16 query rows of `q_stride` values, head h at h·hd.
    pub q: u64,
    /// One layer's bf16 keys: `[blocks][nkv][block_size][hd]`.
    pub k_cache: u64,
    /// One layer's bf16 values, laid out as the keys.
    pub v_cache: u64,
    /// bf16 output rows of nq·hd.
    pub out: u64,
    /// i32 block tables, `[seqs][max_blocks]`.
    pub block_tables: u64,
    /// i32 per sequence: the row of its first new token.
    pub seq_q_start: u64,
    /// i32 per sequence: its new tokens this step.
    pub seq_q_len: u64,
    /// i32 per sequence: tokens in the cache, the new ones included.
    pub seq_context: u64,
    /// Prefill: i32 `[tiles][2]` = (sequence, first new token of the tile).
    pub tiles: u64,
    /// Splits' f32 partial outputs, `[rows][nq][max_splits][hd]`.
    pub part_out: u64,
    /// Splits' f32 (max score, sum of exponentials), `[rows][nq][max_splits][2]`.
    pub part_ml: u64,
    /// Values per query row.
    pub q_stride: i32,
    /// Query heads.
    pub nq: i32,
    /// KV heads.
    pub nkv: i32,
    /// Elements per head.
    pub hd: i32,
    /// Token slots per cache block.
    pub block_size: i32,
    /// Entries per block-table row.
    pub max_blocks: i32,
    /// Keys per decode split.
    pub split_len: i32,
    /// Decode splits per sequence (1 when not split).
    pub max_splits: i32,
    /// Score scale, 1/sqrt(hd).
    pub scale: f32,
    /// Padding; unused.
    pub reserved: i32,
}

/// Every field of [`AttnParams`] with its offset in this crate's layout.
pub fn attn_param_offsets() -> Vec<(&'static str, usize)> {
    use std::mem::offset_of;
    vec![
        ("q", offset_of!(AttnParams, q)),
        ("k_cache", offset_of!(AttnParams, k_cache)),
        ("v_cache", offset_of!(AttnParams, v_cache)),
        ("out", offset_of!(AttnParams, out)),
        ("block_tables", offset_of!(AttnParams, block_tables)),
        ("seq_q_start", offset_of!(AttnParams, seq_q_start)),
        ("seq_q_len", offset_of!(AttnParams, seq_q_len)),
        ("seq_context", offset_of!(AttnParams, seq_context)),
        ("tiles", offset_of!(AttnParams, tiles)),
        ("part_out", offset_of!(AttnParams, part_out)),
        ("part_ml", offset_of!(AttnParams, part_ml)),
        ("q_stride", offset_of!(AttnParams, q_stride)),
        ("nq", offset_of!(AttnParams, nq)),
        ("nkv", offset_of!(AttnParams, nkv)),
        ("hd", offset_of!(AttnParams, hd)),
        ("block_size", offset_of!(AttnParams, block_size)),
        ("max_blocks", offset_of!(AttnParams, max_blocks)),
        ("split_len", offset_of!(AttnParams, split_len)),
        ("max_splits", offset_of!(AttnParams, max_splits)),
        ("scale", offset_of!(AttnParams, scale)),
        ("reserved", offset_of!(AttnParams, reserved)),
    ]
}

/// Kernels that each store one field's byte offset within the device's `AttnParams`, which the
/// device compiler folds to a constant in the PTX; the parameter's declaration there carries the
/// struct's size (NVRTC has no `offsetof` to assert on at compile time).
pub fn layout_probe() -> String {
    let mut s = String::new();
    for (f, _) in attn_param_offsets() {
        s += &format!(
            "extern \"C\" __global__ void probe_{f}(AttnParams p, unsigned long long* out) {{ \
             *out = (unsigned long long)((const char*)&p.{f} - (const char*)&p); }}\n"
        );
    }
    s
}

/// From the PTX of [`layout_probe`]: each field's offset and the parameter block's size, as the
/// device compiler has them. Missing entries mean the PTX did not read as expected.
pub fn probe_offsets(ptx: &str) -> (Vec<(String, usize)>, Option<usize>) {
    let mut offsets = Vec::new();
    let mut size = None;
    for (f, _) in attn_param_offsets() {
        let param = format!("probe_{f}_param_0");
        let Some(entry) = ptx.split(&format!(".entry probe_{f}(")).nth(1) else {
            continue;
        };
        let body = entry.split(".entry ").next().unwrap_or(entry);
        // `.param .align 8 .b8 probe_f_param_0[128]`
        if let Some(decl) = body.split(&format!("{param}[")).nth(1) {
            size = decl.split(']').next().and_then(|n| n.parse().ok());
        }
        // `mov.u64 %rd3, 88;`: the folded offset.
        let folded = body.lines().find_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("mov.u64")?;
            rest.split(',')
                .nth(1)?
                .trim()
                .trim_end_matches(';')
                .parse()
                .ok()
        });
        if let Some(off) = folded {
            offsets.push((f.to_string(), off));
        }
    }
    (offsets, size)
}

/// Keys per split of attention: a split is one thread block, so a sequence of 4k tokens spreads
/// over 8 of them while short ones stay whole. Splits start at fixed positions (multiples of
/// this), so a row's splits follow from its own position, never from the batch.
pub const DECODE_SPLIT_LEN: usize = 512;

/// Splits of a context of `ctx` tokens.
pub fn decode_splits(ctx: usize) -> usize {
    ctx.div_ceil(DECODE_SPLIT_LEN).max(1)
}

/// Output columns a block of the small-row product tiling covers (gemm.cu's gemm_pipe_small).
pub const GEMM_SMALL_COLS: usize = 32;

/// Blocks a small-row product aims for when k is cut into segments: four an SM of a 132-SM part
/// (H100, H200), what gemm_pipe_small's 48 KiB of buffers let an SM hold.
pub const GEMM_SEG_BLOCKS: usize = 512;

/// The most rows the small tiling runs a block per k-segment for (above, a block walks the
/// segments: the partial sums' traffic grows with the rows, the weight's does not). Either way
/// the same bits.
pub const GEMM_SPLIT_MAX_ROWS: usize = 16;

/// The shortest k-segment: 8 of the small tiling's k-steps, so its 4-deep pipeline fills.
pub const GEMM_SEG_MIN: usize = 1024;

/// k is cut only where the column tiles are at most this fraction (1 / it) of the aim: a
/// product with more tiles (Llama-3-8B's q·k·v, 192: 3 segments, 1×6144×4096 in 33.1 µs against
/// 35.3 on an H200) gains little at decode, while at prefill's row counts every segmented
/// product runs the large tiling's one-block-an-SM twin (see gemm.cu).
pub const GEMM_SEG_FEWEST: usize = 4;

/// The k-segment of a product with a weight of `n` × `k` (gemm.cu: each segment summed from zero,
/// the sums added in order): a multiple of 128 (every tiling's k-step divides it), or `k` itself
/// (one segment) where the weight's column tiles alone give most of the blocks, where k is
/// short, or where k is not a multiple of 8 (the fallback kernels, which take k whole). A
/// function of the weight's shape only, so a row's bits never depend on the batch.
pub fn gemm_segment(n: usize, k: usize) -> usize {
    if !k.is_multiple_of(8) {
        return k;
    }
    let tiles = n.div_ceil(GEMM_SMALL_COLS).max(1);
    let segs = GEMM_SEG_BLOCKS.div_ceil(tiles).min(k / GEMM_SEG_MIN);
    if tiles * GEMM_SEG_FEWEST > GEMM_SEG_BLOCKS || segs <= 1 {
        return k;
    }
    k.div_ceil(segs).next_multiple_of(128)
}

/// Batch sizes decode steps are captured as CUDA graphs for: a step of `n` sequences replays the
/// graph of the smallest bucket ≥ n, its extra rows padded (their cache slots negative, so nothing
/// is written). Fine steps where padding costs most, coarse ones above.
pub const GRAPH_BUCKETS: &[usize] = &[
    1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
];

/// Longest context a decode step's graph serves: its attention is captured with this context's
/// splits (each graph holds their partial results) and block-table rows of this many tokens,
/// most of which a shorter context leaves idle; a step with a longer context runs eagerly.
pub const GRAPH_MAX_CONTEXT: usize = 8192;

/// Block-table entries a context of `context` tokens spans, at least one.
pub fn table_blocks(context: usize, block_size: usize) -> usize {
    context.div_ceil(block_size.max(1)).max(1)
}

/// The graph bucket a decode step of `n` sequences runs in; None above the largest (run eagerly).
pub fn graph_bucket(n: usize) -> Option<usize> {
    GRAPH_BUCKETS.iter().copied().find(|&b| b >= n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceSpec::Cuda(3)));
        assert!("cuda:x".parse::<DeviceSpec>().is_err());
        assert!("gpu".parse::<DeviceSpec>().is_err());
        assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
    }

    #[test]
    fn opening_a_gpu_without_a_driver_is_an_error() {
        if driver_present() {
            eprintln!("a CUDA driver is present: the no-driver path is not exercised here");
            return;
        }
        assert_eq!(device_count(), 0);
        let e = open(0).err().expect("no driver, no device");
        assert!(matches!(e, CudaError::NoDriver), "{e}");
        assert!(e.to_string().contains("no CUDA driver"), "{e}");
    }

    #[test]
    fn buckets_cover_every_batch_with_the_smallest_fit() {
        assert_eq!(graph_bucket(0), Some(1));
        assert_eq!(graph_bucket(1), Some(1));
        assert_eq!(graph_bucket(3), Some(4));
        assert_eq!(graph_bucket(17), Some(24));
        assert_eq!(graph_bucket(256), Some(256));
        assert_eq!(graph_bucket(257), None);
        for n in 1..=256 {
            let b = graph_bucket(n).unwrap();
            assert!(b >= n);
            // No smaller bucket fits.
            assert!(GRAPH_BUCKETS.iter().all(|&o| o >= b || o < n));
            // Padding stays under half the bucket.
            assert!((b - n) * 2 < b, "{n} in {b}");
        }
    }

    #[test]
    fn product_segments_follow_the_weight() {
        // Llama-3-8B's decode products: o and down cut into 4, q·k·v and the wide gate·up
        // whole; SmolLM2's k is too short to cut; Llama-3-70B's under 8-way tensor parallelism
        // (o: 8192 × 1024, down: 8192 × 3584) and its q·k·v (1280 × 8192) as far as k allows.
        assert_eq!(gemm_segment(4096, 4096), 1024);
        assert_eq!(gemm_segment(4096, 14336), 3584);
        assert_eq!(gemm_segment(6144, 4096), 4096);
        assert_eq!(gemm_segment(8192, 8192), 8192);
        assert_eq!(gemm_segment(8192, 1024), 1024);
        assert_eq!(gemm_segment(8192, 3584), 3584);
        assert_eq!(gemm_segment(1280, 8192), 1024);
        assert_eq!(gemm_segment(28672, 4096), 4096);
        assert_eq!(gemm_segment(128256, 4096), 4096);
        assert_eq!(gemm_segment(576, 576), 576);
        assert_eq!(gemm_segment(1536, 576), 576);
        assert_eq!(gemm_segment(576, 1536), 1536);
        assert_eq!(gemm_segment(300, 570), 570);
        assert_eq!(gemm_segment(512, 4099), 4099);
        for n in [
            1, 31, 32, 100, 576, 1000, 4096, 5120, 8192, 16383, 16384, 20000,
        ] {
            for k in [8, 1000, 1024, 2048, 2056, 4096, 4104, 14336, 28672] {
                let seg = gemm_segment(n, k);
                let segs = k.div_ceil(seg);
                if segs == 1 {
                    assert!(seg >= k, "{n}×{k}");
                    continue;
                }
                assert_eq!(seg % 128, 0, "{n}×{k}");
                assert!(seg >= GEMM_SEG_MIN, "{n}×{k}");
                // No more blocks than the aim (give or take a segment), none empty; only where
                // the tiles alone are at most a quarter of it.
                let tiles = n.div_ceil(GEMM_SMALL_COLS);
                assert!(tiles * GEMM_SEG_FEWEST <= GEMM_SEG_BLOCKS, "{n}×{k}");
                assert!(tiles * (segs - 1) < GEMM_SEG_BLOCKS, "{n}×{k}");
                assert!((segs - 1) * seg < k, "{n}×{k}");
                // What the small tiling's partial sums take: within the device's workspace.
                assert!(segs * n <= 2 * GEMM_SEG_BLOCKS * GEMM_SMALL_COLS, "{n}×{k}");
            }
        }
    }

    #[test]
    fn decode_splits_follow_the_context() {
        assert_eq!(decode_splits(0), 1);
        assert_eq!(decode_splits(1), 1);
        assert_eq!(decode_splits(DECODE_SPLIT_LEN), 1);
        assert_eq!(decode_splits(DECODE_SPLIT_LEN + 1), 2);
        assert_eq!(decode_splits(4096), 8);
    }

    #[test]
    fn attention_params_pack_as_the_device_struct() {
        // 11 addresses, then 10 four-byte fields: no padding anywhere.
        assert_eq!(std::mem::size_of::<AttnParams>(), 11 * 8 + 10 * 4);
        assert_eq!(std::mem::align_of::<AttnParams>(), 8);
        let offsets = attn_param_offsets();
        assert_eq!(offsets[11], ("q_stride", 88));
        assert_eq!(offsets[19], ("scale", 120));
        // Every field of the device struct is probed, in its order.
        let device_fields: Vec<&str> = COMMON
            .split("struct AttnParams {")
            .nth(1)
            .and_then(|s| s.split("};").next())
            .unwrap()
            .lines()
            .filter_map(|l| l.split(';').next().filter(|_| l.contains(';')))
            .filter_map(|decl| decl.split_whitespace().last())
            .map(|name| name.trim_start_matches('*'))
            .collect();
        let host_fields: Vec<&str> = offsets.iter().map(|(f, _)| *f).collect();
        assert_eq!(device_fields, host_fields);
    }

    #[test]
    fn probe_offsets_read_the_folded_constants() {
        let ptx = ".visible .entry probe_q(\n\t.param .align 8 .b8 probe_q_param_0[128],\n)\n{\n\t\
                   ld.param.u64 %rd1, [probe_q_param_1];\n\tmov.u64 %rd3, 0;\n}\n\
                   .visible .entry probe_nq(\n\t.param .align 8 .b8 probe_nq_param_0[128],\n)\n{\n\t\
                   ld.param.u64 %rd1, [probe_nq_param_1];\n\tmov.u64 \t%rd3, 92;\n}\n";
        let (offsets, size) = probe_offsets(ptx);
        assert_eq!(offsets, vec![("q".to_string(), 0), ("nq".to_string(), 92)]);
        assert_eq!(size, Some(128));
    }

    #[test]
    fn every_source_defines_its_kernels_unmangled() {
        for (name, src) in SOURCES {
            assert!(src.contains("extern \"C\" __global__"), "{name}");
        }
        let all: String = SOURCES.iter().map(|(_, s)| *s).collect();
        // Each `extern "C" __global__ void [__launch_bounds__(...)] name(`.
        let kernels: Vec<&str> = all
            .split("extern \"C\" __global__ void")
            .skip(1)
            .map(|d| {
                let d = d.trim_start();
                let d = match d.strip_prefix("__launch_bounds__(") {
                    Some(rest) => rest.split_once(')').map_or("", |(_, r)| r).trim_start(),
                    None => d,
                };
                d.split('(').next().unwrap_or("").trim()
            })
            .collect();
        for k in [
            "rms_norm",
            "add_rms_norm",
            "qkv_rope",
            "silu_mul",
            "embedding",
            "copy_cols_f32",
            "sum_ranks",
            "fill_random",
            "write_kv",
            "paged_attention",
            "paged_attention_combine",
            "paged_attention_decode",
            "gemm_rows16",
            "gemm_rows64",
            "gemm_pipe_small",
            "gemm_pipe_mid",
            "gemm_pipe_large",
            "gemm_pipe_large_seg",
            "argmax_rows",
            "sample_rows",
        ] {
            assert!(kernels.contains(&k), "{k} is not an extern \"C\" kernel");
        }
    }
}
