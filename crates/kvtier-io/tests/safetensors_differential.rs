//! Differential tests against the reference `safetensors` crate: files it
//! writes parse identically with ours, and headers we encode are files it
//! reads.

// Helpers outside #[test] fns unwrap too: clippy.toml lets tests unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use kvtier_io::safetensors::{
    Dtype, ENCODE_PATH, SafetensorsError, TensorInfo, encode_header, parse_header, read_header,
};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView as RefView;

fn ref_dtype(d: Dtype) -> safetensors::Dtype {
    serde_json::from_str(&format!("\"{}\"", d.as_str())).unwrap()
}

fn ref_name(d: safetensors::Dtype) -> String {
    serde_json::to_value(d)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

/// Tensors of every dtype, including a scalar and empty shapes.
fn fixture() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, d) in Dtype::ALL.into_iter().enumerate() {
        let shapes: [Vec<usize>; 3] = [vec![3, i + 1], vec![], vec![0, 5]];
        for (j, shape) in shapes.into_iter().enumerate() {
            let n: usize = shape.iter().product::<usize>() * d.size_bytes();
            let data = (0..n).map(|k| (k * 13 + i * 7 + j) as u8).collect();
            out.push((format!("layer.{i}.{}.{j}", d.as_str()), d, shape, data));
        }
    }
    out
}

fn write_reference(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, RefView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                RefView::new(ref_dtype(*d), s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

#[test]
fn files_written_by_the_reference_crate_parse_identically() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ref.safetensors");
    let tensors = fixture();
    write_reference(&path, &tensors);

    let ours = read_header(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let theirs = SafeTensors::deserialize(&bytes).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();

    assert_eq!(ours.header_len, n as u64);
    assert_eq!(ours.tensors.len(), theirs.len());
    assert_eq!(ours.tensors.len(), tensors.len());
    assert_eq!(ours.metadata.get("format").map(String::as_str), Some("pt"));
    assert_eq!(ours.file_len(), bytes.len() as u64);
    assert_eq!(ours.data_len() as usize, meta.data_len());
    // Ours lists tensors by offset, as the reference's offset order does.
    let ours_names: Vec<_> = ours.tensors.iter().map(|t| t.name.clone()).collect();
    assert_eq!(ours_names, meta.offset_keys());
    for t in &ours.tensors {
        let r = theirs.tensor(&t.name).unwrap();
        assert_eq!(t.dtype.as_str(), ref_name(r.dtype()), "{}", t.name);
        assert_eq!(t.shape, r.shape(), "{}", t.name);
        let (s, e) = t.data_offsets;
        let start = (ours.data_start() + s) as usize;
        let end = (ours.data_start() + e) as usize;
        assert_eq!(&bytes[start..end], r.data(), "{}", t.name);
        let want = tensors.iter().find(|x| x.0 == t.name).unwrap();
        assert_eq!(&bytes[start..end], &want.3[..]);
    }
}

#[test]
fn encoded_headers_are_read_by_the_reference_crate_and_by_us() {
    let tensors = fixture();
    let mut infos = Vec::new();
    let mut data = Vec::new();
    // Reverse order in, offset order out.
    for (n, d, s, b) in tensors.iter().rev() {
        let start = data.len() as u64;
        data.extend_from_slice(b);
        infos.push(TensorInfo {
            name: n.clone(),
            dtype: *d,
            shape: s.clone(),
            data_offsets: (start, data.len() as u64),
        });
    }
    let metadata = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("quote\"d".to_string(), "ünïcode\n".to_string()),
    ]);
    for align in [1usize, 8, 4096] {
        let prefix = encode_header(&infos, &metadata, align).unwrap();
        assert_eq!(prefix.len() % align, 0, "align {align}");
        let mut file = prefix.clone();
        file.extend_from_slice(&data);

        let theirs = SafeTensors::deserialize(&file).unwrap();
        for (n, d, s, b) in &tensors {
            let r = theirs.tensor(n).unwrap();
            assert_eq!(
                (ref_name(r.dtype()), r.shape(), r.data()),
                (d.as_str().to_string(), &s[..], &b[..])
            );
        }
        let (_, meta) = SafeTensors::read_metadata(&file).unwrap();
        let ref_meta: BTreeMap<_, _> = meta.metadata().clone().unwrap().into_iter().collect();
        assert_eq!(ref_meta, metadata);

        let n = u64::from_le_bytes(prefix[..8].try_into().unwrap());
        let ours = parse_header(Path::new("enc"), &prefix[8..], n, file.len() as u64).unwrap();
        let mut sorted = infos.clone();
        sorted.sort_by_key(|t| (t.data_offsets, t.name.clone()));
        assert_eq!(ours.tensors, sorted);
        assert_eq!(ours.metadata, metadata);
    }
}

#[test]
fn encode_rejects_what_parse_would_reject() {
    let t = |name: &str, start: u64, end: u64| TensorInfo {
        name: name.into(),
        dtype: Dtype::U8,
        shape: vec![(end - start) as usize],
        data_offsets: (start, end),
    };
    let m = BTreeMap::new();
    let e = encode_header(&[t("a", 0, 4), t("a", 4, 8)], &m, 8).unwrap_err();
    assert!(matches!(e, SafetensorsError::DuplicateTensor { .. }), "{e}");
    assert_eq!(e.path(), Path::new(ENCODE_PATH));
    let e = encode_header(&[t("__metadata__", 0, 4)], &m, 8).unwrap_err();
    assert!(matches!(e, SafetensorsError::DuplicateTensor { .. }), "{e}");
    let e = encode_header(&[t("a", 0, 4), t("b", 8, 12)], &m, 8).unwrap_err();
    assert!(matches!(e, SafetensorsError::Gap { .. }), "{e}");
    let e = encode_header(&[t("a", 0, 4)], &m, 12).unwrap_err();
    assert!(
        matches!(e, SafetensorsError::BadAlignment { align: 12, .. }),
        "{e}"
    );
    let mut bad = t("a", 0, 4);
    bad.shape = vec![5];
    let e = encode_header(&[bad], &m, 8).unwrap_err();
    assert!(matches!(e, SafetensorsError::SizeMismatch { .. }), "{e}");
    let empty = encode_header(&[], &m, 8).unwrap();
    assert_eq!(&empty[8..], b"{}      ");
}
