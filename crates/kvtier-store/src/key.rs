//! Block keys: chained prefix hashes that name a KV block by everything that
//! determines its contents.
//!
//! `key_0 = H(key_seed || tokens of block 0)`, `key_i = H(key_{i-1} || tokens
//! of block i)`, where `H` is XXH3-128 and the seed hashes the model
//! fingerprint, the KV layout (dtype included) and a tenant salt. A key thus
//! names the whole prefix up to and including its block, and the longest
//! cached prefix of a prompt is its longest run of leading keys found in any
//! tier. docs/keys.md pins the exact byte encoding and golden vectors.

use std::fmt;

use xxhash_rust::xxh3::{Xxh3Default, xxh3_128};

use crate::codec::KvCodec;
use crate::kv_layout::{Arrangement, KvLayout};

/// Domain-separation string hashed first into every key-chain seed. Bump the
/// version suffix whenever the key derivation changes, so old and new keys
/// can never collide.
pub const KEYCHAIN_DOMAIN: &str = "kvtier.keychain.v1";

/// Domain-separation string hashed first into every raw key
/// ([`KeyChain::raw_key`]), so a raw key never equals a token-chain key.
pub const RAWKEY_DOMAIN: &str = "kvtier.rawkey.v1";

/// Domain string of a request salt added to a chain ([`KeyChain::salted`]).
pub const SALT_DOMAIN: &str = "kvtier.salt.v1";

/// Domain string of a partial block's key ([`KeyChain::partial`]), so it
/// never equals a full block's.
pub const PARTIAL_DOMAIN: &str = "kvtier.partial.v1";

/// The 128-bit name of one KV block (and of the whole prefix it ends).
///
/// `Debug` and `Display` print 32 lower-case hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey(pub [u8; 16]);

impl BlockKey {
    /// 32 lower-case hex digits.
    pub fn to_hex(&self) -> String {
        hex16(&self.0)
    }

    /// Parses exactly 32 hex digits (either case); `None` otherwise.
    pub fn from_hex(s: &str) -> Option<Self> {
        parse_hex16(s).map(Self)
    }

    /// The raw key bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Identity of a model's weights and config, so KV from one model can never
/// match another's keys. How it is derived (shard hashes, header digests,
/// config) is the caller's choice; [`ModelFingerprint::of_bytes`] hashes a
/// byte string.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ModelFingerprint(pub [u8; 16]);

impl ModelFingerprint {
    /// XXH3-128 of `data`, as little-endian bytes.
    pub fn of_bytes(data: &[u8]) -> Self {
        Self(xxh3_128(data).to_le_bytes())
    }

    /// 32 lower-case hex digits.
    pub fn to_hex(&self) -> String {
        hex16(&self.0)
    }

    /// Parses exactly 32 hex digits (either case); `None` otherwise.
    pub fn from_hex(s: &str) -> Option<Self> {
        parse_hex16(s).map(Self)
    }
}

impl fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Derives the keys of a token sequence's blocks for one model, layout and
/// tenant.
#[derive(Clone, Debug)]
pub struct KeyChain {
    seed: BlockKey,
    block_tokens: usize,
}

impl KeyChain {
    /// Builds the chain for one (model, layout, tenant).
    ///
    /// The seed is XXH3-128 (little-endian bytes) over a length-prefixed
    /// encoding: each of the following fields is written as its length in
    /// bytes (`u64` little-endian) followed by the bytes:
    ///
    /// 1. the domain string [`KEYCHAIN_DOMAIN`] (`"kvtier.keychain.v1"`),
    /// 2. the 16 fingerprint bytes,
    /// 3. the layout as 17 bytes: `layers`, `kv_heads`, `head_dim`,
    ///    `block_tokens` (each `u32` little-endian) then the dtype byte;
    ///    a layout with another arrangement than KV-major, with a shard or
    ///    with a codec appends 5 bytes: the arrangement byte, the rank and
    ///    the world (`u16` little-endian each, both 0 unsharded), 22 in all,
    ///    and one with a codec then its codec byte, 23 in all,
    /// 4. the tenant salt.
    ///
    /// docs/keys.md has the scheme and golden vectors.
    pub fn new(fingerprint: &ModelFingerprint, layout: &KvLayout, tenant_salt: &[u8]) -> Self {
        let mut layout_bytes = [0u8; 23];
        for (i, v) in [
            layout.layers,
            layout.kv_heads,
            layout.head_dim,
            layout.block_tokens,
        ]
        .into_iter()
        .enumerate()
        {
            layout_bytes[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        layout_bytes[16] = layout.dtype as u8;
        let coded = layout.codec != KvCodec::None;
        let extended =
            coded || layout.arrangement != Arrangement::KvMajor || layout.shard.is_some();
        let mut layout_len = 17;
        if extended {
            layout_bytes[17] = layout.arrangement as u8;
            let (rank, world) = layout.shard.map_or((0, 0), |s| (s.rank, s.world));
            layout_bytes[18..20].copy_from_slice(&rank.to_le_bytes());
            layout_bytes[20..22].copy_from_slice(&world.to_le_bytes());
            layout_len = 22;
        }
        if coded {
            layout_bytes[22] = layout.codec as u8;
            layout_len = 23;
        }

        let mut h = Xxh3Default::new();
        for field in [
            KEYCHAIN_DOMAIN.as_bytes(),
            &fingerprint.0[..],
            &layout_bytes[..layout_len],
            tenant_salt,
        ] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        Self {
            seed: BlockKey(h.digest128().to_le_bytes()),
            block_tokens: layout.block_tokens as usize,
        }
    }

    /// The seed: the "previous key" of block 0.
    pub fn seed(&self) -> BlockKey {
        self.seed
    }

    /// Tokens per block (from the layout).
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// The key of the block of tokens `block` that follows the block keyed
    /// `prev` (or the [`seed`](Self::seed) for the first block):
    /// `XXH3-128(prev bytes || each token as u32 little-endian)`.
    ///
    /// Hashes whatever it is given; callers pass exactly `block_tokens`
    /// tokens to stay consistent with [`keys`](Self::keys).
    pub fn next(&self, prev: &BlockKey, block: &[u32]) -> BlockKey {
        let mut h = Xxh3Default::new();
        h.update(&prev.0);
        // Feed tokens through a stack buffer: no allocation per block.
        let mut buf = [0u8; 1024];
        for chunk in block.chunks(buf.len() / 4) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        BlockKey(h.digest128().to_le_bytes())
    }

    /// The key of a **partial** block: the first `tokens.len()` tokens
    /// (fewer than a block) after the block keyed `prev` (or the seed):
    /// `XXH3-128(field(PARTIAL_DOMAIN) || field(prev) || field(tokens as
    /// u32 LE))`. It names exactly that prefix, so a prompt finds it only
    /// when its tail after its full blocks is those tokens (a repeated
    /// prompt); its block holds their KV in the first rows, the rest of the
    /// payload is whatever the page held.
    pub fn partial(&self, prev: &BlockKey, tokens: &[u32]) -> BlockKey {
        let mut h = Xxh3Default::new();
        for field in [PARTIAL_DOMAIN.as_bytes(), &prev.0[..]] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        h.update(&((tokens.len() * 4) as u64).to_le_bytes());
        let mut buf = [0u8; 1024];
        for chunk in tokens.chunks(buf.len() / 4) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..chunk.len() * 4]);
        }
        BlockKey(h.digest128().to_le_bytes())
    }

    /// This chain with a request's salt added (vLLM's `cache_salt`, a
    /// tenant id per request): the seed becomes
    /// `XXH3-128(field(SALT_DOMAIN) || field(seed) || field(salt))`. An
    /// empty salt gives this chain itself, so unsalted requests share the
    /// namespace's keys; two different salts never share a key.
    pub fn salted(&self, salt: &[u8]) -> KeyChain {
        if salt.is_empty() {
            return self.clone();
        }
        let mut h = Xxh3Default::new();
        for field in [SALT_DOMAIN.as_bytes(), &self.seed.0[..], salt] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        KeyChain {
            seed: BlockKey(h.digest128().to_le_bytes()),
            block_tokens: self.block_tokens,
        }
    }

    /// The key of an engine's own block hash `raw` (any bytes: vLLM's block
    /// hash, a content digest) in this chain's model, layout and tenant:
    /// `XXH3-128(field(RAWKEY_DOMAIN) || field(seed) || field(raw))`, with
    /// `field(x) = len(x) as u64 LE || x`. The engine's hash must already
    /// name the whole prefix (vLLM's block hashes chain their parents);
    /// kvtier only scopes it.
    pub fn raw_key(&self, raw: &[u8]) -> BlockKey {
        let mut h = Xxh3Default::new();
        for field in [RAWKEY_DOMAIN.as_bytes(), &self.seed.0[..], raw] {
            h.update(&(field.len() as u64).to_le_bytes());
            h.update(field);
        }
        BlockKey(h.digest128().to_le_bytes())
    }

    /// Keys of every full block of `tokens`, in order; a trailing partial
    /// block gets no key. Empty if the layout had `block_tokens == 0`.
    pub fn keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        if self.block_tokens == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / self.block_tokens);
        let mut prev = self.seed;
        for block in tokens.chunks_exact(self.block_tokens) {
            prev = self.next(&prev, block);
            out.push(prev);
        }
        out
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex16(bytes: &[u8; 16]) -> String {
    let mut s = String::with_capacity(32);
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    s
}

fn parse_hex16(s: &str) -> Option<[u8; 16]> {
    let s = s.as_bytes();
    if s.len() != 32 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; 16];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::kv_layout::{KvDtype, TpShard};

    fn golden_layout() -> KvLayout {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            block_tokens: 4,
            dtype: KvDtype::F32,
            codec: crate::KvCodec::None,
            arrangement: Arrangement::KvMajor,
            shard: None,
        }
    }

    fn golden_chain() -> KeyChain {
        KeyChain::new(
            &ModelFingerprint::of_bytes(b"kvtier-golden-model"),
            &golden_layout(),
            b"tenant-a",
        )
    }

    /// Pinned values: if these change, every stored block and every key in
    /// another process or machine stops matching. Change only with a new
    /// KEYCHAIN_DOMAIN version and a note in docs/keys.md.
    /// Cross-checked against Python's `xxhash` 4.1 (`xxh3_128_intdigest`,
    /// little-endian bytes); `abc` is the canonical XXH128 test vector
    /// `06b05ab6733a618578af5f94892f3950` byte-reversed.
    #[test]
    fn golden_vectors() {
        assert_eq!(
            ModelFingerprint::of_bytes(b"abc").to_hex(),
            "50392f89945faf7885613a73b65ab006"
        );
        assert_eq!(
            ModelFingerprint::of_bytes(b"kvtier-golden-model").to_hex(),
            "3df3093447649bf0d5046a30b8eb8c52"
        );
        let chain = golden_chain();
        assert_eq!(chain.seed().to_hex(), "c5e6aa66328a74351995a86c18a9b635");
        let tokens: Vec<u32> = (0..12).collect();
        let keys: Vec<String> = chain.keys(&tokens).iter().map(BlockKey::to_hex).collect();
        assert_eq!(
            keys,
            [
                "d367b8a181f5f23128d58da0cf8632d9",
                "40bc8478ddc6ff44292e641f9314d5c9",
                "70155e30094059263d111c7388e81394"
            ]
        );
    }

    /// Raw keys and the extended layout bytes, pinned the same way
    /// (docs/keys.md; computed with Python's `xxhash` from the documented
    /// encoding, not by this code).
    #[test]
    fn golden_raw_keys_and_extended_layouts() {
        let fp = ModelFingerprint::of_bytes(b"kvtier-golden-model");
        let chain = golden_chain();
        assert_eq!(
            chain.raw_key(b"abc").to_hex(),
            "ef79ddfb82bc4c5dfbe2f2ad8f8715b2"
        );
        assert_eq!(
            chain.raw_key(b"").to_hex(),
            "c54238c10919dc721adcd70204dd71a0"
        );
        let vllm = KeyChain::new(&fp, &KvLayout::vllm_cpu(2, 2, 64, 128, KvDtype::F32), b"");
        assert_eq!(vllm.seed().to_hex(), "f913554079baeb8ebe59263e809d7c45");
        assert_eq!(
            vllm.raw_key(&12345u64.to_le_bytes()).to_hex(),
            "5c5113f0a0443f0980091da1309c7129"
        );
        let shard = KvLayout {
            shard: Some(TpShard { rank: 1, world: 2 }),
            ..KvLayout::kv_major(2, 1, 8, 4, KvDtype::Bf16)
        };
        let chain = KeyChain::new(&fp, &shard, b"tenant-a");
        assert_eq!(chain.seed().to_hex(), "827711384dfb9bdc167a04276cd57053");
        assert_eq!(
            chain.keys(&[0, 1, 2, 3])[0].to_hex(),
            "057b7b1c56e2c60123e1ba22fa05656f"
        ); // A codec appends its byte to the extended layout: coded and
        // uncoded KV never share a key.
        let fp8 = KvLayout::kv_major(2, 2, 8, 4, KvDtype::F32).with_codec(KvCodec::Fp8E4m3);
        let chain = KeyChain::new(&fp, &fp8, b"tenant-a");
        assert_eq!(chain.seed().to_hex(), "412f5a943f2796c8a279fd5254753127");
        assert_eq!(
            chain.keys(&[0, 1, 2, 3])[0].to_hex(),
            "15e7e8ba2f8aadc7445dc53474ba3f25"
        );
        let int8 = KvLayout::vllm_cpu(2, 2, 64, 128, KvDtype::Bf16).with_codec(KvCodec::Int8);
        assert_eq!(
            KeyChain::new(&fp, &int8, b"").seed().to_hex(),
            "6efb42593c80d379dd73c8169e7d6bd6"
        );
    }

    #[test]
    fn golden_salted_chain() {
        let chain = golden_chain();
        let salted = chain.salted(b"req-salt");
        assert_eq!(salted.seed().to_hex(), "82b33b0a29a54ab0127a43a243449838");
        assert_eq!(
            salted.keys(&[0, 1, 2, 3])[0].to_hex(),
            "5dd51103fa28ad9cdcd31996e7cfe01d"
        );
        assert_eq!(chain.salted(b"").seed(), chain.seed());
        assert_ne!(chain.salted(b"a").seed(), chain.salted(b"b").seed());
        assert_ne!(chain.salted(b"a").seed(), chain.seed());
    }

    #[test]
    fn golden_partial_keys() {
        let chain = golden_chain();
        let k0 = chain.keys(&[0, 1, 2, 3])[0];
        assert_eq!(
            chain.partial(&k0, &[4, 5, 6]).to_hex(),
            "9a36497c88f23d68800e7ffa9240bcdb"
        );
        assert_eq!(
            chain.partial(&chain.seed(), &[0]).to_hex(),
            "c1b66096742d8c8ec06507235fc72e1e"
        );
        // Never a full block's key, and every token counts.
        assert_ne!(chain.partial(&chain.seed(), &[0, 1, 2, 3]), k0);
        assert_ne!(chain.partial(&k0, &[4, 5]), chain.partial(&k0, &[4, 5, 6]));
    }

    #[test]
    fn raw_keys_are_scoped_by_model_layout_salt_and_bytes() {
        let fp = ModelFingerprint::of_bytes(b"m");
        let l = golden_layout();
        let base = KeyChain::new(&fp, &l, b"").raw_key(b"h1");
        let others = [
            KeyChain::new(&fp, &l, b"").raw_key(b"h2"),
            KeyChain::new(&fp, &l, b"").raw_key(b"h1\0"),
            KeyChain::new(&fp, &l, b"salt").raw_key(b"h1"),
            KeyChain::new(&ModelFingerprint::of_bytes(b"n"), &l, b"").raw_key(b"h1"),
            KeyChain::new(
                &fp,
                &KvLayout {
                    arrangement: Arrangement::LayerMajor,
                    ..l
                },
                b"",
            )
            .raw_key(b"h1"),
            KeyChain::new(
                &fp,
                &KvLayout {
                    shard: Some(TpShard { rank: 0, world: 2 }),
                    ..l
                },
                b"",
            )
            .raw_key(b"h1"),
        ];
        for (i, k) in others.iter().enumerate() {
            assert_ne!(*k, base, "variant {i}");
        }
        // A raw key never equals the token key of the same bytes.
        let chain = KeyChain::new(&fp, &l, b"");
        let tokens = [1u32, 2, 3, 4];
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_ne!(chain.raw_key(&bytes), chain.keys(&tokens)[0]);
        // Every arrangement and each rank has its own seed.
        let mut seeds = std::collections::HashSet::new();
        for a in Arrangement::ALL {
            for shard in [
                None,
                Some(TpShard { rank: 0, world: 2 }),
                Some(TpShard { rank: 1, world: 2 }),
            ] {
                let l = KvLayout {
                    arrangement: a,
                    shard,
                    ..l
                };
                assert!(seeds.insert(KeyChain::new(&fp, &l, b"").seed()), "{l}");
            }
        }
    }

    #[test]
    fn seed_matches_documented_encoding() {
        // Rebuild the seed input by hand from the documented layout.
        let fp = ModelFingerprint::of_bytes(b"kvtier-golden-model");
        let mut input = Vec::new();
        let mut field = |bytes: &[u8]| {
            input.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            input.extend_from_slice(bytes);
        };
        field(b"kvtier.keychain.v1");
        field(&fp.0);
        let mut l = Vec::new();
        for v in [2u32, 2, 8, 4] {
            l.extend_from_slice(&v.to_le_bytes());
        }
        l.push(0); // F32
        field(&l);
        field(b"tenant-a");
        let expected = BlockKey(xxh3_128(&input).to_le_bytes());
        assert_eq!(golden_chain().seed(), expected);

        // And key_0 is a one-shot hash of seed || tokens LE.
        let mut k0_input = expected.0.to_vec();
        for t in 0u32..4 {
            k0_input.extend_from_slice(&t.to_le_bytes());
        }
        assert_eq!(
            golden_chain().keys(&[0, 1, 2, 3])[0],
            BlockKey(xxh3_128(&k0_input).to_le_bytes())
        );
    }

    #[test]
    fn next_matches_one_shot_hash_across_buffer_chunks() {
        // Lengths around the 256-token stack-buffer boundary.
        let chain = golden_chain();
        let prev = BlockKey([7; 16]);
        for n in [0usize, 1, 255, 256, 257, 512, 1000] {
            let block: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
            let mut input = prev.0.to_vec();
            for t in &block {
                input.extend_from_slice(&t.to_le_bytes());
            }
            assert_eq!(
                chain.next(&prev, &block),
                BlockKey(xxh3_128(&input).to_le_bytes()),
                "n = {n}"
            );
        }
    }

    #[test]
    fn hex_round_trip_and_rejects_garbage() {
        let k = BlockKey(*b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\xaa\xbb\xcc\xdd\xee\xff");
        let hex = k.to_hex();
        assert_eq!(hex, "00010203040506070809aabbccddeeff");
        assert_eq!(format!("{k}"), hex);
        assert_eq!(format!("{k:?}"), hex);
        assert_eq!(k.as_bytes(), &k.0);
        assert_eq!(BlockKey::from_hex(&hex), Some(k));
        assert_eq!(BlockKey::from_hex(&hex.to_uppercase()), Some(k));
        assert_eq!(BlockKey::from_hex(&hex[..31]), None);
        assert_eq!(BlockKey::from_hex(&format!("{hex}0")), None);
        assert_eq!(BlockKey::from_hex(""), None);
        assert_eq!(BlockKey::from_hex(&hex.replace('a', "g")), None);
        // 32 bytes but multi-byte UTF-8: must not panic or parse.
        assert_eq!(BlockKey::from_hex("ééééééééééééééé00"), None);
        let fp = ModelFingerprint::of_bytes(b"x");
        assert_eq!(ModelFingerprint::from_hex(&fp.to_hex()), Some(fp));
        assert_eq!(fp.to_string(), fp.to_hex());
    }

    #[test]
    fn keys_change_with_every_input() {
        let fp = ModelFingerprint::of_bytes(b"kvtier-golden-model");
        let l = golden_layout();
        let tokens: Vec<u32> = (100..112).collect();
        let base = KeyChain::new(&fp, &l, b"tenant-a");
        let base_keys = base.keys(&tokens);
        assert_eq!(base_keys.len(), 3);

        let mut variants = vec![
            KeyChain::new(&ModelFingerprint::of_bytes(b"other-model"), &l, b"tenant-a"),
            KeyChain::new(&fp, &KvLayout { layers: 3, ..l }, b"tenant-a"),
            KeyChain::new(&fp, &KvLayout { kv_heads: 1, ..l }, b"tenant-a"),
            KeyChain::new(&fp, &KvLayout { head_dim: 16, ..l }, b"tenant-a"),
            KeyChain::new(&fp, &l, b"tenant-b"),
            KeyChain::new(&fp, &l, b""),
        ];
        for dtype in [KvDtype::F16, KvDtype::Bf16, KvDtype::F8E4m3] {
            variants.push(KeyChain::new(&fp, &KvLayout { dtype, ..l }, b"tenant-a"));
        }
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(v.seed(), base.seed(), "variant {i}");
            let keys = v.keys(&tokens);
            for (a, b) in keys.iter().zip(&base_keys) {
                assert_ne!(a, b, "variant {i}");
            }
        }
        // block_tokens changes the seed and the block boundaries.
        let bt2 = KeyChain::new(
            &fp,
            &KvLayout {
                block_tokens: 2,
                ..l
            },
            b"tenant-a",
        );
        assert_ne!(bt2.seed(), base.seed());
        assert_eq!(bt2.block_tokens(), 2);
        assert_eq!(bt2.keys(&tokens).len(), 6);

        // A single token change changes its block's key and every later key,
        // but not earlier ones.
        for pos in 0..tokens.len() {
            let mut t = tokens.clone();
            t[pos] ^= 1;
            let keys = base.keys(&t);
            let block = pos / 4;
            assert_eq!(keys[..block], base_keys[..block]);
            for i in block..3 {
                assert_ne!(keys[i], base_keys[i], "token {pos}, key {i}");
            }
        }
    }

    #[test]
    fn salt_and_fingerprint_boundaries_are_unambiguous() {
        // Length prefixes keep ("ab", "c") and ("a", "bc")-style splits apart:
        // moving a byte between salt and nothing else must change the seed.
        let fp = ModelFingerprint([0; 16]);
        let l = golden_layout();
        let a = KeyChain::new(&fp, &l, b"\x00");
        let b = KeyChain::new(&fp, &l, b"");
        assert_ne!(a.seed(), b.seed());
    }

    #[test]
    fn prefixes_and_partial_blocks() {
        let chain = golden_chain();
        let tokens: Vec<u32> = (0..23).collect();
        let all = chain.keys(&tokens);
        assert_eq!(all.len(), 5); // 23 / 4, the last 3 tokens get no key
        for n in 0..=tokens.len() {
            let keys = chain.keys(&tokens[..n]);
            assert_eq!(keys.len(), n / 4);
            assert_eq!(keys[..], all[..n / 4]);
        }
        assert!(chain.keys(&[1, 2, 3]).is_empty());
        assert!(chain.keys(&[]).is_empty());
    }

    #[test]
    fn zero_block_tokens_yields_no_keys() {
        let l = KvLayout {
            block_tokens: 0,
            ..golden_layout()
        };
        let chain = KeyChain::new(&ModelFingerprint([1; 16]), &l, b"");
        assert_eq!(chain.block_tokens(), 0);
        assert!(chain.keys(&[1, 2, 3, 4]).is_empty());
    }

    proptest! {
        #[test]
        fn prop_chaining_extends_prefixes(
            bt in 1u32..9,
            nblocks in 0usize..6,
            a_seed in proptest::collection::vec(any::<u32>(), 0..64),
            b in proptest::collection::vec(any::<u32>(), 0..64),
        ) {
            let l = KvLayout { block_tokens: bt, ..golden_layout() };
            let chain = KeyChain::new(&ModelFingerprint([3; 16]), &l, b"t");
            let bt = bt as usize;
            // a: a whole number of blocks.
            let mut a: Vec<u32> = a_seed.iter().copied().cycle().take(nblocks * bt).collect();
            a.resize(nblocks * bt, 0);
            let ka = chain.keys(&a);
            prop_assert_eq!(ka.len(), nblocks);
            let mut ab = a.clone();
            ab.extend_from_slice(&b);
            let kab = chain.keys(&ab);
            prop_assert_eq!(kab.len(), ab.len() / bt);
            prop_assert_eq!(&kab[..a.len() / bt], &ka[..]);

            // key_i = next(key_{i-1}, block i), with the seed before block 0.
            let mut prev = chain.seed();
            for (i, block) in ab.chunks_exact(bt).enumerate() {
                let k = chain.next(&prev, block);
                prop_assert_eq!(k, kab[i]);
                prev = k;
            }
        }

        #[test]
        fn prop_hex_round_trip(bytes in any::<[u8; 16]>()) {
            let k = BlockKey(bytes);
            prop_assert_eq!(BlockKey::from_hex(&k.to_hex()), Some(k));
        }

        #[test]
        fn prop_from_hex_never_panics(s in ".{0,40}") {
            if let Some(k) = BlockKey::from_hex(&s) {
                prop_assert_eq!(k.to_hex(), s.to_ascii_lowercase());
            }
        }
    }
}
