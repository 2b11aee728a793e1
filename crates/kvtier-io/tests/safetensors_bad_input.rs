//! Every malformed-file case the reader must reject, each with its typed
//! error naming the file (and the tensor, where there is one), and no panic
//! or header-sized allocation.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kvtier_io::safetensors::{MAX_HEADER_BYTES, SafetensorsError, parse_header, read_header};

/// Writes `8-byte LE len(header) + header + data` and returns its path.
fn file_with(dir: &Path, name: &str, header: &[u8], data: &[u8]) -> PathBuf {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn tensor(name: &str, dtype: &str, shape: &[usize], start: u64, end: u64) -> String {
    format!(r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}"#)
}

fn header(entries: &[String]) -> Vec<u8> {
    format!("{{{}}}", entries.join(",")).into_bytes()
}

/// Reads `path` expecting an error, checks it names the file, returns it.
fn rejected(path: &Path) -> SafetensorsError {
    let err = read_header(path).expect_err("malformed file accepted");
    assert_eq!(err.path(), path);
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "message does not name the file: {err}"
    );
    err
}

/// A well-formed two-tensor file: "a" F32 [2] then "b" U8 [3].
fn good(dir: &Path) -> PathBuf {
    let h = header(&[
        tensor("a", "F32", &[2], 0, 8),
        tensor("b", "U8", &[3], 8, 11),
    ]);
    file_with(dir, "good.safetensors", &h, &[7u8; 11])
}

#[test]
fn the_good_file_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let h = read_header(&good(dir.path())).unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.data_len(), 11);
}

#[test]
fn truncated_data_names_the_tensor_cut_short() {
    let dir = tempfile::tempdir().unwrap();
    let path = good(dir.path());
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 2)
        .unwrap();
    match rejected(&path) {
        SafetensorsError::OffsetsPastEnd {
            name,
            end,
            data_len,
            ..
        } => assert_eq!((name.as_str(), end, data_len), ("b", 11, 9)),
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn truncated_below_the_length_prefix_is_too_short() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.safetensors");
    std::fs::write(&path, [1u8, 0, 0]).unwrap();
    assert!(matches!(
        rejected(&path),
        SafetensorsError::TooShort { len: 3, .. }
    ));
}

#[test]
fn header_length_past_end_of_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("past.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, bytes).unwrap();
    assert!(matches!(
        rejected(&path),
        SafetensorsError::HeaderPastEnd {
            header_len: 1000,
            file_len: 10,
            ..
        }
    ));
}

#[test]
fn four_gib_header_length_is_too_large_before_any_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.safetensors");
    // A sparse 5 GiB file, so the length would fit in the file: only the
    // size limit stands between the reader and a 4 GiB allocation.
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(5 << 30).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &0x1_0000_0000u64.to_le_bytes(), 0).unwrap();
    drop(file);
    match rejected(&path) {
        SafetensorsError::HeaderTooLarge { len, .. } => assert_eq!(len, 0x1_0000_0000),
        e => panic!("wrong error: {e}"),
    }
    // parse_header applies the limit too, whatever slice it is handed.
    let e = parse_header(&path, b"{}", 0x1_0000_0000, 5 << 30).unwrap_err();
    assert!(matches!(e, SafetensorsError::HeaderTooLarge { .. }), "{e}");
    // The limit itself is accepted as a length (then fails for other reasons).
    let e = parse_header(&path, b"{}", MAX_HEADER_BYTES, 5 << 30).unwrap_err();
    assert!(
        matches!(e, SafetensorsError::HeaderLenMismatch { .. }),
        "{e}"
    );
}

#[test]
fn overlapping_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[
        tensor("a", "F32", &[4], 0, 16),
        tensor("b", "F32", &[4], 8, 24),
    ]);
    let path = file_with(dir.path(), "overlap.safetensors", &h, &[0u8; 24]);
    match rejected(&path) {
        SafetensorsError::Overlap {
            name,
            previous,
            start,
            previous_end,
            ..
        } => {
            assert_eq!((name.as_str(), previous.as_str()), ("b", "a"));
            assert_eq!((start, previous_end), (8, 16));
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn shape_times_dtype_differs_from_the_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[tensor("w", "F32", &[3], 0, 8)]);
    let path = file_with(dir.path(), "size.safetensors", &h, &[0u8; 8]);
    match rejected(&path) {
        SafetensorsError::SizeMismatch {
            name,
            expected,
            got,
            ..
        } => assert_eq!((name.as_str(), expected, got), ("w", 12, 8)),
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn shape_that_overflows_is_a_bad_shape() {
    let dir = tempfile::tempdir().unwrap();
    let big = usize::MAX / 2;
    let h = header(&[tensor("w", "F64", &[big, 4], 0, 8)]);
    let path = file_with(dir.path(), "overflow.safetensors", &h, &[0u8; 8]);
    assert!(matches!(rejected(&path), SafetensorsError::BadShape { ref name, .. } if name == "w"));
}

#[test]
fn end_before_start_is_bad_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[tensor("w", "U8", &[0], 4, 0)]);
    let path = file_with(dir.path(), "backwards.safetensors", &h, &[0u8; 4]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::BadOffsets {
            start: 4,
            end: 0,
            ..
        }
    ));
}

#[test]
fn non_utf8_header() {
    let dir = tempfile::tempdir().unwrap();
    let mut h = br#"{"w"#.to_vec();
    h.push(0xff);
    h.extend_from_slice(br#"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#);
    let path = file_with(dir.path(), "utf8.safetensors", &h, &[0u8; 1]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::NotUtf8 { valid_up_to: 3, .. }
    ));
}

#[test]
fn duplicate_tensor_names() {
    let dir = tempfile::tempdir().unwrap();
    // serde_json maps would silently keep the second entry; the file would
    // then even tile correctly. It must be rejected.
    let h = header(&[tensor("w", "U8", &[4], 0, 4), tensor("w", "U8", &[8], 0, 8)]);
    let path = file_with(dir.path(), "dup.safetensors", &h, &[0u8; 8]);
    match rejected(&path) {
        SafetensorsError::DuplicateTensor { name, .. } => assert_eq!(name, "w"),
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn header_not_starting_with_a_brace() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (h, first)) in [
        (&b" {}"[..], Some(b' ')),
        (&b"[]"[..], Some(b'[')),
        (&b"\"x\""[..], Some(b'"')),
        (&b""[..], None),
    ]
    .into_iter()
    .enumerate()
    {
        let path = file_with(dir.path(), &format!("brace{i}.safetensors"), h, &[]);
        match rejected(&path) {
            SafetensorsError::NotStartingWithBrace { found, .. } => assert_eq!(found, first),
            e => panic!("wrong error: {e}"),
        }
    }
}

#[test]
fn unknown_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[tensor("q", "Q4_K", &[2], 0, 2)]);
    let path = file_with(dir.path(), "dtype.safetensors", &h, &[0u8; 2]);
    match rejected(&path) {
        SafetensorsError::UnknownDtype { name, dtype, .. } => {
            assert_eq!((name.as_str(), dtype.as_str()), ("q", "Q4_K"))
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn gap_between_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[
        tensor("a", "U8", &[4], 0, 4),
        tensor("b", "U8", &[4], 8, 12),
    ]);
    let path = file_with(dir.path(), "gap.safetensors", &h, &[0u8; 12]);
    match rejected(&path) {
        SafetensorsError::Gap {
            name,
            start,
            expected,
            ..
        } => assert_eq!((name.as_str(), start, expected), ("b", 8, 4)),
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn gap_before_the_first_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[tensor("a", "U8", &[4], 2, 6)]);
    let path = file_with(dir.path(), "lead.safetensors", &h, &[0u8; 6]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::Gap {
            start: 2,
            expected: 0,
            ..
        }
    ));
}

#[test]
fn file_longer_than_the_data() {
    let dir = tempfile::tempdir().unwrap();
    let h = header(&[tensor("a", "U8", &[4], 0, 4)]);
    let path = file_with(dir.path(), "long.safetensors", &h, &[0u8; 5]);
    let n = h.len() as u64;
    match rejected(&path) {
        SafetensorsError::FileLengthMismatch { expected, got, .. } => {
            assert_eq!((expected, got), (8 + n + 4, 8 + n + 5))
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn lying_header_claiming_a_terabyte_is_bounded_by_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let tib = 1u64 << 40;
    let h = header(&[tensor("w", "U8", &[tib as usize], 0, tib)]);
    let path = file_with(dir.path(), "liar.safetensors", &h, &[0u8; 16]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::OffsetsPastEnd { data_len: 16, .. }
    ));
}

#[test]
fn malformed_entries_name_the_tensor_or_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = file_with(
        dir.path(),
        "nofield.safetensors",
        br#"{"w":{"dtype":"U8","shape":[1]}}"#,
        &[0u8; 1],
    );
    match rejected(&path) {
        SafetensorsError::InvalidTensor { name, msg, .. } => {
            assert_eq!(name, "w");
            assert!(msg.contains("data_offsets"), "{msg}");
        }
        e => panic!("wrong error: {e}"),
    }
    let path = file_with(
        dir.path(),
        "meta.safetensors",
        br#"{"__metadata__":{"format":["pt"]}}"#,
        &[],
    );
    assert!(matches!(
        rejected(&path),
        SafetensorsError::InvalidMetadata { .. }
    ));
    let path = file_with(dir.path(), "json.safetensors", br#"{"w":1,,}"#, &[]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::InvalidTensor { .. }
    ));
    let path = file_with(dir.path(), "trail.safetensors", br#"{} {}"#, &[]);
    assert!(matches!(
        rejected(&path),
        SafetensorsError::InvalidJson { .. }
    ));
}

#[test]
fn parse_header_checks_the_slice_against_the_prefix() {
    let p = Path::new("x.safetensors");
    let e = parse_header(p, b"{}", 3, 100).unwrap_err();
    assert!(matches!(
        e,
        SafetensorsError::HeaderLenMismatch {
            expected: 3,
            got: 2,
            ..
        }
    ));
    let e = parse_header(p, b"{}", 2, 9).unwrap_err();
    assert!(matches!(e, SafetensorsError::HeaderPastEnd { .. }));
    let h = parse_header(p, b"{}  ", 4, 12).unwrap();
    assert!(h.tensors.is_empty() && h.metadata.is_empty());
    assert_eq!(h.data_start(), 12);
}
