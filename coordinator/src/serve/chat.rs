//! Chat templates: a conversation rendered into the prompt text the model was trained on.
//!
//! The template is the model's own `tokenizer.chat_template` (Jinja, from the GGUF file) or a
//! built-in one named with `--chat-template` (chatml, gemma, llama3), or a Jinja file. A
//! template from a downloaded file is hostile input: it renders in minijinja, which has no file
//! or network access, with a fuel budget (bounded loops and instructions) and a cap on the
//! output size, and a template that fails to compile is refused at start-up. Message contents
//! are data: Jinja in them is never evaluated.

use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// Instructions a render may execute (minijinja fuel).
const FUEL: u64 = 2_000_000;

/// Largest rendered prompt, bytes.
pub const MAX_RENDERED: usize = 4 << 20;

/// Built-in templates, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "chatml",
        "{%- for message in messages -%}\
         {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\
         {%- endfor -%}\
         {%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    ),
    (
        // llama.cpp's LLM_CHAT_TEMPLATE_GEMMA (src/llama-chat.cpp): system messages (trimmed,
        // concatenated) go before the next user turn, "assistant" is "model", contents trimmed.
        "gemma",
        "{%- set ns = namespace(sys='') -%}\
         {%- for message in messages -%}\
           {%- if message['role'] == 'system' -%}{%- set ns.sys = ns.sys + message['content'] | trim -%}\
           {%- else -%}\
             {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
             {{- '<start_of_turn>' + role + '\\n' -}}\
             {%- if ns.sys and role != 'model' -%}{{- ns.sys + '\\n\\n' -}}{%- set ns.sys = '' -%}{%- endif -%}\
             {{- message['content'] | trim + '<end_of_turn>\\n' -}}\
           {%- endif -%}\
         {%- endfor -%}\
         {%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}",
    ),
    (
        // LLM_CHAT_TEMPLATE_LLAMA_3 (BOS comes from the tokenizer, not the template).
        "llama3",
        "{%- for message in messages -%}\
         {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}\
         {%- endfor -%}\
         {%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}",
    ),
];

/// One message, its content already flattened to text.
#[derive(Clone, Debug, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Template problems.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template {name}: {err:#}")]
    Compile { name: String, err: Error },
    #[error("rendering the chat template: {0:#}")]
    Render(Error),
    #[error("the rendered chat prompt is {len} bytes, over the limit of {max}")]
    TooLong { len: usize, max: usize },
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from, for logs: `gguf`, a built-in name or a file path.
    pub name: String,
    bos: String,
    eos: String,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`; `bos` / `eos` are the texts of the model's BOS and EOS tokens.
    pub fn new(name: &str, source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|err| ChatError::Compile {
                name: name.to_string(),
                err,
            })?;
        Ok(ChatTemplate {
            env,
            name: name.to_string(),
            bos: bos.to_string(),
            eos: eos.to_string(),
        })
    }

    /// A built-in template by name.
    pub fn builtin(name: &str, bos: &str, eos: &str) -> Option<Result<ChatTemplate, ChatError>> {
        BUILTIN
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(n, src)| ChatTemplate::new(n, src, bos, eos))
    }

    /// The prompt for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[Message]) -> Result<String, ChatError> {
        let t = self.env.get_template("chat").map_err(ChatError::Render)?;
        let out = t
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos,
                eos_token => self.eos,
            })
            .map_err(ChatError::Render)?;
        if out.len() > MAX_RENDERED {
            return Err(ChatError::TooLong {
                len: out.len(),
                max: MAX_RENDERED,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: &[(&str, &str)]) -> Vec<Message> {
        v.iter()
            .map(|(r, c)| Message {
                role: r.to_string(),
                content: c.to_string(),
            })
            .collect()
    }

    #[test]
    fn chatml_renders_turns_and_the_generation_prompt() {
        let t = ChatTemplate::builtin("chatml", "<s>", "</s>")
            .unwrap()
            .unwrap();
        let out = t
            .render(&msgs(&[("system", "Be brief."), ("user", "Hi")]))
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma_folds_the_system_message_into_the_first_user_turn() {
        let t = ChatTemplate::builtin("gemma", "<bos>", "<eos>")
            .unwrap()
            .unwrap();
        let out = t
            .render(&msgs(&[
                ("system", " Be brief. "),
                ("user", "Hi "),
                ("assistant", "Hello"),
                ("user", "Bye"),
            ]))
            .unwrap();
        assert_eq!(
            out,
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn jinja_in_a_message_is_text_not_code() {
        let t = ChatTemplate::builtin("chatml", "", "").unwrap().unwrap();
        let out = t
            .render(&msgs(&[("user", "{{ 7*7 }}{% for x in range(9) %}")]))
            .unwrap();
        assert!(out.contains("{{ 7*7 }}{% for x in range(9) %}"));
    }

    #[test]
    fn hostile_templates_are_refused_or_bounded() {
        assert!(matches!(
            ChatTemplate::new("bad", "{% for %}", "", ""),
            Err(ChatError::Compile { .. })
        ));
        // An endless loop runs out of fuel instead of hanging.
        let t = ChatTemplate::new(
            "loop",
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert!(matches!(t.render(&[]), Err(ChatError::Render(_))));
        let t =
            ChatTemplate::new("raise", "{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[]).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }
}
