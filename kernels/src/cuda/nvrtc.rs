//! Kernel sources compiled by NVRTC for one GPU architecture: a cubin (the device's own machine
//! code), or PTX for the driver to finish when this NVRTC cannot emit a cubin for it. Results are
//! cached on disk, keyed by the hash of the full source text, the architecture and NVRTC's version,
//! so an edited kernel or a new compiler never reuses a stale binary.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{result, sys};

use super::{Arch, CudaError};

/// Compiled device code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    /// Machine code for the device's own architecture.
    Cubin(Vec<u8>),
    /// PTX text, which the driver compiles the rest of the way when loading it.
    Ptx(String),
}

impl Image {
    /// The image as bytes (what the disk cache stores).
    pub fn bytes(&self) -> &[u8] {
        match self {
            Self::Cubin(b) => b,
            Self::Ptx(s) => s.as_bytes(),
        }
    }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), CudaError> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded; both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// The cache file name for `text` compiled for `arch` by NVRTC `version`.
pub fn cache_key(text: &str, arch: Arch, version: (i32, i32)) -> String {
    let h = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    format!("{h:016x}-{arch}-nvrtc{}.{}", version.0, version.1)
}

/// The NVRTC options for `arch`: bf16 needs no headers, so none are searched.
fn options(arch: Arch, cubin: bool) -> Vec<String> {
    let target = if cubin {
        format!("--gpu-architecture=sm_{}{}", arch.major, arch.minor)
    } else {
        format!("--gpu-architecture=compute_{}{}", arch.major, arch.minor)
    };
    vec![
        target,
        "--std=c++17".into(),
        "--use_fast_math".into(),
        "--restrict".into(),
    ]
}

/// Compiles `text` (named `name` in messages) for `arch`: a cubin, or PTX when this NVRTC has no
/// machine code for the architecture.
pub fn compile(name: &str, text: &str, arch: Arch) -> Result<Image, CudaError> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    match compile_as(name, text, arch, true) {
        Ok(img) => Ok(img),
        // An architecture newer than this compiler: PTX of the highest virtual one is the fallback.
        Err(CudaError::Compile { log, .. })
            if log.contains("invalid value for --gpu-architecture") =>
        {
            compile_as(name, text, arch, false)
        }
        Err(e) => Err(e),
    }
}

/// Compiles `text` to PTX for the virtual architecture of `arch` (what the layout probe reads).
pub fn compile_ptx(name: &str, text: &str, arch: Arch) -> Result<String, CudaError> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    match compile_as(name, text, arch, false)? {
        Image::Ptx(p) => Ok(p),
        Image::Cubin(_) => unreachable!("asked for PTX"),
    }
}

fn compile_as(name: &str, text: &str, arch: Arch, cubin: bool) -> Result<Image, CudaError> {
    let err = |log: String| CudaError::Compile {
        name: name.to_string(),
        arch: arch.to_string(),
        log,
    };
    let src = CString::new(text).map_err(|_| err("source holds a NUL byte".into()))?;
    let cname = CString::new(format!("{name}.cu")).expect("kernel names have no NUL");
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| err(format!("{e:?}")))?;
    // SAFETY: `prog` was just created and is destroyed once, below; the buffers passed to the
    // getters are sized by their size queries.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options(arch, cubin));
        let log = program_log(prog);
        let out = match compiled {
            Err(e) => Err(err(format!("{e:?}\n{log}"))),
            Ok(()) if cubin => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| err(format!("{e:?}")))
                    .and_then(|()| {
                        let mut buf = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|()| Image::Cubin(buf))
                            .map_err(|e| err(format!("{e:?}")))
                    })
            }
            Ok(()) => result::get_ptx(prog)
                .map(|p| {
                    let bytes: Vec<u8> = p
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    Image::Ptx(String::from_utf8_lossy(&bytes).into_owned())
                })
                .map_err(|e| err(format!("{e:?}"))),
        };
        let _ = result::destroy_program(prog);
        out
    };
    out
}

/// The compiler's log (warnings and errors) of `prog`.
///
/// # Safety
/// `prog` is a live program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    match result::get_program_log(prog) {
        Ok(log) => {
            let bytes: Vec<u8> = log
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// Where compiled kernels are kept: `$TANDEM_KERNEL_CACHE`, else `~/.cache/tandem/kernels`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache/tandem/kernels")
}

/// Compiles `text` for `arch` through the cache in `dir`: a hit reads the file, a miss compiles and
/// writes it (through a temporary file, so a concurrent reader never sees half of one).
pub fn compile_cached(dir: &Path, name: &str, text: &str, arch: Arch) -> Result<Image, CudaError> {
    let key = cache_key(text, arch, version()?);
    let io = |path: &Path, source| CudaError::Cache {
        path: path.display().to_string(),
        source,
    };
    for (ext, cubin) in [("cubin", true), ("ptx", false)] {
        let path = dir.join(format!("{name}-{key}.{ext}"));
        if let Ok(bytes) = std::fs::read(&path) {
            return Ok(if cubin {
                Image::Cubin(bytes)
            } else {
                Image::Ptx(String::from_utf8_lossy(&bytes).into_owned())
            });
        }
    }
    let img = compile(name, text, arch)?;
    let ext = match img {
        Image::Cubin(_) => "cubin",
        Image::Ptx(_) => "ptx",
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let path = dir.join(format!("{name}-{key}.{ext}"));
    let tmp = dir.join(format!(".{name}-{key}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, img.bytes()).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: Arch = Arch { major: 9, minor: 0 };

    #[test]
    fn cache_keys_change_with_source_arch_and_compiler() {
        let k = cache_key("a", H100, (13, 0));
        assert_eq!(k, cache_key("a", H100, (13, 0)));
        assert!(k.ends_with("-sm_90-nvrtc13.0"), "{k}");
        assert_ne!(k, cache_key("b", H100, (13, 0)));
        assert_ne!(k, cache_key("a", Arch { major: 8, minor: 0 }, (13, 0)));
        assert_ne!(k, cache_key("a", H100, (13, 1)));
    }

    #[test]
    fn options_name_the_real_or_virtual_architecture() {
        assert_eq!(options(H100, true)[0], "--gpu-architecture=sm_90");
        assert_eq!(options(H100, false)[0], "--gpu-architecture=compute_90");
    }
}
