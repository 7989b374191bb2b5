//! `tandem`: one binary, a subcommand per role. This crate is the binary's code (its `main`,
//! [`main`], is all the root package's `src/main.rs` calls); it wires the crates together; each
//! subcommand's flags are one clap struct, and every flag also reads a `TANDEM_*` variable.

mod autoscale;
mod bench;
mod bench_serve;
mod fetch;
mod generate;
mod plan;
mod serve;
mod up;

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tandem_engine::{Engine, EngineConfig, KvDtype, PrefillOrder, TpCpuConfig, WeightFormat};

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Disaggregated LLM serving: router, prefill and decode workers"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// The whole cluster on this machine: a router, prefill and decode workers as child processes.
    Up(up::UpArgs),
    /// The router: OpenAI-compatible HTTP and gRPC in front of decode workers.
    Router(tandem_router::RouterArgs),
    /// A decode worker: the engine behind the gRPC Decode service.
    Decode(serve::DecodeArgs),
    /// A prefill worker: prompts prefilled for decode workers, KV pushed to them.
    Prefill(serve::PrefillArgs),
    /// Make the worker on this host leave the cluster before it is stopped (Kubernetes' preStop
    /// hook): it takes no new requests and finishes the ones it has; SIGTERM then stops it.
    Deregister(serve::DeregisterArgs),
    /// Generate offline: JSON lines on stdin (--jsonl), or one prompt streamed as text.
    Generate(generate::GenerateArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
    /// How many prefill and decode workers a load needs to meet TTFT and ITL targets at least
    /// cost, from measured profiles (`tandem bench profile`) and a queueing model.
    Plan(plan::PlanArgs),
    /// Manage model files.
    Model {
        #[command(subcommand)]
        what: ModelCommand,
    },
    /// The CPU kernel levels: which this CPU runs, and which this process would use
    /// (TANDEM_ISA=scalar|avx2|avx512|amx caps it).
    Isa {
        /// Print only the names of the levels this CPU runs, one per line, lowest first.
        #[arg(long)]
        supported: bool,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Fetch the default model (SmolLM2-135M-Instruct, GGUF Q4_1) into the model cache.
    Fetch {
        /// Fetch again even if the cached file is present and intact.
        #[arg(long)]
        force: bool,
    },
}

/// Flags shared by every command that runs the engine.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// GGUF file or HF model directory; the default model (fetched if missing) when not given.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// Where steps run: cpu, or a CUDA GPU (cuda, cuda:N; weights and cache in bf16 there).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: tandem_kernels::cuda::DeviceSpec,
    /// Weight storage on the CPU: as in the file (native), or decoded to f32 at load.
    #[arg(long, env = "TANDEM_WEIGHTS", default_value = "native")]
    pub weights: WeightFormat,
    /// Compute threads (default: all cores).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size in MiB.
    #[arg(long, env = "TANDEM_KV_CACHE_MB", default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// On a GPU: size the KV pool so that the weights, the pool and whatever else the device
    /// holds when it is sized fill this share of its memory (as vLLM's flag of that name); a
    /// step's activations come on top, so leave them room (0.9 leaves a tenth). Overrides
    /// --kv-cache-mb. Refused on the CPU.
    #[arg(long, env = "TANDEM_GPU_MEMORY_FRACTION")]
    pub gpu_memory_fraction: Option<f64>,
    /// On a GPU: launch every kernel of every step from the host, capturing no CUDA graphs (as
    /// vLLM's flag of that name). By default a decode step of up to 256 sequences and contexts
    /// up to 8192 tokens runs as its batch-size bucket's graph, captured at the bucket's first
    /// step. The CPU runs every step eagerly either way.
    #[arg(long, env = "TANDEM_ENFORCE_EAGER")]
    pub enforce_eager: bool,
    /// Token budget of one forward pass.
    #[arg(long, env = "TANDEM_MAX_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, env = "TANDEM_MAX_SEQS", default_value_t = 256)]
    pub max_seqs: usize,
    /// Order prompts are computed in: arrival (first come, first served) or shortest (fewest
    /// prompt tokens left first; a prompt passed over 32 times goes next).
    #[arg(long, env = "TANDEM_PREFILL_ORDER", default_value = "arrival")]
    pub prefill_order: PrefillOrder,
    /// Keep each step within this many milliseconds while prompts are computed: a step's
    /// tokens are sized from what the engine's steps have cost (so decoding sequences get a
    /// token about this often, and a burst's prompts finish one by one instead of together).
    /// A prompt of up to 256 tokens is never cut by it: where such a chunk takes longer (a slow
    /// machine), a step with one takes that long. 0: off, every step may take
    /// --max-batched-tokens. Default: 250 in the serving roles (decode and prefill workers),
    /// off in generate and the engine benchmarks.
    #[arg(long, env = "TANDEM_STEP_TARGET_MS")]
    pub step_target_ms: Option<f64>,
    /// Keep decoding streams' inter-token gaps near this many milliseconds: a step that holds a
    /// decoding sequence takes only the prompt tokens that fit in this time by the engine's
    /// measure of its steps (16 at least, so prompts keep moving); a step with no stream
    /// decoding keeps --step-target-ms. The router sends a prompt to a prefill worker when
    /// computing it here would take longer than this while streams decode. 0 or unset: off
    /// (the serving roles then keep their gaps with --step-target-ms alone).
    #[arg(long, env = "TANDEM_ITL_TARGET_MS")]
    pub itl_target_ms: Option<f64>,
    /// KV cache element type: f32 (exact), f16 (half the bytes, each value rounded to 11
    /// significant bits) or int8 (a byte per value, a scale per token and head).
    #[arg(long, env = "TANDEM_KV_DTYPE", default_value = "f32")]
    pub kv_dtype: KvDtype,
    /// KV pool size in blocks (overrides --kv-cache-mb).
    #[arg(long, env = "TANDEM_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Tokens of growth per running sequence that admission keeps free blocks for (0: admit
    /// whenever a new prompt's first chunk fits, and preempt later if the pool runs out).
    #[arg(long, env = "TANDEM_ADMISSION_LOOKAHEAD", default_value_t = 64)]
    pub admission_lookahead: usize,
    /// Do not reuse KV blocks of identical prompt prefixes across requests.
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHING")]
    pub no_prefix_caching: bool,
    /// A disk tier under the prefix cache: KV blocks the pool evicts are written here and read
    /// back (checksummed) for later requests with the same prefix, across restarts too.
    /// Workers may share the directory: each keeps the blocks of its model and cache layout
    /// apart.
    #[arg(long, env = "TANDEM_KV_DISK_DIR")]
    pub kv_disk_dir: Option<PathBuf>,
    /// Most GiB of KV blocks this worker keeps in --kv-disk-dir (the least recently used go
    /// first).
    #[arg(long, env = "TANDEM_KV_DISK_GB", default_value_t = 16.0)]
    pub kv_disk_gb: f64,
    /// Most milliseconds a request waits for its prefix's blocks to be read back from
    /// --kv-disk-dir; what has not arrived by then it computes (a slow or busy volume holds a
    /// prompt up no longer than this).
    #[arg(long, env = "TANDEM_KV_DISK_MAX_WAIT_MS", default_value_t = 2000)]
    pub kv_disk_max_wait_ms: u64,
    /// Other workers write --kv-disk-dir too (a volume a group shares): look for the blocks
    /// they wrote every few seconds, and read each other's.
    #[arg(long, env = "TANDEM_KV_DISK_SHARED")]
    pub kv_disk_shared: bool,
    /// Tensor-parallel ranks: the model split over this many rank threads of this process,
    /// each with its share of the weights and of the KV heads, and --threads shared among them
    /// (1: no tensor parallelism). With --device cuda:N, a rank per GPU on GPUs N to
    /// N + tp - 1, exchanging through NCCL.
    #[arg(long, env = "TANDEM_TP", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp: u32,
    /// Expert-parallel ranks, for a mixture of experts: its experts split over this many rank
    /// threads of this process (each holds a block of them and everything else whole; each
    /// step's sequences are split among the ranks for attention, and every token's rows go to
    /// the ranks of its experts and back), --threads shared among them. The same bits as 1.
    /// Not with --tp above 1.
    #[arg(long, env = "TANDEM_EP", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub ep: u32,
    /// Seconds a tensor-parallel collective waits for its peers before it fails the step
    /// (a stuck rank fails the step with an error instead of hanging the group); on GPUs, where
    /// a step's collectives are queued behind its kernels, how long a step's wait for them lasts.
    #[arg(long, env = "TANDEM_TP_WATCHDOG_SECS", default_value_t = 120.0)]
    pub tp_watchdog_secs: f64,
    /// Speculative decoding: each decoding sequence's next tokens are proposed cheaply and
    /// verified in one step, with the outputs it gives without (greedy and seeded alike).
    /// ngram: prompt lookup over the request's own tokens; suffix: that and a worker-wide
    /// index of recent outputs (traffic that repeats itself); self:N: a self-draft, the
    /// model's own first N layers with its head (an early exit over the same KV cache; pays
    /// only for a model trained to exit early); draft:PATH: a smaller model with the same
    /// tokenizer (GGUF file or HF directory) run on the CPU beside the target over a KV pool
    /// of its own, as many blocks as the target's. Off when not given.
    #[arg(long, env = "TANDEM_SPECULATIVE")]
    pub speculative: Option<tandem_engine::SpecMethod>,
    /// Most tokens proposed per sequence and step (with --speculative). Default: 2 on the CPU
    /// at the AVX2 kernel level, 4 elsewhere (see [`default_speculative_tokens`]).
    #[arg(long, env = "TANDEM_NUM_SPECULATIVE_TOKENS")]
    pub num_speculative_tokens: Option<usize>,
    /// Verify every proposed token, instead of only those the measured cost of the steps says
    /// pay (by default a step verifies what is expected to raise its tokens per second, and a
    /// loaded, compute-bound step decodes plainly).
    #[arg(long, env = "TANDEM_SPECULATIVE_FIXED")]
    pub speculative_fixed: bool,
}

/// Most tokens a sequence proposes a step unless `--num-speculative-tokens` says: 2 on the CPU
/// at the AVX2 kernel level, 4 elsewhere. What a verify step costs follows the product kernels'
/// paths by row count. At AVX2 a one-sequence step of up to three rows costs little more than
/// one (each weight decoded once in registers for all of them), and a fourth row almost a step
/// more (its kernel has too few registers for four rows' accumulators and the weights): the model's
/// products on a 2-core Zen 3 (`decode_matmul`) take 6.2 ms for one row, 6.4 for two, 7.8 for
/// three, 12.4 for four (about 11 since its kernel keeps every accumulator in a register) and
/// 13.5 for five. One edit stream there (`tandem bench serve --dataset
/// edit --concurrency 1`, suffix proposer, two rounds, decode tokens/s over plain decoding):
/// 2 tokens 1.42x and 1.84x, 3 tokens 1.38x and 1.71x (1.40x and 1.70x in another run, beside
/// 4 tokens' 1.38x and 1.62x). AVX-512 fuses up to eight rows, and 4 was measured there; the
/// portable level and GPUs keep it.
pub fn default_speculative_tokens(device: &tandem_kernels::cuda::DeviceSpec) -> usize {
    use tandem_kernels::isa::{active, Isa};
    match (device, active()) {
        (tandem_kernels::cuda::DeviceSpec::Cpu, Isa::Avx2) => 2,
        _ => 4,
    }
}

impl EngineArgs {
    /// The same settings as command-line flags, for a child process.
    pub fn flags(&self) -> Vec<String> {
        let mut f = vec![
            format!("--device={}", self.device),
            format!("--weights={}", format!("{:?}", self.weights).to_lowercase()),
            format!("--block-size={}", self.block_size),
            format!("--kv-cache-mb={}", self.kv_cache_mb),
            format!("--max-batched-tokens={}", self.max_batched_tokens),
            format!("--max-seqs={}", self.max_seqs),
            format!("--prefill-order={}", self.prefill_order),
            format!("--kv-dtype={}", self.kv_dtype),
            format!("--admission-lookahead={}", self.admission_lookahead),
            format!("--tp={}", self.tp),
            format!("--ep={}", self.ep),
            format!("--tp-watchdog-secs={}", self.tp_watchdog_secs),
        ];
        if let Some(m) = &self.model {
            f.push(format!("--model={}", m.display()));
        }
        if let Some(t) = self.threads {
            f.push(format!("--threads={t}"));
        }
        if let Some(b) = self.kv_blocks {
            f.push(format!("--kv-blocks={b}"));
        }
        if let Some(g) = self.gpu_memory_fraction {
            f.push(format!("--gpu-memory-fraction={g}"));
        }
        if self.no_prefix_caching {
            f.push("--no-prefix-caching".into());
        }
        if self.enforce_eager {
            f.push("--enforce-eager".into());
        }
        if let Some(t) = self.step_target_ms {
            f.push(format!("--step-target-ms={t}"));
        }
        if let Some(t) = self.itl_target_ms {
            f.push(format!("--itl-target-ms={t}"));
        }
        if let Some(s) = &self.speculative {
            f.push(format!("--speculative={s}"));
            if let Some(k) = self.num_speculative_tokens {
                f.push(format!("--num-speculative-tokens={k}"));
            }
            if self.speculative_fixed {
                f.push("--speculative-fixed".into());
            }
        }
        f
    }

    /// Speculative decoding as the flags ask for it (none without --speculative).
    pub fn speculative(&self) -> Option<tandem_engine::SpecConfig> {
        self.speculative
            .clone()
            .map(|method| tandem_engine::SpecConfig {
                method,
                tokens: self
                    .num_speculative_tokens
                    .unwrap_or_else(|| default_speculative_tokens(&self.device)),
                adaptive: !self.speculative_fixed,
            })
    }

    /// The tensor-parallel group the flags ask for: `--threads` (all cores by default) shared
    /// among the ranks, one at least each.
    pub fn tp(&self) -> Result<TpCpuConfig> {
        let w = self.tp_watchdog_secs;
        anyhow::ensure!(
            w.is_finite() && w > 0.0,
            "--tp-watchdog-secs {w} must be a positive number of seconds"
        );
        anyhow::ensure!(
            self.tp == 1 || self.ep == 1,
            "--tp {} with --ep {}: a group is tensor-parallel or expert-parallel, not both",
            self.tp,
            self.ep
        );
        let size = self.tp.max(self.ep) as usize;
        let threads = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        Ok(TpCpuConfig {
            size,
            threads_per_rank: (threads / size).max(1),
            watchdog: std::time::Duration::from_secs_f64(w),
            max_step_tokens: self.max_batched_tokens,
            max_step_seqs: self.max_seqs,
            experts: self.ep > 1,
        })
    }

    /// `--step-target-ms` as a duration (none at 0 or unset).
    pub fn step_target(&self) -> Result<Option<std::time::Duration>> {
        target("--step-target-ms", self.step_target_ms)
    }

    /// `--itl-target-ms` as a duration (none at 0 or unset).
    pub fn itl_target(&self) -> Result<Option<std::time::Duration>> {
        target("--itl-target-ms", self.itl_target_ms)
    }

    /// The disk tier's configuration, when `--kv-disk-dir` is given: its blocks are kept for
    /// this model's file, weight format and kernel level (the bits a block holds depend on
    /// all three).
    fn kv_disk(&self, model: &std::path::Path) -> Result<Option<tandem_engine::KvDiskConfig>> {
        let Some(dir) = &self.kv_disk_dir else {
            return Ok(None);
        };
        anyhow::ensure!(
            self.kv_disk_gb.is_finite() && self.kv_disk_gb > 0.0,
            "--kv-disk-gb {} must be a positive number of GiB",
            self.kv_disk_gb
        );
        let identity = format!(
            "{}|weights {:?}|kernels {}",
            tandem_model::file_identity(model)
                .with_context(|| format!("reading {}", model.display()))?,
            self.weights,
            tandem_kernels::isa::active().name()
        );
        let mut c = tandem_engine::KvDiskConfig::new(
            dir,
            (self.kv_disk_gb * (1u64 << 30) as f64) as u64,
            &identity,
        );
        c.max_wait = std::time::Duration::from_millis(self.kv_disk_max_wait_ms);
        if self.kv_disk_shared {
            c.rescan = Some(std::time::Duration::from_secs(5));
        }
        Ok(Some(c))
    }

    /// Loads the model (fetching the default if needed) and builds an engine.
    pub fn build(&self) -> Result<(Engine, tandem_model::LoadedModel)> {
        tandem_kernels::init_threads(self.threads);
        let path = match &self.model {
            Some(p) => p.clone(),
            None => fetch::ensure_default_model()?,
        };
        let loaded =
            tandem_model::load(&path).with_context(|| format!("loading {}", path.display()))?;
        let cfg = EngineConfig {
            block_size: self.block_size,
            kv_cache_mb: self.kv_cache_mb,
            gpu_memory_fraction: self.gpu_memory_fraction,
            max_batched_tokens: self.max_batched_tokens,
            max_seqs: self.max_seqs,
            kv_dtype: self.kv_dtype,
            prefix_caching: !self.no_prefix_caching,
            num_blocks: self.kv_blocks,
            admission_lookahead: self.admission_lookahead,
            prefill_order: self.prefill_order,
            step_target: self.step_target()?,
            step_target_whole: crate::serve::STEP_TARGET_WHOLE_TOKENS,
            itl_target: self.itl_target()?,
            panic_at_step: test_panic_at_step()?,
            kv_disk: self.kv_disk(&path)?,
            speculative: self.speculative(),
        };
        cfg.check()?;
        if let Some(tandem_engine::SpecMethod::Draft(draft)) = &self.speculative {
            // The engine loads the draft's weights; its tokenizer must be the target's.
            let d = tandem_model::load_text(draft)
                .with_context(|| format!("loading the draft model {}", draft.display()))?;
            if let Some(diff) = loaded.tokenizer.vocabulary_difference(&d.tokenizer) {
                anyhow::bail!(
                    "--speculative draft:{}: the draft's tokenizer is not the target's ({diff})",
                    draft.display()
                );
            }
        }
        let tp = self.tp()?;
        let mut backend = tandem_engine::device::on(
            self.device,
            &loaded,
            &cfg.pool(),
            self.weights,
            tp,
            self.enforce_eager,
        )
        .with_context(|| format!("starting the model on {}", self.device))?;
        let slowdown = test_slowdown()?;
        if slowdown > 1.0 {
            backend = Box::new(tandem_engine::backend::Slowed::new(backend, slowdown)?);
        }
        let grammars = tandem_grammar::GrammarCompiler::new(
            loaded.tokenizer.clone(),
            loaded.config.vocab_size,
        );
        let engine = Engine::with_backend(backend, cfg, loaded.tokenizer.eos_token_ids.clone())?
            .with_grammars(std::sync::Arc::new(grammars));
        Ok((engine, loaded))
    }
}

/// `TANDEM_TEST_SLOWDOWN`: every engine step takes this many times its compute time, so the
/// tests (and anyone checking deadlines) can run this machine as if it were that much slower.
/// Unset in production.
fn test_slowdown() -> Result<f64> {
    match std::env::var("TANDEM_TEST_SLOWDOWN") {
        Err(_) => Ok(1.0),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 1.0)
            .with_context(|| format!("TANDEM_TEST_SLOWDOWN={v:?} is not a number of at least 1")),
    }
}

/// `TANDEM_TEST_PANIC_AT_STEP`: the engine thread panics in that step, as a bug would (the
/// tests check what a worker does then). Unset in production.
fn test_panic_at_step() -> Result<Option<u64>> {
    match std::env::var("TANDEM_TEST_PANIC_AT_STEP") {
        Err(_) => Ok(None),
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n >= 1)
            .map(Some)
            .with_context(|| {
                format!("TANDEM_TEST_PANIC_AT_STEP={v:?} is not a step number (from 1)")
            }),
    }
}

fn print_isa(names_only: bool) {
    use tandem_kernels::isa::{self, Isa};
    if names_only {
        isa::supported().for_each(|l| println!("{l}"));
        return;
    }
    for l in Isa::ALL {
        let mark = if l == isa::active() {
            "active"
        } else if l <= isa::detected() {
            "runs here"
        } else {
            "not on this CPU"
        };
        println!("{:<8} {:<16} {}", l.name(), mark, l.describe());
    }
    println!("{}", isa::summary());
}

/// The `tandem` command: parses the command line and runs the subcommand.
pub fn main() {
    let cli = Cli::parse();
    // Each role is its own service in a trace; `up` itself serves nothing.
    let service = match &cli.command {
        Command::Router(_) => "tandem-router",
        Command::Decode(_) => "tandem-decode",
        Command::Prefill(_) => "tandem-prefill",
        _ => "tandem",
    };
    let log_filter = std::env::var("TANDEM_LOG").unwrap_or_else(|_| "warn".into());
    let telemetry = match tandem_telemetry::init(service, &log_filter) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    // A misspelt level would silently run the CPU's best: refuse it before anything runs.
    if let Err(e) = tandem_kernels::isa::requested() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    tracing::info!("{}", tandem_kernels::isa::summary());
    let res = match cli.command {
        Command::Up(a) => up::run(a),
        Command::Router(a) => serve::run_router(a),
        Command::Decode(a) => serve::run_decode(a),
        Command::Prefill(a) => serve::run_prefill(a),
        Command::Deregister(a) => serve::run_deregister(a),
        Command::Generate(a) => generate::run(a),
        Command::Bench { what } => bench::run(what),
        Command::Plan(a) => plan::run(a),
        Command::Model {
            what: ModelCommand::Fetch { force },
        } => fetch::fetch_default(force).map(|p| println!("{}", p.display())),
        Command::Isa { supported } => {
            print_isa(supported);
            Ok(())
        }
    };
    // Flush the spans still buffered before the process goes.
    drop(telemetry);
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// A millisecond target flag as a duration: none at 0 or unset, refused when negative or not a
/// number.
fn target(flag: &str, ms: Option<f64>) -> Result<Option<std::time::Duration>> {
    let ms = ms.unwrap_or(0.0);
    anyhow::ensure!(
        ms.is_finite() && ms >= 0.0,
        "{flag} {ms} must be 0 (off) or a positive number of milliseconds"
    );
    Ok((ms > 0.0).then(|| std::time::Duration::from_secs_f64(ms / 1e3)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kernels::cuda::DeviceSpec;
    use tandem_kernels::isa::{active, Isa};

    /// The engine's flags from `args` alone: no TANDEM_* variable of the test's environment
    /// is read.
    fn parse(args: &[&str]) -> EngineArgs {
        use clap::{CommandFactory, FromArgMatches};
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let m = Cli::command()
            .mut_args(|a| a.env(None))
            .try_get_matches_from(["tandem"].iter().chain(args))
            .unwrap();
        Cli::from_arg_matches(&m).unwrap().engine
    }

    /// Two tokens a proposal on the CPU at AVX2, four at every other level and on a GPU; a
    /// worker started by `up` without the flag works the default out itself, and an explicit
    /// count is passed on and used.
    #[test]
    fn the_speculative_tokens_default_follows_the_kernel_level() {
        let cpu = default_speculative_tokens(&DeviceSpec::Cpu);
        assert_eq!(cpu, if active() == Isa::Avx2 { 2 } else { 4 });
        assert_eq!(default_speculative_tokens(&DeviceSpec::Cuda(0)), 4);
        let parse = |extra: &[&str]| {
            let args: Vec<&str> = ["--speculative=ngram"]
                .iter()
                .chain(extra)
                .copied()
                .collect();
            parse(&args)
        };
        let default = parse(&[]);
        assert!(!default
            .flags()
            .iter()
            .any(|f| f.starts_with("--num-speculative-tokens")));
        assert_eq!(default.speculative().unwrap().tokens, cpu);
        let three = parse(&["--num-speculative-tokens=3"]);
        assert!(three
            .flags()
            .contains(&"--num-speculative-tokens=3".to_string()));
        assert_eq!(three.speculative().unwrap().tokens, 3);
    }

    /// The disk tier's wait for a prefix's blocks is 2 s unless the flag says otherwise; no
    /// tier without a directory.
    #[test]
    fn the_disk_tier_waits_as_long_as_its_flag_says() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.gguf");
        std::fs::write(&model, b"GGUF").unwrap();
        let disk = format!("--kv-disk-dir={}", dir.path().join("kv").display());
        let wait = |args: &[&str]| parse(args).kv_disk(&model).unwrap().map(|c| c.max_wait);
        assert_eq!(wait(&[]), None);
        assert_eq!(wait(&[&disk]), Some(std::time::Duration::from_secs(2)));
        assert_eq!(
            wait(&[&disk, "--kv-disk-max-wait-ms=250"]),
            Some(std::time::Duration::from_millis(250))
        );
    }
}
