"""Benchmarks of the ``kvtier`` package, run as ``python -m kvtier.bench``:

* ``load DIR``: cold load of a sharded safetensors model by kvtier,
  ``safetensors``, Run:ai Model Streamer and fastsafetensors, interleaved in
  one run, with the device's read limit measured between them
  (:mod:`kvtier.bench.load`);
* ``restore``: G3 restore GB/s through the Python store API beside the Rust
  ``kvtier store bench`` on a block set of the same shape
  (:mod:`kvtier.bench.restore`);
* ``gpu-restore``: KV restore into accelerator memory, kvtier's store
  (staged through pinned memory) beside vLLM ExampleConnector's way (a
  safetensors file per layer), every restored block checked
  (:mod:`kvtier.bench.gpu_restore`).

Each prints a table, or JSON with ``--json``. The contenders are installed
with pip by the bench itself when missing, never by the tests.
"""
