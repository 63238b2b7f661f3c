"""
test_serve.py -- serve.py (issue 17) with real clients. The openai package against a live server: chat and
completions, streamed and not, against the engine's own greedy ids on the SFT template (turns kept, the oldest
dropped), seeds, stop strings, a base checkpoint; 50 concurrent requests, none lost or mixed up; a client that
leaves frees its place; every 4xx answer in OpenAI's error shape; the CLI's one-line errors and Ctrl-C, and
its per-request speculation (as sample decides); the chat page in headless Chromium (Playwright), its
screenshot kept in test_artifacts/. openai, playwright and chromium skip when missing; make setup-test installs
them, so CI runs them. A GPU test runs the GPU engine's server.
"""
import concurrent.futures
import dataclasses
import http.client
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import bpe
import nanoeuler as ne
from conftest import ROOT, ctrl_c_as_from_a_shell
import pipeline as pl
import serve

ARTIFACTS = ROOT / "test_artifacts"
CFG = dataclasses.replace(pl.CONFIGS["tiny"], ctx=384)      # room for a few SFT turns (~110 tokens each)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GREEDY = pl.Sampling(temperature=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model with random weights, saved as a chat and as a base checkpoint."""
    d = tmp_path_factory.mktemp("serve")
    tok = bpe.Tokenizer.train(pl.default_corpus()[0][:20_000], CFG.vocab)
    P = pl.Params.init(CFG)
    for kind in ("chat", "base"):
        pl.save_checkpoint(str(d / f"{kind}.npz"), P, tok, extra={"kind": kind})
    return P, tok, d


def serve_args(*flags):
    """The CPU engine's serve flags, parsed."""
    p = pl.Parser(prog="nanoeuler.py serve")
    serve.add_serve_flags(p, ckpt=pl.run_ckpt("sft"), max_batch_help="default 8")
    return p.parse_args([str(f) for f in flags])


def start(model, kind="chat", decoder=None, *flags, workers=0):
    """An in-process server on a free port, built from the serve mode's own flags, over the CPU engine's
    decoder (4 rows unless --max-batch says) or decoder(rows), its scheduler a thread or (workers, as the
    serve mode runs) in an engine process fed by that many HTTP processes; -> the server (worker 0)."""
    P, tok, d = model
    a = serve_args("--ckpt", d / f"{kind}.npz", "--port", 0, *flags)
    factory = lambda rows: (decoder or (lambda rows: ne.Decoder(P, rows)))(rows or 4)
    server = serve.make_server(a, tok, P.cfg, kind == "chat", factory, quiet=True, workers=workers)
    threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    return server


@pytest.fixture(scope="module")
def chat_server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve_log.jsonl"
    server = start(model, "chat", None, "--log", log)
    yield server
    server.shutdown()
    server.server_close()


def client(server, port=None):
    """The openai package's client of a server (or of a port)."""
    openai = pytest.importorskip("openai")
    port = port or server.server_address[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=30, http_client=openai.DefaultHttpxClient(trust_env=False))


def engine_text(model, ids, n, sampling=GREEDY, seed=0):
    """What the engine itself says after ids: its ids up to <|endoftext|>, decoded, and how many it drew."""
    P, tok, _ = model
    out = []
    for t in ne.generate(P, ids, n, rng=np.random.default_rng(seed), sampling=sampling):
        out.append(t)
        if t == tok.eot:
            break
    return tok.decode([t for t in out if t != tok.eot]), len(out)


def sft_ids(tok, turns, last):
    """CONTRACT.md's multi-turn SFT text, one block per turn closed by <|endoftext|>, encoded whole."""
    text = "".join(pl.format_prompt(u) + a + pl.EOT for u, a in turns) + pl.format_prompt(last)
    return tok.encode(text, allowed_special="all")


# ----------------------------------------------------------------------------------------------------
# the openai client against a live server


def test_chat_is_the_engine_on_the_sft_template_streamed_or_not(model, chat_server):
    c = client(chat_server)
    ids = sft_ids(model[1], [], "Name a colour.")
    want, n = engine_text(model, ids, 12)
    r = c.chat.completions.create(model="nanoeuler-custom-chat", messages=[{"role": "user", "content": "Name a colour."}],
                                  max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)
    assert r.choices[0].finish_reason == ("length" if n == 12 else "stop") and r.object == "chat.completion"
    chunks = list(c.chat.completions.create(model=r.model, messages=[{"role": "user", "content": "Name a colour."}],
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    # a system message goes in front of the user's
    r = c.chat.completions.create(model=r.model, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    ids = sft_ids(model[1], [], "Be brief.\n\nName a colour.")
    assert r.choices[0].message.content == engine_text(model, ids, 6)[0] and r.usage.prompt_tokens == len(ids)


def test_chat_keeps_the_turns_and_drops_the_oldest_to_fit(model, chat_server):
    c, tok = client(chat_server), model[1]
    turns = [("Name a colour.", "Blue."), ("Name a fruit.", "A pear.")]           # 361 tokens with the last
    messages = [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
    messages.append({"role": "user", "content": "Name a bird."})
    for max_new in (8, 200):                      # all three turns fit in 384 - 8; with 200, only the last
        budget, kept = max(CFG.ctx - max_new, CFG.ctx // 2), turns
        while kept and len(sft_ids(tok, kept, "Name a bird.")) > budget:
            kept = kept[1:]
        ids = sft_ids(tok, kept, "Name a bird.")
        assert (max_new == 8) == (kept == turns)
        r = c.chat.completions.create(model="nanoeuler-custom-chat", messages=messages, max_tokens=max_new,
                                      temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == engine_text(model, ids, max_new)[0]


def test_completions_streamed_or_not_and_token_prompts(model, chat_server):
    c, tok = client(chat_server), model[1]
    want, n = engine_text(model, tok.encode("It was"), 10)
    r = c.completions.create(model="nanoeuler-custom-chat", prompt="It was", max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(tok.encode("It was"))
    assert r.usage.completion_tokens == n and r.object == "text_completion"
    chunks = list(c.completions.create(model=r.model, prompt="It was", max_tokens=10, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    r2 = c.completions.create(model=r.model, prompt=tok.encode("It was"), max_tokens=10, temperature=0)
    assert r2.choices[0].text == want
    r3 = c.completions.create(model=r.model, prompt="", max_tokens=3, temperature=0)    # a document's start
    assert r3.choices[0].text == engine_text(model, [tok.eot], 3)[0] and r3.usage.prompt_tokens == 1


def test_seed_temperature_and_top_p_are_honoured(model, chat_server):
    c, tok = client(chat_server), model[1]
    ask = lambda **kw: c.completions.create(model="nanoeuler-custom-chat", prompt="It was", max_tokens=20,
                                            **kw).choices[0].text
    a, b = ask(seed=7, temperature=1.0), ask(seed=8, temperature=1.0)
    assert a == ask(seed=7, temperature=1.0) != b
    stream = c.completions.create(model="nanoeuler-custom-chat", prompt="It was", max_tokens=20, seed=7,
                                  temperature=1.0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == a
    for kw in (dict(temperature=1.0), dict(temperature=0.5, top_p=0.3)):   # the engine's draw, same seed
        sampling = pl.Sampling(kw["temperature"], 40, kw.get("top_p", 1.0))  # --top-k 40 is the default
        assert ask(seed=11, **kw) == engine_text(model, tok.encode("It was"), 20, sampling, seed=11)[0]
    assert ask(seed=11, temperature=1.0) != ask(seed=11, temperature=1.0, top_p=0.05)


def test_stop_strings_end_the_text_even_across_tokens(chat_server):
    c = client(chat_server)
    kw = dict(model="nanoeuler-custom-chat", prompt="It was", max_tokens=40, temperature=1.0, seed=3)
    full = c.completions.create(**kw).choices[0].text
    stop = full[10:13]
    want = full[:full.find(stop)]
    r = c.completions.create(stop=[stop, "\u2603never"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
    streamed = c.completions.create(stop=stop, stream=True, **kw)
    assert "".join(ch.choices[0].text for ch in streamed) == want
    r = c.completions.create(stop=full[-1] + "\u2603", **kw)    # the last character, held back, was no stop string
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = c.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=40, seed=3).choices[0].message.content
    stop = whole[5:7]
    r = c.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=40, seed=3, stop=stop)
    assert r.choices[0].message.content == whole[:whole.find(stop)] and r.choices[0].finish_reason == "stop"


def test_stop_scan_holds_back_a_possible_stop_string():
    s = serve.StopScan(["END", "xy"])
    assert s.feed("abcE") == ("abc", False)            # 'E' may begin END
    assert s.feed("N") == ("", False)
    assert s.feed("Dzz") == ("", True)                 # END is complete: nothing after it
    s = serve.StopScan(["END"])
    assert s.feed("EN") == ("", False) and s.feed("x") == ("ENx", False) and s.rest() == ""
    s = serve.StopScan(["END"])
    assert s.feed("aE") == ("a", False) and s.rest() == "E"


def test_base_checkpoint_chats_on_plain_text(model):
    server = start(model, "base")
    try:
        c, tok = client(server), model[1]
        assert c.models.list().data[0].id == "nanoeuler-custom-base"
        messages = [{"role": "user", "content": "Name a colour:"}, {"role": "assistant", "content": " Blue."},
                    {"role": "user", "content": "And another:"}]
        ids = tok.encode("Name a colour: Blue.\nAnd another:")          # as the chat mode joins a base model's turns
        r = c.chat.completions.create(model="nanoeuler-custom-base", messages=messages, max_tokens=8, temperature=0)
        assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == engine_text(model, ids, 8)[0]
    finally:
        server.shutdown()
        server.server_close()


def test_models_route(chat_server):
    c = client(chat_server)
    models = c.models.list().data
    assert [m.id for m in models] == ["nanoeuler-custom-chat"] and models[0].context_length == CFG.ctx
    assert c.models.retrieve("nanoeuler-custom-chat").id == "nanoeuler-custom-chat"


# ----------------------------------------------------------------------------------------------------
# load and disconnection


def test_50_concurrent_requests_none_lost_none_mixed(chat_server):
    """Chat and completions, streamed and not, seeds 0..49, all at once: each answer is the one the same request
    gets alone, and the log has one line per request."""
    c = client(chat_server)
    log = Path(chat_server.log_path)
    before = len(log.read_text().splitlines()) if log.exists() else 0

    def one(i):
        kw = dict(model="nanoeuler-custom-chat", max_tokens=8, temperature=1.0, seed=i, stream=i % 4 >= 2)
        if i % 2:
            r = c.completions.create(prompt=f"It was {i}", **kw)
            return "".join(ch.choices[0].text for ch in r) if kw["stream"] else r.choices[0].text
        r = c.chat.completions.create(messages=[{"role": "user", "content": f"Count to {i}."}], **kw)
        return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if kw["stream"] \
            else r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        together = list(pool.map(one, range(50)))
    alone = [one(i) for i in range(50)]
    assert together == alone and len(set(alone)) > 40
    records = [json.loads(l) for l in log.read_text().splitlines()[before:]]
    assert len(records) == 100 and all(r["event"] == "done" for r in records)


def _raw(port, body, path="/v1/chat/completions"):
    """A request on a bare socket, so the test decides when the client leaves."""
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _streaming(port, body):
    """_raw's request once its stream has begun (three events read): it holds a row."""
    s, got = _raw(port, body), b""
    while got.count(b"data: ") < 3:
        got += s.recv(4096)
    return s


def _wait(cond, timeout=5.0):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


class Recorded:
    """The CPU engine's decoder, delay[0] seconds a step, recording each start in calls: its prompt, ids
    drawn, freed before its max_tokens."""

    def __init__(self, model, rows, calls, delay):
        self.inner, self.calls, self.delay, self.rec = ne.Decoder(model[0], rows), calls, delay, {}
        self.capacity, self.ctx = self.inner.capacity, self.inner.ctx

    def start(self, row, ids, sampling, seed):
        self.rec[row] = dict(prompt=list(ids), drawn=1, closed=False)
        self.calls.append(self.rec[row])
        return self.inner.start(row, ids, sampling, seed)

    def step(self, rows):
        time.sleep(self.delay[0])
        for r in rows:
            self.rec[r]["drawn"] += 1
        return self.inner.step(rows)

    def free(self, row):
        self.rec[row]["closed"] = True
        self.inner.free(row)


def test_a_client_that_leaves_frees_its_place(model, tmp_path):
    """One row (--max-batch 1): a streams; b and c wait. b leaves while queued (never started); a leaves
    mid-stream (its row freed at the next step): c, queued, starts at once and finishes."""
    calls, log = [], tmp_path / "log.jsonl"
    server = start(model, "chat", lambda rows: Recorded(model, rows, calls, [0.01]), "--log", log, "--max-batch", 1)
    port, waiting = server.server_address[1], server.scheduler.waiting
    try:
        msgs = lambda text: [{"role": "user", "content": text}]
        tok = model[1]
        assert engine_text(model, sft_ids(tok, [], "first"), 300)[1] > 250     # greedy: no early <|endoftext|>
        c = client(server)
        a = _raw(port, dict(messages=msgs("first"), max_tokens=300, stream=True, temperature=0))
        got = b""
        while got.count(b"data: ") < 4:                  # the role chunk and three tokens' text
            got += a.recv(4096)
        b = _raw(port, dict(messages=msgs("second"), max_tokens=300))      # waits in the queue behind a
        _wait(lambda: len(waiting) == 1)
        b.close()                                        # leaves while queued: dropped, never started
        _wait(lambda: len(waiting) == 0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(c.chat.completions.create, model="nanoeuler-custom-chat", messages=msgs("third"),
                                max_tokens=5)
            _wait(lambda: len(waiting) == 1)             # c waits for a's row
            a.close()                                    # leaves mid-stream: its row goes to c
            drawn = calls[0]["drawn"]
            assert third.result(timeout=10).usage.completion_tokens == 5
        assert [call["prompt"] for call in calls] == [sft_ids(tok, [], "first"), sft_ids(tok, [], "third")]
        assert calls[0]["closed"] and calls[0]["drawn"] < min(drawn + 50, 300) and server.scheduler.skipped == 1
        events = [json.loads(l)["event"] for l in log.read_text().splitlines()]
        assert events == ["skipped", "left", "done"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_stop_string_frees_its_row_at_once(model):
    """Authority: issue 33, "a finished or cancelled one leaves and frees its cache slot at once". The stop
    scan runs in the connection's thread (serve.py): the stop it finds frees the row within a few steps, not
    at max_tokens; the text is the answer's up to the stop string, as alone."""
    calls, delay = [], [0.0]
    server = start(model, "chat", lambda rows: Recorded(model, rows, calls, delay), "--max-batch", 1)
    try:
        body = dict(messages=[{"role": "user", "content": "first"}], max_tokens=300, temperature=0)
        whole = json.loads(post(server, "/v1/chat/completions", body)[2])
        text = whole["choices"][0]["message"]["content"]
        assert whole["usage"]["completion_tokens"] > 250 and len(text) > 40      # greedy: no early <|endoftext|>
        stop = text[20:24]
        delay[0] = 0.002                                 # 2 ms a step: 300 steps would take 0.6 s
        got = json.loads(post(server, "/v1/chat/completions", dict(body, stop=stop))[2])
        assert got["choices"][0]["message"]["content"] == text[:text.find(stop)]
        assert got["choices"][0]["finish_reason"] == "stop"
        _wait(lambda: calls[1]["closed"])
        assert calls[1]["drawn"] < got["usage"]["completion_tokens"] + 100 < 250, calls[1]
    finally:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------------------------------
# continuous batching: the same text as alone, n choices, a full queue, a key, a row gone wrong


def test_decoder_rows_are_the_same_alone_or_interleaved(model):
    """Authority: issue 33, "the same text as alone": a request's ids with a given seed are identical alone
    and among others that arrive and leave at other times. Eight requests, greedy and sampled (top-k, top-p,
    a repetition penalty), through 3 rows: they queue, start at other steps, leave mid-way, reuse freed rows.
    The Decoder's step is four-row passes whatever the batch: ids to the id. A row alone is also generate's
    plain decoding with the same seed, draw for draw (both draw one uniform a sampled token, none when
    greedy); their logits differ by float32 rounding (generate's products are BLAS's), so the same ids
    unless a draw lands within that rounding of a boundary: never here."""
    P = pl.Params.init(CFG, 5)
    P.flat *= 4                                          # peaked distributions: a rounding slip would show
    rules = [pl.Sampling(0), pl.Sampling(1.0, 0), pl.Sampling(0.8, 40, 0.9), pl.Sampling(0, repetition_penalty=1.3),
             pl.Sampling(1.2, 20, repetition_penalty=1.2)]
    requests = [((0, 0, 1, 2, 2, 4, 7, 7)[i], [5 + i, 7, 11 * i % 50], 6 + 3 * i, rules[i % 5], 100 + i)
                for i in range(8)]                       # (arrival step, prompt, ids wanted, rule, seed)
    alone = [pl.decode_requests(ne.Decoder(P, 1), [(0, *r[1:])])[0] for r in requests]
    assert pl.decode_requests(ne.Decoder(P, 3), requests) == alone
    assert pl.decode_requests(ne.Decoder(P, 8), [(0, *r[1:]) for r in requests]) == alone   # all eight in one step
    for (_, prompt, n, sampling, seed), ids in zip(requests, alone):
        assert list(ne.generate(P, prompt, n, rng=np.random.default_rng(seed), sampling=sampling)) == ids
    assert len({tuple(a) for a in alone}) == 8


def test_decoder_samples_rows_together_as_sampling_does_one_by_one():
    """The CPU Decoder draws the rows of plain rules (temperature, top-k) together in a kernel of its own
    (_draw_plain): each row's id is pl.Sampling.sample's on that row with the row's own generator, to the id,
    over 300 draws of 12 rows of mixed rules and logits of several scales (ties and huge gaps included)."""
    P = pl.Params.init(pl.CONFIGS["tiny"], 0)
    rules = [pl.Sampling(0.7, 0), pl.Sampling(1.3, 5), pl.Sampling(1.0, 40), pl.Sampling(0), pl.Sampling(0.9, 40, 0.8),
             pl.Sampling(1.1, 1), pl.Sampling(0.8, 300)]
    rng = np.random.default_rng(0)
    dec = ne.Decoder(P, 12)
    for r in range(12):
        dec.rows[r] = [rules[r % 7], np.random.default_rng(r), [1, 2, 3]]
    ref = [(rules[r % 7], np.random.default_rng(r), [1, 2, 3]) for r in range(12)]
    for k in range(300):
        logits = (rng.standard_normal((12, P.cfg.vocab)) * (0.1, 1, 10, 100)[k % 4]).astype(np.float32)
        logits[:, :3] = logits[:, 3:4]                   # ties
        want = [s.sample(logits[r], ids, g) for r, (s, g, ids) in enumerate(ref)]
        for r, t in enumerate(want):
            ref[r][2].append(t)
        assert dec._sample(list(range(12)), logits).tolist() == want


def test_a_row_at_the_context_end_is_refused_not_written_past_it():
    """serve ends a row at the context (job.limit); the CPU Decoder also refuses a step past it, as the GPU's
    does, rather than write a key beyond its cache slot (its kernels do not check bounds)."""
    P = pl.Params.init(pl.CONFIGS["tiny"], 0)
    dec = ne.Decoder(P, 2)
    dec.start(0, list(range(1, P.cfg.ctx)), GREEDY, 0)          # ctx - 1 ids: one step fits
    dec.start(1, [1, 2], GREEDY, 0)
    dec.step([0, 1])
    with pytest.raises(AssertionError, match="past the context"):
        dec.step([0, 1])


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "engine-process"])
def test_a_row_whose_logits_go_nan_fails_alone(model, workers):
    """Authority: issue 33, "a NaN in one row's logits fails that request alone with a 500 and an error body,
    and the others finish"; the body in OpenAI's error shape (API reference, Error codes: 500, type
    server_error). The engine: a row whose cache holds NaN answers -1, its neighbours their ids as alone.
    The server: a request whose row answers -1 gets a 500 (streamed: an error event, no [DONE]), while the
    requests beside it get the text they get alone."""
    P, tok = model[0], model[1]
    dec = ne.Decoder(P, 3)
    prompts = [[5, 6], [7, 8, 9], [10]]
    firsts = [dec.start(r, p, GREEDY, 0) for r, p in enumerate(prompts)]
    dec.v[1, 1] = np.nan                                 # row 1's values in layer 1
    got = [firsts] + [dec.step([0, 1, 2]).tolist() for _ in range(3)]
    assert [g[1] for g in got[1:]] == [-1, -1, -1]
    for r in (0, 2):
        assert [g[r] for g in got] == list(ne.generate(P, prompts[r], 4, sampling=GREEDY))

    class Poisoned(ne.Decoder):                          # the row of a prompt holding "poison": -1 at its 3rd id
        def starts(self, items):
            self.poisoned = getattr(self, "poisoned", {})
            self.poisoned.update({row: "poison" in tok.decode(ids) and 2 for row, ids, *_ in items})
            return super().starts(items)

        def step(self, rows):
            ids = super().step(rows)
            for j, r in enumerate(rows):
                if self.poisoned[r] is not False:
                    self.poisoned[r] -= 1
                    ids[j] = -1 if self.poisoned[r] < 0 else ids[j]
            return ids

    server = start(model, "chat", lambda rows: Poisoned(P, rows), workers=workers)
    try:
        body = lambda text, **kw: dict(messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0, **kw)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            runs = [pool.submit(post, server, "/v1/chat/completions", body(t, stream=s))
                    for t, s in (("poison", False), ("fine", False), ("poison", True), ("also fine", True))]
            (s1, r1, raw1), (s2, _, raw2), (s3, _, raw3), (s4, _, raw4) = [f.result(timeout=30) for f in runs]
        err = json.loads(raw1)["error"]
        assert s1 == 500 and r1.getheader("Content-Type") == "application/json"
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error" and "finite" in err["message"]
        assert s3 == 200 and b'"server_error"' in raw3 and b"[DONE]" not in raw3
        want = lambda text: engine_text(model, sft_ids(tok, [], text), 12)[0]
        assert s2 == 200 and json.loads(raw2)["choices"][0]["message"]["content"] == want("fine")
        assert s4 == 200 and "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(raw4)) == \
            want("also fine")
    finally:
        server.shutdown()
        server.server_close()


def test_n_choices_are_rows_with_seeds_seed_plus_i(chat_server):
    """Authority: OpenAI's API reference, `n`: how many choices to generate for the input, each a choice with
    its index; usage counts every choice's tokens (the prompt once); streamed, each chunk's choice carries its
    index. Here choice i is the request with seed + i (serve.py's rule)."""
    c = client(chat_server)
    kw = dict(model="nanoeuler-custom-chat", prompt="It was", max_tokens=8, temperature=1.0)
    r = c.completions.create(n=3, seed=5, **kw)
    singles = [c.completions.create(seed=5 + i, **kw) for i in range(3)]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [s.choices[0].text for s in singles] and len({ch.text for ch in r.choices}) == 3
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    msgs = [{"role": "user", "content": "Name a colour."}]
    chunks = list(c.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=8, temperature=1.0, seed=9,
                                            n=2, stream=True, stream_options={"include_usage": True}))
    alone = [c.chat.completions.create(model=kw["model"], messages=msgs, max_tokens=8, temperature=1.0, seed=9 + i)
             for i in range(2)]
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == alone[i].choices[0].finish_reason
        assert "".join(m.delta.content or "" for m in mine) == alone[i].choices[0].message.content
    assert chunks[-1].usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_choices_that_end_apart_each_stream_to_their_end(model):
    """Authority: OpenAI's API reference, `n` and the chat completion chunk: each choice streams under its
    index to its own finish_reason; usage counts every choice's tokens. Choice 0 ends (<|endoftext|>) after 3
    ids, choice 1 after 40, 2 ms a step: the stream writes choice 1's text after choice 0 has ended."""
    tok = model[1]
    words = tok.encode(" one two three four five six seven eight nine ten" * 8)

    class Apart:                                         # choice i (seed i) draws words, then <|endoftext|>
        capacity, ctx, drawn = 2, CFG.ctx, {}

        def start(self, row, ids, sampling, seed):
            self.drawn[row] = (0, 3 if seed == 0 else 40)
            return self.step([row])[0]

        def step(self, rows):
            time.sleep(0.002)
            out = []
            for r in rows:
                k, n = self.drawn[r]
                self.drawn[r] = (k + 1, n)
                out.append(words[k] if k + 1 < n else tok.eot)
            return np.array(out)

        def free(self, row):
            pass

    server = start(model, "chat", lambda rows: Apart())
    try:
        status, _, raw = post(server, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], n=2,
                                                                   seed=0, stream=True, max_tokens=100,
                                                                   stream_options={"include_usage": True}))
        chunks = sse_chunks(raw)
        for i, n in ((0, 3), (1, 40)):
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
            assert "".join(m["delta"].get("content") or "" for m in mine) == tok.decode(words[:n - 1])
            assert [m["finish_reason"] for m in mine][-1] == "stop" and mine[-1]["delta"] == {}
        assert status == 200 and chunks[-1]["usage"]["completion_tokens"] == 43
    finally:
        server.shutdown()
        server.server_close()


def test_a_full_queue_answers_429_with_retry_after(model):
    """Authority: OpenAI's error codes guide, 429 "Rate limit reached for requests": pace your requests and
    retry (the openai package raises RateLimitError); RFC 9110 10.2.3: Retry-After gives the seconds to wait.
    One row, one place in the queue: the third request is refused at once, not left hanging."""
    openai = pytest.importorskip("openai")
    calls = []
    server = start(model, "chat", lambda rows: Recorded(model, rows, calls, [0.05]), "--max-batch", 1, "--max-queue", 1)
    port = server.server_address[1]
    try:
        body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=50, stream=True)
        a = _raw(port, body)
        _wait(lambda: len(calls) == 1)                   # a runs
        b = _raw(port, body)
        _wait(lambda: len(server.scheduler.waiting) == 1)   # b waits
        status, r, raw = post(server, "/v1/chat/completions", body)
        err = json.loads(raw)["error"]
        assert status == 429 and r.getheader("Retry-After") == "1" and r.getheader("Content-Type") == "application/json"
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            client(server).chat.completions.create(model="nanoeuler-custom-chat", **body)
        a.close()
        b.close()
        _wait(lambda: not server.scheduler.active and not server.scheduler.waiting)
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200    # room again
    finally:
        server.shutdown()
        server.server_close()


def test_the_engine_process_queues_refuses_and_frees_rows(model, tmp_path):
    """The serve mode's engine process (make_server(workers=1)), one row and one place in the queue: a
    streams; b waits; c is refused 429; b leaves while queued (skipped, never started) and d takes its
    place; a leaves mid-stream, so d gets the row and finishes; the log (the engine's lines relayed) says
    refused (c), skipped, left, done. A decoder that fails to start is one UserError, the engine process gone."""
    tok, log = model[1], tmp_path / "log.jsonl"
    server = start(model, "chat", lambda rows: Slow(tok), "--log", log, "--max-batch", 1, "--max-queue", 1,
                   workers=1)
    port, engine = server.server_address[1], server.scheduler
    try:
        body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=300, stream=True)
        a = _streaming(port, body)                       # a runs
        b = _raw(port, body)
        _wait(lambda: engine.waiting == 1)               # b waits
        status, r, raw = post(server, "/v1/chat/completions", body)
        assert status == 429 and r.getheader("Retry-After") == "1" and json.loads(raw)["error"]["code"] == \
            "rate_limit_exceeded"
        b.close()                                        # leaves while queued
        _wait(lambda: engine.waiting == 0 and engine.skipped == 1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            d = pool.submit(post, server, "/v1/completions", {"prompt": "x", "max_tokens": 5})
            _wait(lambda: engine.waiting == 1)           # d waits for a's row
            a.close()                                    # leaves mid-stream: its row goes to d
            status, _, raw = d.result(timeout=10)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == tok.decode(tok.encode(" word")[:1] * 5)
        _wait(lambda: len(log.read_text().splitlines()) == 4)
        assert [json.loads(l)["event"] for l in log.read_text().splitlines()] == ["refused", "skipped", "left", "done"]
    finally:
        server.shutdown()
        server.server_close()
    assert not engine.proc.is_alive()

    def broken(rows):
        raise pl.UserError("no device here")
    with pytest.raises(pl.UserError, match="no device here"):
        start(model, "chat", broken, workers=1)


class Slow:
    """A decoder of one row that draws " word" forever, 20 ms a step."""
    capacity, ctx = 1, CFG.ctx

    def __init__(self, tok):
        self.id = tok.encode(" word")[0]

    def start(self, row, ids, sampling, seed):
        return self.id

    def step(self, rows):
        time.sleep(0.02)
        return np.array([self.id] * len(rows))

    def free(self, row):
        pass


def test_max_queue_counts_every_workers_requests(model):
    """Three HTTP workers, one row, two places in the queue: a runs, b and c wait (on whichever workers took
    them), and every request beyond is refused 429 whichever worker takes it; b and c leave while queued and
    their places are free again (the engine takes them off the count)."""
    server = start(model, "chat", lambda rows: Slow(model[1]), "--max-batch", 1, "--max-queue", 2, workers=3)
    port, engine = server.server_address[1], server.scheduler
    try:
        body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=300, stream=True)
        a = _streaming(port, body)                       # a runs
        waiting = [_raw(port, body) for _ in range(2)]
        _wait(lambda: engine.waiting == 2)
        for _ in range(8):
            status, r, raw = post(server, "/v1/chat/completions", body)
            assert status == 429 and r.getheader("Retry-After") == "1", raw
        for s in waiting:
            s.close()
        _wait(lambda: engine.waiting == 0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            d = pool.submit(post, server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
            _wait(lambda: engine.waiting == 1)
            a.close()
            assert d.result(timeout=10)[0] == 200
    finally:
        server.shutdown()
        server.server_close()
    assert not engine.proc.is_alive() and not any(w.is_alive() for w in engine.workers)


def test_each_worker_gets_its_own_requests_reports(model, chat_server):
    """Three HTTP workers busy at once over one engine: 24 requests (seeds 0..23, streamed or not), each
    answer the one the same request gets alone from a one-process server, answered by more than one worker
    (an answer's id says whose: worker w counts from w * 10**12)."""
    server = start(model, "chat", None, "--max-batch", 8, workers=3)

    def one(srv, i):
        body = dict(prompt=f"It was {i}", max_tokens=8, temperature=1.0, seed=i, stream=i % 2 == 1)
        status, _, raw = post(srv, "/v1/completions", body)
        assert status == 200, raw
        if body["stream"]:
            chunks = sse_chunks(raw)
            return "".join(c["choices"][0]["text"] for c in chunks), chunks[0]["id"]
        r = json.loads(raw)
        return r["choices"][0]["text"], r["id"]

    try:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            together = list(pool.map(lambda i: one(server, i), range(24)))
    finally:
        server.shutdown()
        server.server_close()
    alone = [one(chat_server, i)[0] for i in range(24)]
    assert [text for text, _ in together] == alone and len(set(alone)) > 16
    assert len({int(ident.rsplit("-", 1)[1]) // 10 ** 12 for _, ident in together}) > 1


def test_api_key_locks_the_api_not_the_page(model, monkeypatch):
    """Authority: OpenAI's API reference, Authentication: `Authorization: Bearer KEY` on every request; its
    error codes guide: 401 "Invalid Authentication" / "Incorrect API key provided", in the error object
    (the openai package raises AuthenticationError); vLLM's and llama.cpp's servers lock the same way
    (--api-key). NANOEULER_API_KEY is the flag's default. The page itself is public (it asks for the key)."""
    openai = pytest.importorskip("openai")
    monkeypatch.setenv("NANOEULER_API_KEY", "s3cret")
    assert serve_args().api_key == "s3cret"
    monkeypatch.delenv("NANOEULER_API_KEY")
    assert serve_args().api_key is None
    server = start(model, "chat", None, "--api-key", "s3cret")
    port = server.server_address[1]
    try:
        for method, path, headers in (("GET", "/v1/models", {}), ("POST", "/v1/completions", {}),
                                      ("POST", "/v1/completions", {"Authorization": "Bearer wrong"}),
                                      ("POST", "/v1/chat/completions", {"Authorization": "s3cret"})):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request(method, path, json.dumps({"prompt": "x"}), headers)
            r = conn.getresponse()
            err = json.loads(r.read())["error"]
            assert r.status == 401 and r.getheader("Content-Type") == "application/json"
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/")
        assert conn.getresponse().status == 200
        c = client(server)                               # api_key "none"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        c = c.with_options(api_key="s3cret")
        assert c.completions.create(model="nanoeuler-custom-chat", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    finally:
        server.shutdown()
        server.server_close()
    assert serve.loopback("127.0.0.1") and serve.loopback("::1") and serve.loopback("localhost")
    assert not serve.loopback("0.0.0.0") and not serve.loopback("192.168.1.4") and not serve.loopback("example.org")


def test_every_interface_without_a_key_is_warned_of(model, monkeypatch, capsys):
    """Authority: issue 33, "starting on a non-loopback --host without a key prints a warning"."""
    P, tok, d = model

    def interrupted(*args, **kw):
        raise KeyboardInterrupt                          # serve_forever stopped at once, as by Ctrl-C
    monkeypatch.setattr(serve.Server, "serve_forever", interrupted)
    for flags, warned in ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "k"], False), ([], False)):
        with pytest.raises(KeyboardInterrupt):
            serve.run(serve_args("--ckpt", d / "chat.npz", "--port", 0, *flags), tok, P.cfg, True,
                      lambda rows: ne.Decoder(P, rows or 2), "CPU")
        out, err = capsys.readouterr()
        assert "[stopped]" in out and ("warning: 0.0.0.0 is reachable" in err and "--api-key" in err) == warned, err


def test_ignore_eos_runs_to_max_tokens(scripted, model):
    """Authority: vLLM's SamplingParams.ignore_eos: "whether to ignore the EOS token and continue generating
    tokens after the EOS token is generated" (load tests use it so every answer has max_tokens tokens)."""
    tok = model[1]
    reply = tok.encode(SCRIPT["Say hello."][0]) + [tok.eot]
    ids = (reply * 3)[:40]
    status, _, raw = post(scripted, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                              "max_tokens": 40, "ignore_eos": True})
    got = json.loads(raw)
    assert status == 200 and got["usage"]["completion_tokens"] == 40 and got["choices"][0]["finish_reason"] == "length"
    assert got["choices"][0]["message"]["content"] == tok.decode([t for t in ids if t != tok.eot])


# ----------------------------------------------------------------------------------------------------
# validation: 4xx answers with OpenAI's error body

LONG = "word " * 400                                     # ~400 tokens: more than the context of 384
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("method,path,body,status,param,code", [
    ("POST", "/v1/chat/completions", "{", 400, None, "invalid_json"),
    ("POST", "/v1/chat/completions", "[1, 2]", 400, None, None),
    ("POST", "/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),
    ("POST", "/v1/chat/completions", {}, 400, "messages", None),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                                   {"role": "assistant", "content": "b"}]}, 400, "messages", None),
    ("POST", "/v1/completions", {}, 400, "prompt", None),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("POST", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 384}, 400, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("POST", "/v1/chat/completions", dict(CHAT, max_completion_tokens=10**6), 400, "max_completion_tokens", None),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("POST", "/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed", None),
    ("POST", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("POST", "/v1/completions", {"prompt": "x", "n": 5}, 400, "n", None),          # more than the 4 rows
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("POST", "/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", None),
    ("POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("POST", "/v1/chat/completions", dict(CHAT, model="gpt-4"), 404, "model", "model_not_found"),
    ("GET", "/v1/models/gpt-4", None, 404, "model", "model_not_found"),
    ("GET", "/v1/nothing", None, 404, None, "unknown_url"),
    ("POST", "/v1/models", {}, 404, None, "unknown_url"),
    ("GET", "/v1/chat/completions", None, 405, None, "method_not_allowed"),
    ("DELETE", "/v1/models", None, 501, None, None),
])
def test_mistakes_get_openai_error_bodies(chat_server, method, path, body, status, param, code):
    conn = http.client.HTTPConnection("127.0.0.1", chat_server.server_address[1], timeout=10)
    conn.request(method, path, body if isinstance(body, str) or body is None else json.dumps(body))
    r = conn.getresponse()
    err = json.loads(r.read())["error"]
    assert r.status == status and r.getheader("Content-Type") == "application/json"
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err


def test_a_prompt_longer_than_the_context_keeps_its_tail(model, chat_server, capsys):
    """Authority: issue 33, "a request whose prompt exceeds the context keeps its tail, as `sample` does":
    the last tokens that pipeline.fit_prompt keeps (room for max_tokens, at most half the context, at least
    one), as text, as token ids and as a chat's last turn (its earlier turns dropped first); usage counts the
    tokens kept; the answer is the engine's after them; max_tokens beyond the room ends it there ("length")."""
    tok, ctx = model[1], CFG.ctx
    ids = tok.encode(LONG)
    assert len(ids) > ctx
    for max_tokens in (8, 300):
        keep = pl.fit_prompt(ids, ctx, max_tokens)
        assert len(keep) == ctx - min(max_tokens, ctx // 2) and keep == ids[-len(keep):]
        text = tok.decode([t for t in ne.generate(model[0], keep, min(max_tokens, ctx - len(keep)), sampling=GREEDY)
                           if t != tok.eot])
        for prompt in (LONG, ids):
            status, _, raw = post(chat_server, "/v1/completions", dict(prompt=prompt, max_tokens=max_tokens,
                                                                       temperature=0, ignore_eos=True))
            got = json.loads(raw)
            assert status == 200 and got["usage"]["prompt_tokens"] == len(keep), got
            assert got["usage"]["completion_tokens"] == min(max_tokens, ctx - len(keep))
            assert got["choices"][0]["finish_reason"] == "length" and got["choices"][0]["text"] == text
    turn = sft_ids(tok, [], LONG)
    status, _, raw = post(chat_server, "/v1/chat/completions", dict(messages=[
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": LONG}], max_tokens=8, temperature=0))
    got = json.loads(raw)
    assert status == 200 and got["usage"]["prompt_tokens"] == ctx - 8
    assert got["choices"][0]["message"]["content"] == engine_text(model, turn[-(ctx - 8):], 8)[0]
    capsys.readouterr()                                  # (fit_prompt's line)


def test_openai_client_raises_on_mistakes(chat_server):
    openai = pytest.importorskip("openai")
    c = client(chat_server)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="nanoeuler-custom-chat", prompt="x", max_tokens=5000)


# ----------------------------------------------------------------------------------------------------
# the wire format, byte for byte, against OpenAI's API reference. A scripted engine draws known ids, so
# each answer's text, finish_reason and token counts are known before the request is sent.

SCRIPT = {                  # a prompt holding the key -> (the reply's text, closed by <|endoftext|>?)
    "Say hello.": ("Hello there, friend. Goodbye now.", True),
    "Count.": ("one two three four five six seven eight nine ten ", False),     # repeated without end
}


@pytest.fixture(scope="module")
def scripted(model):
    """A chat server whose engine draws the ids of the SCRIPT reply its prompt holds, then <|endoftext|> or
    the reply again, never more than asked for; in an engine process, as the serve mode runs it (its ids,
    ends and stop strings cross the relay)."""
    tok = model[1]

    class Scripted:
        capacity, ctx, streams = 4, CFG.ctx, {}

        def start(self, row, ids, sampling, seed):
            text, end = next(v for k, v in SCRIPT.items() if k in tok.decode(ids))
            self.streams[row] = itertools.cycle(tok.encode(text) + ([tok.eot] if end else []))
            return next(self.streams[row])

        def step(self, rows):
            return np.array([next(self.streams[r]) for r in rows])

        def free(self, row):
            del self.streams[row]

    server = start(model, "chat", lambda rows: Scripted(), workers=1)
    yield server
    server.shutdown()
    server.server_close()


def post(server, path, body):
    """A POST by http.client, nothing between the test and the bytes; -> (status, response, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r, data


def sse_chunks(raw):
    """An OpenAI stream read strictly (server-sent events as OpenAI sends them): the body is nothing but
    `data: {json}\\n\\n` events, and its last event, and only that one, is `data: [DONE]\\n\\n`."""
    events, pos = [], 0
    for m in re.finditer(rb"data: ([^\n]*)\n\n", raw):
        assert m.start() == pos, raw[pos:m.start() + 20]             # nothing between or around events
        events.append(m[1])
        pos = m.end()
    assert pos == len(raw) and raw.endswith(b"\n\ndata: [DONE]\n\n"), raw[-80:]
    assert events.count(b"[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def expected(tok, key, max_tokens, stop=()):
    """What OpenAI's rules make of the scripted reply: the text up to the earliest stop string (not
    included), the finish_reason ("stop": the model ended its answer or a stop string came; "length":
    max_tokens did) and completion_tokens: every id drawn, the closing <|endoftext|> too (a generated
    token, which max_tokens counts: never more than max_tokens)."""
    text, end = SCRIPT[key]
    ids = (tok.encode(text) + [tok.eot] if end else tok.encode(text) * 4)[:max_tokens]
    for k in range(1, len(ids) + 1):
        drawn = tok.decode([t for t in ids[:k] if t != tok.eot])
        hits = [drawn.find(s) for s in stop if s in drawn]
        if hits:
            return drawn[:min(hits)], "stop", k
        if ids[k - 1] == tok.eot:
            return drawn, "stop", k
    return tok.decode(ids), "length", len(ids)


def check_head(obj, kind):
    """id, object, created (Unix seconds) and model, on an answer and on each chunk."""
    assert obj["object"] == kind and obj["model"] == "nanoeuler-custom-chat" and obj["id"].startswith(
        "chatcmpl-" if kind.startswith("chat") else "cmpl-")
    assert isinstance(obj["created"], int) and abs(obj["created"] - time.time()) < 600


WIRE_CASES = [                                   # (prompt key, max_tokens, stop)
    ("Say hello.", 60, None),                    # ends with <|endoftext|>: "stop", the end token counted
    ("Say hello.", 25, None),                    # max_tokens reached just before the end token: "length"
    ("Say hello.", 26, None),                    # the end token is the last allowed: "stop"
    ("Count.", 7, None),                         # max_tokens: "length"
    ("Count.", 60, "four"),                      # a stop string made of three tokens
    ("Count.", 60, ["seven", "nine", "three", "e f"]),   # four stop strings: the earliest in the text wins
    ("Count.", 60, ["fi", "t"]),                 # "t" of " two" comes first though listed last
    ("Say hello.", 60, ["he", " t"]),            # both end in the token " the": " t" begins first
]
WIRE_IDS = [f"{k.split()[0].strip('.').lower()}-{n}-{len([s] if isinstance(s, str) else s or [])}stops"
            for k, n, s in WIRE_CASES]


@pytest.mark.parametrize("key,max_tokens,stop", WIRE_CASES, ids=WIRE_IDS)
def test_chat_wire_format_finish_reason_and_usage(model, scripted, key, max_tokens, stop):
    """Authority: OpenAI's API reference for POST /v1/chat/completions: the chat completion object
    (object "chat.completion", choices[0].message {role "assistant", content}, finish_reason "stop" when the
    model hit a natural stop point or a provided stop sequence, "length" when max_tokens was reached; usage
    {prompt_tokens, completion_tokens, total_tokens}); `stop`: up to 4 sequences, the returned text does not
    contain the stop sequence; streamed, the chat completion chunk object (object "chat.completion.chunk",
    one id for all chunks, the first delta's role "assistant", finish_reason null until the last choice
    chunk) as server-sent events (Content-Type text/event-stream, `data: {json}` and a blank line each,
    ended by `data: [DONE]`), and with stream_options.include_usage one more chunk before [DONE] whose
    choices are empty and whose usage is the request's."""
    tok = model[1]
    text, finish, n = expected(tok, key, max_tokens, [stop] if isinstance(stop, str) else stop or [])
    usage = {"prompt_tokens": len(sft_ids(tok, [], key)), "completion_tokens": n,
             "total_tokens": len(sft_ids(tok, [], key)) + n}
    body = {"model": "nanoeuler-custom-chat", "messages": [{"role": "user", "content": key}],
            "max_tokens": max_tokens, **({"stop": stop} if stop else {})}
    status, r, raw = post(scripted, "/v1/chat/completions", body)
    assert status == 200 and r.getheader("Content-Type") == "application/json"
    answer = json.loads(raw)
    check_head(answer, "chat.completion")
    assert answer["choices"] == [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish}]
    assert answer["usage"] == usage

    status, r, raw = post(scripted, "/v1/chat/completions",
                          dict(body, stream=True, stream_options={"include_usage": True}))
    assert status == 200 and r.getheader("Content-Type").split(";")[0] == "text/event-stream"
    chunks = sse_chunks(raw)
    for c in chunks:
        check_head(c, "chat.completion.chunk")
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != answer["id"]
    *choices, last = chunks
    assert choices[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in choices)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in choices) == text
    assert [c["choices"][0]["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [finish]
    assert last["choices"] == [] and last["usage"] == usage
    assert all(c.get("usage") is None for c in choices)

    status, r, raw = post(scripted, "/v1/chat/completions", dict(body, stream=True))    # no usage chunk unasked
    assert status == 200 and all(c["choices"] for c in sse_chunks(raw))


@pytest.mark.parametrize("key,max_tokens,stop", WIRE_CASES[::2], ids=WIRE_IDS[::2])
def test_completions_wire_format(model, scripted, key, max_tokens, stop):
    """Authority: OpenAI's API reference for the (legacy) POST /v1/completions: object "text_completion",
    choices[0] {text, index, logprobs, finish_reason}, usage; streamed, the same object per event, text
    pieces, ended by `data: [DONE]`."""
    tok = model[1]
    text, finish, n = expected(tok, key, max_tokens, [stop] if isinstance(stop, str) else stop or [])
    body = {"prompt": key, "max_tokens": max_tokens, **({"stop": stop} if stop else {})}
    status, r, raw = post(scripted, "/v1/completions", body)
    answer = json.loads(raw)
    check_head(answer, "text_completion")
    assert answer["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    assert answer["usage"] == {"prompt_tokens": len(tok.encode(key)), "completion_tokens": n,
                               "total_tokens": len(tok.encode(key)) + n}
    status, r, raw = post(scripted, "/v1/completions", dict(body, stream=True))
    assert status == 200 and r.getheader("Content-Type").split(";")[0] == "text/event-stream"
    chunks = sse_chunks(raw)
    for c in chunks:
        check_head(c, "text_completion")
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [finish]


@pytest.mark.parametrize("n_stops", [1, 4, 5])
def test_up_to_four_stop_strings(scripted, n_stops):
    """Authority: OpenAI's API reference, `stop`: "Up to 4 sequences where the API will stop generating
    further tokens" (serve.MAX_STOPS); more is a 400 with OpenAI's error object, param "stop"."""
    stops = ["nine", "eight", "seven", "six", "five"][:n_stops]
    status, r, raw = post(scripted, "/v1/completions", {"prompt": "Count.", "max_tokens": 60, "stop": stops})
    if n_stops <= 4:
        got = json.loads(raw)["choices"][0]
        want = "one two three four five " + ("six seven eight " if n_stops == 1 else "")
        assert status == 200 and (got["text"], got["finish_reason"]) == (want, "stop")
    else:
        assert status == 400 and r.getheader("Content-Type") == "application/json"
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert (err["type"], err["param"]) == ("invalid_request_error", "stop")


def test_openai_client_reads_the_scripted_answers(model, scripted):
    """Authority: the openai package, OpenAI's own client: its parsed objects carry what the raw tests read."""
    c, tok = client(scripted), model[1]
    msgs = [{"role": "user", "content": "Say hello."}]
    r = c.chat.completions.create(model="nanoeuler-custom-chat", messages=msgs, max_tokens=60)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (SCRIPT["Say hello."][0], "stop")
    assert r.usage.completion_tokens == len(tok.encode(SCRIPT["Say hello."][0])) + 1
    chunks = list(c.chat.completions.create(model=r.model, messages=msgs, max_tokens=60, stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    r = c.completions.create(model=r.model, prompt="Count.", max_tokens=60, stop=["six", "two"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("one ", "stop")


# ----------------------------------------------------------------------------------------------------
# the command line


def _one_error(capsys, args):
    rc = ne.main(args)
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_cli_mistakes_are_one_line(model, capsys, tmp_path):
    ckpt = str(model[2] / "chat.npz")
    assert "missing.npz" in _one_error(capsys, ["serve", "--ckpt", str(tmp_path / "missing.npz")])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "in use" in _one_error(capsys, ["serve", "--ckpt", ckpt, "--port", str(port)])
    assert "--port" in _one_error(capsys, ["serve", "--ckpt", ckpt, "--port", "70000"])
    assert "--temperature" in _one_error(capsys, ["serve", "--ckpt", ckpt, "--temperature", "-1"])
    assert "--hots" in _one_error(capsys, ["serve", "--ckpt", ckpt, "--hots", "0.0.0.0"])
    assert "--log" in _one_error(capsys, ["serve", "--ckpt", ckpt, "--port", "0", "--log", str(tmp_path / "no/log")])


def _serve_process(script, ckpt, *flags):
    """The serve mode in its own process; -> (process, port) once it says where it listens."""
    p = subprocess.Popen([sys.executable, str(ROOT / script), "serve", "--ckpt", str(ckpt), "--port", "0", *flags],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=ctrl_c_as_from_a_shell)
    line = p.stdout.readline()
    m = re.search(r"at http://([\d.]+):(\d+)/", line)
    if not m:
        p.kill()
        pytest.fail(f"the server did not start: {line}{p.communicate()[1]}")
    return p, m.group(1), int(m.group(2))


def _stop(p):
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=10)
    return p.returncode, out, err


def _stat(pid):
    """The fields of /proc/PID/stat after the process's name (0: its state, 19: its start time)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _children(pid):
    """A process's children, oldest first (the serve mode's: its engine process, then its other workers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    return sorted(kids, key=lambda k: (int(_stat(k)[19]), k))


def _gone(pid):
    return not os.path.exists(f"/proc/{pid}") or _stat(pid)[0] == "Z"


def test_cli_serves_on_localhost_and_stops_on_ctrl_c(model):
    """And its engine process and other HTTP workers end with it."""
    p, host, port = _serve_process("nanoeuler.py", model[2] / "chat.npz", "--temperature", "0", "--workers", "2")
    kids = _children(p.pid)
    try:
        assert host == "127.0.0.1" and len(kids) == 2
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "It was", "max_tokens": 5}))
        r = json.loads(conn.getresponse().read())
        assert r["choices"][0]["text"] == engine_text(model, model[1].encode("It was"), 5)[0]   # --temperature 0
    finally:
        rc, out, err = _stop(p)
    assert rc == 130 and "[stopped]" in out and "done /v1/completions" in err and all(map(_gone, kids))


def test_the_cpu_engine_runs_in_a_fork_of_a_process_that_used_its_threads():
    """serve forks its engine process, in a test after other tests have run the CPU engine: the child must
    get threads of its own (a fork has none of the pool's, and would wait on them forever)."""
    for _ in range(3):
        ne.per_part(lambda i, part: i, 8)
    time.sleep(0.1)                                      # (every worker idle again)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if ne.per_part(lambda i, part: i, 8) == list(range(min(8, ne.n_threads()))) else 1)
    t0 = time.time()
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.time() - t0 > 10:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child waited on its parent's threads")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_no_process_of_the_server_outlives_it(model):
    """The serve mode's engine process (the decoder, and on a GPU its memory) and its other HTTP workers end
    when the server (worker 0) is killed outright (no Ctrl-C, no cleanup): the engine reads each worker's
    closed pipe, not a copy of its end; a worker sees its parent gone. A worker killed alone leaves its
    requests and the others serve on; an engine killed fails the requests (500), the workers stay theirs."""
    ckpt, body = model[2] / "chat.npz", json.dumps({"prompt": "It was", "max_tokens": 3})

    def status(port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body)
        return conn.getresponse().status

    p, _, port = _serve_process("nanoeuler.py", ckpt, "--workers", "3")
    try:
        engine, *workers = _children(p.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        _wait(lambda: _gone(workers[0]))
        assert [status(port) for _ in range(6)] == [200] * 6
    finally:
        p.kill()
        p.communicate(timeout=10)
    _wait(lambda: _gone(engine) and _gone(workers[1]), timeout=10)

    p, _, port = _serve_process("nanoeuler.py", ckpt, "--workers", "2")
    try:
        engine, worker = _children(p.pid)
        os.kill(engine, signal.SIGKILL)
        _wait(lambda: _gone(engine))
        assert [status(port) for _ in range(6)] == [500] * 6
    finally:
        p.kill()
        p.communicate(timeout=10)
    _wait(lambda: _gone(worker), timeout=10)


# ----------------------------------------------------------------------------------------------------
# the GPU engine behind the same server (skips without a GPU)


@pytest.mark.gpu
def test_gpu_engine_serves(model):
    """The GPU engine's server (raw HTTP: the device machine has no openai package): greedy chat is the CPU
    engine's text; seeds repeat; streamed equals whole; 24 seeded requests at once (continuous batching)
    each get their text alone; n choices are the seeds seed + i."""
    p, host, port = _serve_process("nanoeuler_cuda.py", model[2] / "chat.npz")
    at = type("At", (), {"server_address": (host, port)})
    try:
        ids = sft_ids(model[1], [], "Name a colour.")
        status, _, raw = post(at, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour."}],
                                                           "max_tokens": 8, "temperature": 0})
        r = json.loads(raw)
        assert status == 200 and r["choices"][0]["message"]["content"] == engine_text(model, ids, 8)[0]   # the CPU's
        assert r["usage"]["prompt_tokens"] == len(ids)

        def ask(seed, i=0, **kw):
            body = dict(prompt=f"It was {i}" if i else "It was", max_tokens=4 + i % 13, temperature=(1.0, 0)[i % 2],
                        seed=seed, **kw)
            status, _, raw = post(at, "/v1/completions", body)
            assert status == 200, raw
            return ["".join(c["choices"][0]["text"] for c in sse_chunks(raw))] if kw.get("stream") else \
                [c["text"] for c in json.loads(raw)["choices"]]
        text = ask(5)[0]
        assert text == ask(5)[0] != ask(6)[0] and ask(5, stream=True) == [text]
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            together = list(pool.map(lambda i: ask(i, i)[0], range(24)))
        assert together == [ask(i, i)[0] for i in range(24)]
        assert ask(5, n=3) == [text, ask(6)[0], ask(7)[0]]
    finally:
        rc, out, err = _stop(p)
    assert rc == 130 and "[stopped]" in out, err                  # Ctrl-C: 130, as every mode


# ----------------------------------------------------------------------------------------------------
# the chat page in headless Chromium


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_page_streams_a_conversation_stops_and_starts_over(model, browser):
    calls, delay = [], [0.005]
    server = start(model, "chat", lambda rows: Recorded(model, rows, calls, delay))
    page = browser.new_page(viewport={"width": 900, "height": 640})
    page.set_default_timeout(10_000)
    try:
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        page.wait_for_function("document.querySelector('#model').textContent.includes('nanoeuler-custom-chat')")
        assert page.title() == "NanoEuler chat"
        page.click("summary")                            # the settings
        page.fill("#max-tokens", "40")
        page.fill("#temperature", "0")                   # greedy: the answer must be the engine's, to the character

        def ask(text, then_stop=False):
            with page.expect_request("**/v1/chat/completions") as req:
                page.fill("#input", text)
                page.keyboard.press("Enter")
            if then_stop:
                page.wait_for_function("document.querySelectorAll('.msg.assistant .text')[%d].textContent.length > 0"
                                       % (page.locator(".msg.assistant").count() - 1))
                page.click("#stop")
            page.wait_for_function("!document.body.dataset.busy")
            return req.value.post_data_json, page.locator(".msg.assistant .text").last.text_content()

        body, answer = ask("Name a colour.")
        assert body["stream"] is True and body["messages"] == [{"role": "user", "content": "Name a colour."}]
        assert answer == engine_text(model, sft_ids(model[1], [], "Name a colour."), 40)[0]
        assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s.*", page.text_content("#status"))
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "serve_chat.png"), full_page=True)
        assert (ARTIFACTS / "serve_chat.png").stat().st_size > 5000

        body, _ = ask("Name a fruit.")                   # the second turn carries the first
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert body["messages"][1]["content"] == answer

        delay[0] = 0.05                                  # slow enough to be stopped: 300 tokens would take 15 s
        page.fill("#max-tokens", "300")
        body, partial = ask("Tell a long story.", then_stop=True)
        assert "stopped" in page.text_content("#status") and page.is_enabled("#send")
        _wait(lambda: calls[-1]["closed"])               # the server stopped generating for the page
        assert calls[-1]["drawn"] < 100 and partial

        delay[0] = 0.0
        page.fill("#max-tokens", "20")
        body, _ = ask("Go on.")                          # the stopped answer stays in the conversation
        assert len(body["messages"]) == 7 and body["messages"][5]["content"] == partial
        page.click("#new")
        assert page.locator(".msg").count() == 0
        body, _ = ask("Hello again.")
        assert body["messages"] == [{"role": "user", "content": "Hello again."}]
    finally:
        page.close()
        server.shutdown()
        server.server_close()


def test_page_asks_for_the_api_key_once(model, browser):
    """A server locked by --api-key: the page asks for the key at its first 401 (a prompt), sends it as
    `Authorization: Bearer KEY` from then on, and does not ask again."""
    server = start(model, "chat", None, "--api-key", "s3cret")
    page = browser.new_page()
    page.set_default_timeout(10_000)
    asked = []
    page.on("dialog", lambda d: (asked.append(d.message), d.accept("s3cret")))
    try:
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        page.wait_for_function("document.querySelector('#model').textContent.includes('nanoeuler-custom-chat')")
        for text in ("Name a colour.", "Name a fruit."):
            with page.expect_request("**/v1/chat/completions") as req:
                page.fill("#input", text)
                page.keyboard.press("Enter")
            page.wait_for_function("!document.body.dataset.busy")
            assert req.value.headers["authorization"] == "Bearer s3cret"
        assert len(asked) == 1 and "API key" in asked[0] and not page.text_content("#error")
        assert page.locator(".msg.assistant").count() == 2
    finally:
        page.close()
        server.shutdown()
        server.server_close()
