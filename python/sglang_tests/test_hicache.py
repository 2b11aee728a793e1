"""kvtier as SGLang's HiCache storage backend, through SGLang's own
StorageBackendFactory ("dynamic") and real CPU host pools (pools.py).

Run by scripts/sglang-e2e in the cached SGLang venv (scripts/sglang-env)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from pools import (
    SPECS_RESTART,
    WRITE_PAGES,
    PoolSpec,
    fill,
    kvtier_extra,
    make_backend,
    make_pool,
    page_bytes,
    page_indices,
    page_keys,
)

HERE = Path(__file__).resolve().parent


def _worker(mode: str, cache_dir: Path, out: Path) -> dict:
    subprocess.run([sys.executable, str(HERE / "worker.py"), mode, str(cache_dir), str(out)], check=True, cwd=HERE)
    return json.loads(out.read_text())


def test_pages_survive_a_restart_bit_for_bit_and_a_corrupt_block_is_a_miss(tmp_path: Path) -> None:
    """One process writes pages of every pool (MHA and MLA; layer_first,
    page_first, page_first_direct) with batch_set_v1; a block of each is
    corrupted on disk; a new process, a new store on the same directory,
    reads them into other pages of fresh (zeroed) pools with batch_get_v1."""
    cache = tmp_path / "cache"
    wrote = _worker("write", cache, tmp_path / "w.json")
    bad = 3
    for spec in SPECS_RESTART:
        w = wrote[spec.name]
        assert w["set"] == [True] * len(WRITE_PAGES), spec
        assert w["set_again"] == [True] * len(WRITE_PAGES), spec
        assert all(where is not None for where in w["where"]), spec
        path, off = w["where"][bad]
        at = off + 128 + w["payload_bytes"] // 2 + 3
        with open(path, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x20]))
    names = [wrote[s.name]["namespace"] for s in SPECS_RESTART]
    assert len(set(names)) == len(names), "each pool layout has its own namespace"

    read = _worker("read", cache, tmp_path / "r.json")
    for spec in SPECS_RESTART:
        r = read[spec.name]
        assert r["namespace"] == wrote[spec.name]["namespace"]
        assert r["exists_all"] == len(WRITE_PAGES), spec
        assert r["exists_gap"] == 2, spec
        assert r["zero_before"], spec
        want = [i != bad for i in range(len(WRITE_PAGES))]
        assert r["get"] == want, spec
        assert r["same"] == want, spec  # every page read is the page written, bit for bit
        assert r["zero"] == [not w for w in want], spec  # the corrupt page's host page untouched
        assert r["stats"]["g3_corrupt_blocks"] == 1, spec
        assert r["stats"]["g3_hits"] == len(WRITE_PAGES) - 1, spec

    # The reader cleared the first pool's namespace: a process that opens it
    # next (this one) finds no page, and the old generation's directory gone.
    first = SPECS_RESTART[0]
    r = read[first.name]
    assert r["cleared_to"] != r["cleared_from"]
    assert (cache / r["cleared_from"]).is_dir()
    pool = make_pool(first)
    b = make_backend(first, pool, kvtier_extra(str(cache)))
    assert b.namespace.name == r["cleared_to"]
    assert not (cache / r["cleared_from"]).exists()
    assert b.batch_exists(page_keys(len(WRITE_PAGES), first.page_size, 0)) == 0


@pytest.fixture
def mha() -> tuple[PoolSpec, object]:
    spec = PoolSpec("mha", "layer_first")
    return spec, make_pool(spec)


def test_zero_copy_round_trip_from_memory_and_disk(tmp_path: Path, mha) -> None:
    spec, pool = mha
    fill(pool, 7)
    b = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    from kvtier.sglang import KvtierHiCacheStorage

    assert isinstance(b, KvtierHiCacheStorage)
    keys = page_keys(4, spec.page_size, 7)
    src = [2, 5, 6, 11]
    want = [page_bytes(pool, p) for p in src]
    assert b.batch_set_v1(keys, page_indices(src, spec.page_size)) == [True] * 4
    assert b.batch_exists(keys) == 4
    assert b.batch_exists(keys[:1] + page_keys(1, spec.page_size, 8) + keys[2:]) == 1
    assert b.exists(keys[3])
    assert not b.exists(page_keys(1, spec.page_size, 9)[0])

    pool.kv_buffer.zero_()
    assert b.batch_get_v1(keys, page_indices(src, spec.page_size)) == [True] * 4  # from G2
    assert [page_bytes(pool, p) for p in src] == want
    assert b.kvtier_stats()["g2_hits"] >= 4

    b.namespace.evict_memory()
    pool.kv_buffer.zero_()
    dst = [30, 1, 17, 9]
    assert b.batch_get_v1(keys, page_indices(dst, spec.page_size)) == [True] * 4  # from G3
    assert [page_bytes(pool, p) for p in dst] == want
    assert b.kvtier_stats()["g3_hits"] >= 4

    m = b.get_stats()
    assert sum(m.backup_pgs) == 4
    assert sum(m.prefetch_pgs) == 8
    assert all(bw > 0 for bw in m.prefetch_bandwidth)
    assert b.get_stats().prefetch_pgs == []  # since the last call


def test_generic_interface_and_its_own_namespace(tmp_path: Path, mha) -> None:
    spec, pool = mha
    fill(pool, 3)
    b = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    keys = page_keys(3, spec.page_size, 3)
    pages = [4, 8, 1]
    values = [pool.get_data_page(p * spec.page_size, flat=True) for p in pages]
    assert b.batch_set(keys, values)
    assert b.set(keys[0], values[0])
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = b.batch_get(keys, dummies)
    assert all(g is d for g, d in zip(got, dummies, strict=True))
    assert all(torch.equal(g.view(torch.int32), v.view(torch.int32)) for g, v in zip(got, values, strict=True))
    # What SGLang's generic path then does: the flat page back into the pool.
    pool.set_from_flat_data_page(20 * spec.page_size, got[1])
    assert page_bytes(pool, 20) == page_bytes(pool, 8)
    # A page stored through the zero-copy interface is not served as a flat page
    # (its byte order differs), and the other way round.
    other = page_keys(1, spec.page_size, 4)
    assert b.batch_set_v1(other, page_indices([2], spec.page_size)) == [True]
    assert b.get(other[0], pool.get_dummy_flat_data_page()) is None
    assert b.batch_get_v1(keys[:1], page_indices([3], spec.page_size)) == [False]
    assert b.exists(keys[0])
    assert b.exists(other[0])


def test_clear_forgets_every_page_across_a_reopen(tmp_path: Path, mha) -> None:
    spec, pool = mha
    fill(pool, 5)
    b = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    keys = page_keys(2, spec.page_size, 5)
    assert b.batch_set_v1(keys, page_indices([1, 2], spec.page_size)) == [True, True]
    old = b.namespace.name
    b.clear()
    assert b.namespace.name != old
    assert b.batch_exists(keys) == 0
    want = [page_bytes(pool, p) for p in (3, 4)]
    assert b.batch_get_v1(keys, page_indices([3, 4], spec.page_size)) == [False, False]
    assert [page_bytes(pool, p) for p in (3, 4)] == want  # not written
    again = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    assert again.namespace.name == b.namespace.name
    assert again.batch_exists(keys) == 0


def test_the_last_backend_to_close_lets_the_directory_go(tmp_path: Path, mha) -> None:
    spec, pool = mha
    fill(pool, 6)
    a = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    b = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    assert a.store is b.store  # one store per directory and process
    first = weakref.ref(a.store)
    keys = page_keys(2, spec.page_size, 6)
    assert a.batch_set_v1(keys, page_indices([1, 2], spec.page_size)) == [True, True]
    old = a.namespace.name
    a.clear()
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.batch_exists(keys)
    # b still holds the store, and the old generation with it.
    assert b.batch_exists(keys) == 2
    assert (tmp_path / old).is_dir()
    b.close()
    # Let go (the store is gone), so a new backend opens a new store, which
    # removes the old generation.
    gc.collect()
    assert first() is None
    c = make_backend(spec, pool, kvtier_extra(str(tmp_path)))
    assert not (tmp_path / old).exists()
    assert c.batch_exists(keys) == 0
    c.close()


def test_namespaces_by_model_and_layout(tmp_path: Path) -> None:
    a_spec, b_spec = PoolSpec("mha", "layer_first"), PoolSpec("mha", "page_first")
    a_pool, b_pool = make_pool(a_spec), make_pool(b_spec)
    fill(a_pool, 1)
    a = make_backend(a_spec, a_pool, kvtier_extra(str(tmp_path)))
    keys = page_keys(2, a_spec.page_size, 1)
    assert a.batch_set_v1(keys, page_indices([0, 1], a_spec.page_size)) == [True, True]
    b = make_backend(b_spec, b_pool, kvtier_extra(str(tmp_path)))
    assert b.batch_exists(keys) == 0  # same bytes per page, another page layout
    assert b.batch_get_v1(keys, page_indices([0, 1], b_spec.page_size)) == [False, False]
    assert not any(page_bytes(b_pool, 0))
    other_model = make_backend(a_spec, a_pool, kvtier_extra(str(tmp_path), fingerprint="another-model"))
    assert other_model.batch_exists(keys) == 0
    assert a.batch_exists(keys) == 2


def test_unknown_extra_config_key_is_refused(tmp_path: Path, mha) -> None:
    spec, pool = mha
    with pytest.raises(ValueError, match="cache_dri"):
        make_backend(spec, pool, kvtier_extra(str(tmp_path), cache_dri="x"))
