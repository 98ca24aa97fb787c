//! The gRPC API (tonic): `ternfleet.v1.Inference` (`Generate` streaming, `Tokenize`,
//! `Detokenize`, `ListModels`) beside the standard `grpc.health.v1` service and server
//! reflection. Requests go through the same validation, permits, engine and error classes as
//! the HTTP API (`http`), so a limit reads the same on both.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, Stream};
use ternfleet_shared::error::ErrorClass;
use ternfleet_shared::proto::v1::inference_server::{Inference, InferenceServer};
use ternfleet_shared::proto::v1::{
    generate_request::Input, DetokenizeRequest, DetokenizeResponse, FinishReason, GenerateRequest,
    GenerateResponse, ListModelsRequest, ListModelsResponse, Model as PbModel, TokenizeRequest,
    TokenizeResponse, Usage as PbUsage,
};
use tonic::{Request, Response, Status};

use super::chat::Message;
use super::driver::Event;
use super::http::{self, AppState, Kind};
use super::openai::{self, ApiError, Common, Stop};
use super::scheduler::{Finish, Usage};

/// The status of an API error (../shared/CONVENTIONS.md: one class, one code everywhere).
pub fn status(e: &ApiError) -> Status {
    let code = match e.class {
        ErrorClass::BadRequest => tonic::Code::InvalidArgument,
        ErrorClass::NotFound => tonic::Code::NotFound,
        ErrorClass::Unauthenticated => tonic::Code::Unauthenticated,
        ErrorClass::Overloaded => tonic::Code::ResourceExhausted,
        ErrorClass::Unavailable => tonic::Code::Unavailable,
        ErrorClass::Timeout => tonic::Code::DeadlineExceeded,
        ErrorClass::Cancelled => tonic::Code::Cancelled,
        ErrorClass::Internal => tonic::Code::Internal,
    };
    Status::new(code, e.message.clone())
}

/// The inference service over the shared state.
pub struct Service {
    pub state: Arc<AppState>,
}

fn usage(u: &Usage) -> PbUsage {
    let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
    PbUsage {
        prompt_tokens: n(u.prompt_tokens),
        completion_tokens: n(u.completion_tokens),
        cached_tokens: n(u.cached_tokens),
    }
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

impl Service {
    fn check(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let v = meta.get("authorization").and_then(|v| v.to_str().ok());
        http::authorize_value(&self.state, v).map_err(|e| status(&e))
    }

    /// Validation, template rendering and tokenization (run off the async runtime).
    fn prepare(s: &AppState, r: GenerateRequest) -> Result<http::Prepared, ApiError> {
        let e = http::engine(s)?;
        let common = Common {
            max_tokens: (r.max_tokens > 0).then_some(r.max_tokens as i64),
            temperature: r.temperature.map(f64::from),
            top_p: r.top_p.map(f64::from),
            top_k: r.top_k.map(i64::from),
            min_p: r.min_p.map(f64::from),
            presence_penalty: r.presence_penalty.map(f64::from),
            frequency_penalty: r.frequency_penalty.map(f64::from),
            repetition_penalty: r.repetition_penalty.map(f64::from),
            seed: r.seed.map(|x| x as i64),
            stop: (!r.stop.is_empty()).then(|| Stop::Many(r.stop.clone())),
            ignore_eos: r.ignore_eos,
            ..Common::default()
        };
        let valid = openai::validate_common(&common, None, &s.limits)?;
        let tok = &e.model.tokenizer;
        let (kind, prompt) = match r.input {
            None => {
                return Err(ApiError::bad(
                    "input",
                    "one of prompt, prompt_ids or chat is required",
                ))
            }
            Some(Input::Prompt(t)) => (Kind::Completion, tok.encode(&t, true, true)),
            Some(Input::PromptIds(ids)) => {
                http::check_ids(tok.n_vocab(), &ids.ids, "prompt_ids")?;
                (Kind::Completion, ids.ids)
            }
            Some(Input::Chat(c)) => {
                let msgs: Vec<Message> = c
                    .messages
                    .into_iter()
                    .map(|m| Message {
                        role: if m.role == "developer" {
                            "system".into()
                        } else {
                            m.role
                        },
                        content: m.content,
                    })
                    .collect();
                openai::check_messages(&msgs, &s.limits)?;
                (Kind::Chat, http::chat_ids(e, &msgs)?)
            }
        };
        http::prepare_prompt(s, kind, prompt, valid)
    }
}

#[tonic::async_trait]
impl Inference for Service {
    type GenerateStream = GenStream;

    async fn generate(&self, req: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let arrived = Instant::now();
        self.check(req.metadata())?;
        let s = &self.state;
        let st = s.clone();
        let r = req.into_inner();
        let started = match http::take_permit(s) {
            Ok(permit) => http::off_runtime(move || Self::prepare(&st, r))
                .await
                .and_then(|p| http::submit(s, &p, arrived, permit)),
            Err(e) => Err(e),
        };
        let mut f = match started {
            Ok(f) => f,
            Err(e) => {
                s.metrics.request("grpc_generate", e.class.http_status());
                return Err(status(&e));
            }
        };
        // The first event tells whether the engine took the request.
        let first = match f.rx.recv().await {
            Some(Event::Rejected(r)) => {
                let e = http::reject_error(r);
                s.metrics.request("grpc_generate", e.class.http_status());
                return Err(status(&e));
            }
            Some(ev) => ev,
            None => return Err(Status::unavailable("the engine stopped")),
        };
        s.metrics.request("grpc_generate", 200);
        let out = stream::unfold(
            (f, Some(first), false),
            |(mut f, pending, done)| async move {
                if done {
                    return None;
                }
                let ev = match pending {
                    Some(e) => e,
                    None => f.rx.recv().await?,
                };
                let item = match ev {
                    Event::Token { token, text, .. } => {
                        f.observe_token();
                        Ok(GenerateResponse {
                            text,
                            token_ids: vec![token],
                            finish_reason: FinishReason::Unspecified as i32,
                            usage: None,
                        })
                    }
                    Event::Done {
                        reason,
                        text,
                        usage: u,
                    } => {
                        f.metrics.e2e.observe(f.arrived.elapsed().as_secs_f64());
                        let fr = match reason {
                            Finish::Stop => Some(FinishReason::Stop),
                            Finish::Length => Some(FinishReason::Length),
                            _ => None,
                        };
                        let item = match fr {
                            Some(fr) => Ok(GenerateResponse {
                                text,
                                token_ids: Vec::new(),
                                finish_reason: fr as i32,
                                usage: Some(usage(&u)),
                            }),
                            None => Err(status(&openai::finish_error(&reason))),
                        };
                        return Some((item, (f, None, true)));
                    }
                    Event::Rejected(r) => {
                        return Some((Err(status(&http::reject_error(r))), (f, None, true)));
                    }
                };
                Some((item, (f, None, false)))
            },
        );
        Ok(Response::new(Box::pin(out)))
    }

    async fn tokenize(
        &self,
        req: Request<TokenizeRequest>,
    ) -> Result<Response<TokenizeResponse>, Status> {
        self.check(req.metadata())?;
        let st = self.state.clone();
        let r = req.into_inner();
        let tokens = http::off_runtime(move || {
            let e = http::engine(&st)?;
            Ok(e.model.tokenizer.encode(&r.content, r.add_special, true))
        })
        .await
        .map_err(|e| status(&e))?;
        Ok(Response::new(TokenizeResponse { tokens }))
    }

    async fn detokenize(
        &self,
        req: Request<DetokenizeRequest>,
    ) -> Result<Response<DetokenizeResponse>, Status> {
        self.check(req.metadata())?;
        let e = http::engine(&self.state).map_err(|e| status(&e))?;
        let r = req.into_inner();
        http::check_ids(e.model.tokenizer.n_vocab(), &r.tokens, "tokens")
            .map_err(|e| status(&e))?;
        let text = e.model.tokenizer.detokenize(&r.tokens, false, true);
        Ok(Response::new(DetokenizeResponse {
            content: String::from_utf8_lossy(&text).into_owned(),
        }))
    }

    async fn list_models(
        &self,
        req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        self.check(req.metadata())?;
        let s = &self.state;
        let model = match s.engine.get() {
            Some(e) => PbModel {
                id: s.model_name.clone(),
                arch: e.model.cfg.arch.name().to_string(),
                n_vocab: u32::try_from(e.model.cfg.n_vocab).unwrap_or(u32::MAX),
                n_ctx: u32::try_from(s.limits.ctx).unwrap_or(u32::MAX),
            },
            None => PbModel {
                id: s.model_name.clone(),
                ..PbModel::default()
            },
        };
        Ok(Response::new(ListModelsResponse {
            models: vec![model],
        }))
    }
}

/// Serves the gRPC API on `listener` until `shutdown` resolves: the inference service, health
/// (`SERVING` once the model is loaded, `NOT_SERVING` while draining) and reflection.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_not_serving::<InferenceServer<Service>>().await;
    let watch = state.clone();
    tokio::spawn(async move {
        // Follow readiness: serving once loaded, not serving once draining.
        let mut was = false;
        loop {
            let now = watch.ready.load(Ordering::SeqCst) && !watch.draining.load(Ordering::SeqCst);
            if now != was {
                if now {
                    reporter.set_serving::<InferenceServer<Service>>().await;
                } else {
                    reporter.set_not_serving::<InferenceServer<Service>>().await;
                }
                was = now;
            }
            if watch.draining.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ternfleet_shared::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .expect("the descriptor sets are built into the binary");
    let svc = InferenceServer::new(Service { state });
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = tls {
        builder = builder.tls_config(t)?;
    }
    builder
        .add_service(health)
        .add_service(reflection)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await
}
