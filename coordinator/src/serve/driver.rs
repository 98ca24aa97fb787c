//! The compute thread: executes the [`Scheduler`]'s decisions against the model and the KV
//! pool. It owns both; the async API layer reaches it only through a bounded command channel
//! and hears back on one bounded channel per request, so no compute ever runs on the async
//! runtime and nothing the API does can block a step.
//!
//! Each iteration: take commands (block only when idle), end requests whose client went away
//! (their reply channel is closed) or whose deadline passed, admit, run one step, dispatch the
//! scheduler's actions. A failed step changed nothing (steps are transactional) and is retried
//! once; if it fails again, its requests end with the error and the others go on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::expert::Health;

/// How often the driver asks the expert backend for its health (`/ready`).
const HEALTH_EVERY: Duration = Duration::from_millis(250);
use tokio::sync::mpsc::Sender;

use crate::kv_pool::{KvPool, SeqId};
use crate::model::{Logits, Model, NoObserver, SeqInput, StepOptions};

use super::metrics::Metrics;
use super::scheduler::{
    Action, Finish, Reject, ReqId, Row, Scheduler, Submit, TokenLogprob, Usage,
};

/// What the API layer asks of the compute thread.
pub enum Cmd {
    /// A new request; its events go to `reply`, which must hold `max_tokens + 2` events.
    /// The span is the request's trace span (the parent of the steps it runs in).
    Submit(Box<Submit>, Sender<Event>, tracing::Span),
    /// Stop admitting; finish what runs until `deadline`, cancel the rest, then exit.
    Drain { deadline: Instant },
}

/// What a request hears back.
#[derive(Debug)]
pub enum Event {
    Token {
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        reason: Finish,
        text: String,
        usage: Usage,
    },
    Rejected(Reject),
}

/// How the engine runs each step.
pub struct DriverOptions {
    pub step: StepOptions,
    pub top_experts: Option<usize>,
}

struct Live {
    reply: Sender<Event>,
    seq: Option<SeqId>,
    /// Ends (is dropped) with the request.
    span: tracing::Span,
}

/// Runs until drained (or the command channel closes). `status.0` (ready) is set once
/// running; `status.1` says, at most every [`HEALTH_EVERY`], why the expert backend cannot
/// serve everything (a cluster's experts with no live node), `None` when it can.
pub fn run(
    model: Arc<Model>,
    mut pool: KvPool,
    mut sched: Scheduler,
    opts: DriverOptions,
    rx: Receiver<Cmd>,
    metrics: Arc<Metrics>,
    status: (Arc<AtomicBool>, Arc<std::sync::Mutex<Option<String>>>),
) {
    let (ready, degraded) = status;
    let mut checked = Instant::now() - HEALTH_EVERY;
    let mut live: HashMap<ReqId, Live> = HashMap::new();
    let mut drain: Option<Instant> = None;
    metrics
        .kv_blocks_total
        .set(pool.stats().blocks_total as i64);
    ready.store(true, Ordering::SeqCst);
    loop {
        if checked.elapsed() >= HEALTH_EVERY {
            checked = Instant::now();
            let why = match model.experts.health() {
                Health::Ready => None,
                Health::Loading { done, total } => {
                    Some(format!("experts loading: {done} of {total} bytes"))
                }
                Health::Unavailable(why) => Some(why),
            };
            if let Ok(mut d) = degraded.lock() {
                if *d != why {
                    match &why {
                        Some(w) => tracing::warn!("not ready: {w}"),
                        None => tracing::info!("every expert has a live node again: ready"),
                    }
                    *d = why;
                }
            }
        }
        // Commands: wait for one when there is nothing to compute.
        let mut cmds = Vec::new();
        if sched.is_idle() {
            if drain.is_some() {
                break;
            }
            match rx.recv_timeout(Duration::from_millis(200)) {
                Ok(c) => cmds.push(c),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        cmds.extend(rx.try_iter());
        for c in cmds {
            match c {
                Cmd::Submit(req, reply, span) => {
                    let id = req.id;
                    if drain.is_some() {
                        let _ = reply.try_send(Event::Rejected(Reject::QueueFull {
                            waiting: sched.waiting(),
                            max: 0,
                        }));
                        continue;
                    }
                    match sched.submit(*req) {
                        Ok(()) => {
                            live.insert(
                                id,
                                Live {
                                    reply,
                                    seq: None,
                                    span,
                                },
                            );
                        }
                        Err(e) => {
                            let _ = reply.try_send(Event::Rejected(e));
                        }
                    }
                }
                Cmd::Drain { deadline } => drain = Some(deadline),
            }
        }
        let now = Instant::now();
        let mut actions = sched.expire(now);
        // Clients that went away: their receiver is dropped.
        let gone: Vec<ReqId> = live
            .iter()
            .filter(|(_, l)| l.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            actions.extend(sched.end(id, Finish::Cancelled));
        }
        if drain.is_some_and(|d| now >= d) {
            let ids: Vec<ReqId> = live.keys().copied().collect();
            for id in ids {
                actions.extend(sched.end(id, Finish::Cancelled));
            }
        }
        dispatch(actions, &mut live, &mut pool, &metrics);

        for s in sched.admit(now) {
            let seq = pool.add_sequence(s.limit);
            let reused = pool.reuse_prefix(seq, &s.prompt).unwrap_or(0);
            metrics.prompt_tokens.inc_by(s.prompt.len() as u64);
            metrics.prefix_cache_hit_tokens.inc_by(reused as u64);
            if let Some(l) = live.get_mut(&s.id) {
                l.seq = Some(seq);
            }
            sched.started(s.id, reused);
        }
        gauges(&metrics, &sched, &pool);
        let rows = sched.rows();
        if rows.is_empty() {
            continue;
        }
        let result = run_step(&model, &mut pool, &rows, &live, &opts, &metrics, 2);
        let actions = match result {
            Ok(logits) => sched.on_step(&model.tokenizer, &rows, logits),
            Err((class, msg)) if class.is_retryable() && rows.len() > 1 => {
                // Experts out of reach (no live replica) or a timeout: run each request
                // alone, so only those whose rows need what is gone fail. Each row's bits
                // do not depend on what shares its step (invariant numerics), so the others
                // carry on exactly as they would have.
                tracing::warn!(
                    "step of {} rows failed twice ({msg}); running its requests one by one",
                    rows.len()
                );
                let (mut ok_rows, mut ok_logits, mut actions) =
                    (Vec::new(), Vec::new(), Vec::new());
                for r in &rows {
                    let one = std::slice::from_ref(r);
                    match run_step(&model, &mut pool, one, &live, &opts, &metrics, 1) {
                        Ok(l) => {
                            ok_rows.push(r.clone());
                            ok_logits.extend(l);
                        }
                        Err((c, m)) => actions.extend(sched.end(r.id, Finish::Error(c, m))),
                    }
                }
                actions.extend(sched.on_step(&model.tokenizer, &ok_rows, ok_logits));
                actions
            }
            Err((class, msg)) => {
                tracing::error!("step of {} rows failed twice: {msg}", rows.len());
                rows.iter()
                    .flat_map(|r| sched.end(r.id, Finish::Error(class, msg.clone())))
                    .collect()
            }
        };
        dispatch(actions, &mut live, &mut pool, &metrics);
        gauges(&metrics, &sched, &pool);
        if let Some(st) = model.experts.store_stats() {
            metrics.store(&st);
        }
        if let Some(rs) = model.experts.remote_stats() {
            metrics.cluster(&rs);
        }
    }
    ready.store(false, Ordering::SeqCst);
}

fn gauges(metrics: &Metrics, sched: &Scheduler, pool: &KvPool) {
    metrics.queue_depth.set(sched.waiting() as i64);
    metrics.running.set(sched.running() as i64);
    metrics.kv_blocks_used.set(pool.stats().blocks_used as i64);
}

/// One step over `rows`, tried `attempts` times; per row its logits when it asked for them.
fn run_step(
    model: &Model,
    pool: &mut KvPool,
    rows: &[Row],
    live: &HashMap<ReqId, Live>,
    opts: &DriverOptions,
    metrics: &Metrics,
    attempts: usize,
) -> Result<Vec<Option<Vec<f32>>>, (ErrorClass, String)> {
    let mut inputs = Vec::with_capacity(rows.len());
    for r in rows {
        let Some(seq) = live.get(&r.id).and_then(|l| l.seq) else {
            return Err((
                ErrorClass::Internal,
                format!("request {} has no KV sequence", r.id),
            ));
        };
        inputs.push(SeqInput {
            seq,
            tokens: &r.tokens,
            logits: if r.logits { Logits::Last } else { Logits::None },
            top_experts: opts.top_experts,
        });
    }
    metrics
        .batch_rows
        .observe(rows.iter().map(|r| r.tokens.len()).sum::<usize>() as f64);
    // The step's trace span: a child of its first request's, linked to the others'.
    let parent = rows
        .first()
        .and_then(|r| live.get(&r.id))
        .map_or_else(tracing::Span::none, |l| l.span.clone());
    let step = tracing::debug_span!(parent: &parent, "step", rows = rows.len());
    if !step.is_disabled() {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        for r in rows.iter().skip(1) {
            if let Some(l) = live.get(&r.id) {
                step.add_link(l.span.context().span().span_context().clone());
            }
        }
    }
    let _step = step.enter();
    let mut last = (ErrorClass::Internal, String::new());
    for _ in 0..attempts {
        metrics.steps.inc();
        match model.step(pool, &inputs, &opts.step, &mut NoObserver) {
            Ok(out) => {
                return Ok(rows
                    .iter()
                    .zip(out)
                    .map(|(r, l)| r.logits.then_some(l))
                    .collect())
            }
            Err(e) => {
                metrics.step_failures.inc();
                tracing::warn!("step failed (KV unchanged): {e}");
                let class = match &e {
                    crate::model::ForwardError::Expert(x) => x.class(),
                    _ => ErrorClass::Internal,
                };
                last = (class, e.to_string());
            }
        }
    }
    Err(last)
}

fn dispatch(
    actions: Vec<Action>,
    live: &mut HashMap<ReqId, Live>,
    pool: &mut KvPool,
    metrics: &Metrics,
) {
    for a in actions {
        match a {
            Action::Token {
                id,
                token,
                text,
                logprob,
            } => {
                metrics.generated_tokens.inc();
                if let Some(l) = live.get(&id) {
                    // The channel holds max_tokens + 2 events, so it is never full; a closed
                    // one is noticed at the next iteration.
                    let _ = l.reply.try_send(Event::Token {
                        token,
                        text,
                        logprob,
                    });
                }
            }
            Action::Finish {
                id,
                reason,
                text,
                usage,
            } => {
                if let Some(l) = live.get(&id) {
                    let _ = l.reply.try_send(Event::Done {
                        reason,
                        text,
                        usage,
                    });
                }
                if live.get(&id).is_some_and(|l| l.seq.is_none()) {
                    live.remove(&id);
                }
            }
            Action::Free { id } => {
                if let Some(seq) = live.remove(&id).and_then(|l| l.seq) {
                    if let Err(e) = pool.remove(seq) {
                        tracing::error!("freeing request {id}'s KV: {e}");
                    }
                }
            }
        }
    }
}
