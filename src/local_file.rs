//! Bounded reads of the local files an operator points the relay at: the switch file, the
//! self-hosted key file, the budget tool's fleet file (SPEC §11 "Framing": read only if
//! regular and at most 64 KiB).
//!
//! A path can name anything: a symlink to `/dev/zero` (an endless read that would grow the
//! process until it dies), a FIFO (an `open` that blocks until a writer comes, forever), a
//! directory, a file larger than any sane configuration. [`read_bounded`] opens with
//! `O_NONBLOCK` (a FIFO never blocks the open or the read), checks with `fstat` on the open
//! descriptor (no window between a check and the open) that it is a regular file no larger
//! than the limit, then reads at most the limit plus one byte (a file that grows after the
//! check is still refused). It never blocks, never reads more than the limit, and says why it
//! refused with a short cause code.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The largest local file the relay reads (SPEC §11).
pub const MAX_LOCAL_FILE_BYTES: u64 = 64 * 1024;

/// Why a local file was not read.
#[derive(Debug)]
pub enum LocalFileError {
    /// Nothing at the path.
    Missing,
    /// Something other than a regular file (after following symlinks): its kind.
    NotRegular(&'static str),
    /// A regular file larger than the limit (its size, or `limit + 1` if it grew while read).
    TooLarge { size: u64, limit: u64 },
    /// The file could not be opened or read (permissions, a path through a file, a symlink
    /// loop, an I/O error).
    Unreadable(io::Error),
    /// The file is not UTF-8 (only from [`read_bounded_to_string`]).
    NotUtf8,
}

impl LocalFileError {
    /// A short stable code for log lines.
    pub fn cause(&self) -> &'static str {
        match self {
            LocalFileError::Missing => "missing",
            LocalFileError::NotRegular(_) => "not_regular_file",
            LocalFileError::TooLarge { .. } => "too_large",
            LocalFileError::Unreadable(_) => "unreadable",
            LocalFileError::NotUtf8 => "not_utf8",
        }
    }

    /// The detail that goes with the cause: the file's kind, its size, the OS error.
    pub fn detail(&self) -> String {
        match self {
            LocalFileError::Missing | LocalFileError::NotUtf8 => String::new(),
            LocalFileError::NotRegular(kind) => (*kind).to_string(),
            LocalFileError::TooLarge { size, limit } => format!("{size}>{limit}"),
            LocalFileError::Unreadable(error) => match error.raw_os_error() {
                Some(errno) => format!("errno_{errno}"),
                None => format!("{:?}", error.kind()).to_lowercase(),
            },
        }
    }
}

impl fmt::Display for LocalFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocalFileError::Missing => f.write_str("no such file"),
            LocalFileError::NotRegular(kind) => write!(f, "not a regular file but a {kind}"),
            LocalFileError::TooLarge { size, limit } => {
                write!(f, "too large ({size} bytes, at most {limit})")
            }
            LocalFileError::Unreadable(error) => write!(f, "unreadable: {error}"),
            LocalFileError::NotUtf8 => f.write_str("not UTF-8"),
        }
    }
}

impl std::error::Error for LocalFileError {}

fn kind_of(file_type: std::fs::FileType) -> &'static str {
    if file_type.is_dir() {
        "directory"
    } else if file_type.is_fifo() {
        "fifo"
    } else if file_type.is_char_device() {
        "character_device"
    } else if file_type.is_block_device() {
        "block_device"
    } else if file_type.is_socket() {
        "socket"
    } else {
        "other"
    }
}

fn open_error(error: io::Error) -> LocalFileError {
    match error.kind() {
        io::ErrorKind::NotFound => LocalFileError::Missing,
        // Opening a socket fails with ENXIO: it is there, but no file.
        _ if error.raw_os_error() == Some(libc::ENXIO) => LocalFileError::NotRegular("socket"),
        _ => LocalFileError::Unreadable(error),
    }
}

/// Reads the regular file at `path` if it holds at most `limit` bytes, without ever blocking
/// or reading more than `limit + 1` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, LocalFileError> {
    // O_NONBLOCK: a FIFO's open returns at once instead of waiting for a writer. O_NOCTTY: a
    // terminal never becomes the process's controlling terminal.
    let file: File = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(open_error)?;
    let metadata = file.metadata().map_err(LocalFileError::Unreadable)?;
    if !metadata.file_type().is_file() {
        return Err(LocalFileError::NotRegular(kind_of(metadata.file_type())));
    }
    if metadata.len() > limit {
        return Err(LocalFileError::TooLarge {
            size: metadata.len(),
            limit,
        });
    }
    // The size is at most the limit, so this allocation is bounded.
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(LocalFileError::Unreadable)?;
    if bytes.len() as u64 > limit {
        return Err(LocalFileError::TooLarge {
            size: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

/// [`read_bounded`], as UTF-8 text.
pub fn read_bounded_to_string(path: &Path, limit: u64) -> Result<String, LocalFileError> {
    String::from_utf8(read_bounded(path, limit)?).map_err(|_| LocalFileError::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed on drop.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!(
                "orca-relay-local-file-{name}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn mkfifo(path: &Path) {
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a file system node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn each_hostile_path_is_refused_with_its_cause_without_blocking() {
        let scratch = Scratch::new("hostile");
        let dir = &scratch.0;
        let zero = dir.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let fifo = dir.join("fifo");
        mkfifo(&fifo);
        let big = dir.join("big");
        std::fs::write(&big, vec![b' '; 65 * 1024]).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"{}").unwrap();
        let through_file = file.join("switch.json");
        let looped = dir.join("loop");
        std::os::unix::fs::symlink(&looped, &looped).unwrap();
        let cases: Vec<(&Path, &str, &str)> = vec![
            (&zero, "not_regular_file", "character_device"),
            (&fifo, "not_regular_file", "fifo"),
            (dir, "not_regular_file", "directory"),
            (&big, "too_large", "66560>65536"),
            (&through_file, "unreadable", "errno_20"),
            (&looped, "unreadable", "errno_40"),
            (Path::new("/nonexistent/orca"), "missing", ""),
        ];
        for (path, cause, detail) in cases {
            let error = read_bounded(path, MAX_LOCAL_FILE_BYTES).unwrap_err();
            assert_eq!(
                (error.cause(), error.detail().as_str()),
                (cause, detail),
                "{path:?}"
            );
        }
        assert_eq!(read_bounded(&file, MAX_LOCAL_FILE_BYTES).unwrap(), b"{}");
        // At the limit exactly is fine; one byte over is not.
        std::fs::write(&big, vec![b' '; 64 * 1024]).unwrap();
        assert_eq!(
            read_bounded(&big, MAX_LOCAL_FILE_BYTES).unwrap().len(),
            65_536
        );
        std::fs::write(&big, b"12345").unwrap();
        assert_eq!(read_bounded(&big, 4).unwrap_err().cause(), "too_large");
        std::fs::write(&big, [0xff, 0xfe]).unwrap();
        assert_eq!(
            read_bounded_to_string(&big, 4).unwrap_err().cause(),
            "not_utf8"
        );
    }
}
