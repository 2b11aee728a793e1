"""Python imports ``sitecustomize`` at the start of every process; the
end-to-end check (test_server.py) puts this directory on ``PYTHONPATH`` of
the SGLang server it starts, and only there, so the server and the
processes it spawns run SGLang with sglang_cpu's patches (what each one is
for: sglang_cpu.py). The SGLang venv has no sitecustomize of its own that
this one would hide."""

import sglang_cpu

sglang_cpu.install()
