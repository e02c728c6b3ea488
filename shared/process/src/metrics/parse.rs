//! Reading the Prometheus text format back: one sample line (`name{label="value",…} value
//! [timestamp]`) at a time, for the tests and benchmarks that scrape `/metrics` pages.

/// One sample line: `name{label="value",…} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Labels,
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

/// Why a line is not a sample (or a series not a name with labels).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(String);

fn fail<T>(why: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(why.into()))
}

/// The samples of a page: comments and blank lines are skipped; `Err` for the first other
/// line that is not a sample, with that line.
pub fn parse_page(text: &str) -> Result<Vec<Sample>, (String, ParseError)> {
    sample_lines(text)
        .map(|line| parse_sample(line).map_err(|error| (line.to_owned(), error)))
        .collect()
}

/// The lines of a page that should be samples (not comments, not blank), trimmed.
pub fn sample_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
}

/// `name{labels} value [timestamp]`.
pub fn parse_sample(line: &str) -> Result<Sample, ParseError> {
    let (series, rest) = match line.find('{') {
        Some(_) => {
            let end = closing_brace(line)?;
            (&line[..=end], &line[end + 1..])
        }
        None => match line.split_once(' ') {
            Some(parts) => parts,
            None => return fail("no value"),
        },
    };
    let (name, labels) = parse_series(series)?;
    let Some(value) = rest.split_whitespace().next() else {
        return fail("no value");
    };
    let Ok(value) = value.parse() else {
        return fail("the value is not a number");
    };
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The byte index of the `}` that closes the label set (a `}` inside a quoted value does not).
fn closing_brace(line: &str) -> Result<usize, ParseError> {
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
    fail("the label set is not closed")
}

/// A sample's labels, `(name, value)` in the page's order.
pub type Labels = Vec<(String, String)>;

/// `name` or `name{a="x",…}` into the name and the labels (values unescaped).
pub fn parse_series(series: &str) -> Result<(&str, Labels), ParseError> {
    let Some((name, labels)) = series.split_once('{') else {
        check_name(series)?;
        return Ok((series, Vec::new()));
    };
    check_name(name)?;
    let Some(labels) = labels.strip_suffix('}') else {
        return fail("no closing }");
    };
    let mut parsed = Vec::new();
    let mut rest = labels;
    while !rest.is_empty() {
        let Some((label, after)) = rest.split_once("=\"") else {
            return fail("a label without =\"");
        };
        check_name(label.trim())?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((index, '"')) => break index,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return fail("an escape at the end"),
                },
                Some((_, c)) => value.push(c),
                None => return fail(format!("label {label} has no closing quote")),
            }
        };
        parsed.push((label.trim().to_owned(), value));
        rest = after[end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Ok((name, parsed))
}

fn check_name(name: &str) -> Result<(), ParseError> {
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if !valid {
        return fail(format!("{name:?} is not a metric or label name"));
    }
    Ok(())
}
