//! The error every domain check returns: the rule broken, with the field named in SageMaker's
//! spelling.

use std::fmt;
use std::ops::RangeInclusive;

/// An input that breaks a rule, with the field named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    pub field: String,
    pub message: String,
}

impl ValidationError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Refuses a whole number of `field` outside `range`: "must be between START and END, got
/// VALUE", with `unit` (" tokens") after END.
pub(crate) fn whole_in_range(
    field: impl Into<String>,
    range: &RangeInclusive<u32>,
    value: u32,
    unit: &str,
) -> Result<(), ValidationError> {
    in_range(field, range, value, ("between", unit))
}

/// Refuses a number of `field` outside `range`: "must be a number between START and END, got
/// VALUE".
pub(crate) fn number_in_range(
    field: impl Into<String>,
    range: &RangeInclusive<f64>,
    value: f64,
) -> Result<(), ValidationError> {
    in_range(field, range, value, ("a number between", ""))
}

/// "must be BETWEEN START and END`unit`, got VALUE" unless `value` is within `range`.
fn in_range<T: PartialOrd + fmt::Display>(
    field: impl Into<String>,
    range: &RangeInclusive<T>,
    value: T,
    (between, unit): (&str, &str),
) -> Result<(), ValidationError> {
    if range.contains(&value) {
        return Ok(());
    }
    Err(ValidationError::new(
        field,
        format!(
            "must be {between} {} and {}{unit}, got {value}",
            range.start(),
            range.end()
        ),
    ))
}

/// Refuses a list of `field` with more than `max` entries: "names at most MAX WHAT, got LEN".
pub(crate) fn names_at_most(
    field: impl Into<String>,
    max: usize,
    what: &str,
    len: usize,
) -> Result<(), ValidationError> {
    if len <= max {
        return Ok(());
    }
    Err(ValidationError::new(
        field,
        format!("names at most {max} {what}, got {len}"),
    ))
}
