//! Running a batch of requests to its end in this thread: benchmarks and reference checks.

use super::{Engine, Event, Finished, Request, RequestId, StepStats, TokenEvent};
use crate::error::EngineError;
use crate::forward::SeqBatch;
use tandem_types::ValidSampling;

impl Engine {
    /// Runs requests to completion as one continuous batch; `on_token` sees every token as it is
    /// produced, `on_step` every step's timing. Outputs come back in request order (a request's
    /// parallel samples one after the other, in their order).
    pub fn generate(
        &mut self,
        mut requests: Vec<Request>,
        mut on_token: impl FnMut(&TokenEvent),
        mut on_step: impl FnMut(&StepStats),
    ) -> Result<Vec<Finished>, EngineError> {
        for r in &mut requests {
            r.compile(self.grammars.as_deref())?;
            self.validate(r)?;
        }
        let n = requests.len();
        let mut done: Vec<Vec<Option<Finished>>> = requests
            .iter()
            .map(|r| vec![None; r.samples.count as usize])
            .collect();
        let firsts: Vec<u32> = requests.iter().map(|r| r.samples.first).collect();
        let base = self.next_batch_id;
        self.next_batch_id += n as u64;
        for (i, r) in requests.into_iter().enumerate() {
            self.add(RequestId(base + i as u64), r)?;
        }
        while self.has_work() {
            let (events, st) = self.step()?;
            for e in events {
                match e {
                    Event::Token(t) => on_token(&TokenEvent {
                        request: RequestId(t.request.0 - base),
                        ..t
                    }),
                    Event::Finished(f) => {
                        let i = (f.request.0 - base) as usize;
                        let slot = (f.index - firsts[i]) as usize;
                        done[i][slot] = Some(Finished {
                            request: RequestId(i as u64),
                            ..f
                        });
                    }
                    Event::Kv(_) => {}
                }
            }
            on_step(&st);
        }
        done.into_iter()
            .flatten()
            .map(|o| o.ok_or_else(|| EngineError::Internal("request lost".into())))
            .collect()
    }

    /// Last-position logits of a prompt (one prefill, nothing kept): for checks against a reference.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.prompt_logits_with(prompt, None)
    }

    /// [`Self::prompt_logits`] with a LoRA adapter (None: the base model).
    pub fn prompt_logits_with(
        &mut self,
        prompt: &[u32],
        adapter: Option<&std::sync::Arc<tandem_model::LoraAdapter>>,
    ) -> Result<Vec<f32>, EngineError> {
        let mut r = Request::new(
            prompt.to_vec(),
            ValidSampling::greedy(std::num::NonZeroU32::MIN),
        );
        r.adapter = adapter.cloned();
        self.validate(&r)?;
        let mut blocks = self.blocks.sequence();
        if !blocks.reserve(prompt.len()) {
            return Err(EngineError::TooLargeForCache {
                need: prompt.len().div_ceil(self.config.block_size),
                total: self.blocks.available(),
            });
        }
        // Blocks it took from the prefix cache go to the disk tier before the forward writes
        // them.
        self.spill();
        let batch = [SeqBatch {
            tokens: prompt,
            cached: 0,
            block_table: blocks.ids(),
            logits: 1,
            lora: adapter.map(|a| &**a),
        }];
        self.backend.forward(&batch)
    }
}
