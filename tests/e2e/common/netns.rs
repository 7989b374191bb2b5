//! Network namespaces standing in for hosts: a bridge in a "switch" namespace and one namespace
//! per host plugged into it, with addresses the test chooses (private ones, inside these
//! namespaces only), and running work inside one of them.

use std::process::Command;

/// `ip ARGS`, which must succeed.
pub fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2's ip (scripts/test installs it)");
    assert!(
        o.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Nets made so far by this process.
static NETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Namespaces joined by a bridge; deleted on drop.
pub struct Net {
    prefix: String,
    made: Vec<String>,
}

impl Net {
    pub fn new() -> Self {
        let mut net = Self {
            // One name per Net, so tests that run at once in this process do not collide.
            prefix: format!(
                "tdm{}n{}",
                std::process::id(),
                NETS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            made: Vec::new(),
        };
        let sw = net.ns("sw");
        ip(&["netns", "add", &sw]);
        net.made.push(sw.clone());
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        net
    }

    pub fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    /// A host: its namespace, with loopback and eth0 at `addr` (a /24) plugged into the switch
    /// (its port there is named after the host).
    pub fn host(&mut self, host: &str, addr: &str) -> String {
        let ns = self.ns(host);
        let sw = self.ns("sw");
        ip(&["netns", "add", &ns]);
        self.made.push(ns.clone());
        ip(&[
            "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", host, "netns", &sw,
        ]);
        ip(&["-n", &sw, "link", "set", host, "master", "br0", "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ns
    }

    /// Unplugs (or plugs back) a host's cable: its switch port goes down, and what it sends or
    /// is sent is dropped without a word.
    pub fn link(&self, host: &str, up: bool) {
        let sw = self.ns("sw");
        ip(&[
            "-n",
            &sw,
            "link",
            "set",
            host,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Runs `f` on a thread inside network namespace `ns` (a thread's namespace is its own, and the
/// threads it starts inherit it): the client's side of the test.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        use std::os::fd::AsRawFd;
        // SAFETY: moves this thread (only) into the namespace the file names.
        let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// [`in_ns`] for async work, on a runtime of its own there.
pub fn block_in<T, F>(ns: &str, f: impl FnOnce() -> F + Send + 'static) -> T
where
    T: Send + 'static,
    F: std::future::Future<Output = T>,
{
    in_ns(ns, move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    })
}

/// `tandem ARGS` in network namespace `ns`, ready at the line starting with `marker`; that line.
pub fn start_in(ns: &str, args: &[String], marker: &str) -> (super::Proc, String) {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns])
        .arg(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .env("TANDEM_LOG", "warn")
        .env("TANDEM_KV_SECRET", super::KV_SECRET);
    super::spawn_command(cmd, marker)
}
