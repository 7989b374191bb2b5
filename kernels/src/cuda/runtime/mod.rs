//! Launching the CUDA kernels: one stream per device, the kernels loaded from their (cached)
//! NVRTC images, the products included (gemm.cu: batch-invariant, see there). Activations and weights are bf16 (raw `u16` bits on the
//! device), logits f32. Every launch checks its arguments on the host first, so a bad shape is an
//! error here rather than an out-of-bounds access there.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
pub use cudarc::driver::CudaSlice;
use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::nvrtc::{cache_dir, compile_cached, Image};
use super::{
    gemm_segment, open, program_text, AttnParams, CudaError, Gpu, GEMM_SEG_BLOCKS, GEMM_SMALL_COLS,
    GEMM_SPLIT_MAX_ROWS, SOURCES,
};

mod attention;
mod copies;
mod timer;

pub use attention::{AttnBatch, PREFILL_TILE_ROWS};
pub use copies::{CopyEvent, CopyStream, PinnedHost};
pub use timer::{tally, OpTimer, StepProfile};

// SAFETY: plain old data, laid out as the device's struct (checked by the layout probe test).
unsafe impl DeviceRepr for AttnParams {}

fn drv(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn shape(msg: String) -> CudaError {
    CudaError::Driver(format!("bad launch: {msg}"))
}

/// Output columns per block of the fallback product kernels (gemm.cu's tiles).
const GEMM_COLS: usize = 64;

/// One tiling of the pipelined products (gemm.cu): its kernel, the most rows it takes, its tile,
/// threads, whether row tiles run on grid x, and its shared memory, (rows + columns) · k-step ·
/// 2 bytes · buffers, as the kernel computes it (static up to 48 KiB, else dynamic, where it
/// traps on less). Every tiling computes each output with the same arithmetic, so the choice by
/// m never changes a bit. `segmented`: the kernel run instead when k is in more than one segment
/// (gemm.cu's SEG_NONE tiling's SEG_FOLD twin), None where the kernel itself takes segments.
struct GemmPipe {
    name: &'static str,
    segmented: Option<&'static str>,
    max_m: usize,
    tile: (usize, usize),
    threads: u32,
    m_fast: bool,
    smem: usize,
}

const fn pipe(
    name: &'static str,
    segmented: Option<&'static str>,
    max_m: usize,
    (bm, bn, bk, stages): (usize, usize, usize, usize),
    threads: u32,
    m_fast: bool,
) -> GemmPipe {
    GemmPipe {
        name,
        segmented,
        max_m,
        tile: (bm, bn),
        threads,
        m_fast,
        smem: (bm + bn) * bk * 2 * stages,
    }
}

impl GemmPipe {
    /// The dynamic shared memory a launch passes: none where the buffers fit the 48 KiB a
    /// kernel may hold statically (the kernel declares them so).
    const fn dynamic_smem(&self) -> usize {
        if self.smem <= 48 * 1024 {
            0
        } else {
            self.smem
        }
    }
}

/// By row count, smallest first; the last takes every larger m.
const GEMM_PIPES: [GemmPipe; 3] = [
    pipe("gemm_pipe_small", None, 64, (16, 32, 128, 4), 128, true),
    pipe("gemm_pipe_mid", None, 128, (64, 64, 64, 4), 128, false),
    pipe(
        "gemm_pipe_large",
        Some("gemm_pipe_large_seg"),
        usize::MAX,
        (128, 128, 64, 3),
        256,
        false,
    ),
];

/// The small tiling's partial sums of a product in segments: at most 64 rows × segments × n
/// (gemm_segment keeps segments · n within twice the blocks' columns).
const GEMM_PART_FLOATS: usize = 64 * 2 * GEMM_SEG_BLOCKS * GEMM_SMALL_COLS;

/// Its per-tile counters: at most 4 row tiles (64 rows) × GEMM_SEG_BLOCKS column tiles.
const GEMM_COUNTERS: usize = 4 * GEMM_SEG_BLOCKS;

/// Threads per block of the row kernels.
const ROW_THREADS: u32 = 256;

struct Kernels {
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    qkv_rope: CudaFunction,
    silu_mul: CudaFunction,
    embedding: CudaFunction,
    copy_cols: CudaFunction,
    sum_ranks: CudaFunction,
    fill_random: CudaFunction,
    write_kv: CudaFunction,
    combine: CudaFunction,
    attention: CudaFunction,
    attention_decode: CudaFunction,
    gemm_rows16: CudaFunction,
    gemm_rows64: CudaFunction,
    /// GEMM_PIPES' kernels, in its order, each with its `segmented` twin.
    gemm_pipes: Vec<(CudaFunction, Option<CudaFunction>)>,
    argmax: CudaFunction,
    sample: CudaFunction,
}

/// One GPU's stream and kernels.
pub struct CudaOps {
    /// The device the ops run on.
    pub gpu: Gpu,
    /// The stream every op is queued on, in order.
    pub stream: Arc<CudaStream>,
    k: Kernels,
    /// The products' workspace for k in segments (gemm.cu's SEG_SPLIT): partial sums, and a
    /// counter per tile that each launch leaves at zero; owned here, and their device addresses
    /// taken once (only this stream's kernels touch them, so launches need no event for them).
    _gemm_ws: (CudaSlice<f32>, CudaSlice<u32>),
    gemm_ws_ptrs: (u64, u64),
}

/// A step captured as a CUDA graph ([`CudaOps::capture`]): replayed on the stream it was
/// captured on, over the buffers it was captured with.
pub struct StepGraph(cudarc::driver::CudaGraph);

// SAFETY: a graph is used (launched, dropped) only by its owner, which `&mut` or ownership
// serializes: the driver asks that no two threads touch one graph at once, not that it stay on
// the thread that made it (each call binds the context to the calling thread first).
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Queues the whole step on its stream, in one call.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.0.launch().map_err(drv)
    }
}

/// Element types a product can write: bf16 bits or f32.
pub trait GemmOut {
    /// Whether the product writes f32 (else bf16 bits).
    const F32: bool;
}

impl GemmOut for u16 {
    const F32: bool = false;
}

impl GemmOut for f32 {
    const F32: bool = true;
}

impl CudaOps {
    /// Opens device `ordinal`, compiles (or reads from the cache) and loads every kernel.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let gpu = open(ordinal)?;
        let stream = gpu.context.new_stream().map_err(drv)?;
        let dir = cache_dir();
        let mut modules = Vec::new();
        for (name, src) in SOURCES {
            let ptx = match compile_cached(&dir, name, &program_text(src), gpu.arch)? {
                Image::Cubin(b) => Ptx::from_binary(b),
                Image::Ptx(s) => Ptx::from_src(s),
            };
            modules.push(gpu.context.load_module(ptx).map_err(drv)?);
        }
        let f = |m: usize, name: &str| modules[m].load_function(name).map_err(drv);
        let k = Kernels {
            rms_norm: f(0, "rms_norm")?,
            add_rms_norm: f(0, "add_rms_norm")?,
            qkv_rope: f(0, "qkv_rope")?,
            silu_mul: f(0, "silu_mul")?,
            embedding: f(0, "embedding")?,
            copy_cols: f(0, "copy_cols_f32")?,
            sum_ranks: f(0, "sum_ranks")?,
            fill_random: f(0, "fill_random")?,
            write_kv: f(1, "write_kv")?,
            combine: f(2, "paged_attention_combine")?,
            attention: f(2, "paged_attention")?,
            attention_decode: f(2, "paged_attention_decode")?,
            gemm_rows16: f(4, "gemm_rows16")?,
            gemm_rows64: f(4, "gemm_rows64")?,
            gemm_pipes: GEMM_PIPES
                .iter()
                .map(|p| {
                    let load = |name: &str| {
                        let f = f(4, name)?;
                        if p.dynamic_smem() > 0 {
                            f.set_attribute(
                                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                p.dynamic_smem() as i32,
                            )
                            .map_err(drv)?;
                        }
                        Ok::<_, CudaError>(f)
                    };
                    Ok((load(p.name)?, p.segmented.map(load).transpose()?))
                })
                .collect::<Result<_, CudaError>>()?,
            argmax: f(3, "argmax_rows")?,
            sample: f(3, "sample_rows")?,
        };
        let part = stream.alloc_zeros::<f32>(GEMM_PART_FLOATS).map_err(drv)?;
        let count = stream.alloc_zeros::<u32>(GEMM_COUNTERS).map_err(drv)?;
        let gemm_ws_ptrs = (part.device_ptr(&stream).0, count.device_ptr(&stream).0);
        Ok(Self {
            gpu,
            stream,
            k,
            _gemm_ws: (part, count),
            gemm_ws_ptrs,
        })
    }

    /// Copies `host` into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(drv)
    }

    /// Copies `host` into `dev`, which holds exactly as many values, in stream order.
    pub fn write<T: DeviceRepr>(
        &self,
        dev: &mut CudaSlice<T>,
        host: &[T],
    ) -> Result<(), CudaError> {
        if dev.len() != host.len() {
            return Err(shape(format!(
                "a copy of {} values into a buffer of {}",
                host.len(),
                dev.len()
            )));
        }
        self.stream.memcpy_htod(host, dev).map_err(drv)
    }

    /// The first `len` values of a device buffer, into a new host vector.
    pub fn download_prefix<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        len: usize,
    ) -> Result<Vec<T>, CudaError> {
        if len > dev.len() {
            return Err(shape(format!("{len} values of a buffer of {}", dev.len())));
        }
        self.stream.clone_dtoh(&dev.slice(0..len)).map_err(drv)
    }

    /// Captures what `queue` queues on the stream as a CUDA graph, without running it: every
    /// buffer it touches must be allocated before (no allocation, free, copy from the host or
    /// wait may happen inside a capture) and outlive the graph, which reads and writes them at
    /// these addresses on each [`StepGraph::launch`]. The context's event tracking is paused
    /// meanwhile, for the whole context (cudarc keeps one flag): it would make the stream wait
    /// on events recorded outside the capture, which a capture refuses. This stream's work is
    /// ordered by the stream itself, and the copy streams order theirs with explicit events on
    /// raw addresses ([`CopyStream`]), so no other user of the context depends on it. Whatever
    /// happens, the stream leaves capture mode before this returns, or it says it could not
    /// ([`Self::leave_capture`]).
    pub fn capture<T, E: From<CudaError>>(
        &self,
        queue: impl FnOnce() -> Result<T, E>,
    ) -> Result<(T, StepGraph), E> {
        let ctx = &self.gpu.context;
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // cudarc keeps an error a drop met for the next call on the context, which returns it:
        // one stored before would fail the capture's first call, so it is reported here.
        ctx.check_err().map_err(drv)?;
        // SAFETY: turned back on below whatever happens; no buffer is created meanwhile (each
        // would lack events for good), and the capture itself orders this stream's work.
        unsafe { ctx.disable_event_tracking() };
        let out = match self.stream.begin_capture(mode) {
            Ok(()) => {
                let queued = queue();
                // An error stored during the capture (a failed free of a buffer the queueing
                // dropped on its way out, another thread's) would make cudarc's end_capture
                // return before ending anything: taken first.
                let stored = ctx.check_err();
                let graph = self
                    .stream
                    .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
                match (queued, stored, graph) {
                    (Ok(v), Ok(()), Ok(Some(g))) => Ok((v, StepGraph(g))),
                    (Err(e), _, _) => Err(e),
                    (Ok(_), Err(e), _) | (Ok(_), _, Err(e)) => Err(drv(e).into()),
                    (Ok(_), _, Ok(None)) => {
                        Err(CudaError::Driver("a capture made no graph".into()).into())
                    }
                }
            }
            Err(e) => Err(drv(e).into()),
        };
        // SAFETY: as before the capture.
        unsafe { ctx.enable_event_tracking() };
        match (out, self.leave_capture()) {
            (out, Ok(())) => out,
            (_, Err(stuck)) => Err(stuck.into()),
        }
    }

    /// Ends a capture left open on the stream (one that failed before its end), discarding its
    /// graph: a stream in capture mode fails every later call. An error only where it stays
    /// in capture mode. Raw driver calls: cudarc's return a stored error before calling.
    pub fn leave_capture(&self) -> Result<(), CudaError> {
        use cudarc::driver::result::{graph, stream};
        use cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE as NONE;
        let s = self.stream.cu_stream();
        // SAFETY: the live stream of these ops, on its context (bound by the calls before).
        let capturing = || unsafe { stream::is_capturing(s) }.map(|st| st != NONE);
        if !capturing().map_err(drv)? {
            return Ok(());
        }
        // SAFETY: as above; an invalidated capture ends with an error and no graph, a valid
        // one with a graph nobody instantiated, destroyed here.
        if let Ok(g) = unsafe { stream::end_capture(s) } {
            if !g.is_null() {
                unsafe { graph::destroy(g) }.map_err(drv)?;
            }
        }
        match capturing().map_err(drv)? {
            false => Ok(()),
            true => Err(CudaError::Driver(
                "the compute stream is stuck in a failed graph capture".into(),
            )),
        }
    }

    /// Copies a device buffer into a new host vector.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(dev).map_err(drv)
    }

    /// The device's free and total memory in bytes, as the driver reports them now (after what
    /// this process and others hold).
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.gpu.context.bind_to_thread().map_err(drv)?;
        cudarc::driver::result::mem_get_info().map_err(drv)
    }

    /// Waits until everything queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(drv)
    }

    fn rows(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `out = rms_norm(x) · w`, rows of `d`.
    pub fn rms_norm(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let d = w.len();
        if x.len() < rows * d || out.len() < rows * d {
            return Err(shape(format!("rms_norm of {rows}×{d}")));
        }
        let di = d as i32;
        let mut b = self.stream.launch_builder(&self.k.rms_norm);
        b.arg(x).arg(w).arg(out).arg(&di).arg(&eps);
        // SAFETY: argument types match the kernel's; sizes checked above.
        unsafe { b.launch(Self::rows(rows)) }
            .map(|_| ())
            .map_err(drv)
    }

    /// `residual += delta; out = rms_norm(residual) · w`.
    pub fn add_rms_norm(
        &self,
        residual: &mut CudaSlice<u16>,
        delta: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let d = w.len();
        if residual.len() < rows * d || delta.len() < rows * d || out.len() < rows * d {
            return Err(shape(format!("add_rms_norm of {rows}×{d}")));
        }
        let di = d as i32;
        let mut b = self.stream.launch_builder(&self.k.add_rms_norm);
        b.arg(residual)
            .arg(delta)
            .arg(w)
            .arg(out)
            .arg(&di)
            .arg(&eps);
        // SAFETY: as above.
        unsafe { b.launch(Self::rows(rows)) }
            .map(|_| ())
            .map_err(drv)
    }

    /// Rotary embedding of the q and k heads of `tokens` fused qkv rows, in place. `cos`/`sin`:
    /// f32 tables of (max position) × hd/2.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope(
        &self,
        qkv: &mut CudaSlice<u16>,
        positions: &CudaSlice<i32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        tokens: usize,
        (nq, nkv, hd): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        if qkv.len() < tokens * (nq + 2 * nkv) * hd || positions.len() < tokens || hd % 2 != 0 {
            return Err(shape(format!("qkv_rope of {tokens} rows")));
        }
        let (a, b2, c) = (nq as i32, nkv as i32, hd as i32);
        let mut b = self.stream.launch_builder(&self.k.qkv_rope);
        b.arg(qkv)
            .arg(positions)
            .arg(cos)
            .arg(sin)
            .arg(&a)
            .arg(&b2)
            .arg(&c);
        // SAFETY: as above; positions are below the tables' length (checked by the caller, which
        // built them from the sequences' lengths against the model's maximum).
        unsafe { b.launch(Self::rows(tokens)) }
            .map(|_| ())
            .map_err(drv)
    }

    /// `out = silu(gate) · up` for `tokens` rows of [gate | up] (2·ff each).
    pub fn silu_mul(
        &self,
        gu: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        tokens: usize,
        ff: usize,
    ) -> Result<(), CudaError> {
        let n = tokens * ff;
        if gu.len() < 2 * n || out.len() < n {
            return Err(shape(format!("silu_mul of {tokens}×{ff}")));
        }
        let (ffi, ni) = (ff as i32, n as i64);
        let mut b = self.stream.launch_builder(&self.k.silu_mul);
        b.arg(gu).arg(out).arg(&ffi).arg(&ni);
        let blocks = n.div_ceil(ROW_THREADS as usize).clamp(1, 65535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `out[t] = table[ids[t]]`, zeros for a negative id; ids are checked against the table on
    /// the host by the caller.
    pub fn embedding(
        &self,
        ids: &CudaSlice<i32>,
        table: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        d: usize,
    ) -> Result<(), CudaError> {
        let t = ids.len();
        if out.len() < t * d {
            return Err(shape(format!("embedding of {t} ids")));
        }
        let di = d as i32;
        let mut b = self.stream.launch_builder(&self.k.embedding);
        b.arg(ids).arg(table).arg(out).arg(&di);
        // SAFETY: as above.
        unsafe { b.launch(Self::rows(t)) }.map(|_| ()).map_err(drv)
    }

    /// `out[i]` = the sum over ranks, in rank order, of `parts`' `size` runs of `out.len()`
    /// bf16 values each (f32 sums, rounded once).
    pub fn sum_ranks(
        &self,
        parts: &CudaSlice<u16>,
        size: usize,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let n = out.len();
        if parts.len() < size * n || size == 0 {
            return Err(shape(format!(
                "a sum of {size} runs of {n} values from {}",
                parts.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let (si, ni) = (size as i32, n as i64);
        let mut b = self.stream.launch_builder(&self.k.sum_ranks);
        b.arg(parts).arg(&si).arg(&ni).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (
                n.div_ceil(ROW_THREADS as usize).clamp(1, 65535) as u32,
                1,
                1,
            ),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads parts[..size·n] and writes out[..n], checked above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// `dst[r][..cols] = src[r][..cols]` for `rows` rows, `src` rows `src_ld` values apart
    /// from `src_at` on, `dst` rows `dst_ld` apart from `dst_at` on (f32).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_cols(
        &self,
        (src, src_at, src_ld): (&CudaSlice<f32>, usize, usize),
        (dst, dst_at, dst_ld): (&mut CudaSlice<f32>, usize, usize),
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let end = |at: usize, ld: usize| at + rows.saturating_sub(1) * ld + cols;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if cols > src_ld
            || cols > dst_ld
            || end(src_at, src_ld) > src.len()
            || end(dst_at, dst_ld) > dst.len()
        {
            return Err(shape(format!(
                "copy of {rows}×{cols} from {src_at} (rows {src_ld} apart) of {} into {dst_at} (rows {dst_ld} apart) of {}",
                src.len(),
                dst.len()
            )));
        }
        let (s, d) = (src.slice(src_at..), dst.slice_mut(dst_at..));
        let (sl, dl, c) = (src_ld as i32, dst_ld as i32, cols as i32);
        let mut d = d;
        let mut b = self.stream.launch_builder(&self.k.copy_cols);
        b.arg(&s).arg(&sl).arg(&mut d).arg(&dl).arg(&c);
        // SAFETY: rows and columns checked against both buffers above.
        unsafe { b.launch(Self::rows(rows)) }
            .map(|_| ())
            .map_err(drv)
    }

    /// Fills `x` with bf16 values uniform in ±`scale`, made on the device from `seed`.
    pub fn fill_random(
        &self,
        x: &mut CudaSlice<u16>,
        seed: u64,
        scale: f32,
    ) -> Result<(), CudaError> {
        let n = x.len() as i64;
        let mut b = self.stream.launch_builder(&self.k.fill_random);
        b.arg(x).arg(&n).arg(&seed).arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (
                (n as usize).div_ceil(ROW_THREADS as usize).clamp(1, 65535) as u32,
                1,
                1,
            ),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel writes x[..n].
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// A device buffer of `n` bf16 values, not initialized to anything meaningful.
    pub fn alloc_bf16(&self, n: usize) -> Result<CudaSlice<u16>, CudaError> {
        self.stream.alloc_zeros::<u16>(n).map_err(drv)
    }

    /// A device buffer of `n` f32 values.
    pub fn alloc_f32(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        self.stream.alloc_zeros::<f32>(n).map_err(drv)
    }

    /// Device-to-device copy of all of `src` into the start of `dst`.
    pub fn copy(&self, src: &CudaSlice<u16>, dst: &mut CudaSlice<u16>) -> Result<(), CudaError> {
        if dst.len() < src.len() {
            return Err(shape(format!("copy of {} into {}", src.len(), dst.len())));
        }
        let mut view = dst.slice_mut(..src.len());
        self.stream.memcpy_dtod(src, &mut view).map_err(drv)
    }

    /// Copies the `len` values at `from` in `buf` to `to` in the same buffer (the two ranges
    /// must not overlap), through a scratch buffer: one KV block's copy-on-write.
    pub fn copy_within(
        &self,
        buf: &mut CudaSlice<u16>,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        let end = from.max(to) + len;
        if end > buf.len() || from.abs_diff(to) < len {
            return Err(shape(format!(
                "copy of {len} values from {from} to {to} in a buffer of {}",
                buf.len()
            )));
        }
        let mut tmp = self.stream.alloc_zeros::<u16>(len).map_err(drv)?;
        self.stream
            .memcpy_dtod(&buf.slice(from..from + len), &mut tmp)
            .map_err(drv)?;
        let mut dst = buf.slice_mut(to..to + len);
        self.stream.memcpy_dtod(&tmp, &mut dst).map_err(drv)
    }

    /// Gathers rows `rows` (each of `d` values) of `src` into `out`.
    pub fn gather_rows(
        &self,
        rows: &CudaSlice<i32>,
        src: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        d: usize,
    ) -> Result<(), CudaError> {
        self.embedding(rows, src, out, d)
    }

    /// K and V of each token's fused qkv row into its cache slot (negative: skipped).
    #[allow(clippy::too_many_arguments)]
    pub fn write_kv(
        &self,
        qkv: &CudaSlice<u16>,
        slots: &CudaSlice<i64>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
        (nq, nkv, hd): (usize, usize, usize),
        block_size: usize,
    ) -> Result<(), CudaError> {
        let t = slots.len();
        if qkv.len() < t * (nq + 2 * nkv) * hd || k_cache.len() != v_cache.len() {
            return Err(shape(format!("write_kv of {t} tokens")));
        }
        let (a, b2, c, bs) = (nq as i32, nkv as i32, hd as i32, block_size as i32);
        let mut b = self.stream.launch_builder(&self.k.write_kv);
        b.arg(qkv)
            .arg(slots)
            .arg(k_cache)
            .arg(v_cache)
            .arg(&a)
            .arg(&b2)
            .arg(&c)
            .arg(&bs);
        // SAFETY: slots come from the block manager's blocks, inside the pool.
        unsafe { b.launch(Self::rows(t)) }.map(|_| ()).map_err(drv)
    }

    /// `out = x · Wᵀ`, bf16 inputs and f32 accumulation; `out` in bf16 (`u16` bits) or f32 (the
    /// logits).
    pub fn gemm<O: GemmOut>(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<O>,
        mnk: (usize, usize, usize),
    ) -> Result<(), CudaError> {
        self.gemm_on(x, w, out, mnk, false)
    }

    /// The product through the fallback kernels whatever k is (what runs when k is not a
    /// multiple of 8): the baseline `tandem bench gpu` sets the pipelined kernels against.
    pub fn gemm_fallback<O: GemmOut>(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<O>,
        mnk: (usize, usize, usize),
    ) -> Result<(), CudaError> {
        self.gemm_on(x, w, out, mnk, true)
    }

    fn gemm_on<O: GemmOut>(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<O>,
        (m, n, k): (usize, usize, usize),
        fallback: bool,
    ) -> Result<(), CudaError> {
        if x.len() < m * k || w.len() < n * k || out.len() < m * n {
            return Err(shape(format!("gemm {m}×{n}×{k}")));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let too_big = |v: usize| i32::try_from(v).is_err();
        if too_big(m) || too_big(n) || too_big(k) {
            return Err(shape(format!("gemm {m}×{n}×{k}: a side over 2³¹")));
        }
        // One arithmetic per output whichever tiling runs (gemm.cu): the pipelined kernels
        // when rows are 16-byte aligned (k a multiple of 8; the choice among them by m changes
        // no bit), else the fallback (a property of the weight's shape, never of the batch).
        // k's segment (gemm_segment: the weight's shape alone), for the pipelined kernels.
        let seg = gemm_segment(n, k);
        let segs = k.div_ceil(seg);
        // (kernel, grid, threads, dynamic shared memory)
        let (f, grid, threads, smem) = if fallback || k % 8 != 0 {
            let rows = if m <= 16 { 16 } else { 64 };
            let f = if m <= 16 {
                &self.k.gemm_rows16
            } else {
                &self.k.gemm_rows64
            };
            (f, (n.div_ceil(GEMM_COLS), m.div_ceil(rows), 1), 128, 0)
        } else {
            let i = GEMM_PIPES
                .iter()
                .position(|p| m <= p.max_m)
                .unwrap_or(GEMM_PIPES.len() - 1);
            let p = &GEMM_PIPES[i];
            let (mt, nt) = (m.div_ceil(p.tile.0), n.div_ceil(p.tile.1));
            let (grid, f) = match &self.k.gemm_pipes[i] {
                // A block per segment for a few rows, its partial sums in the workspace.
                (f, None) if i == 0 => {
                    let z = if m <= GEMM_SPLIT_MAX_ROWS { segs } else { 1 };
                    if z > 1 && (z * m * n > GEMM_PART_FLOATS || mt * nt > GEMM_COUNTERS) {
                        return Err(shape(format!(
                            "gemm {m}×{n}×{k}: {segs} segments outgrow the workspace"
                        )));
                    }
                    ((mt, nt, z), f)
                }
                (f, None) => ((nt, mt, 1), f),
                (f, Some(twin)) => ((nt, mt, 1), if segs > 1 { twin } else { f }),
            };
            debug_assert_eq!(p.m_fast, i == 0, "only the small tiling splits by segment");
            (f, grid, p.threads, p.dynamic_smem())
        };
        let seg = (!(fallback || k % 8 != 0)).then_some(seg);
        self.launch_gemm(f, grid, threads, smem, x, w, out, (m, n, k), seg)
    }

    /// One product kernel's launch; `seg`: the k-segment the pipelined kernels take (None: a
    /// fallback kernel, which takes k whole).
    #[allow(clippy::too_many_arguments)]
    fn launch_gemm<O: GemmOut>(
        &self,
        f: &CudaFunction,
        grid: (usize, usize, usize),
        threads: u32,
        smem: usize,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        out: &mut CudaSlice<O>,
        (m, n, k): (usize, usize, usize),
        seg: Option<usize>,
    ) -> Result<(), CudaError> {
        if grid.0 > i32::MAX as usize || grid.1 > 65_535 || grid.2 > 65_535 {
            return Err(shape(format!(
                "gemm {m}×{n}×{k}: more tiles than a grid holds"
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (mi, ni, ki, f32_out) = (m as i32, n as i32, k as i32, O::F32 as i32);
        let s = &self.stream;
        let op = out.device_ptr_mut(s).0;
        let mut b = s.launch_builder(f);
        b.arg(x)
            .arg(w)
            .arg(&op)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&f32_out);
        let segi = seg.map(|s| s.min(k) as i32).unwrap_or(0);
        let (part, count) = &self.gemm_ws_ptrs;
        if seg.is_some() {
            b.arg(&segi).arg(part).arg(count);
        }
        // SAFETY: the buffers hold at least m·k, n·k and m·n values (checked by the caller), the
        // workspace the partial sums of a split launch (checked there too); the kernel reads and
        // writes inside those bounds only.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// Greedy next tokens: the argmax of each of `rows` rows of `vocab` logits (the first on
    /// ties) into `out`, and its log-probability (log-softmax of the row) into `logprob`.
    pub fn argmax(
        &self,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaSlice<i32>,
        logprob: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if vocab == 0 || logits.len() < rows * vocab || out.len() < rows || logprob.len() < rows {
            return Err(shape(format!("argmax of {rows}×{vocab}")));
        }
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(&self.k.argmax);
        b.arg(logits).arg(&v).arg(out).arg(logprob);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }

    /// A draw from softmax(logits / temperature) per row (temperature 0: greedy), reproducible in
    /// the row's seed.
    pub fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        temperature: &CudaSlice<f32>,
        seeds: &CudaSlice<u64>,
        out: &mut CudaSlice<i32>,
    ) -> Result<(), CudaError> {
        let rows = temperature.len();
        if logits.len() < rows * vocab || seeds.len() < rows || out.len() < rows {
            return Err(shape(format!("sample of {rows}×{vocab}")));
        }
        let v = vocab as i32;
        let mut b = self.stream.launch_builder(&self.k.sample);
        b.arg(logits).arg(&v).arg(temperature).arg(seeds).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }
}

#[cfg(test)]
mod tests {
    use super::{GEMM_COUNTERS, GEMM_PART_FLOATS, GEMM_PIPES, GEMM_SEG_BLOCKS, GEMM_SMALL_COLS};

    /// Each tiling's table entry against its kernel in gemm.cu: the template arguments give the
    /// tile, threads, row-tile placement and shared memory the kernel checks at launch.
    #[test]
    fn the_product_tilings_match_their_kernels() {
        let src = include_str!("../../../cuda/gemm.cu");
        let mut last = 0;
        let template_args = |name: &str| -> Vec<String> {
            let body = src
                .split(&format!("{name}(const bf16"))
                .nth(1)
                .unwrap_or_else(|| panic!("{name} is not in gemm.cu"));
            let args = body
                .split("gemm_pipe<")
                .nth(1)
                .and_then(|a| a.split('>').next())
                .unwrap();
            args.split(',').map(|a| a.trim().to_string()).collect()
        };
        for p in &GEMM_PIPES {
            let v = template_args(p.name);
            // How it takes k's segments: the small tiling a block each (it alone puts row tiles
            // on grid x), the others in turn, but for a twin-pair's two-blocks-an-SM form.
            let segs = match p.segmented {
                Some(twin) => {
                    let t = template_args(twin);
                    assert_eq!(t[..7], v[..7], "{twin} is {}'s tiling", p.name);
                    assert_eq!(t[7], "SEG_FOLD", "{twin}");
                    "SEG_NONE"
                }
                None if p.m_fast => "SEG_SPLIT",
                None => "SEG_FOLD",
            };
            assert_eq!(v[7], segs, "{}", p.name);
            let n = |i: usize| v[i].parse::<usize>().unwrap();
            let (wm, wn, mi, ni, bk, stages) = (n(0), n(1), n(2), n(3), n(4), n(5));
            let (bm, bn) = (wm * mi * 16, wn * ni * 8);
            assert_eq!(p.tile, (bm, bn), "{}", p.name);
            assert_eq!(p.threads as usize, wm * wn * 32, "{}", p.name);
            assert_eq!(p.m_fast, v[6] == "true", "{}", p.name);
            assert_eq!(p.smem, (bm + bn) * bk * 2 * stages, "{}", p.name);
            // Within what every sm_80+ part grants a block (sm_86/89: 99 KiB).
            assert!(p.smem <= 99 * 1024, "{}: {} bytes", p.name, p.smem);
            // A k-step holds whole 32-wide pairs of products.
            assert_eq!(bk % 32, 0, "{}", p.name);
            // k-segments (multiples of 128) start on a k-step.
            assert_eq!(128 % bk, 0, "{}", p.name);
            assert!(p.max_m > last, "ascending row limits");
            assert!(p.max_m % 16 == 0 || p.max_m == usize::MAX);
            last = p.max_m;
        }
        assert_eq!(last, usize::MAX, "the last tiling takes every larger m");
        // The small tiling's segments: gemm_segment counts its column tiles, and its partial
        // sums and counters fit the workspace.
        let small = &GEMM_PIPES[0];
        assert_eq!(small.tile.1, GEMM_SMALL_COLS);
        assert!(small.max_m.div_ceil(small.tile.0) * GEMM_SEG_BLOCKS <= GEMM_COUNTERS);
        assert!(small.max_m * 2 * GEMM_SEG_BLOCKS * GEMM_SMALL_COLS <= GEMM_PART_FLOATS);
    }
}
