//! Where a step's device time goes: an event before and after each op on the stream, read once
//! the step is done. What an op's span holds depends on who leads:
//! - with the device ahead of the host (the step queued behind earlier work), a span is the op's
//!   device time, and the time between spans the events' own;
//! - with the host ahead (a step of small kernels, launched one by one), the device reaches an
//!   op's first event before the host has queued the op, so a span is the longer of the op's
//!   device time and the host's time to issue it, and the time between spans is the host's work
//!   between ops.
//!
//! Benchmarks run both and compare. The events are made before the timer starts, so their
//! creation does not land in the spans.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::{drv, CudaOps};
use crate::cuda::CudaError;

/// Events around each op of a step on one stream (see [`CudaOps::op_timer`]).
pub struct OpTimer {
    start: CudaEvent,
    /// Unused events, made ahead.
    spare: Vec<CudaEvent>,
    /// (op, event before it, event after it), in stream order.
    ops: Vec<(&'static str, CudaEvent, Option<CudaEvent>)>,
}

/// A step's device time by op.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepProfile {
    /// Milliseconds per op name, summed over its launches, in the order each name first ran.
    pub ops: Vec<(&'static str, f64)>,
    /// Milliseconds between one op's end and the next one's start.
    pub gaps_ms: f64,
    /// Milliseconds from the timer's start to the last op's end.
    pub span_ms: f64,
}

fn event(ops: &CudaOps) -> Result<CudaEvent, CudaError> {
    ops.gpu
        .context
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(drv)
}

impl CudaOps {
    /// Starts timing this stream's ops from here, with events made ahead for `ops` ops (more
    /// are made as needed).
    pub fn op_timer(&self, ops: usize) -> Result<OpTimer, CudaError> {
        let spare = (0..2 * ops)
            .map(|_| event(self))
            .collect::<Result<Vec<_>, _>>()?;
        let start = event(self)?;
        start.record(&self.stream).map_err(drv)?;
        Ok(OpTimer {
            start,
            spare,
            ops: Vec::new(),
        })
    }
}

impl OpTimer {
    fn record(&mut self, stream: &CudaStream) -> Result<CudaEvent, CudaError> {
        let ev = match self.spare.pop() {
            Some(ev) => ev,
            None => stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv)?,
        };
        ev.record(stream).map_err(drv)?;
        Ok(ev)
    }

    /// Marks the start of an op called `what` (queued next on `stream`).
    pub fn begin(&mut self, stream: &CudaStream, what: &'static str) -> Result<(), CudaError> {
        let ev = self.record(stream)?;
        self.ops.push((what, ev, None));
        Ok(())
    }

    /// Marks the end of the op begun last.
    pub fn end(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        let ev = self.record(stream)?;
        match self.ops.last_mut() {
            Some((_, _, end @ None)) => {
                *end = Some(ev);
                Ok(())
            }
            _ => Err(CudaError::Driver("an op's end with no op begun".into())),
        }
    }

    /// Waits for the step and reads its times.
    pub fn finish(self) -> Result<StepProfile, CudaError> {
        let mut spans = Vec::with_capacity(self.ops.len());
        for (what, before, after) in &self.ops {
            let after = after
                .as_ref()
                .ok_or_else(|| CudaError::Driver(format!("the op {what} never ended")))?;
            let at = |e: &CudaEvent| self.start.elapsed_ms(e).map(f64::from).map_err(drv);
            spans.push((*what, at(before)?, at(after)?));
        }
        Ok(tally(&spans))
    }
}

/// Sums ops' (name, start, end) spans, in milliseconds from a common start and in stream
/// order, by name; the time between consecutive spans (and before the first) is the gaps'.
pub fn tally(spans: &[(&'static str, f64, f64)]) -> StepProfile {
    let mut t = StepProfile::default();
    let mut last_end = 0.0;
    for &(what, start, end) in spans {
        let ms = (end - start).max(0.0);
        match t.ops.iter_mut().find(|(n, _)| *n == what) {
            Some((_, sum)) => *sum += ms,
            None => t.ops.push((what, ms)),
        }
        t.gaps_ms += (start - last_end).max(0.0);
        last_end = end;
    }
    t.span_ms = last_end;
    t
}

#[cfg(test)]
mod tests {
    use super::{tally, StepProfile};

    #[test]
    fn spans_sum_by_op_and_the_rest_is_gaps() {
        let t = tally(&[
            ("norm", 0.5, 1.0),
            ("product", 1.0, 3.0),
            ("norm", 3.25, 3.5),
            ("product", 4.0, 6.0),
        ]);
        assert_eq!(
            t,
            StepProfile {
                ops: vec![("norm", 0.75), ("product", 4.0)],
                gaps_ms: 0.5 + 0.25 + 0.5,
                span_ms: 6.0,
            }
        );
        // Every millisecond of the span is an op's or a gap's.
        let busy: f64 = t.ops.iter().map(|(_, ms)| ms).sum();
        assert_eq!(busy + t.gaps_ms, t.span_ms);
        assert_eq!(tally(&[]), StepProfile::default());
    }
}
