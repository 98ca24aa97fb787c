//! OpenAI-compatible wire types and their validation: each request is parsed once into a
//! [`Valid`] request or a typed [`ApiError`] that names the field, the limit and the numbers
//! (*like* text-generation-inference's `validation.rs`).

use serde::Deserialize;
use serde_json::{json, Value};
use ternfleet_shared::error::ErrorClass;

use super::chat::Message;
use crate::sampler::SamplerParams;

/// An error as the API answers it: a class (status / gRPC code) and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub class: ErrorClass,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn new(class: ErrorClass, message: impl Into<String>) -> ApiError {
        ApiError {
            class,
            message: message.into(),
            param: None,
        }
    }

    pub fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            class: ErrorClass::BadRequest,
            message: message.into(),
            param: Some(param),
        }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        let kind = match self.class {
            ErrorClass::BadRequest => "invalid_request_error",
            ErrorClass::NotFound => "not_found_error",
            ErrorClass::Unauthenticated => "authentication_error",
            ErrorClass::Overloaded => "rate_limit_error",
            ErrorClass::Unavailable => "unavailable_error",
            ErrorClass::Timeout => "timeout_error",
            ErrorClass::Cancelled => "cancelled_error",
            ErrorClass::Internal => "server_error",
        };
        json!({
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.class.http_status(),
            }
        })
    }
}

/// The limits requests are checked against.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Positions per sequence (prompt + generated).
    pub ctx: usize,
    /// Prompt tokens at most.
    pub max_prompt_tokens: usize,
    /// Stop strings per request, and bytes per stop string.
    pub max_stop: usize,
    pub max_stop_len: usize,
    /// `top_logprobs` / completions `logprobs` at most.
    pub max_logprobs: usize,
    /// Messages per chat request.
    pub max_messages: usize,
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `prompt` of `/v1/completions`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields `/v1/completions` and `/v1/chat/completions` share.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Completions' logprobs: how many alternatives (0..=limit).
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub common: Common,
}

/// A chat message's content: text, or a list of parts of which only text is accepted.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

/// What every generation request becomes after validation (the prompt still as text or ids).
#[derive(Clone, Debug)]
pub struct Valid {
    pub max_tokens: Option<usize>,
    pub sampling: SamplerParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
}

fn finite(name: &'static str, v: f64, lo: f64, hi: f64) -> Result<f32, ApiError> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(ApiError::bad(
            name,
            format!("{name} = {v} is out of range: it must be a finite number in [{lo}, {hi}]"),
        ));
    }
    Ok(v as f32)
}

/// Checks the shared fields; `logprobs` is the already-read alternatives count.
pub fn validate_common(
    c: &Common,
    logprobs: Option<i64>,
    limits: &Limits,
) -> Result<Valid, ApiError> {
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad(
                "n",
                format!("n = {n}: only one choice per request is supported (n must be 1)"),
            ));
        }
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => None,
        Some(m) if m < 1 || m as u64 > limits.ctx as u64 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "max_tokens = {m} is out of range: it must be in [1, {}] (the context size)",
                    limits.ctx
                ),
            ))
        }
        Some(m) => Some(m as usize),
    };
    let d = SamplerParams::default();
    let temperature = match c.temperature {
        Some(t) => finite("temperature", t, 0.0, 2.0)?,
        None => 1.0,
    };
    let top_p = match c.top_p {
        Some(p) => finite("top_p", p, 0.0, 1.0)?,
        None => 1.0,
    };
    if top_p == 0.0 {
        return Err(ApiError::bad(
            "top_p",
            "top_p = 0 is out of range: it must be in (0, 1]",
        ));
    }
    let top_k = match c.top_k {
        Some(k) if !(0..=1_000_000).contains(&k) => {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k = {k} is out of range: it must be in [0, 1000000] (0 disables)"),
            ))
        }
        Some(k) => k as usize,
        None => 0,
    };
    let min_p = match c.min_p {
        Some(p) => finite("min_p", p, 0.0, 1.0)?,
        None => 0.0,
    };
    let presence_penalty = match c.presence_penalty {
        Some(p) => finite("presence_penalty", p, -2.0, 2.0)?,
        None => 0.0,
    };
    let frequency_penalty = match c.frequency_penalty {
        Some(p) => finite("frequency_penalty", p, -2.0, 2.0)?,
        None => 0.0,
    };
    let repeat_penalty = match c.repetition_penalty {
        Some(p) => finite("repetition_penalty", p, 0.01, 10.0)?,
        None => 1.0,
    };
    let seed = match c.seed {
        Some(s) => s as u64,
        None => 0,
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > limits.max_stop {
        return Err(ApiError::bad(
            "stop",
            format!(
                "{} stop strings: at most {} are allowed",
                stop.len(),
                limits.max_stop
            ),
        ));
    }
    if let Some(s) = stop.iter().find(|s| s.len() > limits.max_stop_len) {
        return Err(ApiError::bad(
            "stop",
            format!(
                "a stop string is {} bytes: at most {} are allowed",
                s.len(),
                limits.max_stop_len
            ),
        ));
    }
    let logprobs = match logprobs {
        None => None,
        Some(n) if n < 0 || n as u64 > limits.max_logprobs as u64 => {
            return Err(ApiError::bad(
                "top_logprobs",
                format!(
                    "{n} log-probabilities requested: the limit is {}",
                    limits.max_logprobs
                ),
            ))
        }
        Some(n) => Some(n as usize),
    };
    Ok(Valid {
        max_tokens,
        sampling: SamplerParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
            ..d
        },
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        logprobs,
        ignore_eos: c.ignore_eos,
    })
}

/// A chat request's messages as template input.
pub fn chat_messages(req: &ChatRequest, limits: &Limits) -> Result<Vec<Message>, ApiError> {
    let mut out = Vec::with_capacity(req.messages.len().min(limits.max_messages + 1));
    for (i, m) in req
        .messages
        .iter()
        .take(limits.max_messages + 1)
        .enumerate()
    {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        _ => {
                            return Err(ApiError::bad(
                                "messages",
                                format!("messages[{i}]: content part of type {:?} is not supported (text only)", p.kind),
                            ))
                        }
                    }
                }
                s
            }
        };
        // OpenAI's newer name for the system role.
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        out.push(Message {
            role: role.to_string(),
            content,
        });
    }
    if req.messages.len() > limits.max_messages {
        return Err(ApiError::bad(
            "messages",
            format!(
                "{} messages: at most {} are allowed",
                req.messages.len(),
                limits.max_messages
            ),
        ));
    }
    check_messages(&out, limits)?;
    Ok(out)
}

/// The checks of [`chat_messages`] for messages that arrive already flattened (gRPC).
pub fn check_messages(msgs: &[Message], limits: &Limits) -> Result<(), ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::bad(
            "messages",
            "messages is empty: at least one message is needed",
        ));
    }
    if msgs.len() > limits.max_messages {
        return Err(ApiError::bad(
            "messages",
            format!(
                "{} messages: at most {} are allowed",
                msgs.len(),
                limits.max_messages
            ),
        ));
    }
    if let Some((i, m)) = msgs
        .iter()
        .enumerate()
        .find(|(_, m)| !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool"))
    {
        return Err(ApiError::bad(
            "messages",
            format!(
                "messages[{i}].role = {:?}: expected system, user, assistant or tool",
                m.role
            ),
        ));
    }
    Ok(())
}

/// The `usage` object.
pub fn usage_json(u: &super::scheduler::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// OpenAI's `finish_reason` for the reasons that end a response normally.
pub fn finish_reason(f: &super::scheduler::Finish) -> Option<&'static str> {
    use super::scheduler::Finish;
    match f {
        Finish::Stop => Some("stop"),
        Finish::Length => Some("length"),
        _ => None,
    }
}

/// The error a request ends with when it did not finish normally.
pub fn finish_error(f: &super::scheduler::Finish) -> ApiError {
    use super::scheduler::Finish;
    match f {
        Finish::Timeout => ApiError::new(
            ErrorClass::Timeout,
            "the request's deadline passed before it finished",
        ),
        Finish::Cancelled => ApiError::new(
            ErrorClass::Cancelled,
            "the request was cancelled (server shutting down or client gone)",
        ),
        Finish::Error(c, m) => ApiError::new(*c, format!("generation failed: {m}")),
        Finish::Stop | Finish::Length => ApiError::new(ErrorClass::Internal, "finished normally"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            ctx: 4096,
            max_prompt_tokens: 4000,
            max_stop: 4,
            max_stop_len: 64,
            max_logprobs: 20,
            max_messages: 256,
        }
    }

    fn common(v: Value) -> Result<Valid, ApiError> {
        let c: Common = serde_json::from_value(v).unwrap();
        validate_common(&c, None, &limits())
    }

    #[test]
    fn out_of_range_parameters_name_the_field_and_the_numbers() {
        let cases = [
            (json!({"temperature": 3.5}), "temperature", "3.5"),
            (json!({"top_p": 0.0}), "top_p", "0"),
            (json!({"max_tokens": 0}), "max_tokens", "[1, 4096]"),
            (json!({"max_tokens": 100000}), "max_tokens", "100000"),
            (json!({"n": 2}), "n", "n = 2"),
            (
                json!({"stop": ["a", "b", "c", "d", "e"]}),
                "stop",
                "at most 4",
            ),
            (json!({"presence_penalty": -9}), "presence_penalty", "-9"),
            (json!({"top_k": -1}), "top_k", "-1"),
        ];
        for (v, field, needle) in cases {
            let e = common(v.clone()).unwrap_err();
            assert_eq!(e.class, ErrorClass::BadRequest, "{v}");
            assert_eq!(e.param, Some(field), "{v}");
            assert!(e.message.contains(needle), "{v}: {}", e.message);
        }
    }

    #[test]
    fn defaults_are_openai_s() {
        let v = common(json!({})).unwrap();
        assert_eq!(v.sampling.temperature, 1.0);
        assert_eq!(v.sampling.top_p, 1.0);
        assert_eq!(v.max_tokens, None);
        assert!(!v.stream);
        let v = common(json!({"max_completion_tokens": 5, "max_tokens": 9, "stop": "x"})).unwrap();
        assert_eq!(v.max_tokens, Some(5));
        assert_eq!(v.stop, ["x"]);
    }

    #[test]
    fn wrong_types_fail_to_parse() {
        assert!(serde_json::from_value::<Common>(json!({"temperature": "hot"})).is_err());
        assert!(serde_json::from_value::<Common>(json!({"max_tokens": 1e300})).is_err());
        assert!(serde_json::from_value::<ChatRequest>(json!({"messages": "hi"})).is_err());
    }

    #[test]
    fn chat_messages_flatten_text_parts_and_refuse_others() {
        let r: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi"}
        ]}))
        .unwrap();
        let m = chat_messages(&r, &limits()).unwrap();
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_str()),
            ("system", "ab")
        );
        let r: ChatRequest = serde_json::from_value(json!({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
        ]}))
        .unwrap();
        assert!(chat_messages(&r, &limits())
            .unwrap_err()
            .message
            .contains("image_url"));
        let r: ChatRequest =
            serde_json::from_value(json!({"messages": [{"role": "wizard", "content": "x"}]}))
                .unwrap();
        assert!(chat_messages(&r, &limits()).is_err());
    }
}
