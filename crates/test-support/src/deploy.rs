//! The files deploy/ mounts, read from the manifests themselves, so a test
//! runs what a fresh deployment runs.

use std::path::Path;

/// The text of the block scalar `name: |` in the manifest at `path` (relative
/// to the repository), dedented: a ConfigMap's file, verbatim.
pub fn block(path: &str, name: &str) -> String {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let mut lines = text.lines().skip_while(|l| l.trim() != format!("{name}: |"));
    let head = lines.next().unwrap_or_else(|| panic!("{path} has no `{name}: |` block"));
    let outer = head.len() - head.trim_start().len();
    let body: Vec<&str> = lines.take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > outer).collect();
    let indent =
        body.iter().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
    body.iter().map(|l| l.get(indent..).unwrap_or("")).collect::<Vec<_>>().join("\n") + "\n"
}
