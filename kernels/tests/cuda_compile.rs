//! Every CUDA kernel compiles through NVRTC for the data-centre architectures we serve on (sm_80,
//! sm_90), with no GPU: NVRTC is a library. `scripts/test` installs it (the `nvidia-cuda-nvrtc`
//! Python package) and puts it on LD_LIBRARY_PATH.

use tandem_kernels::cuda::nvrtc::{compile, compile_cached, compile_ptx, Image};
use tandem_kernels::cuda::{
    attn_param_offsets, layout_probe, nvrtc_present, probe_offsets, program_text, Arch, AttnParams,
    CudaError, SOURCES,
};

const ARCHS: [Arch; 2] = [Arch { major: 8, minor: 0 }, Arch { major: 9, minor: 0 }];

fn require_nvrtc() {
    assert!(
        nvrtc_present(),
        "libnvrtc not found: `python3 -m pip install nvidia-cuda-nvrtc` and put its lib folder on \
         LD_LIBRARY_PATH (scripts/test does both)"
    );
}

#[test]
fn every_kernel_compiles_to_machine_code_for_sm80_and_sm90() {
    require_nvrtc();
    for arch in ARCHS {
        for (name, src) in SOURCES {
            match compile(name, &program_text(src), arch) {
                Ok(Image::Cubin(bin)) => {
                    assert_eq!(
                        &bin[..4],
                        b"\x7fELF",
                        "{name} for {arch}: a cubin is an ELF image"
                    )
                }
                Ok(Image::Ptx(_)) => panic!("{name} for {arch}: PTX only, expected a cubin"),
                Err(e) => panic!("{e}"),
            }
        }
    }
}

#[test]
fn the_host_and_device_agree_on_the_attention_parameters() {
    require_nvrtc();
    let text = program_text(&layout_probe());
    let want: Vec<(String, usize)> = attn_param_offsets()
        .into_iter()
        .map(|(f, o)| (f.to_string(), o))
        .collect();
    for arch in ARCHS {
        let ptx = compile_ptx("layout_probe", &text, arch).unwrap_or_else(|e| panic!("{e}"));
        let (offsets, size) = probe_offsets(&ptx);
        assert_eq!(offsets, want, "field offsets for {arch}");
        assert_eq!(
            size,
            Some(std::mem::size_of::<AttnParams>()),
            "size for {arch}"
        );
    }
}

#[test]
fn a_kernel_that_does_not_compile_reports_the_compiler_log() {
    require_nvrtc();
    let text =
        program_text("extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }");
    match compile("broken", &text, ARCHS[1]) {
        Err(CudaError::Compile { name, arch, log }) => {
            assert_eq!((name.as_str(), arch.as_str()), ("broken", "sm_90"));
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn the_disk_cache_returns_what_was_compiled() {
    require_nvrtc();
    let dir = tempfile::tempdir().unwrap();
    let (name, src) = SOURCES[0];
    let text = program_text(src);
    let first = compile_cached(dir.path(), name, &text, ARCHS[1]).unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    // A hit reads the file: make it recognizably different to see that it was read.
    std::fs::write(&files[0], b"\x7fELF-cached").unwrap();
    assert_eq!(
        compile_cached(dir.path(), name, &text, ARCHS[1]).unwrap(),
        Image::Cubin(b"\x7fELF-cached".to_vec())
    );
    assert!(matches!(first, Image::Cubin(_)));
    // Another architecture is another entry.
    compile_cached(dir.path(), name, &text, ARCHS[0]).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}
