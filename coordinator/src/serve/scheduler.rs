//! The serving scheduler: which requests run, which rows go into the next step, and what each
//! step's logits mean for each request — as logic without I/O. The time comes in as an
//! argument and decisions go out as [`Action`]s, so the tests drive it with no model, no
//! sockets and no clock (STYLE.md: *like* quinn-proto). [`super::driver`] executes it against
//! the model and the KV pool on the compute thread.
//!
//! Policy:
//! - **Admission** in arrival order while a sequence slot is free (`max_running`) and the KV
//!   pool can hold the request's worst case (prompt + `max_tokens`, reserved in whole blocks);
//!   at most `max_waiting` wait behind them (the HTTP layer answers 429 beyond that, before a
//!   request gets here). A request that shares a whole block of prompt with one still reading
//!   its prompt waits for it, so the shared blocks are computed once (prefix sharing).
//! - **Steps**: one decode row for every generating sequence, then prompt chunks of at most
//!   `chunk` tokens per sequence, in admission order, within `step_tokens` rows — a long prompt
//!   is read over several steps and never stalls everyone's next token.
//! - **Per request**: its own sampler and seed, stop strings matched across token boundaries
//!   ([`super::text`]), `max_tokens`, end-of-generation tokens, a deadline. Cancelling frees its
//!   KV at the next step boundary.

use std::collections::VecDeque;
use std::time::Instant;

use crate::kv_pool::BLOCK;
use crate::sampler::{Sampler, SamplerParams};

use super::text::TextStream;

/// A request's id (unique per server).
pub type ReqId = u64;

/// What the scheduler needs to know of the vocabulary.
pub trait Vocab {
    /// The bytes a token adds to the output text.
    fn piece(&self, token: u32) -> Vec<u8>;
    /// Whether the token ends generation.
    fn is_eog(&self, token: u32) -> bool;
}

impl Vocab for crate::tokenizer::Tokenizer {
    fn piece(&self, token: u32) -> Vec<u8> {
        self.token_to_piece(token, false)
    }
    fn is_eog(&self, token: u32) -> bool {
        crate::tokenizer::Tokenizer::is_eog(self, token)
    }
}

/// Sizes the scheduler works within.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Sequences generating at once.
    pub max_running: usize,
    /// Requests waiting for a slot.
    pub max_waiting: usize,
    /// Prompt tokens per sequence per step.
    pub chunk: usize,
    /// Rows per step (decode rows first, then prompt chunks).
    pub step_tokens: usize,
    /// Blocks of [`BLOCK`] positions in the KV pool.
    pub kv_blocks: usize,
    /// Whether the pool shares prompt prefixes (invariant numerics).
    pub sharing: bool,
}

/// A request as the scheduler takes it (validated by the API layer).
#[derive(Clone, Debug)]
pub struct Submit {
    pub id: ReqId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    /// Keep generating through end-of-generation tokens.
    pub ignore_eos: bool,
    /// Log-probabilities: `Some(n)` returns the chosen token's and the `n` most likely.
    pub logprobs: Option<usize>,
    pub deadline: Option<Instant>,
}

/// Why a request was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("server overloaded: {waiting} requests already waiting (limit {max}); retry later")]
    QueueFull { waiting: usize, max: usize },
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of {BLOCK} positions; the KV pool holds {total} (raise --kv-budget or lower max_tokens)")]
    TooLarge {
        prompt: usize,
        max_tokens: usize,
        need: usize,
        total: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid sampling parameters: {0}")]
    Sampling(String),
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` generated.
    Length,
    /// The client went away or cancelled.
    Cancelled,
    /// Its deadline passed.
    Timeout,
    /// The step failed: the error's class (an expert with no live replica is `Unavailable`)
    /// and why.
    Error(ternfleet_shared::error::ErrorClass, String),
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens taken from the KV pool's shared prefixes instead of computed.
    pub cached_tokens: usize,
}

/// The log-probability of a generated token, and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// `(token, logprob, bytes)`, most likely first.
    pub top: Vec<(u32, f32, Vec<u8>)>,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// A generated token and the text it released (possibly empty: held back for a stop
    /// string or an incomplete character).
    Token {
        id: ReqId,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The request ended; `text` is the last text it releases.
    Finish {
        id: ReqId,
        reason: Finish,
        text: String,
        usage: Usage,
    },
    /// Remove the request's sequence from the KV pool.
    Free { id: ReqId },
}

/// A request the driver must start: a KV sequence of `limit` positions, its prompt's cached
/// prefix reused, then [`Scheduler::started`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Start {
    pub id: ReqId,
    pub prompt: Vec<u32>,
    pub limit: usize,
}

/// One sequence's rows in the next step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub id: ReqId,
    pub tokens: Vec<u32>,
    /// Whether the step must return logits for its last row.
    pub logits: bool,
}

struct Running {
    req: Submit,
    sampler: Sampler,
    text: TextStream,
    /// Prompt tokens in the KV cache (reused or computed).
    done: usize,
    cached: usize,
    generated: usize,
    /// The prompt, then the generated tokens (for the repetition penalty).
    history: Vec<u32>,
    /// The token to feed next (decode phase).
    next: Option<u32>,
    blocks: usize,
    started: bool,
}

/// The scheduler state.
pub struct Scheduler {
    cfg: SchedConfig,
    waiting: VecDeque<Submit>,
    running: Vec<Running>,
    reserved_blocks: usize,
}

/// Blocks reserved for a request of `positions` positions (prompt + `max_tokens`): one more
/// than the positions need, since a sequence starting on a shared block may copy it.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK) + 1
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Scheduler {
    pub fn new(cfg: SchedConfig) -> Scheduler {
        Scheduler {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            reserved_blocks: 0,
        }
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted (reading their prompt or generating).
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether there is nothing to do until a request arrives.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Queues a request.
    pub fn submit(&mut self, req: Submit) -> Result<(), Reject> {
        if req.prompt.is_empty() {
            return Err(Reject::EmptyPrompt);
        }
        let need = blocks_for(req.prompt.len() + req.max_tokens);
        if need > self.cfg.kv_blocks {
            return Err(Reject::TooLarge {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                need,
                total: self.cfg.kv_blocks,
            });
        }
        req.sampling
            .validate()
            .map_err(|e| Reject::Sampling(e.to_string()))?;
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(Reject::QueueFull {
                waiting: self.waiting.len(),
                max: self.cfg.max_waiting,
            });
        }
        self.waiting.push_back(req);
        Ok(())
    }

    /// Requests to start now, in arrival order.
    pub fn admit(&mut self, _now: Instant) -> Vec<Start> {
        let mut out = Vec::new();
        while self.running.len() < self.cfg.max_running.max(1) {
            let Some(req) = self.waiting.front() else {
                break;
            };
            let need = blocks_for(req.prompt.len() + req.max_tokens);
            if self.reserved_blocks + need > self.cfg.kv_blocks {
                break;
            }
            if self.cfg.sharing
                && self
                    .running
                    .iter()
                    .any(|r| r.next.is_none() && shared_prefix(&r.req.prompt, &req.prompt) >= BLOCK)
            {
                break;
            }
            let req = self.waiting.pop_front().expect("front() was Some");
            let sampler = Sampler::new(req.sampling.clone())
                .expect("sampling parameters were validated at submit");
            self.reserved_blocks += need;
            out.push(Start {
                id: req.id,
                prompt: req.prompt.clone(),
                limit: req.prompt.len() + req.max_tokens,
            });
            self.running.push(Running {
                text: TextStream::new(&req.stop),
                history: req.prompt.clone(),
                sampler,
                req,
                done: 0,
                cached: 0,
                generated: 0,
                next: None,
                blocks: need,
                started: false,
            });
        }
        out
    }

    /// The driver created request `id`'s sequence, `reused` prompt tokens already cached.
    pub fn started(&mut self, id: ReqId, reused: usize) {
        if let Some(r) = self.running.iter_mut().find(|r| r.req.id == id) {
            r.done = reused.min(r.req.prompt.len());
            r.cached = r.done;
            r.started = true;
        }
    }

    /// The rows of the next step.
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = Vec::new();
        let mut budget = self.cfg.step_tokens.max(1);
        for r in self.running.iter().filter(|r| r.started) {
            if let Some(t) = r.next {
                rows.push(Row {
                    id: r.req.id,
                    tokens: vec![t],
                    logits: true,
                });
                budget = budget.saturating_sub(1);
            }
        }
        for r in self
            .running
            .iter()
            .filter(|r| r.started && r.next.is_none())
        {
            if budget == 0 {
                break;
            }
            let len = r.req.prompt.len();
            let mut end = (r.done + self.cfg.chunk.max(1).min(budget)).min(len);
            // End chunks on block boundaries where they can, so filled blocks are whole and
            // shareable as soon as possible.
            if end < len && end > r.done + BLOCK {
                end -= end % BLOCK;
            }
            budget -= end - r.done;
            rows.push(Row {
                id: r.req.id,
                tokens: r.req.prompt[r.done..end].to_vec(),
                logits: end == len,
            });
        }
        rows
    }

    fn finish_at(&mut self, i: usize, reason: Finish, out: &mut Vec<Action>) {
        let mut r = self.running.remove(i);
        self.reserved_blocks -= r.blocks;
        let text = match reason {
            Finish::Stop | Finish::Length => r.text.finish(),
            _ => String::new(),
        };
        out.push(Action::Finish {
            id: r.req.id,
            reason,
            text,
            usage: Usage {
                prompt_tokens: r.req.prompt.len(),
                completion_tokens: r.generated,
                cached_tokens: r.cached,
            },
        });
        if r.started {
            out.push(Action::Free { id: r.req.id });
        }
    }

    /// A step ran: `results` holds, per row of [`Scheduler::rows`] in order, its logits
    /// (rows that asked) or `None`.
    pub fn on_step(
        &mut self,
        vocab: &dyn Vocab,
        rows: &[Row],
        results: Vec<Option<Vec<f32>>>,
    ) -> Vec<Action> {
        let mut out = Vec::new();
        for (row, logits) in rows.iter().zip(results) {
            let Some(i) = self.running.iter().position(|r| r.req.id == row.id) else {
                continue; // cancelled while the step ran
            };
            let r = &mut self.running[i];
            if r.next.is_none() {
                r.done += row.tokens.len();
                if r.done < r.req.prompt.len() {
                    continue;
                }
            }
            let Some(logits) = logits else {
                continue;
            };
            let token = r.sampler.sample(&logits, &r.history);
            let eog = !r.req.ignore_eos && vocab.is_eog(token);
            if eog {
                self.finish_at(i, Finish::Stop, &mut out);
                continue;
            }
            r.generated += 1;
            r.history.push(token);
            let logprob = r.req.logprobs.map(|n| logprob_of(vocab, &logits, token, n));
            let pushed = r.text.push(&vocab.piece(token));
            out.push(Action::Token {
                id: r.req.id,
                token,
                text: pushed.text,
                logprob,
            });
            if pushed.stopped {
                self.finish_at(i, Finish::Stop, &mut out);
            } else if r.generated >= r.req.max_tokens {
                self.finish_at(i, Finish::Length, &mut out);
            } else {
                r.next = Some(token);
            }
        }
        out
    }

    /// Ends request `id` (waiting or running) for `reason`.
    pub fn end(&mut self, id: ReqId, reason: Finish) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            let r = self.waiting.remove(i).expect("position() found it");
            out.push(Action::Finish {
                id,
                reason,
                text: String::new(),
                usage: Usage {
                    prompt_tokens: r.prompt.len(),
                    ..Usage::default()
                },
            });
        } else if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
            self.finish_at(i, reason, &mut out);
        }
        out
    }

    /// Ends every request whose deadline is before `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Action> {
        let late: Vec<ReqId> = self
            .waiting
            .iter()
            .filter(|r| r.deadline.is_some_and(|d| d <= now))
            .map(|r| r.id)
            .chain(
                self.running
                    .iter()
                    .filter(|r| r.req.deadline.is_some_and(|d| d <= now))
                    .map(|r| r.req.id),
            )
            .collect();
        late.into_iter()
            .flat_map(|id| self.end(id, Finish::Timeout))
            .collect()
    }
}

/// The chosen token's log-probability under `logits` and the `n` most likely tokens'.
fn logprob_of(vocab: &dyn Vocab, logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let n = n.min(idx.len());
        idx.select_nth_unstable_by(n - 1, |&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        idx.truncate(n);
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        top = idx
            .into_iter()
            .map(|t| (t, lp(logits[t as usize])))
            .collect();
    }
    TokenLogprob {
        token,
        logprob: lp(logits[token as usize]),
        bytes: vocab.piece(token),
        top: top
            .into_iter()
            .map(|(t, l)| (t, l, vocab.piece(t)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token `t` is the letter `'a' + t % 26`; token 0 is end-of-generation.
    struct Letters;
    impl Vocab for Letters {
        fn piece(&self, t: u32) -> Vec<u8> {
            vec![b'a' + (t % 26) as u8]
        }
        fn is_eog(&self, t: u32) -> bool {
            t == 0
        }
    }

    fn cfg() -> SchedConfig {
        SchedConfig {
            max_running: 2,
            max_waiting: 2,
            chunk: 4,
            step_tokens: 6,
            kv_blocks: 8,
            sharing: false,
        }
    }

    fn req(id: ReqId, prompt_len: usize, max_tokens: usize) -> Submit {
        Submit {
            id,
            prompt: (1..=prompt_len as u32).collect(),
            max_tokens,
            sampling: SamplerParams {
                temperature: 0.0,
                ..SamplerParams::default()
            },
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            deadline: None,
        }
    }

    /// Logits whose argmax is `t` over a 30-token vocabulary.
    fn pick(t: u32) -> Vec<f32> {
        let mut l = vec![0.0; 30];
        l[t as usize] = 5.0;
        l
    }

    fn start_all(s: &mut Scheduler, now: Instant) -> Vec<ReqId> {
        let st = s.admit(now);
        for x in &st {
            s.started(x.id, 0);
        }
        st.into_iter().map(|x| x.id).collect()
    }

    #[test]
    fn long_prompts_are_chunked_and_decodes_go_first() {
        let now = Instant::now();
        let mut s = Scheduler::new(cfg());
        s.submit(req(1, 3, 5)).unwrap();
        s.submit(req(2, 10, 5)).unwrap();
        assert_eq!(start_all(&mut s, now), [1, 2]);
        let rows = s.rows();
        // Request 1's whole prompt (3) and 3 of request 2's (budget 6, chunk 4).
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].tokens.len(), rows[0].logits), (3, true));
        assert_eq!((rows[1].tokens.len(), rows[1].logits), (3, false));
        let acts = s.on_step(&Letters, &rows, vec![Some(pick(7)), None]);
        assert!(matches!(
            acts[..],
            [Action::Token {
                id: 1,
                token: 7,
                ..
            }]
        ));
        let rows = s.rows();
        // The decode row first, then request 2's next chunk of 4.
        assert_eq!(
            rows[0],
            Row {
                id: 1,
                tokens: vec![7],
                logits: true
            }
        );
        assert_eq!(
            (rows[1].id, rows[1].tokens.len(), rows[1].logits),
            (2, 4, false)
        );
    }

    #[test]
    fn a_full_queue_is_refused_at_once() {
        let mut s = Scheduler::new(cfg());
        s.submit(req(1, 2, 2)).unwrap();
        s.submit(req(2, 2, 2)).unwrap();
        assert_eq!(
            s.submit(req(3, 2, 2)),
            Err(Reject::QueueFull { waiting: 2, max: 2 })
        );
    }

    #[test]
    fn admission_waits_for_kv_blocks() {
        let now = Instant::now();
        let mut s = Scheduler::new(cfg());
        // 8 blocks: a request of 64*4 positions needs 5, so the second must wait.
        s.submit(req(1, 200, 56)).unwrap();
        s.submit(req(2, 200, 56)).unwrap();
        assert_eq!(start_all(&mut s, now), [1]);
        assert_eq!(s.waiting(), 1);
        let acts = s.end(1, Finish::Cancelled);
        assert!(acts.contains(&Action::Free { id: 1 }));
        assert_eq!(start_all(&mut s, now), [2]);
        assert!(matches!(
            s.submit(req(3, 500, 100)),
            Err(Reject::TooLarge {
                need: 11,
                total: 8,
                ..
            })
        ));
    }

    #[test]
    fn max_tokens_eog_and_stop_strings_end_a_request() {
        let now = Instant::now();
        let mut s = Scheduler::new(cfg());
        let mut a = req(1, 2, 2);
        a.stop = vec!["hi".into()];
        s.submit(a).unwrap();
        s.submit(req(2, 2, 9)).unwrap();
        start_all(&mut s, now);
        let rows = s.rows();
        // 'h' (7) for 1, 'b' (1) for 2.
        let acts = s.on_step(&Letters, &rows, vec![Some(pick(7)), Some(pick(1))]);
        assert!(matches!(&acts[0], Action::Token { id: 1, text, .. } if text.is_empty()));
        assert!(matches!(&acts[1], Action::Token { id: 2, text, .. } if text == "b"));
        let rows = s.rows();
        // 'i' completes the stop string for 1; 2 draws end-of-generation.
        let acts = s.on_step(&Letters, &rows, vec![Some(pick(8)), Some(pick(0))]);
        let finishes: Vec<_> = acts
            .iter()
            .filter_map(|a| match a {
                Action::Finish {
                    id,
                    reason,
                    text,
                    usage,
                } => Some((*id, reason.clone(), text.clone(), usage.completion_tokens)),
                _ => None,
            })
            .collect();
        assert_eq!(
            finishes,
            [
                (1, Finish::Stop, String::new(), 2),
                (2, Finish::Stop, String::new(), 1)
            ]
        );
        assert!(s.is_idle());
        // max_tokens
        s.submit(req(3, 2, 1)).unwrap();
        start_all(&mut s, now);
        let rows = s.rows();
        let acts = s.on_step(&Letters, &rows, vec![Some(pick(3))]);
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Finish {
                id: 3,
                reason: Finish::Length,
                ..
            }
        )));
    }

    #[test]
    fn deadlines_and_cancellation_free_at_once() {
        let now = Instant::now();
        let mut s = Scheduler::new(cfg());
        let mut a = req(1, 2, 5);
        a.deadline = Some(now + std::time::Duration::from_millis(10));
        s.submit(a).unwrap();
        s.submit(req(2, 2, 5)).unwrap();
        let mut w = req(3, 2, 5);
        w.deadline = Some(now);
        s.submit(w).unwrap_err(); // queue of 2 is full while nothing is admitted
        start_all(&mut s, now);
        assert!(s.expire(now).is_empty());
        let acts = s.expire(now + std::time::Duration::from_millis(10));
        assert!(acts.contains(&Action::Free { id: 1 }));
        assert!(acts.iter().any(|a| matches!(
            a,
            Action::Finish {
                id: 1,
                reason: Finish::Timeout,
                ..
            }
        )));
        // A cancelled request's row from a step in flight is ignored.
        let rows = s.rows();
        s.end(2, Finish::Cancelled);
        assert!(s.on_step(&Letters, &rows, vec![Some(pick(4))]).is_empty());
        assert!(s.is_idle());
    }

    #[test]
    fn prefix_sharing_admits_the_second_after_the_first_has_read_its_prompt() {
        let now = Instant::now();
        let mut s = Scheduler::new(SchedConfig {
            sharing: true,
            chunk: 128,
            step_tokens: 256,
            kv_blocks: 64,
            ..cfg()
        });
        s.submit(req(1, 100, 4)).unwrap();
        s.submit(req(2, 100, 4)).unwrap();
        assert_eq!(start_all(&mut s, now), [1]);
        let rows = s.rows();
        s.on_step(&Letters, &rows, vec![Some(pick(5))]);
        assert_eq!(s.admit(now).len(), 1);
    }

    #[test]
    fn logprobs_are_log_softmax_and_top_is_sorted() {
        let logits = vec![0.0f32, 2.0, 1.0];
        let lp = logprob_of(&Letters, &logits, 2, 2);
        let z = (0f64.exp() + 2f64.exp() + 1f64.exp()).ln();
        assert!((lp.logprob as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(lp.bytes, b"c");
    }
}
