//! Paged attention on the device: one packed step's sequences uploaded once ([`AttnBatch`]),
//! then per layer the tiled kernel over the prompt chunks' rows, the decode kernel over the
//! single new rows (both split along the context at fixed positions, with the same arithmetic
//! per row) and, where a context has several splits, the combine.

use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use super::{drv, shape, CudaOps};
use crate::cuda::{decode_splits, table_blocks, AttnParams, CudaError, DECODE_SPLIT_LEN};

/// Sequences of a packed attention call, on the device (built by [`CudaOps::attn_batch`]).
pub struct AttnBatch {
    /// Entries per block-table row: the longest table (at least 1).
    pub max_blocks: usize,
    block_tables: CudaSlice<i32>,
    q_start: CudaSlice<i32>,
    q_len: CudaSlice<i32>,
    context: CudaSlice<i32>,
    /// Tiles: (sequence, first new token) per 16 query rows; first those of sequences with
    /// several new rows, then the single-row (decode) ones.
    tiles: CudaSlice<i32>,
    /// Number of tiles ([`PREFILL_TILE_ROWS`] query rows of one sequence each).
    pub n_tiles: usize,
    /// How many of them (the last ones) are single decode rows.
    pub n_decode_tiles: usize,
    /// Splits of the longest context, and the rows' partial results (kept for the whole step,
    /// so the layers' launches never wait to free them).
    pub splits: usize,
    part_out: CudaSlice<f32>,
    part_ml: CudaSlice<f32>,
}

impl AttnBatch {
    /// Device bytes the batch holds.
    pub fn bytes(&self) -> usize {
        4 * (self.block_tables.len()
            + self.q_start.len()
            + self.q_len.len()
            + self.context.len()
            + self.tiles.len()
            + self.part_out.len()
            + self.part_ml.len())
    }
}

/// An [`AttnBatch`]'s values on the host, before they go up.
struct BatchHost<'a> {
    /// The tables, `max_blocks` entries a sequence, and that count.
    block_tables: (&'a [i32], usize),
    q_start: &'a [i32],
    q_len: &'a [i32],
    context: &'a [i32],
    /// (sequence, first new token) pairs, how many, and how many of them (the last) decode.
    tiles: (&'a [i32], usize, usize),
    /// Query rows in all.
    rows: usize,
}

/// Query rows per prefill attention tile (`TQ` in attention.cu).
pub const PREFILL_TILE_ROWS: usize = 16;

/// The most query heads per KV head the decode kernel serves (`G_MAX` in attention.cu).
const DECODE_MAX_GROUP: usize = 8;

impl CudaOps {
    /// Uploads one packed step's sequences: block tables padded to the longest, query ranges,
    /// context lengths and the prefill tiles.
    pub fn attn_batch(
        &self,
        block_tables: &[&[u32]],
        q_len: &[usize],
        context: &[usize],
        (nq, hd): (usize, usize),
    ) -> Result<AttnBatch, CudaError> {
        let seqs = block_tables.len();
        let max_blocks = block_tables
            .iter()
            .map(|b| b.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut bt = vec![0i32; seqs * max_blocks];
        for (s, t) in block_tables.iter().enumerate() {
            for (i, &b) in t.iter().enumerate() {
                bt[s * max_blocks + i] = b as i32;
            }
        }
        let mut starts = Vec::with_capacity(seqs);
        let mut tiles = Vec::new();
        let mut decode_tiles = Vec::new();
        let mut row = 0usize;
        for (s, &n) in q_len.iter().enumerate() {
            starts.push(row as i32);
            if n == 1 {
                decode_tiles.extend([s as i32, 0]);
            } else {
                for q0 in (0..n).step_by(PREFILL_TILE_ROWS) {
                    tiles.extend([s as i32, q0 as i32]);
                }
            }
            row += n;
        }
        let n_decode_tiles = decode_tiles.len() / 2;
        tiles.extend(decode_tiles);
        let n_tiles = tiles.len() / 2;
        if tiles.is_empty() {
            tiles.extend([0, 0]);
        }
        let as_i32 = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        let splits = decode_splits(context.iter().copied().max().unwrap_or(0));
        self.batch_on_device(
            BatchHost {
                block_tables: (&bt, max_blocks),
                q_start: &starts,
                q_len: &as_i32(q_len),
                context: &as_i32(context),
                tiles: (&tiles, n_tiles, n_decode_tiles),
                rows: row,
            },
            splits,
            (nq, hd),
        )
    }

    /// A batch's host side uploaded, with room for the partial results of `splits` splits of
    /// each row's heads.
    fn batch_on_device(
        &self,
        h: BatchHost<'_>,
        splits: usize,
        (nq, hd): (usize, usize),
    ) -> Result<AttnBatch, CudaError> {
        let parts = if splits > 1 { h.rows * nq * splits } else { 1 };
        Ok(AttnBatch {
            splits,
            part_out: self.stream.alloc_zeros::<f32>(parts * hd).map_err(drv)?,
            part_ml: self.stream.alloc_zeros::<f32>(parts * 2).map_err(drv)?,
            max_blocks: h.block_tables.1,
            block_tables: self.upload(h.block_tables.0)?,
            q_start: self.upload(h.q_start)?,
            q_len: self.upload(h.q_len)?,
            context: self.upload(h.context)?,
            tiles: self.upload(h.tiles.0)?,
            n_tiles: h.tiles.1,
            n_decode_tiles: h.tiles.2,
        })
    }

    /// A batch of decode rows (one new token a sequence, row i sequence i) whose buffers stay
    /// put: a decode step's CUDA graph reads them at the addresses it was captured with, and
    /// each replay rewrites only the block tables and context lengths
    /// ([`Self::refill_decode_batch`]). It starts with this step's: each row's block table
    /// (`table_blocks(max_context, block_size)` entries a row) and context length (0: a row
    /// that attends to nothing). The partial results have room for `max_context`'s splits,
    /// which every launch takes (a row's bits are those of any other split count: its own
    /// splits are fixed by its position, and a row of one split is copied by the combine, not
    /// merged).
    pub fn decode_attn_batch(
        &self,
        block_tables: &[i32],
        context: &[i32],
        max_context: usize,
        block_size: usize,
        heads: (usize, usize),
    ) -> Result<AttnBatch, CudaError> {
        let rows = context.len();
        let max_blocks = table_blocks(max_context, block_size);
        if rows == 0 || block_tables.len() != rows * max_blocks {
            return Err(shape(format!(
                "a decode batch of {rows} rows with {} table entries for {max_blocks} a row",
                block_tables.len()
            )));
        }
        let starts: Vec<i32> = (0..rows as i32).collect();
        let tiles: Vec<i32> = (0..rows as i32).flat_map(|s| [s, 0]).collect();
        self.batch_on_device(
            BatchHost {
                block_tables: (block_tables, max_blocks),
                q_start: &starts,
                q_len: &vec![1; rows],
                context,
                tiles: (&tiles, rows, rows),
                rows,
            },
            decode_splits(max_context),
            heads,
        )
    }

    /// A [`Self::decode_attn_batch`]'s rows for this step: each row's block table (`max_blocks`
    /// entries a row) and context length (0: a row that attends to nothing), copied into its
    /// buffers in stream order.
    pub fn refill_decode_batch(
        &self,
        batch: &mut AttnBatch,
        block_tables: &[i32],
        context: &[i32],
    ) -> Result<(), CudaError> {
        let rows = batch.n_tiles;
        if batch.n_decode_tiles != rows
            || context.len() != rows
            || block_tables.len() != rows * batch.max_blocks
        {
            return Err(shape(format!(
                "a decode batch of {rows} rows and {} blocks a row refilled with {} tables and {} contexts",
                batch.max_blocks,
                block_tables.len(),
                context.len()
            )));
        }
        self.write(&mut batch.block_tables, block_tables)?;
        self.write(&mut batch.context, context)
    }

    /// Paged attention of a packed step: the tiled kernel over the chunks' rows, the decode
    /// kernel over single new rows (the tiled one takes them too where the decode kernel cannot:
    /// more than 8 query heads per KV head, or heads under 32 values), each over every split,
    /// then the combine where the longest context has several splits.
    /// `q` holds token rows of `q_stride` values (q heads first); `out` token rows of nq·hd.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        batch: &mut AttnBatch,
        q: &CudaSlice<u16>,
        q_stride: usize,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        (nq, nkv, hd): (usize, usize, usize),
        block_size: usize,
    ) -> Result<(), CudaError> {
        if nkv == 0 || nq % nkv != 0 || hd == 0 || 128 % hd != 0 || hd > 128 {
            return Err(shape(format!(
                "attention with {nq} heads, {nkv} KV heads of {hd} (head size must divide 128)"
            )));
        }
        let splits = batch.splits;
        let s = &self.stream;
        let params = AttnParams {
            q: q.device_ptr(s).0,
            k_cache: k_cache.device_ptr(s).0,
            v_cache: v_cache.device_ptr(s).0,
            out: out.device_ptr_mut(s).0,
            block_tables: batch.block_tables.device_ptr(s).0,
            seq_q_start: batch.q_start.device_ptr(s).0,
            seq_q_len: batch.q_len.device_ptr(s).0,
            seq_context: batch.context.device_ptr(s).0,
            tiles: batch.tiles.device_ptr(s).0,
            part_out: batch.part_out.device_ptr_mut(s).0,
            part_ml: batch.part_ml.device_ptr_mut(s).0,
            q_stride: q_stride as i32,
            nq: nq as i32,
            nkv: nkv as i32,
            hd: hd as i32,
            block_size: block_size as i32,
            max_blocks: batch.max_blocks as i32,
            split_len: DECODE_SPLIT_LEN as i32,
            max_splits: splits as i32,
            scale: 1.0 / (hd as f32).sqrt(),
            reserved: 0,
        };
        let heads = nq as u32;
        if batch.n_tiles > 0 {
            let decode = if nq / nkv <= DECODE_MAX_GROUP && hd >= 32 {
                batch.n_decode_tiles
            } else {
                0
            };
            let tiled = batch.n_tiles - decode;
            if tiled > 0 {
                let grid = (tiled as u32, heads, splits as u32);
                self.launch_attn(&self.k.attention, &params, grid, 0)?;
            }
            if decode > 0 {
                // The same parameters over the tile list's tail.
                let mut dp = params;
                dp.tiles += (tiled * 2 * std::mem::size_of::<i32>()) as u64;
                let grid = (decode as u32, nkv as u32, splits as u32);
                self.launch_attn(&self.k.attention_decode, &dp, grid, 0)?;
            }
            if splits > 1 {
                let grid = (batch.n_tiles as u32, heads, 1);
                self.launch_attn(&self.k.combine, &params, grid, 0)?;
            }
        }
        Ok(())
    }

    /// One attention kernel over `grid` blocks of 128 threads.
    fn launch_attn(
        &self,
        f: &CudaFunction,
        params: &AttnParams,
        grid: (u32, u32, u32),
        shared_bytes: usize,
    ) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (128, 1, 1),
            shared_mem_bytes: shared_bytes as u32,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(params);
        // SAFETY: every pointer in `params` is a live device allocation of the sizes the kernel
        // reads (the batch was built from the same sequences, the buffers checked by the caller).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv)
    }
}
