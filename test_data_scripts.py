"""
test_data_scripts.py -- the corpus scripts data/get_gutenberg.sh, get_web.sh and get_alpaca.sh (and, for
the output path OUT, every data/get_*.sh), run on the local fixtures in data/fixtures (no network; a server on 127.0.0.1 for the download path).

Authority: the fixtures' known contents. Each script writes the documents it should, separated by
<|endoftext|>, leaves an existing output alone unless FORCE=1, and for each bad source ends with one error
line and nothing left behind; so does an OUT that cannot be written as a file.
"""
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest


_ROOT = next(p for p in Path(__file__).resolve().parents if (p / "data" / "get_web.sh").is_file())


_DATA = _ROOT / "data"


_FIX = _DATA / "fixtures"


_SEP = "\n<|endoftext|>\n"


_OFFLINE = "http://127.0.0.1:9/x"  # the discard port: connection refused at once


_ENV_KEYS = ("GUTENBERG_SOURCE", "GUTENBERG_IDS", "WEB_SOURCE", "ALPACA_SOURCE", "HELLASWAG_SOURCE",
             "PREFS_SOURCE", "OUT", "FORCE")


def _run_data_script(name, out, *args, wrap=(), **env):
    """Run data/<name> with OUT=out and the given environment overrides (under the command wrap, if any)."""
    e = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
    e.update(OUT=str(out), PYTHON=sys.executable, no_proxy="127.0.0.1", NO_PROXY="127.0.0.1")
    e.update({k: str(v) for k, v in env.items()})
    return subprocess.run([*wrap, "bash", str(_DATA / name), *map(str, args)], env=e,
                          capture_output=True, text=True, timeout=120)


def _assert_one_error_line(r, out):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert not out.exists()
    assert not list(out.parent.glob("*.tmp")), "temporary files left behind"


def _assert_idempotent(name, out, *args, **env):
    os.utime(out, ns=(10**18, 10**18))  # an mtime that any rewrite would change
    before = out.read_bytes()
    r = _run_data_script(name, out, *args, **env)
    assert r.returncode == 0, r.stderr
    assert "already exists" in r.stdout
    assert out.stat().st_mtime_ns == 10**18 and out.read_bytes() == before
    r = _run_data_script(name, out, *args, FORCE=1, **env)  # FORCE=1 rebuilds
    assert r.returncode == 0, r.stderr
    assert out.stat().st_mtime_ns != 10**18 and out.read_bytes() == before


@pytest.fixture
def _fixture_server():
    """A local HTTP server over data/fixtures; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(_FIX))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _docs(text):
    assert text.endswith(_SEP)
    docs = text.split(_SEP)[:-1]
    assert docs and all(d and d == d.strip() and "<|endoftext|>" not in d for d in docs)
    return docs


_GUT = dict(GUTENBERG_SOURCE=_FIX / "gutenberg", GUTENBERG_IDS="1 2 3")


# ----------------------------------------------------------------------------------------------------
# Project Gutenberg

def test_data_scripts_parse():
    for name in ("get_gutenberg.sh", "get_web.sh", "get_alpaca.sh", "get_hellaswag.sh", "get_prefs.sh", "fetch.sh"):
        r = subprocess.run(["bash", "-n", str(_DATA / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_data_gutenberg_fixture(tmp_path):
    out = tmp_path / "gutenberg.txt"
    r = _run_data_script("get_gutenberg.sh", out, **_GUT)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert [l.split()[0] for l in r.stdout.splitlines()[:3]] == ["[1/3]", "[2/3]", "[3/3]"]
    text = out.read_text(encoding="utf-8")
    for gone in ("*** START OF", "*** END OF", "Project Gutenberg", "PROJECT GUTENBERG", "Title:",
                 "This ebook is for", "Updated editions", "Produced by", "1342.txt", "\r", "\ufeff"):
        assert gone not in text, gone
    docs = _docs(text)  # also checks the literal <|endoftext|> inside book 3 was removed
    assert len(docs) == 3 and text.count("<|endoftext|>") == 3
    assert docs[0].startswith("CHAPTER I.\nDown the Rabbit-Hole\n")
    assert "Alice was beginning to get very tired" in docs[0] and docs[0].endswith("close by her.")
    assert docs[1].startswith("Chapter 1\n\nIt is a truth universally acknowledged")
    assert docs[1].endswith("of some one or other of their daughters.")
    assert docs[2].startswith("Letter 1") and docs[2].endswith("success\nof my undertaking.")


def test_data_gutenberg_idempotent(tmp_path):
    out = tmp_path / "gutenberg.txt"
    assert _run_data_script("get_gutenberg.sh", out, **_GUT).returncode == 0
    _assert_idempotent("get_gutenberg.sh", out, **_GUT)
    assert not list(tmp_path.glob("*.tmp"))


def test_data_gutenberg_skips_book_without_markers(tmp_path):
    out = tmp_path / "g.txt"
    r = _run_data_script("get_gutenberg.sh", out, GUTENBERG_SOURCE=_FIX / "gutenberg",
                         GUTENBERG_IDS="4 1")
    assert r.returncode == 0 and r.stderr.startswith("warning: book 4"), r.stderr
    assert len(_docs(out.read_text())) == 1
    # nothing left at all: an error, and no output
    r = _run_data_script("get_gutenberg.sh", tmp_path / "h.txt", GUTENBERG_SOURCE=_FIX / "gutenberg",
                         GUTENBERG_IDS="4")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error:")
    assert not (tmp_path / "h.txt").exists()


@pytest.mark.parametrize("env", [
    dict(GUTENBERG_SOURCE=_OFFLINE, GUTENBERG_IDS="1 2"),
    dict(GUTENBERG_SOURCE=_OFFLINE),                          # the built-in list
    dict(GUTENBERG_SOURCE=_FIX / "gutenberg", GUTENBERG_IDS="1 99"),  # no such book
    dict(GUTENBERG_SOURCE=_FIX / "gutenberg", GUTENBERG_IDS="1 x"),   # bad id
    dict(GUTENBERG_SOURCE=_FIX / "no-such-dir"),
])
def test_data_gutenberg_fails_cleanly(tmp_path, env):
    out = tmp_path / "gutenberg.txt"
    r = _run_data_script("get_gutenberg.sh", out, **env)
    _assert_one_error_line(r, out)
    if env["GUTENBERG_SOURCE"] == _OFFLINE:
        assert r.stderr.startswith(f"error: cannot download {_OFFLINE}/")


def test_data_gutenberg_over_http(tmp_path, _fixture_server):
    # URL layout BASE/ID/pgID.txt: only book 3 of the fixtures is laid out that way
    out = tmp_path / "g.txt"
    base = _fixture_server + "/gutenberg/"
    r = _run_data_script("get_gutenberg.sh", out, GUTENBERG_SOURCE=base, GUTENBERG_IDS="3")
    assert r.returncode == 0, r.stderr
    assert _docs(out.read_text())[0].startswith("Letter 1")
    r = _run_data_script("get_gutenberg.sh", tmp_path / "h.txt", GUTENBERG_SOURCE=base,
                         GUTENBERG_IDS="3 1")  # 404
    _assert_one_error_line(r, tmp_path / "h.txt")
    assert "HTTP error" in r.stderr


# ----------------------------------------------------------------------------------------------------
# web text (parquet, through DuckDB)

def _web_expected():
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.connect().execute("SELECT text FROM read_parquet(?)",
                                    [str(_FIX / "web.parquet")]).fetchall()
    return [d for d in ((t or "").replace("<|endoftext|>", "").strip() for (t,) in rows) if d]


def test_data_web_fixture(tmp_path):
    expected = _web_expected()
    out = tmp_path / "web.txt"
    r = _run_data_script("get_web.sh", out, WEB_SOURCE=_FIX / "web.parquet")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    text = out.read_text(encoding="utf-8")
    assert _docs(text) == expected and len(expected) == 12  # file order; NULL and blank rows dropped
    assert text.startswith("Photosynthesis is the process")
    assert "then add the numerators.  The result" in text  # literal <|endoftext|> removed
    _assert_idempotent("get_web.sh", out, WEB_SOURCE=_FIX / "web.parquet")


def test_data_web_size_limit(tmp_path):
    expected = _web_expected()
    out = tmp_path / "web.txt"
    r = _run_data_script("get_web.sh", out, "0.0005", WEB_SOURCE=_FIX / "web.parquet")  # 500 bytes
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    docs = _docs(data.decode())
    assert docs == expected[:len(docs)] and len(docs) < len(expected)
    last = len((docs[-1] + _SEP).encode())
    assert len(data) >= 500 > len(data) - last  # stops at the first document reaching the limit


def test_data_web_over_http(tmp_path, _fixture_server):
    # needs DuckDB's httpfs extension; the script would download it, which can hang on a
    # firewalled machine, so run only where it is already installed
    expected = _web_expected()
    import duckdb
    if not duckdb.connect().execute("SELECT installed FROM duckdb_extensions() "
                                    "WHERE extension_name = 'httpfs'").fetchone()[0]:
        pytest.skip("DuckDB httpfs extension not installed")
    out = tmp_path / "web.txt"
    r = _run_data_script("get_web.sh", out, WEB_SOURCE=_fixture_server + "/web.parquet")
    if r.returncode == 0:
        assert _docs(out.read_text()) == expected
    else:
        _assert_one_error_line(r, out)


@pytest.mark.parametrize("source,args", [(_OFFLINE + ".parquet", ()), (_FIX / "nothing.parquet", ()),
                                         (_FIX / "alpaca.json", ()), (_FIX / "web.parquet", ("0",))])
def test_data_web_fails_cleanly(tmp_path, source, args):
    # without duckdb installed the one line is the pip hint, so this runs either way
    out = tmp_path / "web.txt"
    r = _run_data_script("get_web.sh", out, *args, WEB_SOURCE=source)
    _assert_one_error_line(r, out)


def test_data_web_without_duckdb(tmp_path):
    fake = tmp_path / "fake"
    (fake / "duckdb").mkdir(parents=True)
    (fake / "duckdb" / "__init__.py").write_text("raise ImportError('No module named duckdb')\n")
    out = tmp_path / "web.txt"
    r = _run_data_script("get_web.sh", out, WEB_SOURCE=_FIX / "web.parquet", PYTHONPATH=fake)
    _assert_one_error_line(r, out)
    assert "pip install duckdb" in r.stderr


# ----------------------------------------------------------------------------------------------------
# Alpaca

def test_data_alpaca_fixture(tmp_path):
    out = tmp_path / "alpaca.json"
    r = _run_data_script("get_alpaca.sh", out, ALPACA_SOURCE=_FIX / "alpaca.json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "5 examples" in r.stdout
    assert out.read_bytes() == (_FIX / "alpaca.json").read_bytes()
    data = json.loads(out.read_text())
    assert len(data) == 5 and all(set(ex) >= {"instruction", "input", "output"} for ex in data)
    _assert_idempotent("get_alpaca.sh", out, ALPACA_SOURCE=_FIX / "alpaca.json")


@pytest.mark.parametrize("bad", [
    '[{"instruction": "a", "input": "", "output": "b"},',      # truncated
    '{"instruction": "a", "input": "", "output": "b"}',        # not a list
    "[]",                                                      # empty
    '[{"instruction": "a", "input": "", "output": "b"}, "x"]',  # entry not an object
    '[{"instruction": "a", "input": ""}]',                     # no output
    '[{"instruction": "a", "input": null, "output": "b"}]',    # input not a string
    "",                                                        # empty file
])
def test_data_alpaca_rejects_malformed(tmp_path, bad):
    src = tmp_path / "src" / "bad.json"
    src.parent.mkdir()
    src.write_text(bad)
    out = tmp_path / "alpaca.json"
    _assert_one_error_line(_run_data_script("get_alpaca.sh", out, ALPACA_SOURCE=src), out)


def test_data_alpaca_over_http(tmp_path, _fixture_server):
    out = tmp_path / "alpaca.json"
    r = _run_data_script("get_alpaca.sh", out, ALPACA_SOURCE=_fixture_server + "/alpaca.json")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == (_FIX / "alpaca.json").read_bytes()
    r = _run_data_script("get_alpaca.sh", tmp_path / "b.json", ALPACA_SOURCE=_fixture_server + "/no.json")
    _assert_one_error_line(r, tmp_path / "b.json")


@pytest.mark.parametrize("source", [_OFFLINE, _FIX / "nothing.json"])
def test_data_alpaca_fails_cleanly(tmp_path, source):
    out = tmp_path / "alpaca.json"
    r = _run_data_script("get_alpaca.sh", out, ALPACA_SOURCE=source)
    _assert_one_error_line(r, out)


# ----------------------------------------------------------------------------------------------------
# the output path OUT, for every script: a good source each, and a bad one that fails after the checks

_GOOD = {"get_alpaca.sh": dict(ALPACA_SOURCE=_FIX / "alpaca.json"),
         "get_hellaswag.sh": dict(HELLASWAG_SOURCE=_FIX / "hellaswag_val.jsonl"),
         "get_prefs.sh": dict(PREFS_SOURCE=_FIX / "hh-rlhf.jsonl.gz"),
         "get_web.sh": dict(WEB_SOURCE=_FIX / "web.parquet"),
         "get_gutenberg.sh": _GUT}
_BAD = {"get_alpaca.sh": dict(ALPACA_SOURCE=_FIX / "hellaswag_val.jsonl"),
        "get_hellaswag.sh": dict(HELLASWAG_SOURCE=_FIX / "alpaca.json"),
        "get_prefs.sh": dict(PREFS_SOURCE=_FIX / "alpaca.json"),
        "get_web.sh": dict(WEB_SOURCE=_FIX / "alpaca.json"),
        "get_gutenberg.sh": dict(GUTENBERG_SOURCE=_FIX / "gutenberg", GUTENBERG_IDS="4")}  # no text
_SCRIPTS = sorted(_GOOD)


def _tree(root):
    """Every path under root, with a file's bytes (a folder or fifo as such: reading a fifo would block)."""
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else p.is_dir()) for p in root.rglob("*"))


def _assert_refused(r, root, before):
    """One error line about OUT, a non-zero exit, and nothing under root made or changed."""
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: OUT="), r.stderr
    assert "wrote" not in r.stdout and "already exists" not in r.stdout, r.stdout
    assert _tree(root) == before


@pytest.mark.parametrize("force", [0, 1])
@pytest.mark.parametrize("name", _SCRIPTS)
def test_data_out_folder_is_refused(tmp_path, name, force):
    # was: "wc: Is a directory", then "already exists (0 bytes)" or, with FORCE=1, "wrote D" and
    # D/D.PID.tmp left inside the folder; exit 0 either way
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "keep.txt").write_text("x")
    before = _tree(tmp_path)
    for out in (tmp_path / "D", f"{tmp_path}/D/", f"{tmp_path}/E/"):  # a trailing / names a folder too
        _assert_refused(_run_data_script(name, out, FORCE=force, **_GOOD[name]), tmp_path, before)


@pytest.mark.parametrize("name", _SCRIPTS)
def test_data_out_under_a_file_is_refused(tmp_path, name):
    # was: "mkdir: cannot create directory ...: File exists", exit 1, no error: line
    (tmp_path / "afile").write_text("x")
    before = _tree(tmp_path)
    for out in (tmp_path / "afile" / "x.json", tmp_path / "afile" / "sub" / "x.json"):
        _assert_refused(_run_data_script(name, out, **_GOOD[name]), tmp_path, before)


@pytest.mark.parametrize("name", _SCRIPTS)
def test_data_out_not_a_regular_file_is_refused(tmp_path, name):
    # was: the fifo replaced by the data (and as root, OUT=/dev/null would replace the device)
    os.mkfifo(tmp_path / "fifo")
    _assert_refused(_run_data_script(name, tmp_path / "fifo", **_GOOD[name]), tmp_path, _tree(tmp_path))
    assert (tmp_path / "fifo").is_fifo()


def _as_unprivileged():
    """A command prefix under which folder permissions apply (root ignores them), or skip."""
    if os.geteuid() != 0:
        return ()
    if not shutil.which("capsh"):
        pytest.skip("running as root without capsh, so a read-only folder cannot be made")
    return ("capsh", "--drop=cap_dac_override", "--", "-c", 'exec "$0" "$@"')


@pytest.mark.parametrize("name", _SCRIPTS)
def test_data_out_in_read_only_folder(tmp_path, name):
    # was: a bare "cp: Permission denied" (or a Python traceback from get_web.sh), no error: line
    wrap = _as_unprivileged()
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "have.txt").write_bytes(b"data")
    ro.chmod(0o555)
    try:
        before = _tree(tmp_path)
        for out in (ro / "x.txt", ro / "sub" / "x.txt"):
            _assert_refused(_run_data_script(name, out, wrap=wrap, **_GOOD[name]), tmp_path, before)
        r = _run_data_script(name, ro / "have.txt", wrap=wrap, FORCE=1, **_GOOD[name])
        _assert_refused(r, tmp_path, before)
        # an output already there is still fine without FORCE: nothing to write
        r = _run_data_script(name, ro / "have.txt", wrap=wrap, **_GOOD[name])
        assert r.returncode == 0 and "already exists" in r.stdout and r.stderr == "", r.stderr
        assert _tree(tmp_path) == before
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("name", _SCRIPTS)
def test_data_out_missing_folders_made_and_unmade(tmp_path, name):
    # the folders above OUT are made on purpose; a failed run takes back the ones it made (was: left)
    out = tmp_path / "new" / "sub" / "out.txt"
    r = _run_data_script(name, out, **_GOOD[name])
    assert r.returncode == 0 and out.stat().st_size > 0, r.stderr
    assert os.listdir(out.parent) == ["out.txt"]
    r = _run_data_script(name, tmp_path / "bad" / "sub" / "out.txt", **_BAD[name])
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error:"), r.stderr
    assert not (tmp_path / "bad").exists(), "folders left behind"
    r = _run_data_script(name, out.parent / "x" / "out.txt", **_BAD[name])  # only what it made goes
    assert r.returncode != 0 and os.listdir(out.parent) == ["out.txt"]
