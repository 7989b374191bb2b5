//! A host fake of the device seam ([`DeviceKv`]), for tests: "device memory" in host RAM,
//! "pinned" buffers that are plain vectors, and a copy stream that is a thread running the
//! queued copies in order, each after a delay (the knob that makes completion late, as a real
//! device's is), completing each batch through an event the caller waits on.
//!
//! Its memory is either bytes of its own in any format (a GPU's bf16 layout, say: the staging
//! logic's conversions are checked against it) or a CPU backend's pool (the CPU model steps over
//! it while transfers go through the seam: [`FakeDeviceBackend`]).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tandem_kv_transfer::Float;
use tandem_model::ModelConfig;
use tandem_types::BlockId;

use crate::backend::{Backend, RankPool, TpStats};
use crate::device::staging::{Completion, DeviceKv, DeviceKvFormat, InFlight, Pinned, PinnedMem};
use crate::error::EngineError;
use crate::forward::{OpTimes, SeqBatch};
use crate::kv_cache::{KvDtype, KvPool};

struct HostMem(Vec<u8>);

impl PinnedMem for HostMem {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// How a batch of copies ended (None: not yet).
type Outcome = Option<Result<(), String>>;

/// An event: set by the copy thread once the copies before it are done.
#[derive(Clone, Default)]
struct Event(Arc<(Mutex<Outcome>, Condvar)>);

impl Event {
    fn set(&self, r: Result<(), String>) {
        let (m, cv) = &*self.0;
        *m.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        cv.notify_all();
    }
}

impl Completion for Event {
    fn ready(&self) -> Result<bool, String> {
        match &*self.0 .0.lock().unwrap_or_else(|p| p.into_inner()) {
            None => Ok(false),
            Some(r) => r.clone().map(|()| true),
        }
    }
    fn wait(&self) -> Result<(), String> {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        while g.is_none() {
            g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.clone().expect("set")
    }
}

/// Where the fake's frames live.
enum Memory {
    /// Frames of its own, `(layer · blocks + block) · frame_bytes` each.
    Bytes(Mutex<Vec<u8>>),
    /// A CPU pool's (f32 or f16), shared with the backend that steps over it.
    Pool(KvPool),
}

struct Shared {
    fmt: DeviceKvFormat,
    mem: Memory,
    /// Copies fail from now on (a device that went away), with this reason.
    fail: Mutex<Option<String>>,
}

impl Shared {
    fn read(&self, layer: usize, block: usize, out: &mut [u8]) {
        let n = self.fmt.frame_bytes();
        match &self.mem {
            Memory::Bytes(m) => {
                let at = (layer * self.fmt.blocks + block) * n;
                out.copy_from_slice(&m.lock().expect("memory")[at..at + n]);
            }
            Memory::Pool(p) => {
                let mut v = Vec::with_capacity(n);
                p.read_block(layer, block, &mut v);
                out.copy_from_slice(&v);
            }
        }
    }

    fn write(&self, layer: usize, block: usize, frame: &[u8]) -> Result<(), String> {
        let n = self.fmt.frame_bytes();
        match &self.mem {
            Memory::Bytes(m) => {
                let at = (layer * self.fmt.blocks + block) * n;
                m.lock().expect("memory")[at..at + n].copy_from_slice(frame);
                Ok(())
            }
            // SAFETY: an upload's blocks are reserved for a transfer the engine waits on
            // (`DeviceKv::upload`'s contract), as a pool writer's are.
            Memory::Pool(p) => unsafe { p.writer().write(layer, block, frame) },
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// The host fake of a device's KV pool and copy stream.
pub struct FakeDevice {
    shared: Arc<Shared>,
    stream: Mutex<mpsc::Sender<Job>>,
    delay: Duration,
}

/// A raw pointer a copy job writes through or reads from: the buffer it points into is held by
/// the [`InFlight`] that waits for the job, untouched until then.
struct Raw(*mut u8, usize);
// SAFETY: see above; the buffer outlives the job and nothing else touches it meanwhile.
unsafe impl Send for Raw {}

impl FakeDevice {
    /// A fake whose memory is frames of its own in `fmt`'s layout and type, zeroed; every batch
    /// of copies completes `delay` after the previous one.
    pub fn new(fmt: DeviceKvFormat, delay: Duration) -> Arc<Self> {
        let bytes = fmt.layers * fmt.blocks * fmt.frame_bytes();
        Self::with_memory(fmt, Memory::Bytes(Mutex::new(vec![0; bytes])), delay)
    }

    /// A fake over `pool`'s memory (a CPU backend's f32 or f16 pool: K transposed), which the
    /// backend keeps stepping over.
    pub fn over_pool(pool: &KvPool, delay: Duration) -> Result<Arc<Self>, EngineError> {
        let dtype = match pool.dtype {
            KvDtype::F32 => Float::F32,
            KvDtype::F16 => Float::F16,
            KvDtype::Int8 => {
                return Err(EngineError::Unsupported(
                    "a fake device over an int8 pool (a device cache stores floats)".into(),
                ))
            }
        };
        let fmt = DeviceKvFormat {
            layout: pool.layout,
            layers: pool.num_layers,
            blocks: pool.num_blocks,
            dtype,
            k_transposed: true,
        };
        Ok(Self::with_memory(fmt, Memory::Pool(pool.alias()), delay))
    }

    fn with_memory(fmt: DeviceKvFormat, mem: Memory, delay: Duration) -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("fake-copy-stream".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })
            .expect("a thread for the fake copy stream");
        Arc::new(Self {
            shared: Arc::new(Shared {
                fmt,
                mem,
                fail: Mutex::new(None),
            }),
            stream: Mutex::new(tx),
            delay,
        })
    }

    /// Every copy queued from now on fails with `why` (a device lost), or succeeds again (None).
    pub fn fail_copies(&self, why: Option<&str>) {
        *self.shared.fail.lock().expect("fail") = why.map(str::to_string);
    }

    /// The frame (layer, block) holds now, in the device's layout.
    pub fn frame(&self, layer: usize, block: usize) -> Vec<u8> {
        let mut v = vec![0; self.shared.fmt.frame_bytes()];
        self.shared.read(layer, block, &mut v);
        v
    }

    /// Sets (layer, block) to `frame` (the device's layout), as a step writing it would.
    pub fn set_frame(&self, layer: usize, block: usize, frame: &[u8]) {
        self.shared
            .write(layer, block, frame)
            .expect("a frame of the pool's size");
    }

    fn queue(
        &self,
        mut buf: Pinned,
        frames: &[(usize, usize)],
        upload: bool,
    ) -> Result<InFlight, EngineError> {
        let n = self.shared.fmt.frame_bytes();
        self.shared.fmt.check_copy(frames, buf.len())?;
        let raw = Raw(buf.as_mut_ptr(), buf.len());
        let frames = frames.to_vec();
        let shared = self.shared.clone();
        let delay = self.delay;
        let ev = Event::default();
        let done = ev.clone();
        let job: Job = Box::new(move || {
            std::thread::sleep(delay);
            let raw = raw;
            if let Some(why) = shared.fail.lock().expect("fail").clone() {
                done.set(Err(why));
                return;
            }
            // SAFETY: the buffer is held by the InFlight waiting for this event (Raw's note).
            let buf = unsafe { std::slice::from_raw_parts_mut(raw.0, raw.1) };
            let mut r = Ok(());
            for (i, &(layer, block)) in frames.iter().enumerate() {
                let at = &mut buf[i * n..(i + 1) * n];
                match upload {
                    true => r = r.and(shared.write(layer, block, at)),
                    false => shared.read(layer, block, at),
                }
            }
            done.set(r);
        });
        self.stream
            .lock()
            .expect("stream")
            .send(job)
            .map_err(|_| EngineError::Device("the fake copy stream is gone".into()))?;
        Ok(InFlight::new(buf, Box::new(ev)))
    }
}

impl DeviceKv for FakeDevice {
    fn format(&self) -> DeviceKvFormat {
        self.shared.fmt
    }

    fn pinned(&self, bytes: usize) -> Result<Pinned, EngineError> {
        Ok(Pinned::new(Box::new(HostMem(vec![0; bytes]))))
    }

    fn download(&self, frames: &[(usize, usize)], buf: Pinned) -> Result<InFlight, EngineError> {
        // Steps on the fake's backend run to completion before they return: nothing to order
        // after.
        self.queue(buf, frames, false)
    }

    unsafe fn upload(
        &self,
        buf: Pinned,
        frames: &[(usize, usize)],
    ) -> Result<InFlight, EngineError> {
        self.queue(buf, frames, true)
    }
}

/// A backend whose pools are reached through fake devices only: it steps as `inner` does (a
/// CPU backend, or a tensor-parallel group of CPU ranks, a fake device per rank's pool as a
/// GPU per rank) but offers no host pool, so KV transfers into and out of it take the staging
/// paths GPUs' take.
pub struct FakeDeviceBackend {
    inner: Box<dyn Backend>,
    /// Each rank's pool behind its fake device, with its KV heads, in rank order.
    devices: Vec<(std::ops::Range<u32>, Arc<FakeDevice>)>,
}

impl FakeDeviceBackend {
    /// Each of `inner`'s pools behind a fake device whose copies complete `delay` late.
    pub fn new(inner: Box<dyn Backend>, delay: Duration) -> Result<Self, EngineError> {
        let devices = inner
            .host_pools()
            .iter()
            .map(|rp| Ok((rp.heads.clone(), FakeDevice::over_pool(rp.pool, delay)?)))
            .collect::<Result<Vec<_>, EngineError>>()?;
        if devices.is_empty() {
            return Err(EngineError::Unsupported(
                "a fake device over a backend without a host pool".into(),
            ));
        }
        Ok(Self { inner, devices })
    }

    /// The first rank's fake device.
    pub fn fake(&self) -> &Arc<FakeDevice> {
        &self.devices[0].1
    }
}

impl Backend for FakeDeviceBackend {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn forward(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, EngineError> {
        self.inner.forward(seqs)
    }
    fn forward_argmax(&mut self, seqs: &[SeqBatch<'_>]) -> Result<Vec<(u32, f32)>, EngineError> {
        self.inner.forward_argmax(seqs)
    }
    fn forward_layers(
        &mut self,
        seqs: &[SeqBatch<'_>],
        layers: usize,
    ) -> Result<Vec<f32>, EngineError> {
        self.inner.forward_layers(seqs, layers)
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn copy_blocks(&mut self, pairs: &[(BlockId, BlockId)]) -> Result<(), EngineError> {
        self.inner.copy_blocks(pairs)
    }
    fn host_pools(&self) -> Vec<RankPool<'_>> {
        Vec::new()
    }
    fn device_kv(&self) -> Option<Arc<dyn DeviceKv>> {
        match &self.devices[..] {
            [(_, d)] => Some(d.clone()),
            _ => None,
        }
    }
    fn device_pools(&self) -> Vec<crate::DevicePool> {
        self.devices
            .iter()
            .map(|(h, d)| (h.clone(), d.clone() as Arc<dyn DeviceKv>))
            .collect()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn kv_bytes_per_token(&self) -> f64 {
        self.inner.kv_bytes_per_token()
    }
    fn kv_dtype_name(&self) -> &'static str {
        self.inner.kv_dtype_name()
    }
    fn device(&self) -> String {
        format!("fake device over {}", self.inner.device())
    }
    fn tp(&self) -> usize {
        self.inner.tp()
    }
    fn tp_stats(&self) -> Option<TpStats> {
        self.inner.tp_stats()
    }
    fn profile_ops(&mut self, on: bool) -> bool {
        self.inner.profile_ops(on)
    }
    fn take_op_times(&mut self) -> Option<OpTimes> {
        self.inner.take_op_times()
    }
}
