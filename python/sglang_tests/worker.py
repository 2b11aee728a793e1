"""One process of the restart check (test_hicache.py): ``write`` fills host
pools and stores their pages through kvtier's backend; ``read`` opens a new
store on the same cache directory and reads them back into fresh pools.

    python worker.py write|read CACHE_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys

from pools import (
    READ_PAGES,
    SPECS_RESTART,
    WRITE_PAGES,
    fill,
    kvtier_extra,
    make_backend,
    make_pool,
    page_bytes,
    page_indices,
    page_keys,
)


def main() -> None:
    mode, cache_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    report: dict[str, object] = {}
    for seed, spec in enumerate(SPECS_RESTART):
        pool = make_pool(spec)
        b = make_backend(spec, pool, kvtier_extra(cache_dir, g3_sync_ms=0))
        keys = page_keys(len(WRITE_PAGES), spec.page_size, seed)
        r: dict[str, object] = {"namespace": b.namespace.name}
        if mode == "write":
            fill(pool, seed)
            r["set"] = b.batch_set_v1(keys, page_indices(WRITE_PAGES, spec.page_size))
            r["set_again"] = b.batch_set_v1(keys, page_indices(WRITE_PAGES, spec.page_size))
            b.namespace.flush()
            r["where"] = [b.namespace.locate(bytes.fromhex(k)) for k in keys]
            r["payload_bytes"] = b.layout.stored_payload_bytes
            b.close()
        else:
            expected = make_pool(spec)
            fill(expected, seed)
            missing = page_keys(1, spec.page_size, 999)[0]
            r["exists_all"] = b.batch_exists(keys)
            r["exists_gap"] = b.batch_exists([*keys[:2], missing, *keys[3:]])
            r["zero_before"] = all(not any(page_bytes(pool, p)) for p in READ_PAGES)
            r["get"] = b.batch_get_v1(keys, page_indices(READ_PAGES, spec.page_size))
            r["same"] = [
                page_bytes(pool, rp) == page_bytes(expected, wp) for rp, wp in zip(READ_PAGES, WRITE_PAGES, strict=True)
            ]
            r["zero"] = [not any(page_bytes(pool, rp)) for rp in READ_PAGES]
            r["stats"] = b.kvtier_stats()
            if seed == 0:
                r["cleared_from"] = b.namespace.name
                b.clear()
                r["cleared_to"] = b.namespace.name
        report[spec.name] = r
        del b, pool
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
