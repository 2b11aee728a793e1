//! The KV store binding: `Store`, `Namespace`, `Layout`, `Transfer` and
//! `BlockResult` of `kvtier._kvtier`, over `kvtier-store`'s interface for
//! outside engines (region layouts, caller-owned memory, transfers, raw
//! keys, namespaces sharing one G2 budget).
//!
//! Python hands memory as `(payload offset, address, length)` pieces that
//! `kvtier/store.py` takes from numpy arrays and torch CPU tensors (the
//! abi3 wheel's limited API has no buffer protocol before 3.11), and gives
//! the arrays to the `Transfer`, which holds them until the store is done
//! with the memory: its Rust transfer is dropped (cancelled and waited
//! for) before the arrays are released.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvtier_io::HostAllocator;
use kvtier_store::eviction::EvictionKind;
use kvtier_store::{
    Arrangement, BlockRegions, BlockResult as StoreResult, DiskConfig, DiskError, DiskTier,
    KeyChain, KvCodec, KvDtype, KvLayout, ModelFingerprint, Part, RemoteConfig, SharedMemory,
    StoreConfig, Tier, TieredStore, TpShard,
};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::py_error::{ErrorInfo, Kind};

/// The shape of one KV block (see `kvtier-store`'s `KvLayout`).
#[pyclass(frozen, eq, module = "kvtier._kvtier")]
#[derive(Clone, PartialEq)]
pub struct Layout {
    pub(crate) inner: KvLayout,
}

fn bad(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

#[pymethods]
impl Layout {
    /// A layout: `layers` x `kv_heads` x `head_dim` x `block_tokens`
    /// elements of `dtype` per part, arranged as `arrangement`
    /// (`kv-major`, `layer-major`, `layer-fused`, `latent`), for rank
    /// `tp_rank` of `tp_world`, stored by `codec` (`none`, `bf16`,
    /// `fp8-e4m3`, `int8`: loads decode into, saves code from the caller's
    /// memory).
    #[new]
    #[pyo3(signature = (layers, kv_heads, head_dim, block_tokens, dtype = "f32", arrangement = "kv-major", tp_rank = 0, tp_world = 1, codec = "none"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_tokens: u32,
        dtype: &str,
        arrangement: &str,
        tp_rank: u16,
        tp_world: u16,
        codec: &str,
    ) -> PyResult<Self> {
        let codec = KvCodec::from_name(codec).ok_or_else(|| {
            bad(format!(
                "unknown codec {codec:?} (none, bf16, fp8-e4m3, int8)"
            ))
        })?;
        let dtype = KvDtype::from_name(dtype)
            .ok_or_else(|| bad(format!("unknown dtype {dtype:?} (f32, f16, bf16, f8e4m3)")))?;
        let arrangement = Arrangement::from_name(arrangement).ok_or_else(|| {
            bad(format!(
                "unknown arrangement {arrangement:?} (kv-major, layer-major, layer-fused, latent)"
            ))
        })?;
        let shard = match (tp_rank, tp_world) {
            (0, 0 | 1) => None,
            (rank, world) => Some(TpShard { rank, world }),
        };
        let inner = KvLayout {
            layers,
            kv_heads,
            head_dim,
            block_tokens,
            dtype,
            codec,
            arrangement,
            shard,
        };
        inner.validate().map_err(|e| bad(e.to_string()))?;
        Ok(Self { inner })
    }

    /// vLLM's CPU attention backend: per layer `[num_blocks, num_kv_heads,
    /// block_size, 2 * head_size]`, one page per block and layer.
    #[staticmethod]
    #[pyo3(signature = (layers, kv_heads, head_dim, block_tokens = 128, dtype = "f32", tp_rank = 0, tp_world = 1, codec = "none"))]
    #[allow(clippy::too_many_arguments)]
    fn vllm_cpu(
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        block_tokens: u32,
        dtype: &str,
        tp_rank: u16,
        tp_world: u16,
        codec: &str,
    ) -> PyResult<Self> {
        Self::new(
            layers,
            kv_heads,
            head_dim,
            block_tokens,
            dtype,
            "layer-fused",
            tp_rank,
            tp_world,
            codec,
        )
    }

    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn block_tokens(&self) -> u32 {
        self.inner.block_tokens
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    /// How the lower tiers store the payload (`none`, `bf16`, `fp8-e4m3`,
    /// `int8`).
    #[getter]
    fn codec(&self) -> &'static str {
        self.inner.codec.name()
    }
    #[getter]
    fn arrangement(&self) -> &'static str {
        self.inner.arrangement.name()
    }
    #[getter]
    fn tp_rank(&self) -> u16 {
        self.inner.shard.map_or(0, |s| s.rank)
    }
    #[getter]
    fn tp_world(&self) -> u16 {
        self.inner.shard.map_or(1, |s| s.world)
    }
    /// Bytes of one block's payload (as the caller's memory holds it).
    #[getter]
    fn payload_bytes(&self) -> u64 {
        self.inner.payload_bytes()
    }
    /// Bytes of one block's payload as the store keeps it (coded).
    #[getter]
    fn stored_payload_bytes(&self) -> u64 {
        self.inner.stored_payload_bytes()
    }
    /// Bytes of one region (one layer's K or V, or its latent).
    #[getter]
    fn region_bytes(&self) -> u64 {
        self.inner.region_bytes()
    }
    /// Bytes of one layer of one block.
    #[getter]
    fn layer_bytes(&self) -> u64 {
        self.inner.layer_bytes()
    }
    /// Bytes one block occupies on disk.
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.inner.encoded_bytes()
    }

    /// `(start, end)` of layer `layer` in the payload, where a layer is
    /// contiguous (not `kv-major`).
    fn layer_range(&self, layer: u32) -> Option<(u64, u64)> {
        self.inner.layer_range(layer).map(|r| (r.start, r.end))
    }

    /// `(start, end)` of layer `layer`'s `part` (`"k"` or `"v"`), where K
    /// and V are apart (`kv-major`, `layer-major`).
    fn part_range(&self, layer: u32, part: &str) -> PyResult<Option<(u64, u64)>> {
        let part = match part {
            "k" | "K" => Part::K,
            "v" | "V" => Part::V,
            _ => return Err(bad(format!("part must be 'k' or 'v', not {part:?}"))),
        };
        Ok(self.inner.part_range(layer, part).map(|r| (r.start, r.end)))
    }

    /// The payload ranges of one block's regions in payload order: per
    /// layer for `layer-fused`, `latent` and `layer-major`; per layer and
    /// part (all K, then all V) for `kv-major`.
    fn regions(&self) -> Vec<(u64, u64)> {
        self.inner
            .regions()
            .into_iter()
            .map(|r| (r.start, r.end))
            .collect()
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "Layout(layers={}, kv_heads={}, head_dim={}, block_tokens={}, dtype={:?}, arrangement={:?}, tp_rank={}, tp_world={}, codec={:?})",
            l.layers,
            l.kv_heads,
            l.head_dim,
            l.block_tokens,
            l.dtype.name(),
            l.arrangement.name(),
            self.tp_rank(),
            self.tp_world(),
            l.codec.name()
        )
    }
}

/// What a load or save did with one block (kvtier-store's `BlockResult`,
/// its typed reason as `cause`).
#[pyclass(frozen, module = "kvtier._kvtier")]
pub struct BlockResult {
    /// `hit`, `miss`, `corrupt`, `error`, `stored`, `present` or `cancelled`.
    #[pyo3(get)]
    status: &'static str,
    /// For a hit, where the block was found: `g2`, `g3` or `g4` (only for
    /// a hit, so `tier == "g3"` means "restored from G3"; which tier
    /// refused a corrupt block is in its `reason`).
    #[pyo3(get)]
    tier: Option<&'static str>,
    /// For `corrupt` and `error`, why (a message).
    #[pyo3(get)]
    reason: Option<String>,
    /// For `corrupt`, what the block's check found (`payload_checksum`,
    /// `header_checksum`, `key_mismatch`, `wrong_rows`, ...); for `error`,
    /// what failed (`disk`, `pool` or `block`).
    #[pyo3(get)]
    cause: Option<&'static str>,
}

impl From<StoreResult> for BlockResult {
    fn from(r: StoreResult) -> Self {
        let status = r.name();
        let (tier, reason, cause) = match r {
            StoreResult::Hit(t) => (Some(t.name()), None, None),
            StoreResult::Corrupt(why) => (None, Some(why.to_string()), Some(why.reason.code())),
            StoreResult::Error(why) => (None, Some(why.to_string()), Some(why.cause())),
            _ => (None, None, None),
        };
        Self {
            status,
            tier,
            reason,
            cause,
        }
    }
}

#[pymethods]
impl BlockResult {
    /// True for `hit`, `stored` and `present`: the block is where it was
    /// asked to be.
    #[getter]
    fn ok(&self) -> bool {
        matches!(self.status, "hit" | "stored" | "present")
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        match other.extract::<String>() {
            Ok(s) => s == self.status,
            Err(_) => other.cast::<BlockResult>().is_ok_and(|o| {
                let o = o.get();
                o.status == self.status && o.tier == self.tier && o.reason == self.reason
            }),
        }
    }

    fn __repr__(&self) -> String {
        match (&self.tier, &self.reason) {
            (Some(t), _) => format!("BlockResult({:?}, tier={t:?})", self.status),
            (_, Some(r)) => format!("BlockResult({:?}, reason={r:?})", self.status),
            _ => format!("BlockResult({:?})", self.status),
        }
    }
}

/// A load or save in progress; holds the arrays it reads or writes until
/// the store is done with them.
#[pyclass(module = "kvtier._kvtier")]
pub struct Transfer {
    /// Dropped first (cancel and wait), then `keep`.
    inner: Option<kvtier_store::Transfer>,
    keep: Option<Py<PyAny>>,
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // The Rust transfer waits for its last copy; only then may the
        // arrays go.
        self.inner.take();
        self.keep.take();
    }
}

#[pymethods]
impl Transfer {
    /// True once every block has its result (`wait` will not block).
    fn done(&self) -> bool {
        self.inner.as_ref().is_none_or(|t| t.is_done())
    }

    /// Blocks with a result so far.
    fn finished(&self) -> usize {
        self.inner.as_ref().map_or(0, |t| t.finished_blocks())
    }

    fn __len__(&self) -> usize {
        self.inner.as_ref().map_or(0, |t| t.len())
    }

    /// Waits (without the GIL) until every block has its result, at most
    /// `timeout` seconds; returns one `BlockResult` per key, or `None` on
    /// timeout. Can be called again.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Vec<BlockResult>>> {
        let Some(t) = &self.inner else {
            return Ok(Some(Vec::new()));
        };
        let limit = seconds(timeout)?;
        let results = py.detach(|| match limit {
            Some(l) => t.wait_timeout(l),
            None => Some(t.wait()),
        });
        Ok(results.map(|r| r.into_iter().map(BlockResult::from).collect()))
    }

    /// Waits (without the GIL) until layer `layer` of every block is in
    /// memory or will not come (its result is then not a hit), at most
    /// `timeout` seconds; True once so, False on timeout. A layer-wise load
    /// (`layerwise=True`) has a layer in as soon as it landed in every
    /// block, while later layers are still read; any other transfer once it
    /// is done. A block whose result is not `hit` may have been written by
    /// a layer-wise load: keep nothing computed from it.
    #[pyo3(signature = (layer, timeout = None))]
    fn wait_layer(&self, py: Python<'_>, layer: u32, timeout: Option<f64>) -> PyResult<bool> {
        let Some(t) = &self.inner else {
            return Ok(true);
        };
        let limit = seconds(timeout)?;
        Ok(py.detach(|| t.wait_layer(layer, limit)))
    }

    /// Asks the transfer to stop: blocks not yet copied report
    /// `cancelled` and their memory is left alone.
    fn cancel(&self) {
        if let Some(t) = &self.inner {
            t.cancel();
        }
    }
}

/// A timeout in seconds as a duration (`None`: no limit); refused unless
/// a finite number >= 0.
fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        Some(s) if !(s.is_finite() && s >= 0.0) => Err(bad(format!(
            "timeout must be a number of seconds >= 0, not {s}"
        ))),
        Some(s) => Ok(Some(Duration::from_secs_f64(s.min(1e9)))),
        None => Ok(None),
    }
}

fn store_error(e: impl std::fmt::Display) -> PyErr {
    Python::attach(|py| ErrorInfo::new(Kind::Store, e.to_string()).into_py_err(py))
}

/// One of `TieredStore::load`, `load_layers` and `save`, as
/// `Namespace::start` runs it.
type StartFn = fn(
    &TieredStore,
    Vec<kvtier_store::BlockKey>,
    Vec<BlockRegions>,
    Option<Box<dyn FnOnce() + Send>>,
) -> Result<kvtier_store::Transfer, kvtier_store::StoreError>;

/// One model's (or layout's, or rank's) part of a store.
#[pyclass(frozen, module = "kvtier._kvtier")]
pub struct Namespace {
    name: String,
    pub(crate) layout: KvLayout,
    pub(crate) chain: KeyChain,
    pub(crate) store: TieredStore,
}

impl Namespace {
    fn store_keys(&self, hashes: &[Bound<'_, PyBytes>]) -> Vec<kvtier_store::BlockKey> {
        hashes
            .iter()
            .map(|h| self.chain.raw_key(h.as_bytes()))
            .collect()
    }

    fn start(
        &self,
        keys: Vec<kvtier_store::BlockKey>,
        pieces: Vec<Vec<(u64, usize, usize)>>,
        keep: Py<PyAny>,
        run: StartFn,
    ) -> PyResult<Transfer> {
        let mut regions = Vec::with_capacity(pieces.len());
        for block in &pieces {
            let raw: Vec<(u64, *mut u8, usize)> = block
                .iter()
                .map(|&(off, addr, len)| (off, addr as *mut u8, len))
                .collect();
            // SAFETY: `kvtier/store.py` took the addresses from arrays it
            // checked (contiguous, on the CPU, big enough, writable for a
            // load), and `keep` holds those arrays until the transfer is
            // dropped, after it finished (see `Transfer`'s drop).
            regions
                .push(unsafe { BlockRegions::from_raw(&self.layout, &raw) }.map_err(store_error)?);
        }
        let t = run(&self.store, keys, regions, None).map_err(store_error)?;
        Ok(Transfer {
            inner: Some(t),
            keep: Some(keep),
        })
    }
}

#[pymethods]
impl Namespace {
    /// Its name (its G3 directory under the store's cache directory).
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Its block layout.
    #[getter]
    fn layout(&self) -> Layout {
        Layout { inner: self.layout }
    }

    /// The store keys (16 bytes each) of an engine's block hashes in this
    /// namespace (docs/keys.md: raw keys).
    fn keys<'py>(
        &self,
        py: Python<'py>,
        hashes: Vec<Bound<'py, PyBytes>>,
    ) -> Vec<Bound<'py, PyBytes>> {
        self.store_keys(&hashes)
            .iter()
            .map(|k| PyBytes::new(py, k.as_bytes()))
            .collect()
    }

    /// The store keys of token ids, `block_tokens` per block, chained
    /// (docs/keys.md: token keys); a trailing partial block has none.
    /// `salt` is a request's own salt (docs/keys.md: request salts).
    #[pyo3(signature = (tokens, salt = b"".as_slice()))]
    fn token_keys<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<u32>,
        salt: &[u8],
    ) -> Vec<Bound<'py, PyBytes>> {
        self.chain
            .salted(salt)
            .keys(&tokens)
            .iter()
            .map(|k| PyBytes::new(py, k.as_bytes()))
            .collect()
    }

    /// How many leading blocks of `hashes` the store holds (any tier).
    fn lookup(&self, py: Python<'_>, hashes: Vec<Bound<'_, PyBytes>>) -> usize {
        let keys = self.store_keys(&hashes);
        py.detach(|| self.store.lookup_prefix(&keys).hits())
    }

    /// Starts loading blocks into memory named by `pieces`, per block a
    /// list of `(payload offset, address, length)`; `keep` holds the
    /// memory's owners; `layerwise`: each layer as it lands
    /// (`Transfer.wait_layer`). Use `kvtier.Namespace.load`.
    #[pyo3(signature = (hashes, pieces, keep, layerwise = false))]
    fn _load(
        &self,
        hashes: Vec<Bound<'_, PyBytes>>,
        pieces: Vec<Vec<(u64, usize, usize)>>,
        keep: Py<PyAny>,
        layerwise: bool,
    ) -> PyResult<Transfer> {
        let run: StartFn = if layerwise {
            TieredStore::load_layers
        } else {
            TieredStore::load
        };
        self.start(self.store_keys(&hashes), pieces, keep, run)
    }

    /// Starts saving blocks from memory named by `pieces` (as `_load`).
    fn _save(
        &self,
        hashes: Vec<Bound<'_, PyBytes>>,
        pieces: Vec<Vec<(u64, usize, usize)>>,
        keep: Py<PyAny>,
    ) -> PyResult<Transfer> {
        self.start(self.store_keys(&hashes), pieces, keep, TieredStore::save)
    }

    /// Writes every block not yet on disk and syncs (without the GIL).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.flush()).map_err(store_error)
    }

    /// Empties this namespace's G2 into G3, so the next loads come from
    /// disk (for measurements).
    fn evict_memory(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.store.evict_memory()).map_err(store_error)
    }

    /// Where block `hash` lives on disk: `(segment file, byte offset of its
    /// slot)`, or `None` (for tools and fault-injection tests).
    fn locate(&self, hash: Bound<'_, PyBytes>) -> Option<(String, u64)> {
        let key = self.chain.raw_key(hash.as_bytes());
        let (path, off) = self.store.disk()?.locate_key(&key)?;
        Some((path.display().to_string(), off))
    }

    /// Waits (without the GIL) until the warming of read buffers asked for
    /// at open has ended, at most `timeout` seconds; true once it has (at
    /// once when none was asked for), false on timeout.
    #[pyo3(signature = (timeout = None))]
    fn wait_warm(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let limit = seconds(timeout)?;
        let progress = py.detach(|| self.store.wait_read_buffers_warm(limit));
        Ok(progress.is_none_or(|p| p.done))
    }

    /// This namespace's metrics in Prometheus text.
    fn metrics_text(&self) -> String {
        self.store.metrics().render()
    }

    /// This namespace's counters: hits per tier, misses, corrupt blocks,
    /// blocks held in G3, read buffers warmed (of how many asked for), and
    /// block buffers its allocator served with fresh memory.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.store.metrics();
        let d = PyDict::new(py);
        for (tier, t) in [(Tier::G2, &m.g2), (Tier::G3, &m.g3), (Tier::G4, &m.g4)] {
            d.set_item(format!("{}_hits", tier.name()), t.hits.get())?;
            d.set_item(format!("{}_misses", tier.name()), t.misses.get())?;
            d.set_item(
                format!("{}_corrupt_blocks", tier.name()),
                t.corrupt_blocks.get(),
            )?;
        }
        let warm = self.store.read_buffers_warm().unwrap_or_default();
        d.set_item("read_buffers_warmed", warm.warmed)?;
        d.set_item("read_buffers_warm_target", warm.target)?;
        d.set_item("fresh_buffers", self.store.fresh_buffers().unwrap_or(0))?;
        let s = self.store.stats();
        d.set_item("g3_blocks", s.g3_blocks)?;
        d.set_item("writeback_pending", s.writeback_pending)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!("Namespace({:?}, {})", self.name, self.layout)
    }
}

/// Refuses a namespace name that is not a plain directory name.
fn check_name(name: &str) -> PyResult<()> {
    if name.is_empty()
        || name.starts_with('.')
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(bad(format!(
            "namespace name {name:?}: use letters, digits, '-', '_' and '.', not first"
        )));
    }
    Ok(())
}

/// A tiered KV store: G2 host memory shared by every namespace, a G3 per
/// namespace under `cache_dir`, and an optional G4 pool (`remote`:
/// `redis://`, `rediss://`, `redis+cluster://` or `s3://` URL).
#[pyclass(frozen, module = "kvtier._kvtier")]
pub struct Store {
    cache_dir: PathBuf,
    g3_bytes: u64,
    g3_sync: Option<std::time::Duration>,
    remote: Option<String>,
    shared: SharedMemory,
    /// Block buffers of every namespace, made with the first: the read
    /// buffers one namespace warms serve the others' reads too.
    alloc: Mutex<Option<Arc<dyn HostAllocator>>>,
    namespaces: Mutex<HashMap<String, Py<Namespace>>>,
}

#[pymethods]
impl Store {
    /// Opens a store over `cache_dir` (created if missing): `g2_bytes` of
    /// host memory for every namespace together, `g3_bytes` of disk per
    /// namespace, and the G4 pool at `remote` if given; blocks only in
    /// host memory reach disk within about `g3_sync_ms` (0: off). `eviction`
    /// is the eviction policy of host memory and disk (`kvtier`, `lru`,
    /// `fifo`, `s3fifo`, `clock`).
    #[new]
    #[pyo3(signature = (cache_dir, g2_bytes = 1 << 30, g3_bytes = 8 << 30, remote = None, g3_sync_ms = 1000, eviction = "kvtier"))]
    fn new(
        cache_dir: PathBuf,
        g2_bytes: u64,
        g3_bytes: u64,
        remote: Option<String>,
        g3_sync_ms: u64,
        eviction: &str,
    ) -> PyResult<Self> {
        let eviction: EvictionKind = eviction.parse().map_err(bad)?;
        if let Some(url) = &remote {
            // Checked now, so a bad URL fails here, not at the first namespace.
            kvtier_store::remote::parse_target(url).map_err(store_error)?;
        }
        std::fs::create_dir_all(&cache_dir).map_err(|e| {
            Python::attach(|py| {
                ErrorInfo::new(
                    Kind::Os,
                    format!("cannot create {}: {e}", cache_dir.display()),
                )
                .path(&cache_dir)
                .into_py_err(py)
            })
        })?;
        Ok(Self {
            cache_dir,
            g3_bytes,
            g3_sync: (g3_sync_ms > 0).then(|| std::time::Duration::from_millis(g3_sync_ms)),
            remote,
            shared: SharedMemory::with_eviction(g2_bytes, eviction),
            alloc: Mutex::new(None),
            namespaces: Mutex::new(HashMap::new()),
        })
    }

    /// The namespace of one model and layout (opened once per store; the
    /// same object again after). `fingerprint` names the model (bytes or
    /// str, hashed: KV of another fingerprint never matches); `salt`
    /// separates tenants; `name` is its directory under `cache_dir`
    /// (default: derived from the fingerprint and layout);
    /// `warm_read_buffers`: fault in, on a background thread, the buffers
    /// its reads will take (as many as the G2 budget holds), so a restore
    /// does not fault fresh memory in (commits the G2 budget at open;
    /// `Namespace.wait_warm` waits for it).
    #[pyo3(signature = (layout, fingerprint, salt = b"".as_slice(), name = None, warm_read_buffers = false))]
    fn namespace(
        &self,
        py: Python<'_>,
        layout: &Layout,
        fingerprint: &Bound<'_, PyAny>,
        salt: &[u8],
        name: Option<String>,
        warm_read_buffers: bool,
    ) -> PyResult<Py<Namespace>> {
        let fp_bytes: Vec<u8> = match fingerprint.extract::<String>() {
            Ok(s) => s.into_bytes(),
            Err(_) => fingerprint
                .cast::<PyBytes>()
                .map(|b| b.as_bytes().to_vec())
                .map_err(|_| bad("fingerprint must be bytes or str"))?,
        };
        let fingerprint = ModelFingerprint::of_bytes(&fp_bytes);
        let layout = layout.inner;
        let chain = KeyChain::new(&fingerprint, &layout, salt);
        let name = match name {
            Some(n) => n,
            None => format!(
                "ns-{}",
                &KeyChain::new(&fingerprint, &layout, b"").seed().to_hex()[..16]
            ),
        };
        check_name(&name)?;
        let mut open = self.namespaces.lock();
        if let Some(ns) = open.get(&name) {
            let same = {
                let ns = ns.bind(py).get();
                ns.layout == layout && ns.chain.seed() == chain.seed()
            };
            if !same {
                return Err(bad(format!(
                    "namespace {name:?} is already open with another model, layout or salt"
                )));
            }
            return Ok(ns.clone_ref(py));
        }
        let mut config = StoreConfig::new(layout, fingerprint);
        config.shared_memory = Some(self.shared.clone());
        config.disk = Some(DiskConfig::new(
            vec![self.cache_dir.join(&name)],
            self.g3_bytes,
            layout,
        ));
        config.remote = self.remote.as_ref().map(RemoteConfig::new);
        config.g3_sync = self.g3_sync;
        config.warm_read_buffers = warm_read_buffers;
        // Opened with the GIL held: the namespace lock is held too, and a
        // thread waiting for that lock holds the GIL (releasing it here
        // could deadlock the two).
        let alloc = self
            .alloc
            .lock()
            .get_or_insert_with(|| TieredStore::recycling_allocator(&config))
            .clone();
        let store = TieredStore::open_shared(config, alloc).map_err(store_error)?;
        let ns = Py::new(
            py,
            Namespace {
                name: name.clone(),
                layout,
                chain,
                store,
            },
        )?;
        open.insert(name, ns.clone_ref(py));
        Ok(ns)
    }

    /// Removes the namespace `name`'s G3 directory under `cache_dir` (for
    /// good: an engine forgetting a generation of its cache); `True` once
    /// removed or when there is none, `False` while a store (this one, or
    /// one in another process) has it open. Only kvtier's own files go; a
    /// directory holding anything else stays, with that.
    fn remove_namespace(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        check_name(name)?;
        // One open in this store holds its lock too: refused like any other.
        let root = self.cache_dir.join(name);
        match py.detach(|| DiskTier::remove_dir(&root)) {
            Ok(_) => Ok(true),
            Err(DiskError::Locked { .. }) => Ok(false),
            Err(e) => Err(store_error(e)),
        }
    }

    /// The cache directory.
    #[getter]
    fn cache_dir(&self) -> String {
        self.cache_dir.display().to_string()
    }

    /// The store's figures: G2 bytes used and allowed (all namespaces) and
    /// each namespace's `stats()`.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let memory = self.shared.memory();
        d.set_item("g2_used_bytes", memory.used_bytes())?;
        d.set_item("g2_blocks", memory.len())?;
        let per = PyDict::new(py);
        for (name, ns) in self.namespaces.lock().iter() {
            per.set_item(name, ns.bind(py).get().stats(py)?)?;
        }
        d.set_item("namespaces", per)?;
        Ok(d)
    }

    /// Writes every namespace's blocks not yet on disk and syncs.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let open: Vec<Py<Namespace>> = self
            .namespaces
            .lock()
            .values()
            .map(|n| n.clone_ref(py))
            .collect();
        for ns in open {
            ns.bind(py).get().flush(py)?;
        }
        Ok(())
    }
}
