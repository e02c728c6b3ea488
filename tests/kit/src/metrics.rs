//! Samples of a Prometheus text page (`/metrics`), read one way: by the sample's whole name
//! and its whole label set (in any order). A name never matches a longer name it begins
//! (`x_total` is not `x_total_created`, `x_seconds` not `x_seconds_count`), nor a label set
//! one with more labels.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};
pub use switchyard_process::metrics::parse::Sample;
use switchyard_process::metrics::parse::{parse_page, parse_series};

/// A Prometheus text page, parsed: its samples, and its families' types (`# TYPE` lines; other
/// comments and blank lines are skipped).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    samples: Vec<Sample>,
    families: BTreeMap<String, String>,
}

impl Metrics {
    /// Parses a page; a line that is not a sample is a failure, naming the line.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let samples = parse_page(text)
            .map_err(|(line, error)| anyhow::anyhow!("sample line {line:?}: {error}"))?;
        let families = text
            .lines()
            .filter_map(|line| line.strip_prefix("# TYPE "))
            .filter_map(|rest| {
                let (name, kind) = rest.split_once(' ')?;
                Some((name.to_owned(), kind.trim().to_owned()))
            })
            .collect();
        Ok(Self { samples, families })
    }

    /// `GET {base_url}/metrics`, which must answer 200 with a page that parses.
    pub async fn scrape(base_url: &str) -> anyhow::Result<Self> {
        let url = format!("{base_url}/metrics");
        let (status, text) = crate::http_get(&url).await?;
        if status != 200 {
            bail!("GET {url}: {status}: {text}");
        }
        Self::parse(&text).with_context(|| format!("GET {url}"))
    }

    /// The value of `series`, written as the page writes a sample (`name` for one without
    /// labels, `name{a="x",b="y"}`): the sample with exactly that name and exactly those
    /// labels. Panics on a `series` that does not parse (a mistake in the test).
    pub fn get(&self, series: &str) -> Option<f64> {
        let (name, labels) = parse_series(series)
            .unwrap_or_else(|err| panic!("series {series:?} does not parse: {err:#}"));
        self.samples
            .iter()
            .find(|sample| {
                sample.name == name
                    && sample.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(label, value)| sample.label(label) == Some(value))
            })
            .map(|sample| sample.value)
    }

    /// [`Metrics::get`], failing (naming `series`) when the page has no such sample.
    pub fn value(&self, series: &str) -> anyhow::Result<f64> {
        self.get(series)
            .with_context(|| format!("{series} is not on the page"))
    }

    /// The sum of every sample named exactly `name`, whatever its labels (0 when there is none).
    pub fn sum(&self, name: &str) -> f64 {
        self.named(name).map(|sample| sample.value).sum()
    }

    /// The samples named exactly `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples
            .iter()
            .filter(move |sample| sample.name == name)
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// The families the page declares (`# TYPE name kind`): name → kind.
    pub fn families(&self) -> &BTreeMap<String, String> {
        &self.families
    }
}

/// The value of `series` (as [`Metrics::get`] reads it) on the page `{base_url}/metrics` now;
/// `None` when the sample is absent or the page does not answer 200.
pub async fn metric(base_url: &str, series: &str) -> Option<f64> {
    Metrics::scrape(base_url).await.ok()?.get(series)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP x_total Things.
# TYPE x_total counter
x_total 3
x_total_created 1700000000
x_seconds_count{route="a"} 7
x_seconds_count{route="a",code="OK"} 8
y{path="/v1/{id}",note="a \"quoted\" }, too"} 2.5 1700000000000
z{kind="instance"} +Inf
"#;

    #[test]
    fn a_series_is_its_whole_name_and_its_whole_label_set() {
        let page = Metrics::parse(PAGE).unwrap();
        assert_eq!(page.get("x_total"), Some(3.0));
        assert_eq!(page.get("x"), None, "a name is not a prefix");
        assert_eq!(page.get("x_seconds_count"), None, "labels are part of it");
        assert_eq!(page.get(r#"x_seconds_count{route="a"}"#), Some(7.0));
        assert_eq!(
            page.get(r#"x_seconds_count{code="OK",route="a"}"#),
            Some(8.0),
            "in any order"
        );
        assert_eq!(page.get(r#"x_seconds_count{code="OK"}"#), None);
        assert_eq!(
            page.get(r#"y{note="a \"quoted\" }, too",path="/v1/{id}"}"#),
            Some(2.5)
        );
        assert_eq!(page.get(r#"z{kind="instance"}"#), Some(f64::INFINITY));
        assert_eq!(page.value("x_total").unwrap(), 3.0);
        assert!(page.value("x").is_err());
        assert_eq!(page.sum("x_seconds_count"), 15.0);
        assert_eq!(page.sum("x_seconds"), 0.0);
        assert_eq!(page.named("x_total").count(), 1);
        assert_eq!(
            page.families().get("x_total").map(String::as_str),
            Some("counter")
        );
        assert_eq!(page.families().len(), 1);
    }

    #[test]
    fn a_line_that_is_no_sample_is_refused() {
        assert!(Metrics::parse("x_total").is_err());
        assert!(Metrics::parse("x{a=\"b\" 1").is_err());
        assert!(Metrics::parse("x one").is_err());
    }
}
