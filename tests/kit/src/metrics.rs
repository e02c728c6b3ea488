//! Samples of a Prometheus text page (`/metrics`), read one way: by the sample's whole name
//! and its whole label set (in any order). A name never matches a longer name it begins
//! (`x_total` is not `x_total_created`, `x_seconds` not `x_seconds_count`), nor a label set
//! one with more labels.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};

/// One sample line: `name{label="value",…} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    /// In the order the page writes them.
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(label, _)| label == name)
            .map(|(_, value)| value.as_str())
    }
}

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
        let samples = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(|line| parse_sample(line).with_context(|| format!("sample line {line:?}")))
            .collect::<anyhow::Result<_>>()?;
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

/// `name{labels} value [timestamp]`.
fn parse_sample(line: &str) -> anyhow::Result<Sample> {
    let (series, rest) = match line.find('{') {
        Some(_) => {
            let end = closing_brace(line)?;
            (&line[..=end], &line[end + 1..])
        }
        None => line.split_once(' ').context("no value")?,
    };
    let (name, labels) = parse_series(series)?;
    let value = rest
        .split_whitespace()
        .next()
        .context("no value")?
        .parse()
        .context("the value is not a number")?;
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The byte index of the `}` that closes the label set (a `}` inside a quoted value does not).
fn closing_brace(line: &str) -> anyhow::Result<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (index, c) in line.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Ok(index),
            _ => {}
        }
    }
    bail!("the label set is not closed")
}

/// `name` or `name{a="x",…}` into the name and the labels (values unescaped).
fn parse_series(series: &str) -> anyhow::Result<(&str, Vec<(String, String)>)> {
    let Some((name, labels)) = series.split_once('{') else {
        check_name(series)?;
        return Ok((series, Vec::new()));
    };
    check_name(name)?;
    let labels = labels.strip_suffix('}').context("no closing }")?;
    let mut parsed = Vec::new();
    let mut rest = labels;
    while !rest.is_empty() {
        let (label, after) = rest.split_once("=\"").context("a label without =\"")?;
        check_name(label.trim())?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((index, '"')) => break index,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => bail!("an escape at the end"),
                },
                Some((_, c)) => value.push(c),
                None => bail!("label {label} has no closing quote"),
            }
        };
        parsed.push((label.trim().to_owned(), value));
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Ok((name, parsed))
}

fn check_name(name: &str) -> anyhow::Result<()> {
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if !valid {
        bail!("{name:?} is not a metric or label name");
    }
    Ok(())
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
