//! `ternfleet serve` end to end: the real binary on Gemma 3 270M, bound to port 0 (the address
//! read from its start-up line), driven by real HTTP clients (ureq here, the `openai` Python
//! package in `openai_python_client_*`). Every wait is bounded; the server is killed by pid
//! on every exit path (`Server`'s `Drop`).

mod common;
use common::*;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use ternfleet_shared::testing::skip;

fn gemma() -> Option<PathBuf> {
    let p = root().join("models/gemma-3-270m-q4_k_m.gguf");
    if p.exists() {
        Some(p)
    } else {
        skip(
            "serve tests",
            "models/gemma-3-270m-q4_k_m.gguf missing (scripts/fetch-model.sh)",
        );
        None
    }
}

struct Server {
    child: Child,
    url: String,
    /// The gRPC address from the start-up line.
    grpc: Option<String>,
}

impl Server {
    /// Starts `ternfleet serve` on Gemma with `extra` flags and waits (bounded) until ready.
    fn start(extra: &[&str]) -> Option<Server> {
        Self::start_with(&gemma()?, extra)
    }

    /// Starts `ternfleet serve` on `model`.
    fn start_with(model: &Path, extra: &[&str]) -> Option<Server> {
        let server = Self::spawn(model, extra);
        // /health answers at once; /ready once loaded.
        assert_eq!(get(&server.url, "/health").0, 200);
        let t = Instant::now();
        while get(&server.url, "/ready").0 != 200 {
            assert!(t.elapsed() < Duration::from_secs(120), "not ready in 120 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(server)
    }

    /// Starts `ternfleet serve` on `model` and reads its start-up line (no readiness wait).
    fn spawn(model: &Path, extra: &[&str]) -> Server {
        let log = root().join("target/serve-test.log");
        let child = Command::new(env!("CARGO_BIN_EXE_ternfleet"))
            .arg("serve")
            .arg("-m")
            .arg(model)
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "-t", "2"])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).map_or(Stdio::null(), Stdio::from))
            .spawn()
            .expect("spawning ternfleet serve");
        let mut server = Server {
            child,
            url: String::new(),
            grpc: None,
        };
        let v = startup_line(&mut server.child, 60);
        assert_eq!(v["ternfleet"], "listening");
        assert_eq!(v["role"], "coordinator");
        server.url = format!("http://{}", v["http"].as_str().expect("http address"));
        server.grpc = v["grpc"].as_str().map(String::from);
        server
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (status, body) of a POST of raw bytes.
fn post_bytes(url: &str, path: &str, body: &[u8], key: Option<&str>) -> (u16, String) {
    let mut req = agent()
        .post(&format!("{url}{path}"))
        .set("Content-Type", "application/json");
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.send_bytes(body) {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap_or_default()),
        Err(e) => (0, e.to_string()),
    }
}

fn post(url: &str, path: &str, body: &Value) -> (u16, Value) {
    let (s, b) = post_bytes(url, path, body.to_string().as_bytes(), None);
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

/// The tokens of a completion (as text pieces) and their log-probabilities.
fn completion_tokens(
    url: &str,
    prompt: &str,
    max_tokens: usize,
    seed: u64,
) -> (Vec<String>, Vec<f64>) {
    let (s, v) = post(
        url,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
                "logprobs": 0, "ignore_eos": true}),
    );
    assert_eq!(s, 200, "{v}");
    logprobs_of(&v)
}

#[test]
fn the_same_request_gives_the_same_tokens_alone_or_among_15_others() {
    let Some(srv) = Server::start(&["--parallel", "16", "--numerics", "invariant"]) else {
        return;
    };
    let prompt = "The history of the printing press begins";
    let alone = completion_tokens(&srv.url, prompt, 24, 42);
    assert_eq!(alone.0.len(), 24);
    let others: Vec<String> = (0..15)
        .map(|i| {
            format!(
                "Prompt number {i}: {}",
                "tell me about rivers and mountains ".repeat(i % 5 + 1)
            )
        })
        .collect();
    let url = srv.url.clone();
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let url = url.clone();
            let p = if i == 7 {
                prompt.to_string()
            } else {
                others[i - (i > 7) as usize].clone()
            };
            std::thread::spawn(move || {
                // Staggered joins: requests arrive while others prefill and decode.
                std::thread::sleep(Duration::from_millis(15 * i as u64));
                let n = if i == 7 { 24 } else { 8 + 3 * i };
                completion_tokens(&url, &p, n, if i == 7 { 42 } else { i as u64 })
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();
    assert_eq!(
        results[7].0, alone.0,
        "same tokens alone and among 15 others"
    );
    // Log-probabilities equal to the last bit: the logits did not change either.
    assert_eq!(results[7].1, alone.1);
}

#[test]
fn limits_and_hostile_requests_get_4xx_and_the_server_keeps_serving() {
    let Some(srv) = Server::start(&["--ctx", "256", "--max-body", "64KiB"]) else {
        return;
    };
    let u = &srv.url;
    let long_prompt = "word ".repeat(400);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed JSON",
            b"{\"prompt\": \"x\"".to_vec(),
            400,
            "invalid JSON",
        ),
        (
            "wrong type",
            br#"{"prompt": "x", "max_tokens": "ten"}"#.to_vec(),
            400,
            "invalid type",
        ),
        (
            "invalid UTF-8",
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
            400,
            "invalid JSON",
        ),
        (
            "huge number",
            br#"{"prompt": "x", "max_tokens": 1e400}"#.to_vec(),
            400,
            "invalid JSON",
        ),
        (
            "NaN",
            br#"{"prompt": "x", "temperature": NaN}"#.to_vec(),
            400,
            "invalid JSON",
        ),
        (
            "oversized body",
            format!("{{\"prompt\": \"{}\"}}", "a".repeat(100_000)).into_bytes(),
            400,
            "limit",
        ),
        (
            "prompt over the limit",
            json!({"prompt": long_prompt}).to_string().into_bytes(),
            400,
            "the limit is 255",
        ),
        (
            "prompt + max_tokens over ctx",
            json!({"prompt": "hello", "max_tokens": 255})
                .to_string()
                .into_bytes(),
            400,
            "context size 256",
        ),
        (
            "temperature out of range",
            json!({"prompt": "x", "temperature": 9})
                .to_string()
                .into_bytes(),
            400,
            "temperature = 9",
        ),
        (
            "too many stops",
            json!({"prompt": "x", "stop": ["a","b","c","d","e"]})
                .to_string()
                .into_bytes(),
            400,
            "at most 4",
        ),
        (
            "stop too long",
            json!({"prompt": "x", "stop": ["s".repeat(300)]})
                .to_string()
                .into_bytes(),
            400,
            "300 bytes",
        ),
        (
            "logprobs cap",
            json!({"prompt": "x", "logprobs": 50})
                .to_string()
                .into_bytes(),
            400,
            "limit is 20",
        ),
        (
            "n",
            json!({"prompt": "x", "n": 3}).to_string().into_bytes(),
            400,
            "n = 3",
        ),
        (
            "token id out of range",
            json!({"prompt": [1, 99999999]}).to_string().into_bytes(),
            400,
            "out of range",
        ),
        (
            "empty messages",
            json!({"messages": []}).to_string().into_bytes(),
            400,
            "messages is empty",
        ),
    ];
    for (what, body, status, needle) in &cases {
        let path = if what.contains("messages") {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (s, b) = post_bytes(u, path, body, None);
        assert_eq!(s, *status, "{what}: {b}");
        let v: Value =
            serde_json::from_str(&b).unwrap_or_else(|_| panic!("{what}: error body is JSON: {b}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{what}: {msg:?} lacks {needle:?}");
        assert!(
            v["error"]["type"].is_string(),
            "{what}: OpenAI error object"
        );
    }
    assert_eq!(post(u, "/v1/nothing", &json!({})).0, 404);
    // Jinja in a message is text, not template code.
    let (s, v) = post(u, "/tokenize", &json!({"content": "{{ 7*7 }}"}));
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        u,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "{% for x in range(99999999) %}{{x}}{% endfor %}"}], "max_tokens": 2}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) < 60,
        "{v}"
    );
    // Still serving.
    let (s, v) = post(
        u,
        "/v1/completions",
        &json!({"prompt": "Paris is", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(
        metric(
            u,
            "ternfleet_requests_total{endpoint=\"completions\",status=\"400\"}"
        ) >= 13.0
    );
}

#[test]
fn a_dropped_stream_frees_its_kv_within_a_step() {
    let Some(srv) = Server::start(&[]) else {
        return;
    };
    let u = srv.url.clone();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 400, "stream": true, "ignore_eos": true});
    let r = agent()
        .post(&format!("{u}/v1/completions"))
        .send_string(&body.to_string())
        .expect("stream starts");
    let mut reader = BufReader::new(r.into_reader());
    let mut events = 0;
    let mut line = String::new();
    while events < 5 {
        line.clear();
        assert!(reader.read_line(&mut line).expect("reading the stream") > 0);
        if line.starts_with("data: {") {
            events += 1;
        }
    }
    assert_eq!(metric(&u, "ternfleet_running_sequences"), 1.0);
    assert!(metric(&u, "ternfleet_kv_blocks_used") >= 1.0);
    drop(reader);
    let t = Instant::now();
    while metric(&u, "ternfleet_running_sequences") != 0.0
        || metric(&u, "ternfleet_kv_blocks_used") != 0.0
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "KV not freed 5 s after the client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(metric(&u, "ternfleet_generated_tokens_total") < 100.0);
}

#[test]
fn overload_is_refused_at_once_and_admitted_requests_complete() {
    let Some(srv) = Server::start(&["--parallel", "1", "--max-queue", "1"]) else {
        return;
    };
    let handles: Vec<_> = (0..5)
        .map(|i| {
            let u = srv.url.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10 * i));
                let t = Instant::now();
                let (s, v) = post(
                    &u,
                    "/v1/completions",
                    &json!({"prompt": "Count: one, two,", "max_tokens": 48, "ignore_eos": true}),
                );
                (s, v, t.elapsed())
            })
        })
        .collect();
    let res: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("client"))
        .collect();
    let ok = res.iter().filter(|r| r.0 == 200).count();
    let shed: Vec<_> = res.iter().filter(|r| r.0 == 429).collect();
    assert_eq!(
        (ok, shed.len()),
        (2, 3),
        "{:?}",
        res.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    for (_, v, took) in &shed {
        assert!(*took < Duration::from_millis(500), "429 took {took:?}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("overloaded"),
            "{v}"
        );
    }
    for (s, v, _) in &res {
        if *s == 200 {
            assert_eq!(v["usage"]["completion_tokens"], 48);
        }
    }
}

#[test]
fn api_keys_guard_the_api_but_not_health() {
    let Some(srv) = Server::start(&["--api-key", "sk-test-123456"]) else {
        return;
    };
    let u = &srv.url;
    assert_eq!(get(u, "/health").0, 200);
    assert_eq!(get(u, "/ready").0, 200);
    let body = json!({"prompt": "hi", "max_tokens": 1}).to_string();
    assert_eq!(
        post_bytes(u, "/v1/completions", body.as_bytes(), None).0,
        401
    );
    assert_eq!(
        post_bytes(
            u,
            "/v1/completions",
            body.as_bytes(),
            Some("sk-wrong-123456")
        )
        .0,
        401
    );
    let (s, b) = post_bytes(
        u,
        "/v1/completions",
        body.as_bytes(),
        Some("sk-test-123456"),
    );
    assert_eq!(s, 200, "{b}");
}

#[test]
fn sigterm_drains_running_requests_and_exits_zero() {
    let Some(mut srv) = Server::start(&["--grace", "20"]) else {
        return;
    };
    let u = srv.url.clone();
    let client = std::thread::spawn(move || {
        post(
            &u,
            "/v1/completions",
            &json!({"prompt": "A long story:", "max_tokens": 40, "ignore_eos": true}),
        )
    });
    let t = Instant::now();
    while metric(&srv.url, "ternfleet_running_sequences") != 1.0 {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = Command::new("kill")
        .args(["-TERM", &srv.pid().to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    let (s, v) = client.join().expect("client");
    assert_eq!(s, 200, "the running request finished: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 40);
    let t = Instant::now();
    loop {
        if let Some(code) = srv.child.try_wait().expect("try_wait") {
            assert!(code.success(), "exit status {code}");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "still running 30 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn openai_python_client_chat_and_completions_streaming_and_not() {
    let ok = Command::new("python3")
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        skip(
            "openai client test",
            "the Python openai package is not installed (pip install openai)",
        );
        return;
    }
    let Some(srv) = Server::start(&[]) else {
        return;
    };
    let mut child = Command::new("python3")
        .arg(root().join("tests/e2e/openai_client.py"))
        .arg(format!("{}/v1", srv.url))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3");
    let status = wait_bounded(&mut child, 120, "the openai client script");
    let mut out = String::new();
    let mut err = String::new();
    let _ = child.stdout.take().map(|mut s| s.read_to_string(&mut out));
    let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
    assert!(status.success(), "openai_client.py failed:\n{out}\n{err}");
    assert!(out.contains("all checks passed"), "{out}");
}

#[test]
fn sse_wire_format_as_curl_sees_it() {
    let Some(srv) = Server::start(&[]) else {
        return;
    };
    let out = Command::new("curl")
        .args([
            "-sN",
            "-D",
            "-",
            "--max-time",
            "60",
            "-H",
            "Content-Type: application/json",
            "-d",
        ])
        .arg(
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                    "stream": true, "stream_options": {"include_usage": true}})
            .to_string(),
        )
        .arg(format!("{}/v1/chat/completions", srv.url))
        .output();
    let Ok(out) = out else {
        skip("SSE format test", "curl is not installed");
        return;
    };
    let text = String::from_utf8(out.stdout).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("headers, then the body");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    // Events are `data: <json>` lines separated by blank lines, ending with `data: [DONE]`.
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| {
            let d = e
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"));
            serde_json::from_str(d).unwrap_or_else(|err| panic!("{err}: {d}"))
        })
        .collect();
    // 4 tokens (one chunk each, the first with the role), the finish chunk, the usage chunk.
    assert_eq!(chunks.len(), 6, "{body}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[4]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);
    assert!(chunks[..5].iter().all(|c| c["usage"].is_null()));
}

/// `ternfleet serve`'s `/apply-template` equals llama-server's for every conversation of
/// `tests/data/refs/chat-templates.json` (written by scripts/make-chat-template-refs.py): the
/// built-in chatml / gemma / llama3 templates against `llama-server --no-jinja --chat-template
/// NAME`, and Qwen2.5-Coder's own GGUF template against `llama-server --jinja`.
#[test]
fn chat_templates_render_as_llama_server_does() {
    let path = root().join("tests/data/refs/chat-templates.json");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("the fixture"))
        .expect("the fixture is JSON");
    let configs = refs["configs"].as_array().expect("configs");
    assert_eq!(configs.len(), 4);
    for c in configs {
        let model = root().join(c["model"].as_str().expect("model"));
        if !model.exists() {
            skip(
                "chat template parity",
                &format!("{} missing (scripts/fetch-model.sh)", model.display()),
            );
            continue;
        }
        let name = c["chat_template"].as_str().unwrap_or_default();
        let extra: Vec<&str> = if name.is_empty() {
            vec![]
        } else {
            vec!["--chat-template", name]
        };
        let srv = Server::start_with(&model, &extra).expect("the model exists");
        let cases = c["cases"].as_array().expect("cases");
        assert!(cases.len() >= 3);
        for case in cases {
            let (s, mine) = post(
                &srv.url,
                "/apply-template",
                &json!({ "messages": case["messages"] }),
            );
            assert_eq!(s, 200, "{mine}");
            assert_eq!(
                mine["prompt"], case["prompt"],
                "template {name:?} on {}: ternfleet vs llama-server",
                case["messages"]
            );
        }
    }
}

#[test]
fn grpc_generate_streams_the_same_text_as_http_and_errors_use_the_shared_codes() {
    use ternfleet_shared::proto::v1::generate_request::Input;
    use ternfleet_shared::proto::v1::inference_client::InferenceClient;
    use ternfleet_shared::proto::v1::{
        DetokenizeRequest, FinishReason, GenerateRequest, ListModelsRequest, TokenizeRequest,
    };
    let Some(srv) = Server::start(&[]) else {
        return;
    };
    let grpc = format!(
        "http://{}",
        srv.grpc
            .clone()
            .expect("a grpc address in the start-up line")
    );
    // The same request over HTTP, for comparison.
    let (s, v) = post(
        &srv.url,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
    let http_text = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let timeout = Duration::from_secs(60);
        let mut c = tokio::time::timeout(timeout, InferenceClient::connect(grpc.clone()))
            .await
            .expect("connect within 60 s")
            .expect("gRPC connect");
        let req = GenerateRequest {
            input: Some(Input::Prompt("The capital of France is".into())),
            max_tokens: 8,
            temperature: Some(0.0),
            ..Default::default()
        };
        let mut stream = c.generate(req).await.expect("Generate").into_inner();
        let (mut text, mut ids, mut last) = (String::new(), Vec::new(), None);
        while let Some(m) = tokio::time::timeout(timeout, stream.message())
            .await
            .expect("a message within 60 s")
            .expect("no stream error")
        {
            text.push_str(&m.text);
            ids.extend(m.token_ids.iter().copied());
            last = Some(m);
        }
        let last = last.expect("at least one message");
        assert_eq!(last.finish_reason, FinishReason::Length as i32);
        let usage = last.usage.expect("usage on the last message");
        assert_eq!((usage.completion_tokens, ids.len()), (8, 8));
        assert_eq!(text, http_text, "gRPC and HTTP give the same text");
        // Tokenize / Detokenize round trip, ListModels.
        let t = c
            .tokenize(TokenizeRequest {
                content: "Hello world".into(),
                add_special: false,
            })
            .await
            .expect("Tokenize")
            .into_inner();
        let d = c
            .detokenize(DetokenizeRequest {
                tokens: t.tokens.clone(),
            })
            .await
            .expect("Detokenize")
            .into_inner();
        assert_eq!(d.content, "Hello world");
        let m = c
            .list_models(ListModelsRequest {})
            .await
            .expect("ListModels")
            .into_inner();
        assert_eq!(m.models.len(), 1);
        assert_eq!(m.models[0].arch, "gemma3");
        // Errors: the shared classes.
        let bad = GenerateRequest {
            input: Some(Input::Prompt("x".into())),
            temperature: Some(9.0),
            ..Default::default()
        };
        let e = c.generate(bad).await.expect_err("temperature 9 is refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("temperature = 9"), "{}", e.message());
        let e = c
            .detokenize(DetokenizeRequest {
                tokens: vec![u32::MAX],
            })
            .await
            .expect_err("an out-of-range id is refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        // The standard health service says SERVING for the inference service.
        let channel = tonic::transport::Channel::from_shared(grpc.clone())
            .expect("a valid URI")
            .connect()
            .await
            .expect("health connect");
        let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
        let r = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "ternfleet.v1.Inference".into(),
            })
            .await
            .expect("health check")
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    });
}

#[test]
fn grpc_api_keys_are_required_like_http() {
    use ternfleet_shared::proto::v1::inference_client::InferenceClient;
    use ternfleet_shared::proto::v1::ListModelsRequest;
    let Some(srv) = Server::start(&["--api-key", "sk-test-123456"]) else {
        return;
    };
    let grpc = format!("http://{}", srv.grpc.clone().expect("grpc address"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let mut c = InferenceClient::connect(grpc).await.expect("connect");
        let e = c
            .list_models(ListModelsRequest {})
            .await
            .expect_err("no key");
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let mut req = tonic::Request::new(ListModelsRequest {});
        req.metadata_mut().insert(
            "authorization",
            "Bearer sk-test-123456".parse().expect("ASCII metadata"),
        );
        c.list_models(req).await.expect("with the key");
    });
}

/// (status, body) of `curl` over HTTPS to `localhost:port` trusting `ca` (0 when curl fails:
/// no connection, a refused handshake).
fn curl_https(port: u16, ca: &Path, path: &str, body: Option<&Value>) -> (u16, String) {
    let url = format!("https://localhost:{port}{path}");
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "-m", "60", "-w", "\n%{http_code}", "--cacert"])
        .arg(ca)
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1")]);
    if let Some(b) = body {
        cmd.args(["-H", "Content-Type: application/json", "-d", &b.to_string()]);
    }
    let out = cmd.arg(&url).output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[test]
fn tls_serves_https_and_grpc_and_a_plaintext_client_does_not_break_it() {
    use ternfleet_shared::proto::v1::inference_client::InferenceClient;
    use ternfleet_shared::proto::v1::TokenizeRequest;
    let Some(model) = gemma() else {
        return;
    };
    if Command::new("curl").arg("--version").output().is_err() {
        skip("tls test", "curl missing (scripts/test.sh installs it)");
        return;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
        .expect("a self-signed certificate");
    let (cert, key) = (dir.path().join("api.pem"), dir.path().join("api.key"));
    std::fs::write(&cert, ck.cert.pem()).expect("writing the certificate");
    std::fs::write(&key, ck.key_pair.serialize_pem()).expect("writing the key");

    // A key that does not match, or only one of the two files: a clear error before binding.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let bad_key = dir.path().join("other.key");
    std::fs::write(&bad_key, other.key_pair.serialize_pem()).unwrap();
    for (args, want) in [
        (vec!["--tls-cert", cert.to_str().unwrap()], "go together"),
        (
            vec![
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                bad_key.to_str().unwrap(),
            ],
            "does not match",
        ),
        (
            vec![
                "--tls-cert",
                key.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ],
            "no certificate",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ternfleet"))
            .arg("serve")
            .arg("-m")
            .arg(&model)
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(&args)
            .output()
            .expect("running ternfleet serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "no start-up line before a TLS error");
    }

    let srv = Server::spawn(
        &model,
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    let port: u16 = srv.url.rsplit(':').next().unwrap().parse().unwrap();
    let t = Instant::now();
    while curl_https(port, &cert, "/ready", None).0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "not ready over HTTPS in 120 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Plain HTTP to the TLS port gets no answer; the server keeps serving HTTPS.
    assert_eq!(
        get(&srv.url, "/health").0,
        0,
        "plain HTTP must not be served"
    );
    let (code, body) = curl_https(
        port,
        &cert,
        "/v1/completions",
        Some(&json!({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})),
    );
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("JSON over HTTPS");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    // A client that does not trust the certificate is refused at the handshake.
    let out = Command::new("curl")
        .args([
            "-sS",
            "-m",
            "30",
            "--resolve",
            &format!("localhost:{port}:127.0.0.1"),
        ])
        .arg(format!("https://localhost:{port}/health"))
        .output()
        .expect("curl runs");
    assert!(
        !out.status.success(),
        "an untrusted certificate must fail verification"
    );
    assert_eq!(curl_https(port, &cert, "/health", None).0, 200);

    // gRPC over TLS with the same certificate; a plaintext gRPC client fails.
    let grpc_port: u16 = srv
        .grpc
        .as_deref()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("a gRPC address");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let limit = Duration::from_secs(60);
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ck.cert.pem()))
            .domain_name("localhost");
        let channel =
            tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{grpc_port}"))
                .expect("an endpoint")
                .tls_config(tls)
                .expect("client TLS settings")
                .connect_timeout(limit);
        let channel = tokio::time::timeout(limit, channel.connect())
            .await
            .expect("connect within 60 s")
            .expect("gRPC over TLS connects");
        let mut c = InferenceClient::new(channel);
        let ids = c
            .tokenize(TokenizeRequest {
                content: "hello world".into(),
                ..Default::default()
            })
            .await
            .expect("Tokenize over TLS")
            .into_inner();
        assert!(!ids.tokens.is_empty());
        let plain = tokio::time::timeout(
            limit,
            InferenceClient::connect(format!("http://127.0.0.1:{grpc_port}")),
        )
        .await
        .expect("a plaintext connect attempt ends within 60 s");
        match plain {
            Err(_) => {}
            Ok(mut c) => {
                let r = tokio::time::timeout(
                    limit,
                    c.tokenize(TokenizeRequest {
                        content: "hello".into(),
                        ..Default::default()
                    }),
                )
                .await
                .expect("a plaintext call ends within 60 s");
                assert!(
                    r.is_err(),
                    "plaintext gRPC must not be served on the TLS port"
                );
            }
        }
    });
    drop(srv);
}

/// Runs `ternfleet serve` with `args`, expecting it to exit (bounded) with a failure; its
/// stderr.
fn serve_refuses(args: &[&str]) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ternfleet"))
        .arg("serve")
        .args(["--http", "127.0.0.1:0", "--grpc", ""])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning ternfleet serve");
    let status = wait_bounded(&mut child, 60, &format!("serve {args:?}"));
    let mut err = String::new();
    let _ = child.stderr.take().map(|mut s| s.read_to_string(&mut err));
    assert!(!status.success(), "serve {args:?} should fail:\n{err}");
    err
}

#[test]
fn an_moe_model_served_from_the_expert_store_answers_the_same_and_reports_the_store() {
    let tiny = root().join("tests/data/models/tiny-qwen3moe-q8_0.gguf");
    let prompt = "The capital of France is";
    let want = {
        let srv = Server::start_with(&tiny, &[]).expect("server");
        completion_tokens(&srv.url, prompt, 12, 7)
    };
    let srv = Server::start_with(
        &tiny,
        &[
            "--ram-budget",
            "200KiB",
            "--prefetch",
            "router",
            "--lookahead",
            "1",
            "--evict",
            "lru",
        ],
    )
    .expect("server");
    assert_eq!(completion_tokens(&srv.url, prompt, 12, 7), want);
    let m = |name: &str| metric(&srv.url, name);
    let miss = m("ternfleet_expert_store_demands_total{result=\"miss\"}");
    let hit = m("ternfleet_expert_store_demands_total{result=\"hit\"}");
    assert!(miss >= 1.0 && hit >= 0.0, "misses {miss}, hits {hit}");
    assert!(m("ternfleet_expert_store_read_bytes_total") > 0.0);
    assert!(m("ternfleet_expert_store_reads_total") >= 1.0);
    assert!(m("ternfleet_expert_store_read_seconds_total") > 0.0);
    assert_eq!(m("ternfleet_expert_store_read_errors_total"), 0.0);
    // Bad store options are refused at start with the reason.
    let tiny = tiny.to_string_lossy().into_owned();
    let err = serve_refuses(&["-m", &tiny, "--ram-budget", "lots"]);
    assert!(err.contains("ram_budget"), "{err}");
    let err = serve_refuses(&["-m", &tiny, "--evict", "random"]);
    assert!(err.contains("eviction policy"), "{err}");
    let err = serve_refuses(&["-m", &tiny, "--prefetch", "learned"]);
    assert!(err.contains("no predictor at"), "{err}");
}
