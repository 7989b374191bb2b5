//! Processes: starting `tandem` roles ([`Launch`], and the one-line [`start_decode`],
//! [`start_prefill`], [`start_router`], [`spawn`]), waiting for their ready lines (parsed by the
//! one parser `tandem up` uses), and what the kernel says of them.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{model_path, KV_SECRET};
pub use tandem_discovery::Ready;

/// A child process killed (and reaped) on drop; the kernel kills it too if the test dies.
pub struct Proc {
    pub child: Child,
}

impl Proc {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tandem ARGS` and waits for the stdout line starting with `marker`; returns that line
/// (a role's ready line: read it with [`ready_line`]). [`Launch`] adds an environment.
pub fn spawn(args: &[String], marker: &'static str) -> (Proc, String) {
    Launch::command(args, marker).spawn()
}

/// Runs `cmd` (its stdout read here) and waits for the stdout line starting with `marker`;
/// returns that line.
pub fn spawn_command(cmd: Command, marker: &str) -> (Proc, String) {
    start_command(cmd, marker).wait()
}

/// A process started and not yet known to be ready: [`Starting::wait`] waits for its line.
pub struct Starting {
    proc: Proc,
    line: mpsc::Receiver<String>,
    what: String,
}

impl Starting {
    /// Waits for the process's ready line (the bound only catches one that never prints it).
    pub fn wait(mut self) -> (Proc, String) {
        match self.line.recv_timeout(Duration::from_secs(180)) {
            Ok(line) => (self.proc, line),
            Err(_) => {
                let status = self.proc.child.try_wait();
                panic!("{} did not print its ready line ({status:?})", self.what)
            }
        }
    }
}

/// Starts `cmd` (stdin closed, stdout read here, killed with this thread) without waiting:
/// several can start at once.
pub fn start_command(mut cmd: Command, marker: &str) -> Starting {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null()).stdout(Stdio::piped());
    // SAFETY: prctl only affects the child.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let what = format!("{cmd:?}");
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("start {what}: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let wanted = marker.to_string();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if !sent && line.starts_with(&wanted) {
                let _ = tx.send(line.trim().to_string());
                sent = true;
            }
        }
    });
    Starting {
        proc: Proc { child },
        line: rx,
        what,
    }
}

/// The KV pool of a test's worker, in MiB: 364 blocks of 16 tokens of the test model's f32 cache,
/// room for a request that reserves the model's whole context (4,096 tokens, 256 blocks; several
/// tests send one). Not the default gigabyte: a worker faults its whole pool in at start, which
/// cost 2.8 CPU-s of kernel time a start at 1 GiB and 0.6 at this size (2-core Zen 3).
pub const TEST_POOL_MB: usize = 256;

/// One `tandem` process to start: a role's flags for tests (loopback, ephemeral ports, the test
/// model, a [`TEST_POOL_MB`] KV pool), then the test's own flags and environment. Every process
/// gets the test cluster's [`KV_SECRET`] and quiet logs.
#[derive(Clone, Debug)]
pub struct Launch {
    args: Vec<String>,
    env: Vec<(String, String)>,
    marker: &'static str,
}

impl Launch {
    /// `tandem ARGS`, ready when it prints a line starting with `marker`.
    pub fn command(args: &[String], marker: &'static str) -> Self {
        Self {
            args: args.to_vec(),
            env: Vec::new(),
            marker,
        }
    }

    /// A decode worker with a KV endpoint.
    pub fn decode() -> Self {
        Self::command(
            &[
                "decode".into(),
                "--host=127.0.0.1".into(),
                "--port=0".into(),
                format!("--model={}", model_path().display()),
                format!("--kv-cache-mb={TEST_POOL_MB}"),
                "--kv-port=0".into(),
            ],
            Ready::DECODE,
        )
    }

    /// A prefill worker.
    pub fn prefill() -> Self {
        Self::command(
            &[
                "prefill".into(),
                "--host=127.0.0.1".into(),
                "--port=0".into(),
                format!("--model={}", model_path().display()),
                format!("--kv-cache-mb={TEST_POOL_MB}"),
            ],
            Ready::PREFILL,
        )
    }

    /// A router in front of decode workers `workers` (none: the test's flags say where they are).
    pub fn router(workers: &[String]) -> Self {
        let mut l = Self::command(
            &[
                "router".into(),
                "--host=127.0.0.1".into(),
                "--http-port=0".into(),
                "--grpc-port=0".into(),
                format!("--model={}", model_path().display()),
                "--poll-ms=100".into(),
            ],
            Ready::ROUTER,
        );
        if !workers.is_empty() {
            l.args
                .push(format!("--decode-workers={}", workers.join(",")));
        }
        l
    }

    /// Another model file than the test model, for the role's own `--model` flag.
    pub fn model(mut self, path: &std::path::Path) -> Self {
        for a in self.args.iter_mut().filter(|a| a.starts_with("--model=")) {
            *a = format!("--model={}", path.display());
        }
        self
    }

    /// More flags, after the role's.
    pub fn args(mut self, extra: &[&str]) -> Self {
        self.args.extend(extra.iter().map(|s| s.to_string()));
        self
    }

    /// Environment variables for the process.
    pub fn env(mut self, vars: &[(&str, &str)]) -> Self {
        self.env
            .extend(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self
    }

    /// The command, not started.
    pub fn to_command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        // The test's variables first: the log level and the cluster's secret are always these.
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .args(&self.args)
            .stderr(Stdio::inherit())
            .env("TANDEM_LOG", "warn")
            .env("TANDEM_KV_SECRET", KV_SECRET);
        cmd
    }

    /// Starts it without waiting: several can start at once.
    pub fn start(self) -> Starting {
        start_command(self.to_command(), self.marker)
    }

    /// Starts it and waits for its ready line.
    pub fn spawn(self) -> (Proc, String) {
        self.start().wait()
    }

    /// Starts a decode worker: its gRPC and KV addresses ("none" without a KV endpoint).
    pub fn spawn_decode(self) -> (Proc, String, String) {
        let (p, line) = self.spawn();
        match ready_line(&line) {
            Ready::Decode { grpc, kv } => (p, grpc, kv.unwrap_or_else(|| "none".into())),
            other => panic!("a decode worker printed {other}"),
        }
    }

    /// Starts a prefill worker: its gRPC address.
    pub fn spawn_prefill(self) -> (Proc, String) {
        let (p, line) = self.spawn();
        (p, ready_line(&line).grpc().to_string())
    }

    /// Starts a router.
    pub fn spawn_router(self) -> Router {
        let (p, line) = self.spawn();
        router_at(p, &line)
    }
}

/// A decode worker's gRPC address.
pub fn start_worker(extra: &[&str]) -> (Proc, String) {
    let (p, addr, _) = start_decode(extra);
    (p, addr)
}

/// A decode worker's gRPC and KV addresses.
pub fn start_decode(extra: &[&str]) -> (Proc, String, String) {
    Launch::decode().args(extra).spawn_decode()
}

/// A prefill worker's gRPC address.
pub fn start_prefill(extra: &[&str]) -> (Proc, String) {
    Launch::prefill().args(extra).spawn_prefill()
}

/// A router the test started: its process and its HTTP and gRPC base URLs.
pub struct Router {
    pub proc: Proc,
    pub http: String,
    pub grpc: String,
}

/// A router in front of decode workers `workers` (none: it finds them by `extra`'s discovery).
pub fn start_router(workers: &[String], extra: &[&str]) -> Router {
    Launch::router(workers).args(extra).spawn_router()
}

/// A process's ready line, parsed by the one parser `tandem up` uses too.
pub fn ready_line(line: &str) -> Ready {
    Ready::parse(line).unwrap_or_else(|| panic!("not a ready line: {line:?}"))
}

/// The HTTP address of `tandem up`'s ready line.
pub fn up_http(line: &str) -> String {
    match ready_line(line) {
        Ready::Up { http, .. } => http,
        other => panic!("tandem up printed {other}"),
    }
}

/// The router `proc` whose ready line is `line`.
pub fn router_at(proc: Proc, line: &str) -> Router {
    match ready_line(line) {
        Ready::Router { http, grpc } => Router {
            proc,
            http: format!("http://{http}"),
            grpc: format!("http://{grpc}"),
        },
        other => panic!("a router printed {other}"),
    }
}

/// The child processes of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(s.split_whitespace().filter_map(|x| x.parse::<i32>().ok()));
            }
        }
    }
    out.sort();
    out
}

/// Whether `pid` runs (a zombie still has a /proc entry; its state says so).
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// A free loopback port (free when asked; the caller binds it soon after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
