#!/usr/bin/env python3
"""kvtier serve's /metrics through the official `prometheus_client` parsers.

Usage: test_metrics_parse.py BASE_URL

Fetches BASE_URL/metrics twice: with no Accept header (Prometheus text
0.0.4, parsed by prometheus_client.parser) and with
``Accept: application/openmetrics-text`` (parsed by the strict OpenMetrics
parser, which refuses a family declared twice). Checks that each store
metric is one family whose samples carry tier="g2"/"g3"/"g4", and that
counters round-trip with the same values in both formats. Prints "ok".
"""

import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus


def fetch(url, accept=None):
    req = urllib.request.Request(url)
    if accept:
        req.add_header("Accept", accept)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def families(parse, text):
    out = {}
    for f in parse(text):
        if f.name in out:
            raise AssertionError(f"family {f.name} declared twice")
        out[f.name] = f
    return out


def tiers(fam, sample):
    return sorted(s.labels.get("tier") for s in fam.samples if s.name == sample)


def main():
    base = sys.argv[1].rstrip("/")
    ctype, text = fetch(base + "/metrics")
    assert ctype.startswith("text/plain") and "0.0.4" in ctype, ctype
    assert "# EOF" not in text
    prom = families(parse_prometheus, text)
    ctype, om_text = fetch(base + "/metrics", "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text"), ctype
    om = families(parse_openmetrics, om_text)
    for name in ["kvtier_store_hits", "kvtier_store_misses", "kvtier_store_read_bytes"]:
        assert name in om, sorted(om)
        assert om[name].type == "counter", om[name].type
        assert tiers(om[name], name + "_total") == ["g2", "g3", "g4"], om[name].samples
        assert tiers(prom[name], name + "_total") == ["g2", "g3", "g4"], prom[name].samples
    assert om["kvtier_store_read_seconds"].type == "histogram"
    # Same values in both formats for every counter sample (but the count
    # of /metrics requests, which the first fetch raised).
    def counter_values(fams):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in fams.values()
            if f.type == "counter"
            for s in f.samples
            if s.name.endswith("_total") and s.labels.get("endpoint") != "/metrics"
        }
    a, b = counter_values(prom), counter_values(om)
    assert a and a == b, (set(a) ^ set(b))
    generated = [s.value for s in om["kvtier_server_generated_tokens"].samples]
    assert generated and generated[0] > 0, generated
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
