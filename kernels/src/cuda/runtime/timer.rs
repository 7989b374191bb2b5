//! Where a step's device time goes: an event before and after each op on the stream, read once
//! the step is done. The time between one op's end and the next one's start is the device
//! waiting for the host to queue it (launch overhead and host work); the rest is the ops'.
//! For benchmarks only: two events an op cost a little time of their own.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::{drv, CudaOps};
use crate::cuda::CudaError;

/// Events around each op of a step on one stream (see [`CudaOps::op_timer`]).
pub struct OpTimer {
    start: CudaEvent,
    /// (op, event before it, event after it), in stream order.
    ops: Vec<(&'static str, CudaEvent, Option<CudaEvent>)>,
}

/// A step's device time by op.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpTimes {
    /// Milliseconds per op name, summed over its launches, in the order each name first ran.
    pub ops: Vec<(&'static str, f64)>,
    /// Milliseconds between one op's end and the next one's start: the device idle, waiting for
    /// the host.
    pub gaps_ms: f64,
    /// Milliseconds from the timer's start to the last op's end.
    pub span_ms: f64,
}

impl CudaOps {
    /// Starts timing this stream's ops from here.
    pub fn op_timer(&self) -> Result<OpTimer, CudaError> {
        Ok(OpTimer {
            start: record(&self.stream)?,
            ops: Vec::new(),
        })
    }
}

fn record(stream: &CudaStream) -> Result<CudaEvent, CudaError> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(drv)
}

impl OpTimer {
    /// Marks the start of an op called `what` (queued next on `stream`).
    pub fn begin(&mut self, stream: &CudaStream, what: &'static str) -> Result<(), CudaError> {
        self.ops.push((what, record(stream)?, None));
        Ok(())
    }

    /// Marks the end of the op begun last.
    pub fn end(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        let ev = record(stream)?;
        match self.ops.last_mut() {
            Some((_, _, end @ None)) => {
                *end = Some(ev);
                Ok(())
            }
            _ => Err(CudaError::Driver("an op's end with no op begun".into())),
        }
    }

    /// Waits for the step and reads its times.
    pub fn finish(self) -> Result<OpTimes, CudaError> {
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
/// order, by name; the time between consecutive spans is the gaps'.
pub fn tally(spans: &[(&'static str, f64, f64)]) -> OpTimes {
    let mut t = OpTimes::default();
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
    use super::{tally, OpTimes};

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
            OpTimes {
                ops: vec![("norm", 0.75), ("product", 4.0)],
                gaps_ms: 0.5 + 0.25 + 0.5,
                span_ms: 6.0,
            }
        );
        // Every millisecond of the span is an op's or a gap's.
        let busy: f64 = t.ops.iter().map(|(_, ms)| ms).sum();
        assert_eq!(busy + t.gaps_ms, t.span_ms);
        assert_eq!(tally(&[]), OpTimes::default());
    }
}
