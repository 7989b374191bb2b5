//! Ranks on CUDA GPUs, exchanging through NCCL (cudarc's bindings, loaded at run time: the
//! crate builds and its CPU ranks run on a machine without CUDA or NCCL).
//!
//! A group starts from one [`NcclId`], made once (by rank 0's process) and handed to every rank:
//! cloned within a process, or as its bytes ([`NcclId::to_bytes`]) over a worker's control
//! channel between processes. Each rank then builds its [`NcclRank`] on its own thread, with
//! [`NcclRank::new`]: an NCCL communicator is neither `Send` nor `Sync`, and stays on the thread
//! that made it.
//!
//! NCCL work is queued on the rank's stream; every collective here waits for it under the
//! group's watchdog: a peer that never comes leaves the stream busy, and after the watchdog the
//! call fails with [`CollectiveError::Timeout`] and the rank is poisoned (its communicator is
//! aborted when it is dropped), instead of hanging the step.
//!
//! [`Collective`] is implemented on host buffers (copied to the device and back), so the same
//! tests run the CPU ranks and these. The GPU forward ([`NcclRank::on_stream`], on its own
//! compute stream) queues its gathers on its device buffers behind its kernels with the
//! `_queued` calls, which do not wait, and waits once a step under the watchdog
//! ([`NcclRank::wait_queued`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};

use crate::{Collective, CollectiveError};

/// Whether the CUDA driver and the NCCL library can be loaded here (cudarc panics on the first
/// call into a library it cannot load, so every entry point asks this first).
pub fn available() -> bool {
    // SAFETY: only probes whether the libraries load.
    unsafe { cudarc::driver::sys::is_culib_present() && cudarc::nccl::sys::is_culib_present() }
}

fn device(what: &str, e: impl std::fmt::Debug) -> CollectiveError {
    CollectiveError::Device(format!("{what}: {e:?}"))
}

fn unavailable() -> CollectiveError {
    CollectiveError::Device(
        "NCCL is not available here (no CUDA driver or no libnccl on the library path)".into(),
    )
}

/// The UUID of CUDA device `ordinal`: what tells two workers' GPUs apart (NCCL refuses a
/// communicator with two ranks on one device, so two workers sharing a card cannot link).
pub fn device_uuid(ordinal: usize) -> Result<[u8; 16], CollectiveError> {
    if !available() {
        return Err(unavailable());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| device("opening the device", e))?;
    let uuid = ctx.uuid().map_err(|e| device("cuDeviceGetUuid", e))?;
    Ok(uuid.bytes.map(|c| c as u8))
}

/// The id every rank of one NCCL group starts from.
#[derive(Clone, Copy, Debug)]
pub struct NcclId(Id);

impl NcclId {
    /// A fresh id (once per group, on one rank).
    pub fn new() -> Result<Self, CollectiveError> {
        if !available() {
            return Err(unavailable());
        }
        Id::new()
            .map(Self)
            .map_err(|e| device("ncclGetUniqueId", e))
    }

    /// The id's 128 bytes, for ranks in other processes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal().map(|c| c as u8)
    }

    /// An id from [`NcclId::to_bytes`].
    pub fn from_bytes(b: &[u8; 128]) -> Self {
        Self(Id::uninit(b.map(|c| c as std::ffi::c_char)))
    }
}

/// The element type NCCL sums bf16 device buffers as: they hold bf16 values as their `u16`
/// bits (the kernels' convention), which NCCL must not add as integers.
struct Bf16;

impl NcclType for Bf16 {
    fn as_nccl_type() -> cudarc::nccl::sys::ncclDataType_t {
        cudarc::nccl::sys::ncclDataType_t::ncclBfloat16
    }
}

/// A `u16` device buffer seen as bf16 values by NCCL.
struct AsBf16<'a>(&'a mut CudaSlice<u16>);

impl DeviceSlice<Bf16> for AsBf16<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::<u16>::stream(self.0)
    }
}

impl DevicePtrMut<Bf16> for AsBf16<'_> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr_mut(stream)
    }
}

/// A `u16` device buffer read as bf16 values by NCCL.
struct AsBf16Ref<'a>(&'a CudaSlice<u16>);

impl DeviceSlice<Bf16> for AsBf16Ref<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        DeviceSlice::<u16>::stream(self.0)
    }
}

impl DevicePtr<Bf16> for AsBf16Ref<'_> {
    fn device_ptr<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr(stream)
    }
}

/// What the ranks of one group in one process share: set by the first rank that gives the
/// group up, with why, so that the others' waits end at once instead of at their watchdogs (an
/// NCCL collective a peer never joins does not end by itself).
#[derive(Clone, Debug, Default)]
pub struct GroupAbort(Arc<std::sync::Mutex<Option<String>>>);

impl GroupAbort {
    /// Gives the group up (the first reason is kept).
    pub fn set(&self, why: String) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(why);
    }

    /// Why the group was given up, if it was.
    pub fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// One rank of an NCCL group, on the thread that made it.
pub struct NcclRank {
    /// Shared with the group's other ranks in this process, where they are threads of one.
    abort: Option<GroupAbort>,
    comm: Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    watchdog: Duration,
    poisoned: Option<String>,
}

impl NcclRank {
    /// Rank `rank` of a group of `size` on CUDA device `ordinal`, joining the group `id` names.
    /// Call it on the thread that will run the rank: every rank of the group must call it
    /// (NCCL's initialisation is itself collective).
    pub fn new(
        ordinal: usize,
        rank: usize,
        size: usize,
        id: NcclId,
        watchdog: Duration,
    ) -> Result<Self, CollectiveError> {
        if !available() {
            return Err(unavailable());
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| device("opening the device", e))?;
        let stream = ctx.new_stream().map_err(|e| device("a stream", e))?;
        Self::on_stream(stream, rank, size, id, watchdog, None)
    }

    /// Rank `rank` of a group of `size` whose collectives are queued on `stream` (a forward's
    /// own stream: they are then ordered with its kernels, with no wait between them), joining
    /// the group `id` names. As [`NcclRank::new`]: on the rank's thread, every rank calling it.
    /// `abort`, where the group's ranks are threads of one process, is shared by them all.
    pub fn on_stream(
        stream: Arc<CudaStream>,
        rank: usize,
        size: usize,
        id: NcclId,
        watchdog: Duration,
        abort: Option<GroupAbort>,
    ) -> Result<Self, CollectiveError> {
        if !available() {
            return Err(unavailable());
        }
        if rank >= size {
            return Err(CollectiveError::Shape(format!(
                "rank {rank} of a group of {size}"
            )));
        }
        // NCCL takes the rank's device from the thread's current context: the stream's.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| device("making the stream's device current", e))?;
        let comm = Comm::from_rank(stream.clone(), rank, size, id.0)
            .map_err(|e| device("ncclCommInitRank", e))?;
        Ok(Self {
            abort,
            comm,
            stream,
            rank,
            size,
            watchdog,
            poisoned: None,
        })
    }

    /// The stream the rank's collectives run on (the forward's work on the same stream is
    /// ordered with them).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Every rank's `buf` (a device buffer) summed into every rank's `buf`, waited for.
    pub fn all_reduce_device<T: NcclType>(
        &mut self,
        buf: &mut CudaSlice<T>,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        self.comm
            .all_reduce_in_place(buf, &ReduceOp::Sum)
            .map_err(|e| device("ncclAllReduce", e))?;
        self.wait("all_reduce")
    }

    /// Every rank's `mine` (bf16 values as their bits) into `out` (`size` × its length, rank
    /// after rank), queued on the rank's stream: the stream's later work sees it;
    /// [`NcclRank::wait_queued`] waits for it.
    pub fn all_gather_bf16_queued(
        &mut self,
        mine: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        self.check_gather(mine.len(), out.len())?;
        self.comm
            .all_gather(&AsBf16Ref(mine), &mut AsBf16(out))
            .map(|_| ())
            .map_err(|e| device("ncclAllGather", e))
    }

    fn check_gather(&self, mine: usize, out: usize) -> Result<(), CollectiveError> {
        match out == self.size * mine {
            true => Ok(()),
            false => Err(CollectiveError::Shape(format!(
                "all_gather: {} ranks × {mine} values into {out}",
                self.size
            ))),
        }
    }

    /// Every rank's `mine` into `out` (`size` × its length, rank after rank), queued as
    /// [`NcclRank::all_gather_bf16_queued`] is.
    pub fn all_gather_f32_queued(
        &mut self,
        mine: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        self.check_gather(mine.len(), out.len())?;
        self.comm
            .all_gather(mine, out)
            .map(|_| ())
            .map_err(|e| device("ncclAllGather", e))
    }

    /// Waits under the watchdog for everything queued on the rank's stream so far, its
    /// collectives included: a peer that never comes fails this with a timeout (and poisons
    /// the rank) instead of hanging the caller's next copy to the host.
    pub fn wait_queued(&mut self) -> Result<(), CollectiveError> {
        self.check()?;
        self.wait("a step's collectives")
    }

    /// Gives the group up: every later collective on this rank fails at once with `why`, and
    /// so do the waits of the ranks sharing its [`GroupAbort`].
    pub fn poison(&mut self, why: String) {
        if let Some(a) = &self.abort {
            a.set(why.clone());
        }
        self.poisoned.get_or_insert(why);
    }

    /// Whether an earlier failure poisoned the rank.
    pub fn poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// Fails once this rank, or a peer sharing its [`GroupAbort`], has given the group up: a
    /// rank stops queuing work behind a collective that will never finish.
    fn check(&self) -> Result<(), CollectiveError> {
        let why = self
            .poisoned
            .clone()
            .or_else(|| self.abort.as_ref().and_then(GroupAbort::get));
        match why {
            Some(why) => Err(CollectiveError::Poisoned(why)),
            None => Ok(()),
        }
    }

    /// Waits for the rank's queued work under the watchdog.
    fn wait(&mut self, op: &'static str) -> Result<(), CollectiveError> {
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| device("recording an event", e))?;
        let start = Instant::now();
        loop {
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(device(op, e)),
            }
            if let Some(why) = self.abort.as_ref().and_then(GroupAbort::get) {
                self.poisoned.get_or_insert(why.clone());
                return Err(CollectiveError::Poisoned(why));
            }
            let waited = start.elapsed();
            if waited > self.watchdog {
                // Which peers are missing NCCL does not say; the others' watchdogs name
                // themselves the same way.
                let e = CollectiveError::Timeout {
                    op,
                    rank: self.rank,
                    missing: (0..self.size).filter(|&r| r != self.rank).collect(),
                    waited,
                };
                self.poisoned = Some(e.to_string());
                if let Some(a) = &self.abort {
                    a.set(e.to_string());
                }
                return Err(e);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, CollectiveError> {
        // An empty buffer still takes part: NCCL is called with a count of 0.
        match host.is_empty() {
            true => self.stream.alloc_zeros::<f32>(0),
            false => self.stream.clone_htod(host),
        }
        .map_err(|e| device("copying to the device", e))
    }

    fn download(&self, dev: &CudaSlice<f32>, host: &mut [f32]) -> Result<(), CollectiveError> {
        if host.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| device("copying to the host", e))?;
        self.stream
            .synchronize()
            .map_err(|e| device("copying to the host", e))
    }
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let mut d = self.upload(buf)?;
        self.all_reduce_device(&mut d)?;
        self.download(&d, buf)
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        self.check()?;
        self.check_gather(mine.len(), out.len())?;
        let src = self.upload(mine)?;
        let mut dst = self
            .stream
            .alloc_zeros::<f32>(out.len())
            .map_err(|e| device("a device buffer", e))?;
        self.comm
            .all_gather(&src, &mut dst)
            .map_err(|e| device("ncclAllGather", e))?;
        self.wait("all_gather")?;
        self.download(&dst, out)
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        self.check()?;
        crate::check_root(root, self.size)?;
        let mut d = self.upload(buf)?;
        self.comm
            .broadcast_in_place(&mut d, root as i32)
            .map_err(|e| device("ncclBroadcast", e))?;
        self.wait("broadcast")?;
        self.download(&d, buf)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        // NCCL has no barrier: an all-reduce of one value is one.
        let mut one = [0f32];
        self.all_reduce_sum(&mut one)
    }

    fn send(&mut self, to: usize, buf: &[f32]) -> Result<(), CollectiveError> {
        self.check()?;
        crate::check_peer(true, self.rank, to, self.size)?;
        let d = self.upload(buf)?;
        self.comm
            .send(&d, to as i32)
            .map_err(|e| device("ncclSend", e))?;
        self.wait("send")
    }

    fn all_to_all(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        self.check()?;
        crate::check_sends(send, self.size)?;
        let (size, me) = (self.size, self.rank);
        // Every rank's lengths first (as bits), then one NCCL group of a send and a receive
        // per peer.
        let mine: Vec<f32> = send
            .iter()
            .map(|v| f32::from_bits(v.len() as u32))
            .collect();
        let mut lens = vec![0f32; size * size];
        self.all_gather(&mine, &mut lens)?;
        let from = |i: usize| lens[i * size + me].to_bits() as usize;
        let ups = send
            .iter()
            .enumerate()
            .map(|(p, v)| match p != me && !v.is_empty() {
                true => self.upload(v).map(Some),
                false => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut downs = (0..size)
            .map(|i| {
                self.stream
                    .alloc_zeros::<f32>(from(i).max(1))
                    .map_err(|e| device("a device buffer", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        cudarc::nccl::result::group_start().map_err(|e| device("ncclGroupStart", e))?;
        for peer in (0..size).filter(|&p| p != me) {
            if let Some(up) = &ups[peer] {
                self.comm
                    .send(up, peer as i32)
                    .map_err(|e| device("ncclSend", e))?;
            }
            if from(peer) > 0 {
                self.comm
                    .recv(&mut downs[peer], peer as i32)
                    .map_err(|e| device("ncclRecv", e))?;
            }
        }
        cudarc::nccl::result::group_end().map_err(|e| device("ncclGroupEnd", e))?;
        self.wait("all_to_all")?;
        let mut out = Vec::with_capacity(size);
        for (i, d) in downs.iter().enumerate() {
            let mut v = vec![0f32; from(i)];
            match i == me {
                true => v.copy_from_slice(&send[me]),
                false if !v.is_empty() => {
                    let mut whole = vec![0f32; d.len()];
                    self.download(d, &mut whole)?;
                    v.copy_from_slice(&whole[..from(i)]);
                }
                false => {}
            }
            out.push(v);
        }
        Ok(out)
    }

    fn recv(&mut self, from: usize, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.check()?;
        crate::check_peer(false, self.rank, from, self.size)?;
        let mut d = self.upload(buf)?;
        self.comm
            .recv(&mut d, from as i32)
            .map_err(|e| device("ncclRecv", e))?;
        self.wait("recv")?;
        self.download(&d, buf)
    }
}
