//! Typed, validated names: endpoint configs, endpoints, variants and instances are never
//! identified by bare strings past the edge.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// SageMaker's name rule: `^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$`.
pub fn is_sagemaker_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > 63 * 2 {
        return false;
    }
    if !bytes[0].is_ascii_alphanumeric() || !bytes[bytes.len() - 1].is_ascii_alphanumeric() {
        return false;
    }
    if !bytes
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || *b == b'-')
    {
        return false;
    }
    // {0,62} groups after the first character, each ending in an alphanumeric: at most 63
    // alphanumerics in all, hyphens free in between.
    bytes.iter().filter(|b| b.is_ascii_alphanumeric()).count() <= 63
}

/// Instance ids: 1-128 characters of `[A-Za-z0-9._:-]`, starting with an alphanumeric.
pub fn is_instance_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 128
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $check:path, $rule:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// The rule a valid value follows, in words, for error messages.
            pub const RULE: &'static str = $rule;

            pub fn new(value: &str) -> Result<Self, InvalidName> {
                if $check(value) {
                    Ok(Self(Arc::from(value)))
                } else {
                    Err(InvalidName { value: value.to_owned(), rule: $rule })
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name's shared text (a reference count, no copy).
            pub fn shared(&self) -> Arc<str> {
                Arc::clone(&self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidName;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let value = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                Self::new(&value).map_err(serde::de::Error::custom)
            }
        }
    };
}

const SAGEMAKER_RULE: &str =
    "1-63 letters, digits and hyphens, starting and ending with a letter or digit";

name_type!(
    /// Name of an endpoint config.
    EndpointConfigName,
    is_sagemaker_name,
    SAGEMAKER_RULE
);
name_type!(
    /// Name of an endpoint.
    EndpointName,
    is_sagemaker_name,
    SAGEMAKER_RULE
);
name_type!(
    /// Name of a production variant within an endpoint config.
    VariantName,
    is_sagemaker_name,
    SAGEMAKER_RULE
);
name_type!(
    /// Id of an instance, unique within its endpoint.
    InstanceId,
    is_instance_id,
    "1-128 characters of letters, digits and . _ : -, starting with a letter or digit"
);

impl InstanceId {
    /// The KV index's name for data-parallel rank `rank` of this instance: `ID#dpRANK`. No
    /// registered id contains `#`, so it never names another instance; it appears as the
    /// `instance` label of the KV index's metrics.
    pub fn data_parallel_rank(&self, rank: u32) -> Self {
        Self(Arc::from(format!("{}#dp{rank}", self.0)))
    }
}

/// A name that does not follow its rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a valid name ({rule})")]
pub struct InvalidName {
    pub value: String,
    pub rule: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_parallel_rank_is_named_apart_from_every_instance() {
        let id = InstanceId::new("vllm-0").unwrap();
        let rank = id.data_parallel_rank(3);
        assert_eq!(rank.as_str(), "vllm-0#dp3");
        assert!(!is_instance_id(rank.as_str()));
    }

    #[test]
    fn sagemaker_names() {
        assert_eq!(EndpointName::RULE, SAGEMAKER_RULE);
        for ok in ["a", "A1", "my-endpoint", "a--b", "x".repeat(63).as_str()] {
            assert!(is_sagemaker_name(ok), "{ok}");
        }
        let too_long = "x".repeat(64);
        for bad in ["", "-a", "a-", "a_b", "a.b", too_long.as_str(), "é"] {
            assert!(!is_sagemaker_name(bad), "{bad}");
        }
    }

    #[test]
    fn instance_ids() {
        assert!(is_instance_id("engine-0"));
        assert!(is_instance_id("10.0.0.7:8000"));
        assert!(!is_instance_id(""));
        assert!(!is_instance_id("-x"));
        assert!(!is_instance_id("a/b"));
        assert!(!is_instance_id(&"x".repeat(129)));
    }

    #[test]
    fn names_round_trip_through_serde() {
        let name: EndpointName = serde_json::from_str("\"prod-chat\"").unwrap();
        assert_eq!(name.as_str(), "prod-chat");
        assert_eq!(serde_json::to_string(&name).unwrap(), "\"prod-chat\"");
        let err = serde_json::from_str::<EndpointName>("\"bad name\"").unwrap_err();
        assert!(err.to_string().contains("not a valid name"), "{err}");
    }
}
