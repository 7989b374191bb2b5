//! Copies between device memory and page-locked host memory on a stream of their own, for the
//! KV staging paths (the engine's `device::staging`): thin wrappers over the driver's pinned
//! allocation, async copies and events, each call checked by eye against the driver API.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::{drv, CudaOps};
use crate::cuda::CudaError;

/// `len` bytes of page-locked host memory (not write-combined: the host reads what a device
/// copies into it), freed on drop.
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain host memory owned by this value; who touches it while a copy runs is the
// caller's (the staging layer hands a buffer to copies only by value, and gets it back only
// once their event has completed).
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    /// The memory.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated by `malloc_host`, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The memory, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_host` and freed once.
        let _ = unsafe { result::free_host(self.ptr as _) };
    }
}

/// An event recorded after copies: they are done once it completes.
pub struct CopyEvent(CudaEvent);

impl CopyEvent {
    /// Whether the copies before it have finished.
    pub fn ready(&self) -> Result<bool, CudaError> {
        // SAFETY: a live event of this context.
        match unsafe { result::event::query(self.0.cu_event()) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(drv(e)),
        }
    }

    /// Blocks (without spinning) until the copies before it have finished.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.0.synchronize().map_err(drv)
    }
}

/// A stream for copies beside a device's compute stream.
pub struct CopyStream {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
}

impl CopyStream {
    /// A copy stream on `ops`' device, ordered after `ops`' compute stream where asked.
    pub fn new(ops: &CudaOps) -> Result<Self, CudaError> {
        let ctx = ops.gpu.context.clone();
        Ok(Self {
            copy: ctx.new_stream().map_err(drv)?,
            compute: ops.stream.clone(),
            ctx,
        })
    }

    /// The device address where `buf` starts (an allocation that never moves).
    pub fn address(&self, buf: &CudaSlice<u16>) -> u64 {
        let (ptr, _sync) = buf.device_ptr(&self.copy);
        ptr
    }

    /// `len` bytes of page-locked host memory.
    pub fn pinned(&self, len: usize) -> Result<PinnedHost, CudaError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: flags 0: plain page-locked memory; the pointer is freed by PinnedHost's drop.
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }.map_err(drv)? as *mut u8;
        // The memory starts as whatever it held: zero it once, so no stale bytes ever leave.
        // SAFETY: `len` bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedHost {
            ptr,
            len,
            ctx: self.ctx.clone(),
        })
    }

    /// Orders every copy queued from now on after the work queued on the compute stream so far.
    pub fn after_compute(&self) -> Result<(), CudaError> {
        self.copy.join(&self.compute).map_err(drv)
    }

    /// Queues a copy of `dst.len()` bytes at device address `src` into `dst`.
    ///
    /// # Safety
    /// `src .. src + dst.len()` must be device memory of this context that outlives the copy,
    /// and `dst` must stay untouched and alive until an event recorded after it completes.
    pub unsafe fn to_host(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        result::memcpy_dtoh_async(dst, src, self.copy.cu_stream()).map_err(drv)
    }

    /// Queues a copy of `src` to device address `dst`.
    ///
    /// # Safety
    /// `dst .. dst + src.len()` must be device memory of this context that outlives the copy and
    /// nothing else uses until it completes; `src` must stay alive and unchanged until then.
    pub unsafe fn to_device(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(drv)?;
        result::memcpy_htod_async(dst, src, self.copy.cu_stream()).map_err(drv)
    }

    /// An event that completes once every copy queued so far has.
    pub fn record(&self) -> Result<CopyEvent, CudaError> {
        let ev = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(drv)?;
        ev.record(&self.copy).map_err(drv)?;
        Ok(CopyEvent(ev))
    }

    /// Waits for every copy queued so far.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.copy.synchronize().map_err(drv)
    }
}
