//! A report's output: the table on stdout, the JSON file and the SVG chart.

use std::path::Path;

use anyhow::Context as _;

use super::Report;
use crate::output::print_stdout;

impl Report {
    /// Prints the table on stdout and writes the JSON and SVG files that were asked for.
    pub fn emit(&self, json: Option<&Path>, svg: Option<&Path>) -> anyhow::Result<()> {
        print_stdout(&self.table());
        if let Some(path) = json {
            self.write_json(path)?;
            eprintln!("wrote {}", path.display());
        }
        if let Some(path) = svg {
            std::fs::write(path, super::svg::render(self))
                .with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }

    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))
    }
}
