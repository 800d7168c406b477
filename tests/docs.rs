//! The repository documents itself: README links to the protocol, operations, configuration
//! and benchmark documents and stays short; no document points outside the repository or at a
//! file that does not exist; and docs/CONFIGURATION.md lists exactly the variables the config
//! reader reads, with the defaults it applies.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use orca_relay::config::{Config, VARIABLES};

const DOCUMENTS: &[&str] = &[
    "README.md",
    "ARCHITECTURE.md",
    "docs/PROTOCOL.md",
    "docs/OPERATIONS.md",
    "docs/CONFIGURATION.md",
    "docs/BENCHMARKS.md",
    "docs/DEVELOPMENT.md",
];

/// A newcomer scans the README: what it is, the two commands, trying it, roles and links.
/// Detail belongs in docs/ (issue 20 cut it from 665 lines).
const README_MAX_LINES: usize = 250;

/// ARCHITECTURE.md is the map a newcomer reads in half an hour (issue 29 cut it from 1,045
/// lines): figures and history belong in docs/BENCHMARKS.md, a module's rationale in its own
/// `//!` comment, tests' machinery in docs/DEVELOPMENT.md.
const ARCHITECTURE_MAX_LINES: usize = 600;

/// Read by `env_logger`, not by `Config`, and documented with the rest.
const LOG_VARIABLE: &str = "RUST_LOG";

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
    for document in [
        "docs/PROTOCOL.md",
        "docs/OPERATIONS.md",
        "docs/CONFIGURATION.md",
        "docs/BENCHMARKS.md",
        "ARCHITECTURE.md",
    ] {
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

#[test]
fn readme_stays_short_enough_to_scan() {
    let lines = read("README.md").lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    );
}

#[test]
fn architecture_stays_a_map_read_in_half_an_hour() {
    let lines = read("ARCHITECTURE.md").lines().count();
    assert!(
        lines <= ARCHITECTURE_MAX_LINES,
        "ARCHITECTURE.md has {lines} lines (at most {ARCHITECTURE_MAX_LINES}): move figures to \
         docs/BENCHMARKS.md and a module's rationale into its own `//!` comment"
    );
}

/// Every folder under `src/`, as a path from the repository's root with a trailing slash:
/// `src/relay/`, `src/relay/splice/`.
fn source_folders(folder: &Path, shown: &str, found: &mut Vec<String>) {
    let entries = std::fs::read_dir(folder).unwrap_or_else(|e| panic!("{shown}: {e}"));
    for entry in entries {
        let entry = entry.unwrap_or_else(|e| panic!("{shown}: {e}"));
        if entry.file_type().map(|kind| kind.is_dir()).unwrap_or(false) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = format!("{shown}{name}/");
            source_folders(&entry.path(), &path, found);
            found.push(path);
        }
    }
}

/// The map names every room: each folder of `src/` in backticks as its path from the
/// repository's root (`src/relay/splice/`), each file at the top of `src/` as `name.rs` or
/// `src/name.rs`. A folder or file added without its line in the map fails here.
#[test]
fn architecture_names_every_folder_and_top_level_file_of_src() {
    let text = read("ARCHITECTURE.md");
    let spans: BTreeSet<&str> = text.split('`').skip(1).step_by(2).collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut folders = Vec::new();
    source_folders(&src, "src/", &mut folders);
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&src).expect("src/") {
        let entry = entry.expect("src/");
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".rs") && entry.file_type().map(|k| k.is_file()).unwrap_or(false) {
            files.push(name);
        }
    }
    assert!(
        folders.len() >= 10 && files.len() >= 15,
        "only {} folders and {} files found under src/: the scan is broken",
        folders.len(),
        files.len()
    );
    let mut unnamed: Vec<String> = folders
        .into_iter()
        .filter(|folder| !spans.contains(folder.as_str()))
        .collect();
    unnamed.extend(files.into_iter().filter(|file| {
        !spans.contains(file.as_str()) && !spans.contains(format!("src/{file}").as_str())
    }));
    unnamed.sort();
    assert!(
        unnamed.is_empty(),
        "ARCHITECTURE.md does not name {unnamed:?}: give each folder of src/ a line as \
         `src/<folder>/` and each top-level file as `<file>.rs`, with what it owns"
    );
}

/// The rows of docs/CONFIGURATION.md's tables whose first cell is a variable name in
/// backticks: name → the default cell, as written.
fn documented_variables() -> Vec<(String, String)> {
    read("docs/CONFIGURATION.md")
        .lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix("| `")?.splitn(2, '`');
            let name = cells.next()?;
            let is_name = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if !is_name {
                return None;
            }
            let default = cells.next()?.split('|').nth(1)?.trim().to_string();
            Some((name.to_string(), default))
        })
        .collect()
}

#[test]
fn configuration_documents_exactly_the_variables_the_config_reads() {
    let documented = documented_variables();
    let mut rows: BTreeMap<&str, usize> = BTreeMap::new();
    for (name, _) in &documented {
        *rows.entry(name.as_str()).or_default() += 1;
    }
    let read_by_relay: BTreeSet<&str> = VARIABLES.iter().copied().chain([LOG_VARIABLE]).collect();
    let missing: Vec<&&str> = read_by_relay
        .iter()
        .filter(|name| !rows.contains_key(**name))
        .collect();
    let unknown: Vec<&&str> = rows
        .keys()
        .filter(|name| !read_by_relay.contains(**name))
        .collect();
    let repeated: Vec<(&&str, &usize)> = rows.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        missing.is_empty() && unknown.is_empty() && repeated.is_empty(),
        "docs/CONFIGURATION.md: missing {missing:?}, not read by the relay {unknown:?}, \
         in more than one row {repeated:?}"
    );
}

#[test]
fn configuration_documents_the_defaults_the_config_applies() {
    // The smallest valid cell configuration: every other variable at its default.
    let minimal: HashMap<&str, &str> = [
        ("ORCA_RELAY_ROLE", "cell"),
        (
            "ORCA_RELAY_SERVICE_TOKEN",
            "0123456789abcdef0123456789abcdef",
        ),
        (
            "ORCA_RELAY_JWKS_URL",
            "https://auth.example.com/.well-known/jwks.json",
        ),
        ("ORCA_RELAY_AUTH_ISSUER", "https://auth.example.com"),
    ]
    .into_iter()
    .collect();
    let defaults = Config::from_lookup(&|name| minimal.get(name).map(|v| v.to_string()))
        .expect("the minimal cell configuration is valid")
        .describe();
    let mut checked = 0;
    for (name, documented) in documented_variables() {
        let Some(applied) = defaults.get(name.as_str()) else {
            continue;
        };
        if minimal.contains_key(name.as_str()) {
            continue;
        }
        // A documented default is either a number, a value in backticks, or prose (`unset`,
        // `cores`, `= POOL_MAX`, "10 (cell), 3 (director)"); numbers and literal values are
        // compared, prose is left to the config's own tests.
        let literal = documented
            .strip_prefix('`')
            .and_then(|rest| rest.strip_suffix('`'))
            .filter(|value| !value.contains('<') && !value.contains('$'));
        let value = match literal {
            Some(value) => value.to_string(),
            None if documented.parse::<u64>().is_ok() => documented.clone(),
            None => continue,
        };
        assert_eq!(
            &value, applied,
            "docs/CONFIGURATION.md documents {name}'s default as {documented}, the config applies {applied}"
        );
        checked += 1;
    }
    assert!(
        checked >= 30,
        "only {checked} defaults compared: the scan is broken"
    );
}
