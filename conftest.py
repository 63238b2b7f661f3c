"""Helpers the test files share (pytest puts this folder on sys.path first): the `gpu` marker, which skips a
test on a machine without enough GPUs, runners for the engines' command lines, the check of their one-line
errors, and the small corpus, run and model that several files use."""
import math
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import pipeline as pl


def ctrl_c_as_from_a_shell():
    """preexec_fn of a child that a test sends Ctrl-C: SIGINT at its default disposition and unblocked, as a
    shell starts a program in the foreground, whatever this worker process inherited. A shell without job
    control starts a background command (`make test &`) with SIGINT ignored (POSIX), Python then installs no
    KeyboardInterrupt handler, and its children inherit the ignored signal (fits two failed CI runs of
    2026-12-01); `bash -c 'python3 -m pytest test_serve.py -k ctrl_c & wait'` fails without this."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

ROOT = Path(__file__).resolve().parent        # the project folder


def gpu_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


GPUS = gpu_count()


def pytest_collection_modifyitems(config, items):
    """@pytest.mark.gpu needs CuPy and one GPU, @pytest.mark.gpu(2) two: skipped on a machine with fewer."""
    for item in items:
        marker = item.get_closest_marker("gpu")
        need = marker.args[0] if marker and marker.args else 1
        if marker and GPUS < need:
            item.add_marker(pytest.mark.skip(reason=f"needs CuPy and {need} NVIDIA GPU{'s' * (need > 1)}"))


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")    # a run inherits no rank: env gives one


def run_engine(script, *args, env=None, timeout=900, input=None):
    """The command line of script (nanoeuler.py, nanoeuler_cuda.py, ...) with args, in the project folder,
    output captured as text; input: its stdin."""
    base = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(base, PYTHONUNBUFFERED="1", **(env or {})), input=input)


def run_cli(*args, stdin=None, env_extra=None, timeout=600):
    return run_engine("nanoeuler.py", *args, env=env_extra, timeout=timeout, input=stdin)


def cli_here(*args, stdin=None, env_extra=None, plots=True):
    """run_cli's result from nanoeuler.py's main() in this process (run_here)."""
    return run_here("nanoeuler.py", *args, env=env_extra, input=stdin, plots=plots)


def run_here(script, *args, env=None, input=None, plots=True):
    """run_engine's result, from script's main(args) called in this process (no interpreter to start, no
    Numba to import: ~2 s a command saved): stdout and stderr captured, env set, stdin given, and the exit the
    interpreter would make of `sys.exit(main())`: the int returned, a SystemExit's code (a string printed on
    stderr, status 1), or an uncaught exception's traceback with status 1. The one `error:` line and its
    status end to end, through a real process, stay checked by the run_engine tests beside them. plots=False:
    as without matplotlib (report.md's loss plot costs a run 1.5-3 s; test_evaluate.py checks the plot)."""
    import contextlib
    import importlib
    import io
    import traceback
    main = importlib.import_module(script.removesuffix(".py")).main
    out, err = io.StringIO(), io.StringIO()
    env = {k: str(v) for k, v in (env or {}).items()}
    with pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")             # the warnings a fresh interpreter prints on stderr
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        for k in RANK_VARS:
            m.delenv(k, raising=False)
        for k, v in env.items():
            m.setenv(k, v)
        if "NANOEULER_CACHE" in env:                 # read once, at import, into pipeline.CACHE
            m.setattr(pl, "CACHE", env["NANOEULER_CACHE"])
        if not plots:
            m.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
        m.setattr(sys, "stdin", io.StringIO(input or ""))
        m.setattr(sys, "argv", [script, *map(str, args)])
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
        except Exception:                            # what the interpreter prints of an uncaught exception
            traceback.print_exc(file=err)
            code = 1
    for w in shown:
        err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    if isinstance(code, str):
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess([script, *args], code or 0, out.getvalue(), err.getvalue())


def run_gpu(*args, env=None, timeout=900):
    return run_engine("nanoeuler_cuda.py", *args, env=env, timeout=timeout)


def one_error_line(r, *words):
    """Whether the finished command r failed with one line on stderr, "error: ...", holding every word."""
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    ok = r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: ")
    return ok and all(str(w) in lines[0] for w in words)


def assert_one_line_error(r, *words):
    assert one_error_line(r, *words), r.stdout + r.stderr


def no_cupy(folder):
    """The environment of a run where `import cupy` fails (a stand-in module in folder)."""
    (folder / "cupy.py").write_text("raise ImportError('no CUDA here (test)')\n")
    return {"PYTHONPATH": str(folder)}


# ----------------------------------------------------------------------------------------------------
# a corpus, a one-step run and a model with known heads (the CPU engine's, the CLI's and the GPU's tests)

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small English text file and a private tokenizer cache (one a worker: its runs read it, or copy it)."""
    d = tmp_path_factory.mktemp("corpus")
    text, _ = pl.default_corpus()
    path = d / "corpus.txt"
    path.write_text(text[:150_000], encoding="utf-8")
    return path, {"NANOEULER_CACHE": str(d / "cache")}


def train_cpu(out, corpus, *extra):
    """A short run of nanoeuler.py train on the corpus fixture into out (batch 2 of 32 tokens), more flags in
    extra; in this process (cli_here), no loss plot."""
    path, env = corpus
    return cli_here("train", "--data", path, "--out", out, "--batch", 2, "--seq", 32, "--eval-every", 3,
                    "--sample-every", 0, "--ckpt-every", 1000, *extra, env_extra=env, plots=False)


@pytest.fixture(scope="session")
def one_step_ckpt(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("one_step")
    r = train_cpu(out, corpus, "--steps", 1)
    assert r.returncode == 0, r.stderr
    return out


def shift_model(shifts, sharpness):
    """A tiny model whose head k puts its mass on token (a + shifts[k]) % V after token a: the layers add
    nothing (wo = w2 = 0), so the last hidden state is the current token's normalised embedding, and head
    k's rows are the embeddings, permuted. sharpness scales the logits (large: nearly one-hot)."""
    cfg = pl.Config(dim=32, n_heads=4, n_kv_heads=2, n_layers=2, ctx=64, vocab=40, ffn=64, n_mtp=len(shifts))
    P = pl.Params.init(cfg, 5, np.float64)
    E = P["tok_emb"]
    E[:] = np.random.default_rng(5).standard_normal(E.shape)
    for i in range(cfg.n_layers):
        P[f"layers.{i}.wo"][:] = P[f"layers.{i}.w2"][:] = 0
    for k, shift in enumerate(shifts):
        P[f"heads.{k}"][:] = sharpness * np.roll(E, shift, axis=0) / math.sqrt(cfg.dim)
    return P
