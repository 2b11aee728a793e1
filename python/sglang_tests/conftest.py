"""The SGLang checks import pools.py and worker.py from this directory,
make_model.py from python/testing (the server check's model) and
sglang_cpu.py from cpu_server (the server check's CPU stand-ins)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "testing"))
sys.path.insert(0, os.path.join(_HERE, "cpu_server"))
