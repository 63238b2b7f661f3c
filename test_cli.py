"""
test_cli.py -- the command lines of both engines (nanoeuler.py, nanoeuler_cuda.py, and gradcheck.py, bpe.py
where they share a check): usage mistakes, help, names, and one-line errors.

The rule held here: a user's mistake ends with exit code 1, no traceback and one `error:` line that names the
problem (the words each test asserts); only main() ends the process; every flag has help with its default;
every config name works in every mode of both engines. No GPU needed. The modes with files of their own
(dpo, serve, eval, export, the launcher, bpe.py's commands) check their own mistakes there.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import bpe
from conftest import (ROOT, assert_one_line_error, cli_here, ctrl_c_as_from_a_shell, no_cupy, one_error_line, run_cli,
                      run_engine, run_gpu, run_here)
import nanoeuler as ne
import pipeline as pl
import nanoeuler_cuda as nc


# ----------------------------------------------------------------------------------------------------
# library code raises, main() exits; help and names

PRODUCT = ("nanoeuler.py", "nanoeuler_cuda.py", "pipeline.py", "bpe.py", "gradcheck.py", "evaluate.py", "export.py",
           "serve.py", "distributed.py")


def test_no_sys_exit_below_main():
    """Library code raises UserError; only main() (or the __main__ guard) ends the process."""
    import ast
    for name in PRODUCT:
        tree = ast.parse((ROOT / name).read_text())
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "main" or \
                    isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                allowed |= {id(n) for n in ast.walk(node)}
        exits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) in ("sys.exit", "exit", "die") and id(n) not in allowed]
        assert not exits, f"{name}: sys.exit outside main() at lines {exits}"


def test_every_mutant_still_applies():
    """mutate.py's bugs are planted by text: each must still match the code as often as it says (a change that
    moves the text leaves a mutant that stops `make mutation` before any test)."""
    import mutate
    for name, file, repl, *_ in mutate.MUTANTS:
        mutate.mutated(str(ROOT), file, repl)


def test_cpu_engine_without_numba_says_so_in_one_line():
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numba'] = None; sys.argv = ['x', 'bench'];"
                        "import runpy; runpy.run_path('nanoeuler.py', run_name='__main__')"],
                       cwd=ROOT, capture_output=True, text=True)
    assert_one_line_error(r, "numba is not installed", "pip install")


def cpu_args(monkeypatch, mode, *argv):
    """The flags a CPU mode (a name or a letter) parses from argv; the mode stops there."""
    class Parsed(Exception):
        pass
    parse = pl.Parser.parse_args

    def stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))
    with monkeypatch.context() as m:
        m.setattr(pl.Parser, "parse_args", stop)
        with pytest.raises(Parsed) as e:
            ne.MODES[ne.LETTERS.get(mode, mode)][1]([str(x) for x in argv])
    return e.value.args[0]


def test_every_config_name_in_every_mode(monkeypatch):
    """One name per config, as a word or --config, in the CPU modes and the GPU modes alike."""
    for name in pl.CONFIGS:
        for mode in ("train", "t", "resume", "tr", "bench"):
            for args in ([name], ["--config", name]):
                assert pl.config_arg(cpu_args(monkeypatch, mode, *args)) == name
    with pytest.raises(pl.UserError, match="unknown config 'big_cpu'.*medium"):
        pl.config_arg(cpu_args(monkeypatch, "train", "big_cpu"))

    def stop():
        raise pl.UserError("parsed")
    monkeypatch.setattr(nc, "gpu", stop)
    for name in pl.CONFIGS:
        for mode in ("train", "t", "resume", "tr", "bench"):
            with pytest.raises(pl.UserError, match="parsed"):
                nc.MODES[nc.LETTERS.get(mode, mode)][1]([name] if mode != "bench" else ["--config", name])


def _parsers(monkeypatch):
    """Every argparse parser of both engines' modes, caught as each mode builds it."""
    class Caught(Exception):
        pass
    found = {}

    def catch(self, args=None, namespace=None):
        found[self.prog] = self
        raise Caught
    monkeypatch.setattr(pl.Parser, "parse_args", catch)
    for _, fn in [*nc.MODES.values(), *ne.MODES.values()]:
        with pytest.raises(Caught):
            fn([])
    return found


def test_every_flag_has_help_with_its_default(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert len(parsers) >= 14
    for prog, p in parsers.items():
        assert p.description, prog
        for a in p._actions:
            if not a.option_strings or a.nargs == 0 or a.dest in ("config_flag", "prompt_flag", "stop_after"):
                continue                             # switches; the flag form of a word documented beside it
            assert a.help and "default" in a.help, (prog, a.option_strings)


def test_a_write_cut_short_keeps_the_last_good_file(tmp_path, monkeypatch):
    """A Ctrl-C or a crash between writing a file and putting it in place leaves the old file whole: the loss
    plot, the run report, an HF export's JSON files and a tokenizer were written in place (a Ctrl-C during a
    resume's last plot cut an earlier run's loss.png to 124 bytes)."""
    import evaluate
    import export
    run = tmp_path / "run"
    run.mkdir()
    (run / pl.LOG).write_text('{"step": 1, "loss": 5.0, "tokens": 64, "ms": 10}\n')
    real = os.replace

    def replace(src, dst):                           # the interruption, just before the rename into place
        if os.fspath(dst) == str(target):
            raise KeyboardInterrupt
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    args = dict(pl.TRAIN_DEFAULTS, config="tiny")
    for target, write in ((run / "loss.png", lambda p: evaluate.plot([str(run)], str(p))),
                          (run / "report.md", lambda p: evaluate.write_report(str(run), args, TINY, 5.0, 2.0, "x")),
                          (tmp_path / "config.json", lambda p: export._write_json(str(p), {"a": 1})),
                          (tmp_path / "t.bpe", lambda p: bpe.Tokenizer([]).save(str(p)))):
        target.write_bytes(b"the last good one")
        with pytest.raises(KeyboardInterrupt):
            write(target)
        assert target.read_bytes() == b"the last good one", target.name
    assert not list(tmp_path.rglob("*.tmp"))


def test_ctrl_c_while_the_engine_loads_prints_no_traceback():
    """A Ctrl-C in the first second (Numba and the kernels loading, before main()) printed a traceback; the
    process still ends by SIGINT (a shell's 130)."""
    r = subprocess.run([sys.executable, "-c", "import pipeline; raise KeyboardInterrupt"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGINT and r.stderr == ""


def test_a_library_run_alone_says_which_command_it_serves():
    """python3 export.py (evaluate, serve, distributed) did nothing and exited 0: now one line naming the mode."""
    for name in ("export.py", "evaluate.py", "serve.py", "distributed.py"):
        assert_one_line_error(run_engine(name, timeout=60), name, "--help")


def test_both_engines_have_the_same_modes():
    """The README's promise: the modes and letters of the two engines are one set, but for the GPU's checks."""
    assert set(nc.MODES) - {"selftest", "gradcheck"} == set(ne.MODES)
    assert {k: v for k, v in nc.LETTERS.items() if v in ne.MODES} == ne.LETTERS


def test_gpu_train_takes_batch_auto(monkeypatch):
    """The GPU engine's --batch is a whole number or auto (documented in --help); the CPU engine's a number."""
    parsers = _parsers(monkeypatch)
    monkeypatch.undo()
    p, cpu = parsers["nanoeuler_cuda.py train"], parsers["nanoeuler.py train"]
    assert p.parse_args(["--batch", "auto"]).batch == "auto" and p.parse_args(["--batch", "8"]).batch == 8
    with pytest.raises(pl.UserError, match="--batch"):
        p.parse_args(["--batch", "most"])
    assert "auto: the largest batch" in " ".join(p.format_help().split())
    with pytest.raises(pl.UserError, match="--batch"):
        cpu.parse_args(["--batch", "auto"])


def test_every_cli_answers_help():
    for script, args in (("nanoeuler.py", []), ("nanoeuler.py", ["train"]), ("nanoeuler_cuda.py", []),
                         ("nanoeuler_cuda.py", ["train"]), ("nanoeuler_cuda.py", ["t"]), ("bpe.py", []),
                         ("bpe.py", ["encode"]), ("gradcheck.py", [])):
        r = run_here(script, *args, "--help")
        assert r.returncode == 0 and "usage" in r.stdout.lower() + r.stderr.lower() or "Modes" in r.stdout, \
            (script, args, r.stdout, r.stderr)
    r = run_here("nanoeuler_cuda.py", "--help")
    assert "CONTRACT.md" in r.stdout and all(w in r.stdout for w in ("selftest", "gradcheck", "train", "sample"))


def test_train_help_gives_the_lr_default_once():
    """--lr's help read "(small; 0.001 for the others) (default 0.003)": the default, then its exceptions."""
    out = " ".join(cli_here("train", "--help").stdout.split())
    assert "peak learning rate (default 0.003 for small, 0.001 for the other configs)" in out, out


def test_importing_an_engine_loads_no_server_exporter_or_launcher():
    """The engines are libraries too (gradcheck.py, the GPU's references, the tests): serve, export, evaluate
    and distributed load in the modes that use them. pipeline.py loads none either. One fresh interpreter
    imports all three: any of them loading one of those modules shows."""
    r = subprocess.run([sys.executable, "-c", "import nanoeuler, nanoeuler_cuda, pipeline, sys; print(sorted(m for m in "
                        "('serve', 'export', 'evaluate', 'distributed') if m in sys.modules))"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "[]\n", (r.stdout, r.stderr)


def test_one_dispatch_lists_the_modes_and_their_letters(capsys):
    """Both engines' modes go through pl.run_main: the list on --help (status 0) or without a mode (1), the
    GPU engine's letters on the CPU too, a near name for a misspelt mode, the statuses of a mode's end."""
    assert ne.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: nanoeuler.py MODE") and "CONTRACT.md" in out
    for row in ("train | t ", "resume | tr ", "sample | i ", "chat | c ", "sft | s ", "dpo | d ", "export ", "bench "):
        assert "\n  " + row in out, row
    assert ne.main([]) == 1 and capsys.readouterr().out == out
    assert ne.main(["sampel"]) == 1
    assert capsys.readouterr().err.startswith("error: invalid choice: mode 'sampel' (did you mean sample?)")

    def fail(e):
        raise e
    modes = {"ok": ("", lambda argv: {"a": 1}), "two": ("", lambda argv: 2), "user": ("", lambda argv: fail(pl.UserError("x"))),
             "stop": ("", lambda argv: fail(KeyboardInterrupt())), "oom": ("", lambda argv: fail(MemoryError("big"))),
             "bug": ("", lambda argv: fail(ValueError("bug")))}
    run = lambda *argv: pl.run_main("p", "", modes, {"": "two", "k": "ok"}, argv,
                                    error_of=lambda e: f"out of memory ({e})" if isinstance(e, MemoryError) else None)
    assert [run("ok"), run("k"), run(), run("--flag"), run("user"), run("stop"), run("oom")] == [0, 0, 2, 2, 1, 130, 1]
    assert capsys.readouterr().err == "error: x\nerror: out of memory (big)\n"
    with pytest.raises(ValueError):
        run("bug")


def test_modes_return_none_or_an_exit_status():
    """run_main takes a mode's int as its exit status: a mode returns None on success and an int only where it
    means one (a failed check, a failed rank), through every call it returns. GPU bench --only generation
    returned its dict of speeds, which sys.exit printed, exiting 1."""
    import ast
    trees = {m: ast.parse((ROOT / f"{m}.py").read_text()) for m in ("nanoeuler", "nanoeuler_cuda", "gradcheck",
                                                                       "distributed")}
    funcs = {(m, f.name): f for m, tree in trees.items() for f in tree.body if isinstance(f, ast.FunctionDef)}

    def returns(f):                                  # f's return statements, not those of functions inside it
        todo, found = list(f.body), []
        while todo:
            n = todo.pop()
            found += [n] * isinstance(n, ast.Return)
            todo += [] if isinstance(n, (ast.FunctionDef, ast.Lambda)) else list(ast.iter_child_nodes(n))
        return found

    def status(m, e, seen):                          # e is None, an int, or a call of a function returning those
        if e is None or isinstance(e, ast.Constant) and (e.value is None or type(e.value) is int):
            return True
        if isinstance(e, ast.IfExp):
            return status(m, e.body, seen) and status(m, e.orelse, seen)
        name = ast.unparse(e.func) if isinstance(e, ast.Call) else ""
        key = tuple(name.split(".")) if "." in name else (m, name)
        return key in funcs and (key in seen or all(status(key[0], r.value, seen | {key}) for r in returns(funcs[key])))
    modes = [k for k in funcs if k[1].startswith("cmd_") or k == ("gradcheck", "check")]
    assert len(modes) >= 23
    bad = [f"{m}.{name} line {r.lineno}: return {ast.unparse(r.value)}" for m, name in modes
           for r in returns(funcs[m, name]) if not status(m, r.value, {(m, name)})]
    assert not bad, bad


def test_every_command_line_keeps_one_rule_for_mistakes():
    """0 on success, 1 and one error line for a mistake (a misspelt mode gets the nearest name), 130 for Ctrl-C
    (test_ctrl_c_exits_130_everywhere): gradcheck.py exited 2 for bad arguments and named no mode. A real
    process of each command line: its __main__ guard passes main's status to the shell."""
    for script, args, words in (("nanoeuler.py", ["trian"], ["did you mean train?"]),
                                ("nanoeuler_cuda.py", ["trian"], ["did you mean train?"]),
                                ("gradcheck.py", ["modle"], ["did you mean model?"]),
                                ("bpe.py", ["trian"], ["invalid choice"])):
        r = run_engine(script, *args)
        assert r.returncode == 1 and one_error_line(r, *words), (script, args, r.returncode, r.stderr)
    r = run_here("gradcheck.py", "model", "--fast")
    assert r.returncode == 1 and one_error_line(r, "unrecognized arguments: --fast"), (r.returncode, r.stderr)


def _interrupted(script, *args, ready="", env=None):
    """(exit status, stderr) of a command sent Ctrl-C (SIGINT) once it printed a line holding `ready`."""
    p = subprocess.Popen([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ctrl_c_as_from_a_shell,
                         env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                                                  **(env or {})))
    try:
        for line in p.stdout:
            if ready in line:
                break
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=120)[1]
        return p.returncode, err
    finally:
        p.kill()


def test_ctrl_c_exits_130_everywhere(one_step_ckpt, corpus, tmp_path):
    """Ctrl-C ends every mode with status 130 and no traceback (serve exited 0, gradcheck.py with a traceback)."""
    path, env = corpus
    for script, args, ready in (
            ("nanoeuler.py", ["serve", "--ckpt", one_step_ckpt, "--port", 0], "serving"),
            ("nanoeuler.py", ["train", "--data", path, "--out", tmp_path / "run", "--steps", 10 ** 6, "--batch", 2,
                              "--seq", 32, "--sample-every", 0, "--log-every", 1], "| loss"),   # a step, compiled
            ("gradcheck.py", ["all"], "")):
        rc, err = _interrupted(script, *args, ready=ready, env=env)
        assert rc == 130 and "Traceback" not in err, (script, args, rc, err)


def test_sample_takes_the_prompt_as_a_word_or_a_flag(monkeypatch, one_step_ckpt):
    """As the GPU engine's `i "It was"`: the word, or --prompt, or a newline; two different prompts are a mistake."""
    assert pl.prompt_arg(cpu_args(monkeypatch, "i", "It was")) == "It was"
    assert pl.prompt_arg(cpu_args(monkeypatch, "sample", "--prompt", "It was")) == "It was"
    assert pl.prompt_arg(cpu_args(monkeypatch, "sample")) == "\n"
    with pytest.raises(pl.UserError, match="two prompts"):
        pl.prompt_arg(cpu_args(monkeypatch, "sample", "a", "--prompt", "b"))
    flags = ("--ckpt", one_step_ckpt, "--tokens", 6, "--temperature", 0)
    word, flag = cli_here("i", "It was", *flags), cli_here("sample", "--prompt", "It was", *flags)
    assert word.returncode == 0 and word.stdout.startswith("It was") and word.stdout == flag.stdout, word.stderr


SPEED = re.compile(r"\[(\d+) tokens?(?: in \d+ streams)?, ([\d.]+) s of warm-up \([^)]*\), then ([\d,]+) tokens/s")


def test_speed_line_reports_the_warm_up_apart(monkeypatch, capsys):
    """sample's tokens/s is the steady rate after the first ids; the time to them (compilation, prefill, graph
    capture) is reported apart: a decoder that takes 1.5 s to its first id, then 100 ids/s one at a time or in
    bursts of 8 (the GPU's chunks, speculation's accepted drafts) prints 1.5 s and 100 tokens/s. The old line
    printed 200 / 3.5 s = 57 tokens/s, and with Numba's compilation 5-10x too low on the CPU."""
    clock = [0.0]
    monkeypatch.setattr(pl.time, "perf_counter", lambda: clock[0])

    def decoder(burst):
        def generate(ids, n, rng):
            clock[0] += 1.5 - 0.01 * burst            # the warm-up ends with the first burst
            for i in range(n):
                clock[0] += 0.01 * burst * (i % burst == 0)
                yield 65
        return generate

    def batch(ids, streams, n, rng, arrivals):         # 4 streams, 25 ids each, in bursts of 5 steps
        clock[0] += 1.5
        for step in range(5, n + 1, 5):
            arrivals.append((4 * step, clock[0]))
            clock[0] += 0.05
        return [[65] * n] * streams
    tok, a = bpe.Tokenizer([]), pl.argparse.Namespace(tokens=200, temperature=0, top_k=0, top_p=1,
                                                      repetition_penalty=1, samples=1, seed=0)
    for burst in (1, 8):
        line = pl.speed_line(pl.sample_to_stdout(tok, decoder(burst), "A", a, 512), False, {})
        assert line == "[200 tokens, 1.5 s of warm-up (compilation, prefill), then 100 tokens/s, speculative off]"
    a.tokens, a.samples = 25, 4
    line = pl.speed_line(pl.samples_to_stdout(tok, batch, "A", a, 512), False, {}, 4, warmup="graphs")
    assert line == "[100 tokens in 4 streams, 1.5 s of warm-up (graphs), then 400 tokens/s]"
    assert capsys.readouterr().out.endswith("--- sample 4/4 ---\nA" + "A" * 25 + "\n")
    clock[0] = 0
    line = pl.speed_line(pl.sample_to_stdout(tok, decoder(1), "A", pl.argparse.Namespace(**{**vars(a), "tokens": 1,
                                             "samples": 1}), 512), True, {})
    assert line == "[1 token, 1.5 s of warm-up (compilation, prefill), too few for a steady rate]"


def test_sample_prints_its_warm_up_and_steady_rate(one_step_ckpt):
    """The line sample prints on the CPU: warm-up and rate apart, and together they fit in the run's time."""
    t0 = time.perf_counter()
    r = cli_here("sample", "--ckpt", one_step_ckpt, "--tokens", 60, "--temperature", 0, "--no-speculative")
    wall = time.perf_counter() - t0
    m = SPEED.search(r.stderr)
    assert r.returncode == 0 and m, r.stderr
    n, warmup, rate = int(m[1]), float(m[2]), float(m[3].replace(",", ""))
    assert n == 60 and 0 < warmup and warmup + (n - 1) / rate < wall, (r.stderr, wall)


def test_readme_commands_are_python3():
    text = (ROOT / "README.md").read_text()
    assert not re.findall(r"(?m)^\s*python (?!3)", text)
    assert "CONTRACT.md" in text


def test_readme_is_a_users_guide_and_the_journal_is_apart():
    """Issue 30: the README is a user's guide of at most 20,000 bytes (llm.c's is 16.5 KB, nanoGPT's 13.8 KB);
    measurements and what was tried go to dev/LOG.md, dated entries, which the README links."""
    readme = (ROOT / "README.md").read_bytes()
    assert len(readme) <= 20_000, len(readme)
    assert b"(dev/LOG.md)" in readme
    log = (ROOT / "dev" / "LOG.md").read_text()
    assert len(re.findall(r"(?m)^## 20\d\d-\d\d-\d\d ", log)) >= 10


def test_outputs_are_ignored_by_git():
    r = subprocess.run(["git", "check-ignore", "out/ckpt.npz", "out_chat/ckpt.npz", "data/pretrain.bpe",
                        "data/pretrain.bin"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 128:
        pytest.skip("not a git checkout")
    assert len(r.stdout.split()) == 4, r.stdout


# ----------------------------------------------------------------------------------------------------
# the CPU engine's mistakes: usage, sampling flags, missing, empty or binary data, bad checkpoints

def test_usage_mistakes_get_one_line(tmp_path):
    assert_one_line_error(cli_here("train", "--stpes", 5), "--stpes", "did you mean --steps")
    assert_one_line_error(cli_here("train", "5"), "unknown config '5'")
    assert_one_line_error(run_engine("bpe.py", "train"), "required")
    assert_one_line_error(run_here("gradcheck.py", "nope"), "invalid choice")
    assert_one_line_error(cli_here("train", "--data", tmp_path, "--out", tmp_path / "o"), "is a folder")
    assert_one_line_error(cli_here("sample", "--ckpt", tmp_path), "folder without a ckpt.npz")
    assert_one_line_error(cli_here("sample", "--ckpt", ROOT / "README.md"), "not a NanoEuler checkpoint")
    assert "allow_pickle" not in cli_here("sample", "--ckpt", ROOT / "README.md").stderr


def test_bad_input_gets_one_line(tmp_path, corpus):
    assert_one_line_error(cli_here("fly"), "invalid choice")
    assert_one_line_error(cli_here("train", "--bogus"), "unrecognized")
    assert_one_line_error(run_cli("bench", env_extra={"NANOEULER_THREADS": "two"}), "NANOEULER_THREADS")  # read once
    assert_one_line_error(cli_here("train", "--data", tmp_path / "missing.txt", "--out", tmp_path / "o"), "not found")
    (tmp_path / "empty.txt").write_text("")
    assert_one_line_error(cli_here("train", "--data", tmp_path / "empty.txt", "--out", tmp_path / "o"), "empty")
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 10)
    assert_one_line_error(cli_here("train", "--data", tmp_path / "bin.txt", "--out", tmp_path / "o"), "not text")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "odd.bpe").write_text("x")
    r = cli_here("train", "--data", tmp_path / "odd.bin", "--out", tmp_path / "o")
    assert_one_line_error(r)
    assert_one_line_error(cli_here("sample", "--ckpt", tmp_path / "none.npz"), "not found")


def test_sampling_flags_are_checked(one_step_ckpt):
    ck = one_step_ckpt
    assert_one_line_error(cli_here("sample", "--ckpt", ck, "--temperature", -1), "--temperature -1")
    assert_one_line_error(cli_here("sample", "--ckpt", ck, "--tokens", -5), "--tokens -5")
    assert_one_line_error(cli_here("sample", "--ckpt", ck, "--top-k", -2), "--top-k -2")
    assert_one_line_error(cli_here("chat", "--ckpt", ck, "--temperature", -1, stdin="hi\n"), "--temperature")
    r = cli_here("sample", "--ckpt", ck, "--tokens", 100000, "--prompt", "The", "--temperature", 0)
    assert r.returncode == 0 and "the context of 512 tokens is full" in r.stderr, r.stderr   # a run folder works


def test_a_bin_whose_tokenizer_outgrows_the_config_names_one_that_fits(tmp_path, corpus):
    """make data's 4096-id .bin with the default config (vocab 512) used to end in an IndexError."""
    text = corpus[0].read_text()[:60_000]
    tok = bpe.Tokenizer.train(text, 700)
    tok.save(str(tmp_path / "d.bpe"))
    np.array(tok.encode(text), "<u2").tofile(tmp_path / "d.bin")
    r = cli_here("train", "--data", tmp_path / "d.bin", "--out", tmp_path / "o")
    assert_one_line_error(r, "700 token ids", "small", "medium")
    r = cli_here("train", "medium", "--data", tmp_path / "d.bin", "--out", tmp_path / "o", "--steps", 1, "--batch", 1,
                 "--seq", 32, "--sample-every", 0, plots=False)
    assert r.returncode == 0 and "10,490,112 parameters" in r.stdout, r.stderr


# ----------------------------------------------------------------------------------------------------
# the CPU engine's other branches: token files, tokenizers, runs, checkpoints, SFT data. All run at once.

TINY = pl.CONFIGS["tiny"]


def _save(path, cfg=TINY, tok=None, state=None, edit=None):
    """A checkpoint of cfg at path; edit(arrays) may damage it before it is written back."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pl.save_checkpoint(path, pl.Params.init(cfg, 0), tok or bpe.Tokenizer([]), state)
    if edit:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        edit(arrays)
        np.savez(path, **arrays)
    return path


def _cli_cases(d):
    """(name, argv, words the error line must hold); d is an empty folder for the files they need."""
    tok = bpe.Tokenizer([])                                    # 257 ids
    big = bpe.Tokenizer([(97, 97)] + [(256 + i, 97) for i in range(142)])   # 400 ids, more than tiny's 300
    ids = lambda *v: np.array(v, "<u2").tobytes()
    files = {"empty.bin": b"", "odd.bin": b"\x01\x00\x02", "high.bin": ids(5, 256, 257, 7),
             "short.bin": ids(*range(40)), "big/data.bin": ids(1, 2, 3), "alone/data.bin": ids(1, 2, 3),
             "bad/data.bin": ids(1, 2, 3), "bad/data.bpe": b"junk\n", "latin1.txt": "café".encode("latin-1"),
             "a.txt": b"the cat sat on the mat. " * 40, "b.txt": b"a quick brown fox jumps. " * 40,
             "sft/bad.json": b'[{"instruction": "a", ', "sft/latin1.json": '[{"é": 1}]'.encode("latin-1"),
             "sft/dict.json": b'{"instruction": "a", "output": "b"}', "sft/empty.json": b"[]",
             "sft/no_output.json": b'[{"instruction": "a", "input": ""}]',
             "sft/number.json": b'[{"instruction": 1, "output": "b"}]',
             "sft/one.json": b'[{"instruction": "Say hi.", "input": "", "output": "hi"}]',
             "sft/good.json": b'[{"instruction": "Say hi.", "output": "hi"}, {"instruction": "Say no.", "output": "no"}]',
             "done/ckpt.npz": b"x", "sftdone/ckpt.npz": b"x",
             "logged/train_log.jsonl": b'{"step": 1, "loss": 5.0, "tokens": 64, "wall": 0.5}\n',
             "badlog/train_log.jsonl": b'{"step": 1, "loss": "x"}\n', "c.txt": b"the cat sat on the mat. " * 40,
             "sft/long.json": json.dumps([{"instruction": "Say hi. " * 30, "output": "hi"}] * 2).encode(),
             "hs/empty_ending.jsonl": json.dumps({"ctx": "A cat", "endings": ["sat.", "", "ran.", "hid."],
                                                  "label": 0}).encode()}
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    for name in ("empty", "odd", "high", "short", "data"):
        tok.save(os.path.join(d, f"{name}.bpe"))
    big.save(os.path.join(d, "big", "tokenizer.bpe"))
    os.makedirs(os.path.join(d, "sft", "folder.json"))
    os.makedirs(os.path.join(d, "dir.npz"))
    os.makedirs(os.path.join(d, "logdir", pl.LOG))
    base = _save(os.path.join(d, "base", "ckpt.npz"), pl.Config(**{**pl.asdict(TINY), "ctx": 256}))  # a prompt fits
    short = _save(os.path.join(d, "short", "ckpt.npz"))                                    # tiny's 64 tokens
    lacking = _save(os.path.join(d, "lacking.npz"), edit=lambda a: a.pop("layers.1.wq"))
    nan = _save(os.path.join(d, "nan.npz"), edit=lambda a: a["layers.2.w2"].__setitem__((3, 4), np.nan))
    bigtok = _save(os.path.join(d, "bigtok.npz"), tok=big)
    badcfg = _save(os.path.join(d, "badcfg.npz"), edit=lambda a: a.__setitem__("config", np.array("{not json")))
    run = dict(pl.TRAIN_DEFAULTS, config="tiny", steps=5, batch=2, seq=16, data=os.path.join(d, "a.txt"))
    state = {"step": 1, "adam_m": pl.Params(TINY), "adam_v": pl.Params(TINY),
             "data": np.random.default_rng(0).bit_generator.state, "train": run}
    _save(os.path.join(d, "run", "ckpt.npz"), state=state)
    pl.save_checkpoint(os.path.join(d, "chatrun", "ckpt.npz"), pl.Params.init(TINY, 0), tok, state, {"kind": "chat"})
    j = lambda *p: os.path.join(d, *p)
    train = lambda data, *more: ["train", "tiny", "--data", j(data), "--out", j("out_" + data.replace("/", "_")),
                                 "--steps", 1, "--seq", 16, *more]
    sft = lambda data, *more: ["sft", "--ckpt", base, "--data", j("sft", data), "--out", j("chat"), "--steps", 1, *more]
    return [
        ("token file missing", train("missing.bin"), ["token file not found", "missing.bin"]),
        ("token file empty", train("empty.bin"), ["token file is empty", "empty.bin"]),
        ("token file odd-sized", train("odd.bin"), ["odd number of bytes", "odd.bin"]),
        ("token id >= vocab", train("high.bin"), ["holds id 257", "outside the vocabulary of 257"]),
        ("no tokenizer beside", train("alone/data.bin"), ["no tokenizer for", "data.bpe or tokenizer.bpe"]),
        ("bad tokenizer beside", train("bad/data.bin"), ["bad tokenizer file", "not a tokenizer"]),
        ("tokenizer > vocab", train("big/data.bin"), ["400 token ids", "config tiny's vocabulary of 300"]),
        ("token file too short", train("short.bin", "--seq", 32), ["split has", "too few for windows of 32"]),
        ("text not UTF-8", train("latin1.txt"), ["not UTF-8", "latin1.txt"]),
        ("train over a checkpoint", ["train", "tiny", "--out", j("done"), "--steps", 1], ["ckpt.npz exists", "--force"]),
        ("train --steps 0", ["train", "tiny", "--steps", 0, "--out", j("o1")], ["--steps 0", "at least 1"]),
        ("train --warmup -1", ["train", "tiny", "--warmup", -1, "--out", j("o3")], ["--warmup at least 0"]),
        ("train --seq > ctx", ["train", "tiny", "--seq", 65, "--out", j("o4")], ["--seq 65", "context of 64"]),
        ("train --seed -1", ["train", "tiny", "--seed", -1, "--out", j("o6")], ["--seed", "'-1'", "from 0 to"]),
        ("train --stop-after 0", ["train", "tiny", "--stop-after", 0, "--out", j("o7")], ["--stop-after 0", "at least 1"]),
        ("train --out ''", ["train", "tiny", "--out", ""], ["--out", "the path is empty"]),
        ("train --data ''", ["train", "tiny", "--data", "", "--out", j("o8")], ["data file", "the path is empty"]),
        ("train --data a device", ["train", "tiny", "--data", "/dev/null", "--out", j("o9")],
         ["/dev/null", "not a regular file"]),
        ("a folder where the log goes", ["train", "tiny", "--out", j("logdir"), "--steps", 1],
         ["holds a folder train_log.jsonl", "another --out"]),
        ("sample --seed -1", ["sample", "--ckpt", base, "--seed", -1], ["--seed", "from 0 to"]),
        ("two configs", ["train", "tiny", "--config", "small", "--out", j("o5")], ["two configs", "tiny", "small"]),
        ("bench --seq > ctx", ["bench", "tiny", "--seq", 65], ["--seq 65", "context of 64"]),
        ("resume nothing", ["resume", "--out", j("nothing")], ["checkpoint not found"]),
        ("resume a chat checkpoint", ["resume", "--out", j("base")], ["no training state"]),
        ("resume an sft run stopped by Ctrl-C", ["resume", "--out", j("chatrun")], ["sft or dpo run's", "again"]),
        ("resume other tokenizer", ["resume", "--out", j("run"), "--data", j("b.txt")], ["tokenizer differs"]),
        ("resume with the other optimiser", ["resume", "--out", j("run"), "--optim", "muon"],
         ["--optim muon", "trains with adamw"]),
        ("checkpoint lacks a tensor", ["sample", "--ckpt", lacking], ["lacks tensor layers.1.wq"]),
        ("checkpoint holds NaN", ["sample", "--ckpt", nan], ["NaN", "nan.npz"]),
        ("checkpoint tokenizer > vocab", ["sample", "--ckpt", bigtok], ["tokenizer has 400 tokens", "300"]),
        ("checkpoint config damaged", ["sample", "--ckpt", badcfg], ["corrupt", "JSONDecodeError"]),
        ("empty prompt", ["sample", "--ckpt", base, "--prompt", ""], ["the prompt is empty"]),
        ("sft data missing", sft("missing.json"), ["SFT data not found"]),
        ("sft data folder", sft("folder.json"), ["SFT data", "is a folder"]),
        ("sft bad JSON", sft("bad.json"), ["not valid JSON"]),
        ("sft not UTF-8", sft("latin1.json"), ["not valid JSON"]),
        *[(f"sft {n}", sft(n + ".json"), ["must be a non-empty JSON list"])
          for n in ("dict", "empty", "no_output", "number")],
        ("sft one example", sft("one.json"), ["holds 1 example", "at least 2"]),
        ("sft nothing fits", sft("good.json", "--seq", 8), ["no SFT example fits the context of 8", "raise --seq"]),
        ("sft nothing fits the model", ["sft", "--ckpt", short, "--data", j("sft", "long.json"), "--out", j("chat2"),
                                        "--seq", 1000], ["fits the context of 64", "the model's context"]),
        ("sft --lr 0", sft("good.json", "--lr", 0), ["--lr 0"]),
        ("sft --steps 0", sft("good.json", "--steps", 0), ["--steps 0"]),
        ("sft over a checkpoint", ["sft", "--ckpt", base, "--data", j("sft", "good.json"), "--out", j("sftdone"),
                                   "--steps", 1], ["ckpt.npz exists", "--force"]),
        # outputs that cannot be written: found before any work (pl.writable), whatever --force says
        ("export hf over a file", ["export", "--ckpt", base, "--format", "hf", "--out", j("a.txt"), "--force"],
         ["--out", "a.txt is a file"]),
        ("export gguf, no folder", ["export", "--ckpt", base, "--format", "gguf", "--out", "/nonexistent/dir/m.gguf"],
         ["/nonexistent/dir/m.gguf", "/nonexistent/dir does not exist"]),
        ("export gguf over a folder", ["export", "--ckpt", base, "--format", "gguf", "--out", j("sft"), "--force"],
         ["--out", "is a folder"]),
        ("export to /proc", ["export", "--ckpt", base, "--out", "/proc/x"], ["--out /proc/x cannot be written"]),
        ("import over a file", ["import", "--hf", j("nohf"), "--out", j("a.txt")], ["--out", "a.txt is a file"]),
        ("import under a file", ["import", "--hf", j("nohf"), "--out", j("a.txt", "m.npz")], ["a.txt is a file"]),
        ("import over a checkpoint", ["import", "--hf", j("nohf"), "--out", j("base")], ["ckpt.npz exists", "--force"]),
        ("import over a folder", ["import", "--hf", j("nohf"), "--out", j("dir.npz"), "--force"],
         ["--out", "is a folder"]),
        ("serve --log a folder", ["serve", "--ckpt", base, "--log", j("sft")], ["--log", "is a folder"]),
        ("bpe.py train -o a folder", ["bpe.py", "train", j("a.txt"), "--vocab", 300, "-o", j("sft")],
         ["-o", "is a folder"]),
        ("bpe.py encode -o its input", ["bpe.py", "encode", j("data.bpe"), j("c.txt"), "-o", j("c.txt")],
         ["-o", "c.txt is the input"]),
        ("bpe.py train -o its input", ["bpe.py", "train", j("c.txt"), "--vocab", 300, "-o", j("c.txt")],
         ["-o", "c.txt is the input"]),
        ("export gguf under a file", ["export", "--ckpt", base, "--format", "gguf", "--out", j("a.txt", "m.gguf")],
         ["a.txt is a file, not a folder"]),
        ("eval an empty ending", ["eval", "--ckpt", base, "--data", j("hs", "empty_ending.jsonl")],
         ["line 1 is not a HellaSwag item", "non-empty"]),
        ("plot --out not a .png", ["plot", j("logged"), "--out", j("x.txt")], ["--out", "ending in .png"]),
        ("plot --out ''", ["plot", j("logged"), "--out", ""], ["--out ''", "ending in .png"]),
        ("plot a damaged log", ["plot", j("badlog"), "--out", j("b.png")], ["step 1 has loss 'x', not a number"]),
        ("bpe.py encode -o no folder", ["bpe.py", "encode", j("data.bpe"), j("a.txt"), "-o", j("none", "x.bin")],
         ["-o", "x.bin", "does not exist"]),
        ("plot --out a folder", ["plot", j("logged"), "--out", j("sft")], ["--out", "is a folder"]),
        ("GPU plot --out in /proc", ["nanoeuler_cuda.py", "plot", j("logged"), "--out", "/proc/x.png"],
         ["--out /proc cannot be written"]),
        ("GPU bench --json a folder", ["nanoeuler_cuda.py", "bench", "--json", j("sft")], ["--json", "is a folder"]),
        ("GPU bench --json in /proc", ["nanoeuler_cuda.py", "bench", "--json", "/proc/b.json"],
         ["--json /proc/b.json cannot be written"]),
        ("GPU muon on several GPUs", ["nanoeuler_cuda.py", "train", "--optim", "muon", "--gpus", 2],
         ["--optim muon trains on one GPU", "--gpus"]),
    ]


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Each case's result, its main() called in this process (run_here: the exit status and stderr that
    `sys.exit(main())` would give; test_usage_mistakes_get_one_line and test_bad_input_gets_one_line prove
    the same rule through real processes of each command line)."""
    d = str(tmp_path_factory.mktemp("cli"))
    results = {}
    for name, argv, words in _cli_cases(d):
        script, argv = (argv[0], argv[1:]) if argv[0].endswith(".py") else ("nanoeuler.py", argv)
        results[name] = run_here(script, *argv, env={"NANOEULER_CACHE": os.path.join(d, "cache")}), words
    return results


def test_every_cli_mistake_gets_one_line(cli_results):
    failures = []
    for name, (r, words) in cli_results.items():
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        ok = (r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error: ")
              and all(w in lines[0] for w in words))
        if not ok:
            failures.append(f"{name}: rc={r.returncode} words={words}\n{r.stderr[-600:]}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------
# the GPU engine's mistakes (no GPU needed)

def test_unknown_mode_and_flag_give_one_line():
    assert one_error_line(run_here("nanoeuler_cuda.py", "zz"))
    assert one_error_line(run_here("nanoeuler_cuda.py", "g", "--no-such-flag"))
    assert one_error_line(run_here("nanoeuler_cuda.py", "t", "--steps", "many"))


def test_unknown_precision_gives_one_line():
    for args in (["t", "--precision", "fp8"], ["s", "--precision", "fp16"], ["g", "--precision", "tf32"],
                 ["bench", "--precision", "bf16,fp8"]):
        r = run_here("nanoeuler_cuda.py", *args)
        assert one_error_line(r) and "fp" in r.stderr, (args, r.stderr)


def test_without_cupy_every_mode_says_so(tmp_path, monkeypatch):
    """A CuPy that cannot be imported: each mode ends with one line and a non-zero exit. One real process
    with a stand-in cupy module that fails to import; the other modes in this process, where `import cupy`
    fails as well (None in sys.modules) and no earlier test's CuPy is kept (nc.cp). selftest, the mode run
    without one, compiles every kernel with NVRTC first (20 s; test_every_kernel_compiles_with_nvrtc's work):
    here it finds no libnvrtc, its other branch."""
    r = run_gpu("t", "--steps", "1", env=no_cupy(tmp_path))
    assert one_error_line(r, "CuPy"), (r.stdout, r.stderr)
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(nc, "cp", None)
    monkeypatch.setattr(nc, "compile_check", lambda: (None, []))
    for args in ([], ["g"], ["t", "--steps", "1"], ["tr"], ["i", "It was"], ["s"], ["c"], ["bench"]):
        r = run_here("nanoeuler_cuda.py", *args)
        assert one_error_line(r), (args, r.stdout, r.stderr)
        assert "CuPy" in r.stderr
