//! Arbitrary input never panics the reader, and whatever it accepts the
//! reference crate accepts too, with the same tensors.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use kvtier_io::safetensors::{Header, SafetensorsError, parse_header, read_header};
use proptest::prelude::*;
use safetensors::SafeTensors;

/// Parses a whole file image the way `read_header` does, from memory.
fn parse_image(bytes: &[u8]) -> Result<Header, SafetensorsError> {
    let p = Path::new("mem.safetensors");
    let n = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .unwrap_or(0);
    let json = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_add(8))
        .and_then(|end| bytes.get(8..end))
        .unwrap_or(&[]);
    parse_header(p, json, n, bytes.len() as u64)
}

/// Ours accepting implies the reference accepting, with equal tensors.
fn agrees_with_reference(bytes: &[u8]) {
    let Ok(ours) = parse_image(bytes) else { return };
    let theirs = SafeTensors::deserialize(bytes).expect("we accepted what the reference rejects");
    assert_eq!(ours.tensors.len(), theirs.len());
    for t in &ours.tensors {
        let r = theirs.tensor(&t.name).unwrap();
        assert_eq!(t.shape, r.shape());
        let (s, e) = t.data_offsets;
        let start = (ours.data_start() + s) as usize;
        let end = (ours.data_start() + e) as usize;
        assert_eq!(&bytes[start..end], r.data());
    }
}

fn json_fragments() -> impl Strategy<Value = Vec<u8>> {
    let frag = prop::sample::select(vec![
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        " ",
        "\"a\"",
        "\"b\"",
        "\"dtype\"",
        "\"shape\"",
        "\"data_offsets\"",
        "\"F32\"",
        "\"U8\"",
        "\"BF16\"",
        "\"__metadata__\"",
        "0",
        "1",
        "4",
        "8",
        "-1",
        "1e3",
        "null",
        "\"\\u00ff\"",
        "\u{fffd}",
        "18446744073709551615",
    ]);
    prop::collection::vec(frag, 0..40).prop_map(|v| v.concat().into_bytes())
}

/// A small valid file written by the reference crate.
fn valid_file() -> impl Strategy<Value = Vec<u8>> {
    let dtypes = prop::sample::select(vec![
        safetensors::Dtype::U8,
        safetensors::Dtype::F16,
        safetensors::Dtype::F32,
        safetensors::Dtype::I64,
    ]);
    let tensor = (dtypes, prop::collection::vec(0usize..4, 0..3));
    prop::collection::vec(tensor, 0..4).prop_map(|ts| {
        let datas: Vec<(safetensors::Dtype, Vec<usize>, Vec<u8>)> = ts
            .into_iter()
            .map(|(d, s)| {
                let n = s.iter().product::<usize>() * d.bitsize() / 8;
                (d, s, (0..n).map(|i| i as u8).collect())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = datas
            .iter()
            .enumerate()
            .map(|(i, (d, s, b))| {
                let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                (format!("t{i}"), v)
            })
            .collect();
        let meta = HashMap::from([("k".to_string(), "v".to_string())]);
        safetensors::serialize(views, Some(meta)).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), extra in 0u64..64) {
        let p = Path::new("fuzz");
        let _ = parse_header(p, &bytes, bytes.len() as u64, bytes.len() as u64 + 8 + extra);
        let _ = parse_header(p, &bytes, extra, extra);
        agrees_with_reference(&bytes);
    }

    #[test]
    fn arbitrary_header_after_a_valid_length_never_panics(json in json_fragments(), data in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(&json);
        bytes.extend_from_slice(&data);
        agrees_with_reference(&bytes);
    }

    #[test]
    fn read_header_on_arbitrary_files_never_panics(json in json_fragments(), tail in prop::collection::vec(any::<u8>(), 0..32), lie in prop::option::of(any::<u64>())) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.safetensors");
        let n = lie.unwrap_or(json.len() as u64);
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&n.to_le_bytes()).unwrap();
        f.write_all(&json).unwrap();
        f.write_all(&tail).unwrap();
        drop(f);
        if let Err(e) = read_header(&path) {
            prop_assert_eq!(e.path(), path.as_path());
        }
    }

    #[test]
    fn reference_files_parse_and_mutations_never_fool_us(file in valid_file(), at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in 0usize..16) {
        prop_assert!(parse_image(&file).is_ok());
        agrees_with_reference(&file);
        let mut flipped = file.clone();
        let i = at.index(flipped.len());
        flipped[i] = byte;
        agrees_with_reference(&flipped);
        let cut = cut.min(file.len());
        agrees_with_reference(&file[..file.len() - cut]);
        let mut longer = file.clone();
        longer.push(0);
        prop_assert!(parse_image(&longer).is_err());
    }
}
