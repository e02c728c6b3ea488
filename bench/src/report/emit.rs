//! A report's output: the table on stdout, the JSON file and the SVG chart.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

use super::Report;
use crate::output::{print_stdout, write_json};

/// The output flags of `compare` and of driving a router.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct OutputArgs {
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write an SVG chart (hit rate, TTFT p50, instance shares).
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// No progress line.
    #[arg(long)]
    pub quiet: bool,
}

impl Report {
    /// Prints the table on stdout and writes the JSON and SVG files that were asked for.
    pub fn emit(&self, output: &OutputArgs) -> anyhow::Result<()> {
        print_stdout(&self.table());
        if let Some(path) = &output.json {
            self.write_json(path)?;
            eprintln!("wrote {}", path.display());
        }
        if let Some(path) = &output.svg {
            std::fs::write(path, super::svg::render(self))
                .with_context(|| format!("cannot write {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }

    pub fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        write_json(path, self)
    }
}
