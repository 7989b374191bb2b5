//! The runtime image: deploy/docker/Dockerfile's last stage (the binary and its shared libraries,
//! a non-root user, the model cache a volume), assembled here as a root filesystem and imported
//! into a Docker engine the test starts itself (Debian's docker.io, installed by scripts/test;
//! no base image can be pulled on this machine, so the Dockerfile's build stage is not run here).
//! The container runs as uid 10001 without a network, reads the model from a read-only volume,
//! and generates exactly what the binary generates outside it.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{model_path, Proc};

/// A Docker engine of the test's own: its data, state and socket in a temporary directory.
struct Engine {
    proc: Proc,
    sock: String,
    _dir: tempfile::TempDir,
}

impl Engine {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sock = format!("unix://{}", dir.path().join("docker.sock").display());
        let child = Command::new("dockerd")
            .args(["--bridge=none", "--iptables=false", "--ip6tables=false"])
            .arg(format!("--data-root={}", dir.path().join("data").display()))
            .arg(format!("--exec-root={}", dir.path().join("exec").display()))
            .arg(format!(
                "--pidfile={}",
                dir.path().join("docker.pid").display()
            ))
            .arg(format!("--host={sock}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dockerd (scripts/test installs Debian's docker.io)");
        let e = Engine {
            proc: Proc { child },
            sock,
            _dir: dir,
        };
        let end = Instant::now() + Duration::from_secs(120);
        while !e.docker(&["info"]).status.success() {
            assert!(Instant::now() < end, "dockerd did not come up");
            std::thread::sleep(Duration::from_millis(200));
        }
        e
    }

    fn docker(&self, args: &[&str]) -> Output {
        Command::new(client())
            .arg("-H")
            .arg(&self.sock)
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SIGTERM, so the engine stops the containerd it started.
        self.proc.signal(libc::SIGTERM);
        self.proc.wait_exit(Duration::from_secs(30));
    }
}

/// The docker.io package's client (it speaks the engine's API version).
fn client() -> &'static str {
    if Path::new("/usr/bin/docker").exists() {
        "/usr/bin/docker"
    } else {
        "docker"
    }
}

/// The runtime directives of the Dockerfile's last stage.
fn dockerfile_runtime() -> Vec<String> {
    let text = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/docker/Dockerfile"),
    )
    .unwrap();
    let last = text.rsplit_once("\nFROM ").unwrap().1;
    last.lines()
        .filter(|l| {
            ["USER ", "ENTRYPOINT ", "ENV ", "VOLUME "]
                .iter()
                .any(|d| l.starts_with(d))
        })
        .map(str::to_string)
        .collect()
}

/// The runtime stage's files: the binary where the Dockerfile installs it, the shared libraries
/// it links (as ldd lists them), the user, and the cache directory.
fn rootfs(dir: &Path) {
    let bin = env!("CARGO_BIN_EXE_tandem");
    let put = |from: &Path, to: &str| {
        let dest = dir.join(to.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(from, &dest).unwrap();
    };
    put(Path::new(bin), "/usr/local/bin/tandem");
    let ldd = Command::new("ldd").arg(bin).output().unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        put(&std::fs::canonicalize(lib).unwrap(), lib);
    }
    let etc = dir.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    std::fs::write(
        etc.join("passwd"),
        "tandem:x:10001:10001::/home/tandem:/usr/sbin/nologin\n",
    )
    .unwrap();
    std::fs::write(etc.join("group"), "tandem:x:10001:\n").unwrap();
    for d in ["models", "home/tandem", "tmp"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let own = |p: &Path| std::os::unix::fs::chown(p, Some(10001), Some(10001)).unwrap();
    own(&dir.join("models"));
    own(&dir.join("home/tandem"));
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
}

#[test]
fn the_image_runs_unprivileged_offline_and_generates_what_the_binary_does() {
    let runtime = dockerfile_runtime();
    for directive in [
        "USER 10001:10001",
        "ENTRYPOINT [\"tandem\"]",
        "ENV TANDEM_MODEL_CACHE=/models",
        "VOLUME /models",
    ] {
        assert!(
            runtime.iter().any(|l| l == directive),
            "the Dockerfile's runtime stage lacks {directive}: {runtime:?}"
        );
    }
    let engine = Engine::start();
    let dir = tempfile::tempdir().unwrap();
    rootfs(dir.path());
    let mut tar = Command::new("tar")
        .arg("-C")
        .arg(dir.path())
        .args(["-cf", "-", "."])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let import = Command::new(client())
        .arg("-H")
        .arg(&engine.sock)
        .args(["import", "--change", "USER 10001:10001"])
        .args([
            "--change",
            "ENV TANDEM_MODEL_CACHE=/models HOME=/home/tandem",
        ])
        .args(["--change", "ENTRYPOINT [\"tandem\"]"])
        .args(["-", "tandem-test:latest"])
        .stdin(tar.stdout.take().unwrap())
        .output()
        .unwrap();
    assert!(tar.wait().unwrap().success());
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );

    let model = model_path();
    let file = model.file_name().unwrap().to_str().unwrap();
    let args = [
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ];
    let volume = format!("{}:/models:ro", model.parent().unwrap().display());
    let in_image = engine.docker(
        &[
            &[
                "run",
                "--rm",
                "--network",
                "none",
                "-v",
                &volume,
                "tandem-test:latest",
            ][..],
            &args[..],
            &["--model", &format!("/models/{file}")][..],
        ]
        .concat(),
    );
    assert!(
        in_image.status.success(),
        "{}",
        String::from_utf8_lossy(&in_image.stderr)
    );
    let outside = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    assert!(outside.status.success());
    assert!(!outside.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&in_image.stdout),
        String::from_utf8_lossy(&outside.stdout)
    );

    // It runs as the image's user, not root.
    let inspect = engine.docker(&[
        "image",
        "inspect",
        "-f",
        "{{.Config.User}}",
        "tandem-test:latest",
    ]);
    assert_eq!(
        String::from_utf8_lossy(&inspect.stdout).trim(),
        "10001:10001"
    );
}
