"""The SGLang checks import pools.py and worker.py from this directory."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
