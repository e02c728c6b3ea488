//! Disaggregated prefill/decode (DPD): which variant prefills and which decodes, the token
//! threshold between the direct and the disaggregated path, how each pool is chosen from, and
//! how the KV cache is handed over. Switchyard's extension beside SageMaker's
//! ProductionVariants (SageMaker HyperPod calls it `pdSpec`); absent, an endpoint is
//! colocated as on SageMaker.
//!
//! ```json
//! {"PrefillVariantName": "prefill", "DecodeVariantName": "decode", "RouteThreshold": 4096,
//!  "PrefillRoutingStrategy": "PREFIX_AWARE"}
//! ```

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

use crate::error::{ValidationError, whole_in_range};
use crate::instance::InstanceRole;
use crate::names::VariantName;
use crate::variant::{ProductionVariant, RoutingStrategy};

/// Prompts of at least this many tokens go prefill → decode unless the config says otherwise
/// (the source's `routeThreshold` default).
pub const DEFAULT_ROUTE_THRESHOLD: u32 = 4096;
pub const ROUTE_THRESHOLD_RANGE: std::ops::RangeInclusive<u32> = 1..=1_048_576;
/// How long a prefill may take before the decoder serves the whole request instead.
pub const DEFAULT_PREFILL_TIMEOUT_SECONDS: u32 = 120;
pub const PREFILL_TIMEOUT_RANGE: std::ops::RangeInclusive<u32> = 1..=3600;
/// The tokenizer counting prompts when the config names none: OpenAI's cl100k BPE, shipped
/// with the router.
pub const DEFAULT_TOKENIZER: &str = "cl100k_base";

/// How the prefill instance is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PrefillRoutingStrategy {
    /// Each router takes the prefill instances in turn.
    #[default]
    RoundRobin,
    /// Rendezvous hashing of the prompt's prefix (the prefill variant's
    /// PrefixAwareRoutingConfig): repeated prefixes find their prefill cache warm.
    PrefixAware,
    /// The instance whose KV cache holds the longest start of the prompt, weighed against its
    /// load (`kv::decide` over the prefill instances' KV events, with the prefill variant's
    /// KvAwareRoutingConfig if its own RoutingStrategy is KV_AWARE, else the defaults);
    /// LEAST_OUTSTANDING_REQUESTS when the prompt's token ids or the events are missing.
    KvAware,
    /// `X-Amzn-SageMaker-Session-Id` keeps a session on one prefill instance.
    Session,
}

impl PrefillRoutingStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefillRoutingStrategy::RoundRobin => "ROUND_ROBIN",
            PrefillRoutingStrategy::PrefixAware => "PREFIX_AWARE",
            PrefillRoutingStrategy::KvAware => "KV_AWARE",
            PrefillRoutingStrategy::Session => "SESSION",
        }
    }
}

/// How the decoder is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DecodeRoutingStrategy {
    /// Fewest fleet-wide requests in flight, random tie-break.
    #[default]
    LeastOutstandingRequests,
    Random,
    /// Rendezvous hashing of the prefix (the decode variant's PrefixAwareRoutingConfig), so
    /// short requests that go direct find their decoder's prefix cache warm.
    PrefixAware,
}

impl DecodeRoutingStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            DecodeRoutingStrategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            DecodeRoutingStrategy::Random => "RANDOM",
            DecodeRoutingStrategy::PrefixAware => "PREFIX_AWARE",
        }
    }
}

/// What the threshold counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ThresholdBasis {
    /// The prompt's tokens, as the source counts them.
    #[default]
    PromptTokens,
    /// Only the tokens the decoder that would serve the request directly (the first of the
    /// decode ranking) does not already hold in its KV cache, known from the decode instances'
    /// KV events and the prompt's token ids (the engine's `/tokenize`): the prefill work it
    /// would do. Without token ids or events, every prompt token counts as uncached.
    UncachedTokens,
}

impl ThresholdBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            ThresholdBasis::PromptTokens => "PROMPT_TOKENS",
            ThresholdBasis::UncachedTokens => "UNCACHED_TOKENS",
        }
    }
}

/// How the KV cache travels from the prefill instance to the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum KvTransferProtocol {
    /// vLLM's NixlConnector: the prefill answer's `kv_transfer_params` go into the decode
    /// request, and the decoder (any decoder) pulls the blocks.
    #[default]
    Nixl,
    /// LMCache's PD backend as SageMaker HyperPod runs it: each prefill instance pushes the KV
    /// cache to the decoder named in its own LMCache config (its registered decode partner).
    /// Deprecated: current LMCache names the decoder per request (`LMCACHE_PD`).
    Lmcache,
    /// Current LMCache's PD protocol (its `disagg_proxy_server.py`): the router picks the
    /// decoder per request, sends the prefiller the prompt's token ids with
    /// `kv_transfer_params.disagg_spec` naming that decoder's LMCache receiver (registered as
    /// the decode instance's `LmcacheReceiver`), waits for the prefiller's "KV ready" notices
    /// on its notice socket (`--lmcache-notice-bind`), and sends the decoder the token ids plus
    /// the prefill's first token.
    LmcachePd,
}

impl KvTransferProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            KvTransferProtocol::Nixl => "NIXL",
            KvTransferProtocol::Lmcache => "LMCACHE",
            KvTransferProtocol::LmcachePd => "LMCACHE_PD",
        }
    }
}

/// An endpoint config's disaggregation. Optional fields are echoed back as given; the
/// accessors apply the defaults.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields)]
pub struct DisaggregationConfig {
    pub prefill_variant_name: VariantName,
    pub decode_variant_name: VariantName,
    pub route_threshold: Option<u32>,
    pub prefill_routing_strategy: Option<PrefillRoutingStrategy>,
    pub decode_routing_strategy: Option<DecodeRoutingStrategy>,
    pub threshold_basis: Option<ThresholdBasis>,
    pub kv_transfer_protocol: Option<KvTransferProtocol>,
    /// `cl100k_base`, `o200k_base`, or the name of a Hugging Face `tokenizer.json` that
    /// routers find under their `--tokenizer-dir` (`NAME/tokenizer.json` or
    /// `NAME.json`).
    pub tokenizer: Option<String>,
    pub prefill_timeout_seconds: Option<u32>,
}

impl DisaggregationConfig {
    pub fn route_threshold(&self) -> u32 {
        self.route_threshold.unwrap_or(DEFAULT_ROUTE_THRESHOLD)
    }

    pub fn prefill_routing_strategy(&self) -> PrefillRoutingStrategy {
        self.prefill_routing_strategy.unwrap_or_default()
    }

    pub fn decode_routing_strategy(&self) -> DecodeRoutingStrategy {
        self.decode_routing_strategy.unwrap_or_default()
    }

    pub fn threshold_basis(&self) -> ThresholdBasis {
        self.threshold_basis.unwrap_or_default()
    }

    pub fn kv_transfer_protocol(&self) -> KvTransferProtocol {
        self.kv_transfer_protocol.unwrap_or_default()
    }

    pub fn tokenizer(&self) -> &str {
        self.tokenizer.as_deref().unwrap_or(DEFAULT_TOKENIZER)
    }

    pub fn prefill_timeout_seconds(&self) -> u32 {
        self.prefill_timeout_seconds
            .unwrap_or(DEFAULT_PREFILL_TIMEOUT_SECONDS)
    }

    /// Checks the config against the endpoint config's variants; `field` prefixes the names
    /// in errors (`DisaggregationConfig`).
    pub fn validate(
        &self,
        variants: &[ProductionVariant],
        field: &str,
    ) -> Result<(), ValidationError> {
        let at = |name: &str| format!("{field}.{name}");
        let position = |name: &VariantName, key: &str| {
            variants
                .iter()
                .position(|variant| variant.variant_name == *name)
                .ok_or_else(|| {
                    ValidationError::new(
                        at(key),
                        format!("{name} is not one of the ProductionVariants"),
                    )
                })
        };
        let prefill = position(&self.prefill_variant_name, "PrefillVariantName")?;
        let decode = position(&self.decode_variant_name, "DecodeVariantName")?;
        if prefill == decode {
            return Err(ValidationError::new(
                at("DecodeVariantName"),
                "must name another variant than PrefillVariantName",
            ));
        }
        if variants.len() != 2 {
            return Err(ValidationError::new(
                "ProductionVariants",
                format!(
                    "a disaggregated endpoint has exactly its prefill and decode variants, got {}",
                    variants.len()
                ),
            ));
        }
        if let Some(threshold) = self.route_threshold {
            whole_in_range(
                at("RouteThreshold"),
                &ROUTE_THRESHOLD_RANGE,
                threshold,
                " tokens",
            )?;
        }
        if let Some(seconds) = self.prefill_timeout_seconds {
            whole_in_range(
                at("PrefillTimeoutSeconds"),
                &PREFILL_TIMEOUT_RANGE,
                seconds,
                " seconds",
            )?;
        }
        if let Some(name) = &self.tokenizer {
            validate_tokenizer_name(name)
                .map_err(|err| ValidationError::new(at("Tokenizer"), err.to_string()))?;
        }
        let prefix_aware = |index: usize| {
            variants[index].routing().routing_strategy == RoutingStrategy::PrefixAware
                && variants[index]
                    .routing()
                    .prefix_aware_routing_config
                    .is_some()
        };
        if self.prefill_routing_strategy() == PrefillRoutingStrategy::PrefixAware
            && !prefix_aware(prefill)
        {
            return Err(ValidationError::new(
                format!("ProductionVariants[{prefill}].RoutingConfig"),
                "the prefill variant needs RoutingStrategy PREFIX_AWARE with its \
                 PrefixAwareRoutingConfig (PrefixLength, ConcurrencyThreshold) when \
                 PrefillRoutingStrategy is PREFIX_AWARE",
            ));
        }
        if self.decode_routing_strategy() == DecodeRoutingStrategy::PrefixAware
            && !prefix_aware(decode)
        {
            return Err(ValidationError::new(
                format!("ProductionVariants[{decode}].RoutingConfig"),
                "the decode variant needs RoutingStrategy PREFIX_AWARE with its \
                 PrefixAwareRoutingConfig when DecodeRoutingStrategy is PREFIX_AWARE",
            ));
        }
        // A decode that runs under an adapter pulls KV the prefill computed: under the same
        // adapter, or the answer would come from mismatched weights.
        if let Some(missing) = variants[decode]
            .lora_adapters()
            .iter()
            .find(|adapter| !variants[prefill].lora_adapters().contains(adapter))
        {
            return Err(ValidationError::new(
                format!("ProductionVariants[{prefill}].LoraAdapters"),
                format!(
                    "the prefill variant must serve every adapter the decode variant lists \
                     (the decode pulls the KV cache the prefill computed); {missing:?} is missing"
                ),
            ));
        }
        Ok(())
    }

    /// The place of variant `name` in the disaggregation: the role its instances play.
    pub fn role_of(&self, name: &VariantName) -> Option<InstanceRole> {
        if *name == self.prefill_variant_name {
            Some(InstanceRole::Prefill)
        } else if *name == self.decode_variant_name {
            Some(InstanceRole::Decode)
        } else {
            None
        }
    }
}

/// Checks an instance's role (and decode partner) against its variant's place in the
/// endpoint config's disaggregation, if any: a prefill instance in the decode pool, or a decode
/// instance in the prefill pool, is refused (`both` fits either place); only prefill
/// instances name a decode partner, and only decode instances an LMCache receiver. The error
/// names `Role`, `DecodePartner` or `LmcacheReceiver`.
pub fn check_instance_place(
    disaggregation: Option<&DisaggregationConfig>,
    variant: &VariantName,
    role: InstanceRole,
    (has_decode_partner, has_lmcache_receiver): (bool, bool),
) -> Result<(), ValidationError> {
    let place = disaggregation.and_then(|config| config.role_of(variant));
    match (place, role) {
        (Some(InstanceRole::Prefill), InstanceRole::Decode)
        | (Some(InstanceRole::Decode), InstanceRole::Prefill) => {
            let place = place.unwrap_or_default();
            return Err(ValidationError::new(
                "Role",
                format!(
                    "variant {variant} is the endpoint's {place} pool; register its instances \
                     with role {place} (or both), not {role}"
                ),
            ));
        }
        _ => {}
    }
    // What only one pool's instances have.
    for (has, pool, field, what) in [
        (
            has_decode_partner,
            InstanceRole::Prefill,
            "DecodePartner",
            "a decode partner",
        ),
        (
            has_lmcache_receiver,
            InstanceRole::Decode,
            "LmcacheReceiver",
            "an LMCache receiver",
        ),
    ] {
        if has && place != Some(pool) {
            return Err(ValidationError::new(
                field,
                format!(
                    "only instances of a disaggregated endpoint's {pool} variant have {what}; \
                     variant {variant} is not one"
                ),
            ));
        }
    }
    Ok(())
}

pub use crate::tokenizer_name::{InvalidTokenizerName, validate_tokenizer_name};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sagemaker::parse_production_variants;

    fn variants(prefill_routing: &str) -> Vec<ProductionVariant> {
        parse_production_variants(&format!(
            r#"[{{"VariantName":"prefill"{prefill_routing}}},{{"VariantName":"decode"}}]"#
        ))
        .unwrap()
        .variants
    }

    fn config(json: &str) -> DisaggregationConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_are_the_sources() {
        let pd = config(r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode"}"#);
        assert_eq!(pd.route_threshold(), 4096);
        assert_eq!(
            pd.prefill_routing_strategy(),
            PrefillRoutingStrategy::RoundRobin
        );
        assert_eq!(
            pd.decode_routing_strategy(),
            DecodeRoutingStrategy::LeastOutstandingRequests
        );
        assert_eq!(pd.kv_transfer_protocol(), KvTransferProtocol::Nixl);
        assert_eq!(pd.threshold_basis(), ThresholdBasis::PromptTokens);
        assert_eq!(pd.tokenizer(), "cl100k_base");
        pd.validate(&variants(""), "DisaggregationConfig").unwrap();
        // Only what was given is written back.
        assert_eq!(
            serde_json::to_string(&pd).unwrap(),
            r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode"}"#
        );
    }

    #[test]
    fn every_rule_names_its_field() {
        let cases = [
            (
                r#"{"PrefillVariantName":"nope","DecodeVariantName":"decode"}"#,
                "DisaggregationConfig.PrefillVariantName",
            ),
            (
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"prefill"}"#,
                "DisaggregationConfig.DecodeVariantName",
            ),
            (
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","RouteThreshold":0}"#,
                "DisaggregationConfig.RouteThreshold",
            ),
            (
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","PrefillTimeoutSeconds":0}"#,
                "DisaggregationConfig.PrefillTimeoutSeconds",
            ),
            (
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","Tokenizer":"../etc/passwd"}"#,
                "DisaggregationConfig.Tokenizer",
            ),
            (
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","PrefillRoutingStrategy":"PREFIX_AWARE"}"#,
                "ProductionVariants[0].RoutingConfig",
            ),
        ];
        for (json, field) in cases {
            let err = config(json)
                .validate(&variants(""), "DisaggregationConfig")
                .unwrap_err();
            assert_eq!(err.field, field, "{json}: {err}");
        }
        // Adapters: the prefill variant serves every one the decode variant lists.
        let pd = config(r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode"}"#);
        let with_adapters = |prefill: &str, decode: &str| {
            parse_production_variants(&format!(
                r#"[{{"VariantName":"prefill","LoraAdapters":{prefill}}},{{"VariantName":"decode","LoraAdapters":{decode}}}]"#
            ))
            .unwrap()
            .variants
        };
        pd.validate(
            &with_adapters(r#"["a","b"]"#, r#"["a"]"#),
            "DisaggregationConfig",
        )
        .unwrap();
        let err = pd
            .validate(
                &with_adapters(r#"["a"]"#, r#"["a","b"]"#),
                "DisaggregationConfig",
            )
            .unwrap_err();
        assert_eq!(err.field, "ProductionVariants[0].LoraAdapters", "{err}");
        // PREFIX_AWARE prefill with the prefill variant's own prefix config is fine.
        config(
            r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","PrefillRoutingStrategy":"PREFIX_AWARE"}"#,
        )
        .validate(
            &variants(
                r#","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":1024,"ConcurrencyThreshold":8}}"#,
            ),
            "DisaggregationConfig",
        )
        .unwrap();
        assert!(
            serde_json::from_str::<DisaggregationConfig>(
                r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode","Threshold":5}"#
            )
            .unwrap_err()
            .to_string()
            .contains("Threshold")
        );
    }

    #[test]
    fn instances_fit_their_variants_place() {
        let pd = config(r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode"}"#);
        let name = |text: &str| VariantName::new(text).unwrap();
        let check = |variant: &str, role, partner| {
            check_instance_place(Some(&pd), &name(variant), role, (partner, false))
        };
        check("prefill", InstanceRole::Prefill, true).unwrap();
        check("prefill", InstanceRole::Both, false).unwrap();
        check("decode", InstanceRole::Decode, false).unwrap();
        assert_eq!(
            check("decode", InstanceRole::Prefill, false)
                .unwrap_err()
                .field,
            "Role"
        );
        assert_eq!(
            check("prefill", InstanceRole::Decode, false)
                .unwrap_err()
                .field,
            "Role"
        );
        assert_eq!(
            check("decode", InstanceRole::Decode, true)
                .unwrap_err()
                .field,
            "DecodePartner"
        );
        // Colocated endpoints take any role.
        check_instance_place(None, &name("v"), InstanceRole::Prefill, (false, false)).unwrap();
        // Only decode instances have an LMCache receiver.
        check_instance_place(
            Some(&pd),
            &name("decode"),
            InstanceRole::Decode,
            (false, true),
        )
        .unwrap();
        for variant in ["prefill", "v"] {
            let refused =
                check_instance_place(Some(&pd), &name(variant), InstanceRole::Both, (false, true));
            assert_eq!(refused.unwrap_err().field, "LmcacheReceiver");
        }
    }

    #[test]
    fn variant_places_give_roles() {
        let pd = config(r#"{"PrefillVariantName":"prefill","DecodeVariantName":"decode"}"#);
        let name = |text: &str| VariantName::new(text).unwrap();
        assert_eq!(pd.role_of(&name("prefill")), Some(InstanceRole::Prefill));
        assert_eq!(pd.role_of(&name("decode")), Some(InstanceRole::Decode));
        assert_eq!(pd.role_of(&name("other")), None);
    }
}
