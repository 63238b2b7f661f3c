"""Helpers the test files share (pytest puts this folder on sys.path first): whether a GPU is here, and a
runner for the engines' command lines."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.abspath(__file__))


def gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPUS = gpu_count()
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs CuPy and an NVIDIA GPU")


def run_engine(script, *args, env=None, timeout=900):
    """The command line of script (nanoeuler.py, nanoeuler_cuda.py, ...) with args, in the project folder,
    output captured as text."""
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
