//! The device seam of the KV paths: a device's KV pool as KV transfers see it, and the host-side
//! logic that moves its blocks through page-locked staging buffers.
//!
//! [`DeviceKv`] is the seam: page-locked host memory, copies of whole (layer, block) frames
//! between the pool and that memory queued on a copy stream, and their completion. Two
//! implementations: the CUDA pool's ([`crate::device::cuda`]: cudarc's pinned memory, async
//! copies on a stream of their own, events) and a host fake behind the `fake-device` feature
//! ([`crate::device::fake`]: copies on a thread of their own after a delay), which the tests of
//! everything here run on.
//!
//! What is written once against the seam, for every device:
//! - **export** ([`export_staged`]): a prefill-mode sequence's computed blocks are copied out,
//!   ordered after the step that computed them, into a reused staging buffer, and turned into
//!   wire frames (K transposed where the device keeps it otherwise; the device's element type,
//!   which the receiver converts if its own differs);
//! - **import** ([`DeviceSink`]): a receiver's frames are turned into the device's layout in a
//!   ring of staging slots, each slot uploaded as it fills while the next frames arrive, and
//!   [`DeviceSink::settle`] waits out every copy before a transfer is reported complete or its
//!   blocks are revoked (event-ordered completion: no block reaches the engine, or is freed,
//!   with a copy into it in flight).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tandem_kernels::KvLayout;
use tandem_kv_transfer::{BlockSink, Float};
use tandem_types::BlockId;

use crate::error::EngineError;

/// How a device pool stores its blocks: `layers` × `blocks` frames, one layer of one block each,
/// every frame its K half then its V half.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceKvFormat {
    /// Slots, KV heads and head size of a block.
    pub layout: KvLayout,
    /// Model layers.
    pub layers: usize,
    /// Blocks in the pool.
    pub blocks: usize,
    /// The stored values' type.
    pub dtype: Float,
    /// Whether K is stored `[kv_head][head_dim][slot]` (the CPU's layout, and the wire's) rather
    /// than `[kv_head][slot][head_dim]` (a GPU's). V is `[kv_head][slot][head_dim]` in both.
    pub k_transposed: bool,
}

impl DeviceKvFormat {
    /// Bytes of one frame: one layer of one block, K and V.
    pub fn frame_bytes(&self) -> usize {
        self.layout.block_floats() * self.dtype.bytes()
    }

    /// The cache's dtype as workers advertise it and the KV handshake names it.
    pub fn dtype_name(&self) -> &'static str {
        match self.dtype {
            Float::F32 => "f32",
            Float::F16 => "f16",
            Float::Bf16 => "bf16",
        }
    }

    /// Whether (layer, block) is in the pool.
    fn holds(&self, layer: usize, block: usize) -> bool {
        layer < self.layers && block < self.blocks
    }

    /// Refuses copies of `frames` through a staging buffer of `buf` bytes where a frame is
    /// outside the pool or they do not all fit: what every [`DeviceKv`] checks before it
    /// queues a copy.
    pub fn check_copy(&self, frames: &[(usize, usize)], buf: usize) -> Result<(), EngineError> {
        let n = self.frame_bytes();
        if frames.len() * n > buf {
            return Err(EngineError::Internal(format!(
                "{} frames of {n} bytes do not fit a staging buffer of {buf}",
                frames.len()
            )));
        }
        match frames.iter().find(|&&(l, b)| !self.holds(l, b)) {
            Some((l, b)) => Err(EngineError::Internal(format!(
                "layer {l} block {b} outside the device pool"
            ))),
            None => Ok(()),
        }
    }

    /// Copies one frame from the device's layout (`src`) into the wire's (`dst`), or back
    /// (`to_wire` false): the same bytes, K's two inner axes swapped where the device keeps K
    /// untransposed.
    fn relayout(&self, src: &[u8], dst: &mut [u8], to_wire: bool) {
        let l = self.layout;
        let half = src.len() / 2;
        if self.k_transposed {
            dst.copy_from_slice(src);
            return;
        }
        let e = self.dtype.bytes();
        let (slots, dim) = (l.block_size, l.head_dim);
        // K: per head, [slot][dim] on the device and [dim][slot] on the wire.
        for h in 0..l.num_kv_heads {
            let base = h * slots * dim;
            for s in 0..slots {
                for d in 0..dim {
                    let dev = (base + s * dim + d) * e;
                    let wire = (base + d * slots + s) * e;
                    let (from, to) = if to_wire { (dev, wire) } else { (wire, dev) };
                    dst[to..to + e].copy_from_slice(&src[from..from + e]);
                }
            }
        }
        dst[half..].copy_from_slice(&src[half..]);
    }
}

/// Page-locked (pinned) host memory a device copies into and out of directly.
pub trait PinnedMem: Send {
    /// The memory.
    fn bytes(&self) -> &[u8];
    /// The memory, to fill.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// A staging buffer in page-locked host memory (see [`DeviceKv::pinned`]).
pub struct Pinned(Box<dyn PinnedMem>);

impl Pinned {
    /// Wraps a device's page-locked allocation.
    pub fn new(mem: Box<dyn PinnedMem>) -> Self {
        Self(mem)
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.0.bytes().len()
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer.
    pub fn bytes(&self) -> &[u8] {
        self.0.bytes()
    }

    /// The buffer, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }

    /// Where the buffer starts, for a device's copy engine.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.bytes_mut().as_mut_ptr()
    }
}

/// The completion of copies queued on a device's copy stream (an event recorded after them).
pub trait Completion: Send {
    /// Whether the copies have finished (an error: they failed).
    fn ready(&self) -> Result<bool, String>;
    /// Blocks until the copies have finished.
    fn wait(&self) -> Result<(), String>;
}

/// Copies in flight between a device's pool and a staging buffer. The buffer comes back only
/// through [`InFlight::wait`], once the copies are done: nothing can read a buffer a copy is
/// still filling, or refill one a copy is still reading. Dropped early, it waits for its copies
/// before the buffer is freed.
pub struct InFlight {
    buf: Option<Pinned>,
    done: Box<dyn Completion>,
}

impl InFlight {
    /// `buf`, handed to copies that `done` completes.
    pub fn new(buf: Pinned, done: Box<dyn Completion>) -> Self {
        Self {
            buf: Some(buf),
            done,
        }
    }

    /// Whether the copies have finished.
    pub fn ready(&self) -> Result<bool, EngineError> {
        self.done.ready().map_err(EngineError::Device)
    }

    /// Waits for the copies; the buffer back, or why they failed (the buffer is freed then).
    pub fn wait(mut self) -> Result<Pinned, EngineError> {
        let done = self.done.wait().map_err(EngineError::Device);
        let buf = self.buf.take().expect("a buffer until waited for");
        done.map(|()| buf)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.buf.is_some() {
            if let Err(e) = self.done.wait() {
                tracing::error!(error = %e, "device copies dropped unwaited failed");
            }
        }
    }
}

/// A device's KV pool as KV transfers see it. Frames are addressed as (layer, block) and are
/// whole: [`DeviceKvFormat::frame_bytes`] each, laid out as [`DeviceKv::format`] says.
pub trait DeviceKv: Send + Sync {
    /// How the pool stores its blocks.
    fn format(&self) -> DeviceKvFormat;

    /// `bytes` of page-locked host memory to stage copies through.
    fn pinned(&self, bytes: usize) -> Result<Pinned, EngineError>;

    /// Queues copies of `frames`, in order, out of the pool into `buf` (frame after frame from
    /// its start), after every step the device has been given so far.
    fn download(&self, frames: &[(usize, usize)], buf: Pinned) -> Result<InFlight, EngineError>;

    /// Queues copies of `buf`'s first `frames.len()` frames, in order, into the pool's
    /// (layer, block)s.
    ///
    /// # Safety
    /// Nothing may read or write these blocks until the copies are waited for, and the engine
    /// must not be handed them before then: they must be reserved for a transfer the engine is
    /// waiting on (as for [`crate::KvPoolWriter::write`]).
    unsafe fn upload(
        &self,
        buf: Pinned,
        frames: &[(usize, usize)],
    ) -> Result<InFlight, EngineError>;
}

/// The frames of `layers` × `blocks`, layer-major: how a chunk's pieces hold them.
fn frames_of(layers: usize, blocks: &[BlockId]) -> Vec<(usize, usize)> {
    (0..layers)
        .flat_map(|layer| blocks.iter().map(move |b| (layer, b.index())))
        .collect()
}

/// The most page-locked memory an export stages through at once: a longer chunk goes in
/// batches of frames (a prompt chunk of an 8B model is hundreds of MiB of KV).
const EXPORT_STAGING: usize = 32 << 20;

/// Copies `blocks` (every layer) out of `dev`'s pool through `staging` (grown when too small, up
/// to [`EXPORT_STAGING`] or one frame, kept for the next call) and returns, per layer, the
/// blocks' frames back to back in the wire's layout: what a [`crate::KvChunk`] piece of every KV
/// head holds. Ordered after the steps the device has been given, so the blocks are the computed
/// ones; waits for the copies.
pub fn export_staged(
    dev: &dyn DeviceKv,
    blocks: &[BlockId],
    staging: &mut Option<Pinned>,
) -> Result<Vec<Vec<u8>>, EngineError> {
    export_staged_within(dev, blocks, staging, EXPORT_STAGING)
}

/// [`export_staged`] through at most `cap` bytes of staging at once.
fn export_staged_within(
    dev: &dyn DeviceKv,
    blocks: &[BlockId],
    staging: &mut Option<Pinned>,
    cap: usize,
) -> Result<Vec<Vec<u8>>, EngineError> {
    let fmt = dev.format();
    if blocks.is_empty() {
        return Ok(vec![Vec::new(); fmt.layers]);
    }
    let frame = fmt.frame_bytes();
    let frames = frames_of(fmt.layers, blocks);
    fmt.check_copy(&frames, usize::MAX)?;
    let want = (frames.len() * frame).min(cap.max(frame));
    let mut buf = match staging.take() {
        Some(b) if b.len() >= want => b,
        _ => dev.pinned(want)?,
    };
    let per_batch = buf.len() / frame;
    let n = blocks.len() * frame;
    let mut layers = vec![vec![0u8; n]; fmt.layers];
    for (i, batch) in frames.chunks(per_batch).enumerate() {
        buf = dev.download(batch, buf)?.wait()?;
        for (j, src) in buf
            .bytes()
            .chunks_exact(frame)
            .take(batch.len())
            .enumerate()
        {
            // Frame k of the export: layer k / blocks, block k % blocks.
            let k = i * per_batch + j;
            let at = (k % blocks.len()) * frame;
            fmt.relayout(src, &mut layers[k / blocks.len()][at..at + frame], true);
        }
    }
    *staging = Some(buf);
    Ok(layers)
}

/// Frames a staging slot of a [`DeviceSink`] holds.
const SLOT_FRAMES: usize = 64;
/// Staging slots a [`DeviceSink`] keeps: one filling while the others' uploads run.
const SLOTS: usize = 4;

/// Uploads queued, with the blocks their frames go to.
type Upload = (InFlight, Vec<usize>);

struct SinkState {
    /// The slot being filled, and the frames in it so far.
    filling: Option<(Pinned, Vec<(usize, usize)>)>,
    /// Uploads queued, oldest first.
    in_flight: VecDeque<Upload>,
    /// Slots whose uploads are done.
    free: Vec<Pinned>,
    /// Slots made and not lost to a failure (at most [`SLOTS`]).
    made: usize,
    /// Blocks a frame of which could not be staged or uploaded, with the first reason, until
    /// the settle of the transfer they were granted to reports them. The sink is the worker's,
    /// shared by its transfers: each transfer hears of its own blocks' failures only.
    failed: HashMap<usize, String>,
}

impl SinkState {
    /// Notes that `blocks` lost a frame, for `why`.
    fn fail(&mut self, blocks: impl IntoIterator<Item = usize>, why: &str) {
        for b in blocks {
            self.failed.entry(b).or_insert_with(|| why.to_string());
        }
    }
}

/// A [`BlockSink`] into a device's pool: received frames (whole blocks of every KV head, in the
/// device's element type; the receiver converts others) go into page-locked slots in the
/// device's layout; a full slot is uploaded while the next fills; [`BlockSink::settle`] uploads
/// the last and waits for every copy.
pub struct DeviceSink {
    dev: Arc<dyn DeviceKv>,
    fmt: DeviceKvFormat,
    state: Mutex<SinkState>,
    bytes: AtomicU64,
}

impl DeviceSink {
    /// A sink over `dev`'s pool.
    ///
    /// # Safety
    /// As [`DeviceKv::upload`]: every block granted to a transfer with this sink must be left
    /// alone by the engine until that grant has ended, and no block may be granted to two
    /// transfers at once.
    pub unsafe fn new(dev: Arc<dyn DeviceKv>) -> Self {
        Self {
            fmt: dev.format(),
            dev,
            state: Mutex::new(SinkState {
                filling: None,
                in_flight: VecDeque::new(),
                free: Vec::new(),
                made: 0,
                failed: HashMap::new(),
            }),
            bytes: AtomicU64::new(0),
        }
    }

    /// The pool's format.
    pub fn format(&self) -> DeviceKvFormat {
        self.fmt
    }

    /// Bytes written into the pool so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SinkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the oldest upload: its slot back, or its blocks noted as failed (and the slot
    /// gone with it).
    fn finish_oldest(&self, st: &mut SinkState) -> Option<Pinned> {
        let (up, blocks) = st.in_flight.pop_front()?;
        match up.wait() {
            Ok(buf) => Some(buf),
            Err(e) => {
                st.made -= 1;
                st.fail(blocks, &e.to_string());
                None
            }
        }
    }

    /// A slot to fill: a free one, a new one while fewer than [`SLOTS`] exist, else the oldest
    /// upload's once it is done.
    fn slot(&self, st: &mut SinkState) -> Result<Pinned, EngineError> {
        loop {
            if let Some(b) = st.free.pop() {
                return Ok(b);
            }
            if st.made < SLOTS {
                let b = self.dev.pinned(SLOT_FRAMES * self.fmt.frame_bytes())?;
                st.made += 1;
                return Ok(b);
            }
            if st.in_flight.is_empty() {
                return Err(EngineError::Internal("every staging slot is lost".into()));
            }
            if let Some(b) = self.finish_oldest(st) {
                return Ok(b);
            }
        }
    }

    /// Queues the filling slot's upload; where it cannot be queued, its blocks are noted as
    /// failed and the slot is gone.
    fn flush(&self, st: &mut SinkState) {
        if let Some((buf, frames)) = st.filling.take() {
            let blocks: Vec<usize> = frames.iter().map(|&(_, b)| b).collect();
            // SAFETY: the frames are of blocks granted to live transfers (`new`'s contract);
            // the grant settles this sink before the blocks go back to the engine.
            match unsafe { self.dev.upload(buf, &frames) } {
                Ok(up) => st.in_flight.push_back((up, blocks)),
                Err(e) => {
                    st.made -= 1;
                    st.fail(blocks, &e.to_string());
                }
            }
        }
    }

    fn stage(&self, layer: usize, block: usize, payload: &[u8]) -> Result<(), EngineError> {
        let frame = self.fmt.frame_bytes();
        if !self.fmt.holds(layer, block) || payload.len() != frame {
            return Err(EngineError::Internal(format!(
                "a frame of {} bytes for layer {layer} block {block} of a device pool of {} layers, {} blocks, {frame}-byte frames",
                payload.len(),
                self.fmt.layers,
                self.fmt.blocks
            )));
        }
        let mut st = self.state();
        if st.filling.is_none() {
            let slot = self.slot(&mut st)?;
            st.filling = Some((slot, Vec::with_capacity(SLOT_FRAMES)));
        }
        let (buf, frames) = st.filling.as_mut().expect("a slot");
        let at = frames.len() * frame;
        self.fmt
            .relayout(payload, &mut buf.bytes_mut()[at..at + frame], false);
        frames.push((layer, block));
        if frames.len() == SLOT_FRAMES {
            self.flush(&mut st);
        }
        self.bytes.fetch_add(frame as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl BlockSink for DeviceSink {
    fn frame_len(&self) -> usize {
        self.fmt.frame_bytes()
    }

    fn layers(&self) -> u32 {
        self.fmt.layers as u32
    }

    fn write(&self, layer: u32, block: BlockId, payload: &[u8]) {
        if let Err(e) = self.stage(layer as usize, block.index(), payload) {
            tracing::error!(error = %e, "a KV frame could not be staged for the device");
            self.state().fail([block.index()], &e.to_string());
        }
    }

    fn pieces(&self) -> Vec<Range<u32>> {
        // One range: every KV head of this device's pool (a tensor-parallel group's pools are
        // each a sink's, under the worker's sink of every rank).
        std::iter::once(0..self.fmt.layout.num_kv_heads as u32).collect()
    }

    fn settle(&self, blocks: &[BlockId]) -> Result<(), String> {
        let mut st = self.state();
        self.flush(&mut st);
        while !st.in_flight.is_empty() {
            if let Some(buf) = self.finish_oldest(&mut st) {
                st.free.push(buf);
            }
        }
        let mut first = None;
        for b in blocks {
            if let Some(why) = st.failed.remove(&b.index()) {
                first.get_or_insert(format!("block {}: {why}", b.index()));
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::device::fake::FakeDevice;

    /// A GPU's pool: bf16, K `[kv_head][slot][head_dim]`.
    fn gpu_format(blocks: usize) -> DeviceKvFormat {
        DeviceKvFormat {
            layout: KvLayout {
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 3,
            },
            layers: 3,
            blocks,
            dtype: Float::Bf16,
            k_transposed: false,
        }
    }

    fn random_frames(dev: &FakeDevice, seed: u64) {
        let fmt = dev.format();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for layer in 0..fmt.layers {
            for block in 0..fmt.blocks {
                let f: Vec<u8> = (0..fmt.frame_bytes()).map(|_| rng.gen()).collect();
                dev.set_frame(layer, block, &f);
            }
        }
    }

    /// Element `e` (of `bytes` bytes) of a frame.
    fn at(frame: &[u8], e: usize, bytes: usize) -> &[u8] {
        &frame[e * bytes..(e + 1) * bytes]
    }

    /// Exported blocks come out in the wire's layout (K transposed per head, V as stored), in
    /// the chunk's order (layer-major, blocks as asked); imported into other blocks of another
    /// device they are the same frames there; until the sink settles, a partial slot has not
    /// been uploaded at all.
    #[test]
    fn blocks_go_out_in_the_wire_layout_and_come_back_in_the_devices() {
        let fmt = gpu_format(6);
        let src = FakeDevice::new(fmt, Duration::from_millis(2));
        random_frames(&src, 1);
        let blocks = [BlockId(3), BlockId(1)];
        let mut staging = None;
        let layers = export_staged(&*src, &blocks, &mut staging).unwrap();
        let kept = staging.as_ref().map(Pinned::len);
        assert_eq!(kept, Some(6 * fmt.frame_bytes()));
        let (l, n, e) = (fmt.layout, fmt.frame_bytes(), 2);
        let (slots, dim) = (l.block_size, l.head_dim);
        assert_eq!(layers.len(), fmt.layers);
        for (layer, bytes) in layers.iter().enumerate() {
            assert_eq!(bytes.len(), 2 * n);
            for (j, b) in blocks.iter().enumerate() {
                let dev = src.frame(layer, b.index());
                let wire = &bytes[j * n..(j + 1) * n];
                for h in 0..l.num_kv_heads {
                    for s in 0..slots {
                        for d in 0..dim {
                            let base = h * slots * dim;
                            assert_eq!(
                                at(wire, base + d * slots + s, e),
                                at(&dev, base + s * dim + d, e)
                            );
                        }
                    }
                }
                assert_eq!(wire[n / 2..], dev[n / 2..], "V as stored");
            }
        }
        // A second export reuses the staging buffer.
        export_staged(&*src, &blocks[..1], &mut staging).unwrap();
        assert_eq!(staging.as_ref().map(Pinned::len), kept);
        // Through a buffer of 4 frames (two batches and a part of one) or of one: the same.
        for cap in [4 * n, n, 1] {
            let mut small = None;
            let again = export_staged_within(&*src, &blocks, &mut small, cap).unwrap();
            assert_eq!(again, layers, "cap {cap}");
            assert_eq!(small.map(|b| b.len()), Some(cap.max(n)));
        }

        let dst = FakeDevice::new(fmt, Duration::from_millis(2));
        // SAFETY: the fake's blocks belong to this test alone.
        let sink = unsafe { DeviceSink::new(dst.clone()) };
        assert_eq!(sink.pieces(), std::iter::once(0..2).collect::<Vec<_>>());
        assert_eq!(sink.frame_len(), n);
        let to = [BlockId(0), BlockId(5)];
        for (layer, bytes) in layers.iter().enumerate() {
            for (j, b) in to.iter().enumerate() {
                sink.write_piece(layer as u32, *b, 0, &bytes[j * n..(j + 1) * n]);
            }
        }
        assert_eq!(
            dst.frame(0, 0),
            vec![0; n],
            "nothing is uploaded before the slot fills or settles"
        );
        sink.settle(&to).unwrap();
        for layer in 0..fmt.layers {
            for (from, to) in blocks.iter().zip(&to) {
                assert_eq!(dst.frame(layer, to.index()), src.frame(layer, from.index()));
            }
            for untouched in [1, 2, 3, 4] {
                assert_eq!(dst.frame(layer, untouched), vec![0; n]);
            }
        }
        assert_eq!(sink.bytes(), (fmt.layers * 2 * n) as u64);
    }

    /// More frames than the sink's slots hold at once: full slots are uploaded as they fill,
    /// the oldest waited for when all are in flight, and every frame lands.
    #[test]
    fn a_long_transfer_cycles_through_the_staging_slots() {
        let fmt = gpu_format(120);
        let src = FakeDevice::new(fmt, Duration::ZERO);
        random_frames(&src, 2);
        let dst = FakeDevice::new(fmt, Duration::from_millis(1));
        // SAFETY: the fake's blocks belong to this test alone.
        let sink = unsafe { DeviceSink::new(dst.clone()) };
        let blocks: Vec<BlockId> = (0..120).map(BlockId).collect();
        let layers = export_staged(&*src, &blocks, &mut None).unwrap();
        let n = fmt.frame_bytes();
        // 360 frames: more than SLOTS · SLOT_FRAMES.
        assert!(fmt.layers * blocks.len() > SLOTS * SLOT_FRAMES);
        for (layer, bytes) in layers.iter().enumerate() {
            for (j, b) in blocks.iter().enumerate() {
                sink.write(layer as u32, *b, &bytes[j * n..(j + 1) * n]);
            }
        }
        sink.settle(&blocks).unwrap();
        for layer in 0..fmt.layers {
            for b in 0..120 {
                assert_eq!(
                    dst.frame(layer, b),
                    src.frame(layer, b),
                    "layer {layer} block {b}"
                );
            }
        }
        assert_eq!(sink.state().made, SLOTS);
    }

    /// A copy that fails (a device gone) fails the settle of the transfer whose blocks it
    /// carried, with the reason, and no other transfer's; the sink works again once the device
    /// does (no staging slot is lost for good); a frame of the wrong size or outside the pool is
    /// refused at its transfer's settle. An export through a failing device is an error, not a
    /// hang, and an export of no blocks is empty.
    #[test]
    fn failed_copies_fail_their_own_transfer_only() {
        let fmt = gpu_format(4);
        let dst = FakeDevice::new(fmt, Duration::from_millis(1));
        // SAFETY: the fake's blocks belong to this test alone.
        let sink = unsafe { DeviceSink::new(dst.clone()) };
        let n = fmt.frame_bytes();
        let frame = vec![7u8; n];
        dst.fail_copies(Some("device lost"));
        // More slots' worth of failing uploads than the sink has slots.
        for _ in 0..(SLOTS + 1) * SLOT_FRAMES {
            sink.write(0, BlockId(1), &frame);
        }
        // Another transfer's blocks hear nothing of it; block 1's transfer does.
        sink.settle(&[BlockId(3)]).unwrap();
        assert_eq!(
            sink.settle(&[BlockId(0), BlockId(1)]).unwrap_err(),
            "block 1: device KV copy: device lost"
        );
        // Reported once: a later settle of the same blocks finds nothing left.
        sink.settle(&[BlockId(1)]).unwrap();
        assert!(matches!(
            export_staged(&*dst, &[BlockId(0)], &mut None),
            Err(EngineError::Device(e)) if e == "device lost"
        ));
        dst.fail_copies(None);
        sink.write(0, BlockId(1), &frame);
        sink.settle(&[BlockId(1)]).unwrap();
        assert_eq!(dst.frame(0, 1), frame);
        sink.write(0, BlockId(2), &frame[1..]);
        assert!(sink
            .settle(&[BlockId(2)])
            .unwrap_err()
            .contains("bytes for layer 0 block 2"));
        sink.write(0, BlockId(9), &frame);
        assert!(sink.settle(&[BlockId(9)]).unwrap_err().contains("block 9"));
        assert!(export_staged(&*dst, &[BlockId(4)], &mut None).is_err());
        let none = export_staged(&*dst, &[], &mut None).unwrap();
        assert_eq!(none, vec![Vec::<u8>::new(); fmt.layers]);
    }

    /// A CPU cache's f32 frame (K transposed), converted by a receiver to bf16 and staged into a
    /// GPU's pool, is what the GPU's own cache write stores for those values: each K and V value
    /// rounded to nearest-even bf16 at its slot, K untransposed.
    #[test]
    fn a_cpu_frame_lands_in_a_gpu_pool_as_the_gpu_would_store_it() {
        let fmt = gpu_format(2);
        let l = fmt.layout;
        let dst = FakeDevice::new(fmt, Duration::from_millis(1));
        // SAFETY: the fake's blocks belong to this test alone.
        let sink = unsafe { DeviceSink::new(dst.clone()) };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let values: Vec<f32> = (0..l.block_floats())
            .map(|_| rng.gen_range(-4.0..4.0))
            .collect();
        let cpu_frame: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut wire = Vec::new();
        tandem_kv_transfer::convert_values(Float::F32, &cpu_frame, Float::Bf16, &mut wire);
        sink.write(1, BlockId(1), &wire);
        sink.settle(&[BlockId(1)]).unwrap();
        let got = dst.frame(1, 1);
        let (slots, dim) = (l.block_size, l.head_dim);
        let bf = |v: f32| half::bf16::from_f32(v).to_bits().to_le_bytes();
        let half_values = l.block_floats() / 2;
        for h in 0..l.num_kv_heads {
            for s in 0..slots {
                for d in 0..dim {
                    let base = h * slots * dim;
                    // The CPU's K: [head][dim][slot]; the GPU's: [head][slot][dim].
                    assert_eq!(
                        at(&got, base + s * dim + d, 2),
                        bf(values[base + d * slots + s])
                    );
                    let v = half_values + base + s * dim + d;
                    assert_eq!(at(&got, v, 2), bf(values[v]));
                }
            }
        }
    }
}
