//! f32 scratch that starts on a cache line.
//!
//! The products' decoded panels are read sixty-four bytes at a time.
//! A `Vec<f32>` starts wherever the allocator puts it: sixteen bytes past a line for a large
//! buffer of glibc's, so that every vector load of it straddles two lines. Which address a
//! thread's scratch got changed from run to run, and with it a 200-row product of the model's
//! gate|up on 2 cores of an Intel Xeon (AVX-512, `decode_matmul ONLY=2 ROWS=200 LAYERS=1`,
//! 2026-12-05): 66-68 ms where both threads' panels began on a line, 75-77 ms where they began
//! half a line in.

use bytemuck::{Pod, Zeroable};

/// Sixteen floats on one cache line: the unit an [`AlignedF32`] grows by.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A growable run of f32 whose first value starts a 64-byte line (so does every sixteenth).
/// Derefs to its `len` values.
#[derive(Default)]
pub(crate) struct AlignedF32 {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedF32 {
    /// An empty buffer (no allocation).
    pub(crate) const fn new() -> Self {
        Self {
            lines: Vec::new(),
            len: 0,
        }
    }

    /// Sets the length to `len`; values past the old length are `value`, the others kept.
    pub(crate) fn resize(&mut self, len: usize, value: f32) {
        let old = self.len;
        self.lines.resize(len.div_ceil(16), Line([0.0; 16]));
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }
}

impl std::ops::Deref for AlignedF32 {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

impl std::ops::DerefMut for AlignedF32 {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_keeps_values_when_it_grows() {
        let mut b = AlignedF32::new();
        assert!(b.is_empty());
        b.resize(5, 1.5);
        assert_eq!(&b[..], &[1.5; 5]);
        b[4] = 7.0;
        b.resize(40, -2.0);
        assert_eq!(b.len(), 40);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(&b[..5], &[1.5, 1.5, 1.5, 1.5, 7.0]);
        assert!(b[5..].iter().all(|&v| v == -2.0));
        b.resize(3, 0.0);
        assert_eq!(&b[..], &[1.5; 3]);
        // Growing again refills what shrinking let go.
        b.resize(6, 9.0);
        assert_eq!(&b[..], &[1.5, 1.5, 1.5, 9.0, 9.0, 9.0]);
    }
}
