//! The `.deb` the systemd tests install: the package as `packaging/build-deb.sh` built it, and
//! a second build of it that differs (for an upgrade by `dpkg -i`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

/// The `.deb` under test: `ORCA_RELAY_TEST_DEB` (scripts/test builds the package before the
/// tests and sets it), else the newest `target/debian/orca-relay_*.deb` if it is newer than
/// every file it is built from; panics in one line when there is none.
pub fn deb() -> PathBuf {
    if let Ok(path) = std::env::var("ORCA_RELAY_TEST_DEB") {
        if !path.trim().is_empty() {
            let path = PathBuf::from(path);
            assert!(path.is_file(), "ORCA_RELAY_TEST_DEB={path:?} is not a file");
            return path;
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let newest_deb = std::fs::read_dir(root.join("target/debian"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("orca-relay_"))
                && path.extension().is_some_and(|e| e == "deb")
        })
        .max_by_key(|path| modified(path));
    let Some(deb) = newest_deb else {
        panic!(
            "systemd tests need the package: run packaging/build-deb.sh first (scripts/test \
             builds it before the tests)"
        );
    };
    let built = modified(&deb);
    let sources = [
        "src",
        "sql",
        "systemd",
        "packaging",
        "docs",
        "Cargo.toml",
        "Cargo.lock",
    ];
    if let Some(newer) = sources
        .iter()
        .flat_map(|source| files_under(&root.join(source)))
        .find(|file| modified(file) > built)
    {
        panic!(
            "systemd tests need a package built from this tree: {} is newer than {}; run \
             packaging/build-deb.sh (scripts/test builds it before the tests)",
            newer.display(),
            deb.display()
        );
    }
    deb
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

fn files_under(path: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(path) {
        Ok(entries) => entries
            .flatten()
            .flat_map(|entry| files_under(&entry.path()))
            .collect(),
        Err(_) if path.is_file() => vec![path.to_path_buf()],
        Err(_) => Vec::new(),
    }
}

/// The marker of the build note a packager (or a test) writes into the binary
/// (`orca_relay::handover::build_note`): the bytes after it, up to the first space.
const NOTE_MARKER: &[u8] = b"ORCA_RELAY_BUILD_NOTE=";

/// A second build of the package `deb`: the same files, its binary carrying the build note
/// `note` (its version then reads `<version>+<note>`) and the package's version raised to
/// `<version>+<note>`, so that `dpkg -i` of it is an upgrade (its postinst runs with
/// `configure <old version>`). Built with `dpkg-deb` in `dir`.
pub fn upgraded(deb: &Path, note: &str, dir: &Path) -> PathBuf {
    assert!(note.len() < 40 && note.bytes().all(|b| b.is_ascii_alphanumeric()));
    let tree = dir.join(format!("deb-{note}"));
    let _ = std::fs::remove_dir_all(&tree);
    let run = |command: &mut Command| {
        let output = command.output().expect("run dpkg-deb");
        assert!(
            output.status.success(),
            "{command:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).to_string()
    };
    run(Command::new("dpkg-deb").arg("-R").arg(deb).arg(&tree));
    let binary = tree.join("usr/bin/orca-relay");
    let mut bytes = std::fs::read(&binary).expect("the packaged binary");
    let at = bytes
        .windows(NOTE_MARKER.len())
        .position(|w| w == NOTE_MARKER)
        .expect("the build-note marker in the packaged binary");
    let start = at + NOTE_MARKER.len();
    for (i, slot) in bytes[start..start + 40].iter_mut().enumerate() {
        *slot = note.as_bytes().get(i).copied().unwrap_or(b' ');
    }
    std::fs::write(&binary, &bytes).expect("write the packaged binary");
    let control_path = tree.join("DEBIAN/control");
    let control = std::fs::read_to_string(&control_path).expect("DEBIAN/control");
    let control: String = control
        .lines()
        .map(|line| match line.strip_prefix("Version: ") {
            Some(version) => format!("Version: {version}+{note}\n"),
            None => format!("{line}\n"),
        })
        .collect();
    std::fs::write(&control_path, control).expect("write DEBIAN/control");
    let out = dir.join(format!("orca-relay-{note}.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-b"])
        .arg(&tree)
        .arg(&out));
    let _ = std::fs::remove_dir_all(&tree);
    out
}
