//! Reading a configuration file from disk: the one function every loader
//! (routes, resources, scenarios, `usher check`, TLS files) reads through.
//!
//! A watched path is whatever the operator, an editor or a ConfigMap swap
//! left there: a symlink to `/dev/zero` must not be read until memory runs
//! out, and a FIFO must not block the reload loop in `open()` until a
//! writer turns up. So only regular files are read (symlinks followed),
//! the open never blocks, and at most [`MAX_FILE_BYTES`] are read.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The largest configuration file read: far above any real one (a routes
/// file of 10,000 routes is about 1 MiB), far below what hurts to hold.
pub const MAX_FILE_BYTES: u64 = 16 << 20;

/// Why a file was not read.
#[derive(Debug)]
pub enum ReadError {
    /// Not a regular file once symlinks are followed: what it is instead.
    NotRegular(&'static str),
    /// Larger than the cap.
    TooLarge {
        /// The most bytes that may be read, in bytes.
        cap: u64,
    },
    /// Not valid UTF-8 (text files only).
    NotUtf8,
    /// The file could not be opened or read.
    Io(std::io::Error),
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::NotRegular(what) => write!(f, "not a regular file ({what})"),
            ReadError::TooLarge { cap } => {
                write!(f, "larger than the {} limit for configuration files", human_size(*cap))
            }
            ReadError::NotUtf8 => f.write_str("not valid UTF-8"),
            ReadError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ReadError {}

fn human_size(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes}-byte")
    }
}

fn file_kind(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// Reads a regular file (after symlinks) of at most `cap` bytes, never
/// blocking in `open()`. A file that grows past `cap` while it is read is
/// refused too: at most `cap + 1` bytes are ever read.
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, ReadError> {
    let meta = std::fs::metadata(path).map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::NotRegular(file_kind(meta.file_type())));
    }
    if meta.len() > cap {
        return Err(ReadError::TooLarge { cap });
    }
    // The path may have been swapped for a FIFO since: O_NONBLOCK makes that
    // open return at once (it means nothing for a regular file), and the
    // opened file's own type is checked again.
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(ReadError::Io)?;
    let meta = file.metadata().map_err(ReadError::Io)?;
    if !meta.is_file() {
        return Err(ReadError::NotRegular(file_kind(meta.file_type())));
    }
    let mut bytes = Vec::with_capacity(meta.len().min(cap) as usize);
    file.take(cap + 1).read_to_end(&mut bytes).map_err(ReadError::Io)?;
    if bytes.len() as u64 > cap {
        return Err(ReadError::TooLarge { cap });
    }
    Ok(bytes)
}

/// [`read_capped`] with [`MAX_FILE_BYTES`], as UTF-8 text.
pub fn read_text(path: &Path) -> Result<String, ReadError> {
    String::from_utf8(read_capped(path, MAX_FILE_BYTES)?).map_err(|_| ReadError::NotUtf8)
}

/// [`read_text`] for a configuration file, its error at `file:1:1`;
/// `what` names the file in the message ("routes file").
pub fn read_config(path: &Path, what: &str) -> Result<String, super::ConfigError> {
    read_text(path)
        .map_err(|e| super::ConfigError::whole_file(&path.display().to_string(), format!("cannot read {what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_directories_and_fifos_and_reads_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_capped(Path::new("/dev/zero"), 10).unwrap_err();
        assert_eq!(e.to_string(), "not a regular file (a character device)");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink("/dev/urandom", &link).unwrap();
        assert!(matches!(read_capped(&link, 10), Err(ReadError::NotRegular("a character device"))));
        assert!(matches!(read_capped(dir.path(), 10), Err(ReadError::NotRegular("a directory"))));
        let fifo = dir.path().join("fifo");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        assert!(matches!(read_capped(&fifo, 10), Err(ReadError::NotRegular("a FIFO"))));
        let f = dir.path().join("f");
        std::fs::write(&f, "0123456789").unwrap();
        assert_eq!(read_capped(&f, 10).unwrap(), b"0123456789");
        let e = read_capped(&f, 9).unwrap_err();
        assert!(matches!(e, ReadError::TooLarge { cap: 9 }), "{e}");
        assert_eq!(
            ReadError::TooLarge { cap: MAX_FILE_BYTES }.to_string(),
            "larger than the 16 MiB limit for configuration files"
        );
    }
}
