//! The repository documents itself: README links to the protocol and operations documents,
//! and no document points outside the repository or at a file that does not exist.

use std::path::Path;

const DOCUMENTS: &[&str] = &[
    "README.md",
    "ARCHITECTURE.md",
    "docs/PROTOCOL.md",
    "docs/OPERATIONS.md",
];

/// Folders of the repository a document may name a path in.
const TOP_LEVEL: &[&str] = &[
    "src/",
    "tests/",
    "docs/",
    "packaging/",
    "sql/",
    "systemd/",
    "scripts/",
    "benches/",
];

fn read(document: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(document))
        .unwrap_or_else(|e| panic!("{document}: {e}"))
}

/// Markdown link targets: `](target)`.
fn links(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .map(str::to_string)
        .collect()
}

/// Paths in backticks that start with a top-level folder of the repository.
fn code_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|span| TOP_LEVEL.iter().any(|top| span.starts_with(top)))
        .filter(|span| !span.contains(['*', '<', ' ', '…', '{']))
        .map(|span| span.trim_end_matches([':', ',', '.']).to_string())
        .collect()
}

#[test]
fn readme_links_the_protocol_and_the_runbook() {
    let readme = read("README.md");
    let targets = links(&readme);
    for document in ["docs/PROTOCOL.md", "docs/OPERATIONS.md", "ARCHITECTURE.md"] {
        assert!(
            targets.iter().any(|t| t == document),
            "README links {document}"
        );
    }
}

#[test]
fn documents_point_only_inside_the_repository_at_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    let mut checked = 0;
    for document in DOCUMENTS {
        let text = read(document);
        for outside in ["shared/", "../"] {
            if text.contains(outside) {
                broken.push(format!(
                    "{document} points outside the repository ({outside})"
                ));
            }
        }
        let base = Path::new(document).parent().unwrap_or(Path::new(""));
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") || link.starts_with('#')
            {
                continue;
            }
            let target = link.split('#').next().unwrap_or_default();
            if !root.join(base).join(target).exists() {
                broken.push(format!("{document} links {link}, which does not exist"));
            }
        }
        for path in code_paths(&text) {
            checked += 1;
            if !root.join(&path).exists() {
                broken.push(format!("{document} names {path}, which does not exist"));
            }
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
    assert!(
        checked > 20,
        "only {checked} paths found: the scan is broken"
    );
}
