"""Helpers the test files share (pytest puts this folder on sys.path first): whether a GPU is here, a runner
for the engines' command lines, and the check of their one-line errors."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent        # the project folder


def gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPUS = gpu_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs CuPy and an NVIDIA GPU")


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")    # a run inherits no rank: env gives one


def run_engine(script, *args, env=None, timeout=900, input=None):
    """The command line of script (nanoeuler.py, nanoeuler_cuda.py, ...) with args, in the project folder,
    output captured as text; input: its stdin."""
    base = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(base, PYTHONUNBUFFERED="1", **(env or {})), input=input)


def run_gpu(*args, env=None, timeout=900):
    return run_engine("nanoeuler_cuda.py", *args, env=env, timeout=timeout)


def one_error_line(r, *words):
    """Whether the finished command r failed with one line on stderr, "error: ...", holding every word."""
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    ok = r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ")
    return ok and all(str(w) in lines[0] for w in words)


def no_cupy(folder):
    """The environment of a run where `import cupy` fails (a stand-in module in folder)."""
    (folder / "cupy.py").write_text("raise ImportError('no CUDA here (test)')\n")
    return {"PYTHONPATH": str(folder)}
