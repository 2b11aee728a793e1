//! The small files of a model directory (`config.json`, `tokenizer.json`),
//! read only when they are regular files of bounded size.
//!
//! A model directory is user input: `config.json` may be a link to
//! `/dev/zero` (an endless read), a FIFO (an open that never returns) or a
//! device. Each file is checked with `stat` (following links) before it is
//! opened, and read through a cap, so such a file is an error naming it,
//! never a hang or unbounded memory. Weights go through the loader of
//! `kvtier-io`, which applies the same rule to shards.

use std::io::Read;
use std::path::Path;

use crate::engine_error::EngineError;

/// Most bytes of `config.json` read.
pub const CONFIG_MAX_BYTES: u64 = 1 << 20;
/// Most bytes of `tokenizer.json` read (large vocabularies with merges run
/// to tens of MB).
pub const TOKENIZER_MAX_BYTES: u64 = 256 << 20;

/// The contents of `path`, which must be a regular file (links followed) of
/// at most `max` bytes.
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, EngineError> {
    let err = |msg: String| EngineError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(msg),
    };
    let meta = std::fs::metadata(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    if !meta.is_file() {
        return Err(err(
            "not a regular file (a FIFO, device or directory is never read)".into(),
        ));
    }
    if meta.len() > max {
        return Err(err(format!(
            "{} bytes, more than the {max} read from such a file",
            meta.len()
        )));
    }
    let file = std::fs::File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::with_capacity(meta.len() as usize);
    // The cap holds even if the file grows between the stat and the read.
    file.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    if out.len() as u64 > max {
        return Err(err(format!("grew past {max} bytes while read")));
    }
    Ok(out)
}

/// [`read_bounded`] as UTF-8 text.
pub fn read_bounded_text(path: &Path, max: u64) -> Result<String, EngineError> {
    String::from_utf8(read_bounded(path, max)?).map_err(|_| EngineError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_fifos_and_oversized_files_are_refused_without_reading() {
        let tmp = tempfile::tempdir().unwrap();
        let link = tmp.path().join("config.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_bounded(&link, CONFIG_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("config.json") && e.contains("not a regular file"),
            "{e}"
        );
        let e = read_bounded(tmp.path(), CONFIG_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");

        let fifo = tmp.path().join("fifo.json");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let e = read_bounded(&fifo, CONFIG_MAX_BYTES)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");

        let big = tmp.path().join("big.json");
        std::fs::write(&big, vec![b' '; 100]).unwrap();
        let e = read_bounded(&big, 99).unwrap_err().to_string();
        assert!(e.contains("100 bytes"), "{e}");
        assert_eq!(read_bounded(&big, 100).unwrap().len(), 100);

        std::fs::write(&big, [0xff, 0xfe]).unwrap();
        let e = read_bounded_text(&big, 100).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
    }
}
