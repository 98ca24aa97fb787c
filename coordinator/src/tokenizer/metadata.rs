//! GGUF `tokenizer.*` metadata -> [`TokenizerSpec`], with the key names and types llama.cpp's
//! `llama_vocab::impl::load` expects (llama-arch.cpp `LLM_KV_TOKENIZER_*`).

use ternfleet_shared::gguf::{ArrayValue, GgufError, GgufFile};

use super::vocab::{SpecialIds, TokenizerSpec};
use super::TokenizerError;

const MODEL: &str = "tokenizer.ggml.model";
const PRE: &str = "tokenizer.ggml.pre";
const TOKENS: &str = "tokenizer.ggml.tokens";
const SCORES: &str = "tokenizer.ggml.scores";
const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const MERGES: &str = "tokenizer.ggml.merges";

fn bad(key: &'static str) -> impl FnOnce(GgufError) -> TokenizerError {
    move |e| TokenizerError::BadKey {
        key,
        reason: e.to_string(),
    }
}

fn wrong_element(key: &'static str, expected: &str, found: &ArrayValue) -> TokenizerError {
    TokenizerError::BadKey {
        key,
        reason: format!(
            "expected an array of {expected}, found an array of {}",
            found.element_type_name()
        ),
    }
}

fn id(f: &GgufFile, key: &'static str) -> Result<Option<u32>, TokenizerError> {
    f.get_u32(key).map_err(bad(key))
}

fn flag(f: &GgufFile, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    f.get_bool(key).map_err(bad(key))
}

/// Reads every tokenizer key; a missing required key or a key of the wrong type is an error.
pub(crate) fn spec_from_gguf(f: &GgufFile) -> Result<TokenizerSpec, TokenizerError> {
    let model = f
        .get_str(MODEL)
        .map_err(bad(MODEL))?
        .ok_or(TokenizerError::MissingKey { key: MODEL })?;
    let pre = f.get_str(PRE).map_err(bad(PRE))?.map(str::to_owned);
    let tokens = match f.get_array(TOKENS).map_err(bad(TOKENS))? {
        None => return Err(TokenizerError::MissingKey { key: TOKENS }),
        Some(ArrayValue::String(v)) => v.clone(),
        Some(other) => return Err(wrong_element(TOKENS, "strings", other)),
    };
    // llama.cpp accepts F32 or INT32 scores
    let scores = match f.get_array(SCORES).map_err(bad(SCORES))? {
        None => None,
        Some(ArrayValue::F32(v)) => Some(v.clone()),
        Some(ArrayValue::I32(v)) => Some(v.iter().map(|&s| s as f32).collect()),
        Some(other) => return Err(wrong_element(SCORES, "f32 or i32", other)),
    };
    let token_types = match f.get_array(TOKEN_TYPE).map_err(bad(TOKEN_TYPE))? {
        None => None,
        Some(ArrayValue::I32(v)) => Some(v.clone()),
        Some(other) => return Err(wrong_element(TOKEN_TYPE, "i32", other)),
    };
    let merges = match f.get_array(MERGES).map_err(bad(MERGES))? {
        None => None,
        Some(ArrayValue::String(v)) => Some(v.clone()),
        Some(other) => return Err(wrong_element(MERGES, "strings", other)),
    };
    let ids = SpecialIds {
        bos: id(f, "tokenizer.ggml.bos_token_id")?,
        eos: id(f, "tokenizer.ggml.eos_token_id")?,
        eot: id(f, "tokenizer.ggml.eot_token_id")?,
        eom: id(f, "tokenizer.ggml.eom_token_id")?,
        unk: id(f, "tokenizer.ggml.unknown_token_id")?,
        sep: id(f, "tokenizer.ggml.seperator_token_id")?,
        pad: id(f, "tokenizer.ggml.padding_token_id")?,
        mask: id(f, "tokenizer.ggml.mask_token_id")?,
        // the deprecated prefix/suffix/middle keys come later in llama.cpp's list and win
        fim_pre: id(f, "tokenizer.ggml.prefix_token_id")?
            .or(id(f, "tokenizer.ggml.fim_pre_token_id")?),
        fim_suf: id(f, "tokenizer.ggml.suffix_token_id")?
            .or(id(f, "tokenizer.ggml.fim_suf_token_id")?),
        fim_mid: id(f, "tokenizer.ggml.middle_token_id")?
            .or(id(f, "tokenizer.ggml.fim_mid_token_id")?),
        fim_pad: id(f, "tokenizer.ggml.fim_pad_token_id")?,
        fim_rep: id(f, "tokenizer.ggml.fim_rep_token_id")?,
        fim_sep: id(f, "tokenizer.ggml.fim_sep_token_id")?,
    };
    Ok(TokenizerSpec {
        model: model.to_owned(),
        pre,
        tokens,
        scores,
        token_types,
        merges,
        ids,
        add_bos: flag(f, "tokenizer.ggml.add_bos_token")?,
        add_eos: flag(f, "tokenizer.ggml.add_eos_token")?,
        add_space_prefix: flag(f, "tokenizer.ggml.add_space_prefix")?,
        name: f
            .get_str("general.name")
            .map_err(bad("general.name"))?
            .map(str::to_owned),
    })
}
