//! An etcd server for discovery tests (Debian's etcd-server, installed by scripts/test).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, Proc};

/// An etcd server on loopback (Debian's etcd-server, installed by scripts/test), killed on drop.
pub struct Etcd {
    pub proc: Proc,
    pub port: u16,
}

impl Etcd {
    /// Starts etcd on `port` with its data in `dir` and waits until it answers.
    pub fn start(dir: &std::path::Path, port: u16) -> Self {
        let peer = free_port();
        let child = Command::new("etcd")
            .args([
                "--name=t".to_string(),
                format!("--data-dir={}", dir.display()),
                format!("--listen-client-urls=http://127.0.0.1:{port}"),
                format!("--advertise-client-urls=http://127.0.0.1:{port}"),
                format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
                format!("--initial-cluster=t=http://127.0.0.1:{peer}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the etcd binary (scripts/test installs Debian's etcd-server)");
        let etcd = Self {
            proc: Proc { child },
            port,
        };
        let end = Instant::now() + Duration::from_secs(60);
        while etcd.try_ctl(&["get", "probe"]).is_none() {
            assert!(Instant::now() < end, "etcd did not start on port {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        etcd
    }

    /// `--discovery` for this etcd.
    pub fn flag(&self) -> String {
        format!("--discovery=etcd://127.0.0.1:{}", self.port)
    }

    fn try_ctl(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints=127.0.0.1:{}", self.port))
            .args(args)
            .output()
            .expect("etcdctl (scripts/test installs Debian's etcd-client)");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `etcdctl ARGS` against this etcd, which must succeed; its stdout.
    pub fn ctl(&self, args: &[&str]) -> String {
        self.try_ctl(args)
            .unwrap_or_else(|| panic!("etcdctl {args:?} failed"))
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.ctl(&["get", "--prefix", "--keys-only", prefix])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn stop(&mut self) {
        let _ = self.proc.child.kill();
        let _ = self.proc.child.wait();
    }
}
