//! The instruction-set level the CPU kernels run at.
//!
//! Every hot kernel exists at each level users' CPUs have: [`Isa::Portable`] (the `wide` crate's
//! vectors: NEON on aarch64, SSE2 on any x86-64), [`Isa::Avx2`] (AVX2 + FMA + F16C: Zen 1-3,
//! Haswell to Alder Lake), [`Isa::Avx512`] (F, BW, VL: Skylake-SP on, Zen 4/5) and [`Isa::Amx`]
//! (AVX-512 plus the AMX bf16 tiles: Sapphire Rapids on). A process runs at the best level its CPU
//! has, or at the level `TANDEM_ISA` names if that is lower, so every path can be run and tested on
//! any machine; a level above the CPU's is capped at what it has. The level is read once per
//! process: set it before the first kernel runs.

use std::sync::OnceLock;

/// The environment variable that caps the level.
pub const ENV: &str = "TANDEM_ISA";

/// A kernel level, ordered: each includes what the ones below it use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable SIMD through the `wide` crate (what the compile target guarantees: NEON on
    /// aarch64, SSE2 on x86-64). Named `scalar` too: no x86 extension is used.
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512 F, BW and VL (and everything AVX2 needs).
    Avx512,
    /// AVX-512 with AVX512-BF16 and the AMX bf16 tiles.
    Amx,
}

/// `TANDEM_ISA` names no level.
#[derive(Debug, thiserror::Error)]
#[error("{ENV}={value:?} is not a kernel level: use one of scalar, avx2, avx512, amx")]
pub struct UnknownIsa {
    /// The variable's value.
    pub value: String,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Amx];

    /// The name `TANDEM_ISA` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    /// What the level runs on, for reports: the instructions its kernels use.
    pub fn describe(self) -> &'static str {
        match self {
            Isa::Portable if cfg!(target_arch = "aarch64") => "portable SIMD (NEON, 4 lanes)",
            Isa::Portable => "portable SIMD (SSE2, 4 lanes)",
            Isa::Avx2 => "AVX2+FMA (8 lanes)",
            Isa::Avx512 => "AVX-512 (16 lanes)",
            Isa::Amx => "AMX bf16 tiles + AVX-512",
        }
    }

    /// Parses a level name (`scalar` and `portable` are the same level).
    pub fn parse(s: &str) -> Result<Isa, UnknownIsa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "portable" => Ok(Isa::Portable),
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512),
            "amx" => Ok(Isa::Amx),
            _ => Err(UnknownIsa {
                value: s.to_string(),
            }),
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best level this CPU runs (checked once).
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    if !avx2 {
        return Isa::Portable;
    }
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    if !avx512 {
        return Isa::Avx2;
    }
    if crate::amx::cpu_has_tiles() {
        Isa::Amx
    } else {
        Isa::Avx512
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Portable
}

/// The level `TANDEM_ISA` asks for, if it is set (and not empty).
pub fn requested() -> Result<Option<Isa>, UnknownIsa> {
    match std::env::var(ENV) {
        Ok(v) if !v.trim().is_empty() => Isa::parse(&v).map(Some),
        _ => Ok(None),
    }
}

/// The level the kernels of this process run at: the CPU's best, capped by `TANDEM_ISA` (an
/// unknown name is ignored here; binaries refuse it at startup through [`requested`]).
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| match requested() {
        Ok(Some(cap)) => cap.min(detected()),
        _ => detected(),
    })
}

/// Every level this CPU runs, lowest first (what a test sweeps over).
pub fn supported() -> impl Iterator<Item = Isa> {
    Isa::ALL.into_iter().filter(|l| *l <= detected())
}

/// One line for a process's log: the level it runs at, and why, if it is not the CPU's best.
pub fn summary() -> String {
    let (act, det) = (active(), detected());
    match requested() {
        Ok(Some(req)) if req > det => format!(
            "kernels: {act} ({}); {ENV}={} asks for more than this CPU has",
            act.describe(),
            req
        ),
        Ok(Some(_)) if act < det => format!(
            "kernels: {act} ({}), capped by {ENV}; this CPU has {det}",
            act.describe()
        ),
        _ => format!("kernels: {act} ({})", act.describe()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for l in Isa::ALL {
            assert_eq!(Isa::parse(l.name()).unwrap(), l);
        }
        assert_eq!(Isa::parse("portable").unwrap(), Isa::Portable);
        assert_eq!(Isa::parse(" AVX2 ").unwrap(), Isa::Avx2);
        let e = Isa::parse("sse9").unwrap_err();
        assert!(e.to_string().contains("sse9") && e.to_string().contains("avx512"));
    }

    #[test]
    fn the_active_level_is_capped_by_the_cpu() {
        assert!(active() <= detected());
        assert!(supported().any(|l| l == active()));
        assert_eq!(supported().next(), Some(Isa::Portable));
    }
}
