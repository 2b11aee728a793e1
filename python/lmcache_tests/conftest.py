"""The LMCache checks import servers.py from python/testing (waiting for a
server, dropping the page cache)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testing"))
