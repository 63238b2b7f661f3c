"""
serve.py -- an OpenAI-compatible HTTP server and a web chat page, over either engine, decoding every
active request in one batch (continuous batching).

    python3 nanoeuler.py serve --ckpt out_chat [--host 127.0.0.1] [--port 8000]       # the CPU engine
    python3 nanoeuler_cuda.py serve --ckpt out_chat                                    # the GPU engine

Routes: GET / is the chat page (chat.html, beside this file); GET /v1/models and /v1/models/NAME; POST
/v1/chat/completions and /v1/completions, streamed as server-sent events (`data: {chunk}` lines, then
`data: [DONE]`) when the request says "stream": true. Honoured: model, max_tokens (or
max_completion_tokens), temperature, top_p, stop, seed, n (choice i draws with seed + i), stream,
stream_options.include_usage, and beyond OpenAI's set top_k, repetition_penalty and ignore_eos (vLLM's:
<|endoftext|> does not end the answer, so a load test's answers run their max_tokens); other fields are
ignored. A mistake gets a 4xx answer with OpenAI's error body {"error": {"message", "type", "param",
"code"}}: 401 without the --api-key (when one is set), 429 with Retry-After when --max-queue requests
already wait; a request whose logits go non-finite gets a 500 (streamed: an error event), the others go on.

Chat messages take the SFT template of CONTRACT.md (a chat checkpoint) or are joined as plain text (a base
checkpoint, which continues it), one turn per user message, as the chat mode does (pipeline.user_turn and
fit_turns): the oldest turns are dropped when the conversation outgrows the context. A prompt (or last
turn) longer than the context keeps its last tokens, leaving room to answer as sample does (fit_prompt);
usage counts the tokens kept. A system message goes in front of the next user message. Generation ends at <|endoftext|> or a stop string ("stop"), at
max_tokens or the context's end ("length").

The engine hands serve a decoder of `capacity` rows (--max-batch), used from the scheduler thread alone:

    capacity: int, ctx: int           # rows; the model's context (a row's prompt + ids <= ctx)
    start(row, ids, sampling, seed)   # prefill free row `row` with ids (1 <= len < ctx), its repetition
                                      # history = ids, its own generator np.random.default_rng(seed)
                                      # -> its first id (-1: the logits are not finite)
    starts(items) -> ids              # optional: start(*item) for each (row, ids, sampling, seed) at once
                                      # (the GPU packs the prompts in a few passes) -> their first ids
    step(rows) -> ids                 # rows: active rows, ascending; feeds each the id it returned last
                                      # -> an int array of each row's next id (-1: not finite). serve never
                                      # passes a row whose position would pass ctx
    free(row)                         # forget the row; its slot is reusable at once

Sampling is a pipeline.Sampling per row, drawn from the row's own generator (one uniform a sampled
token), from its own logits and history: a row's ids depend on its prompt, sampling and seed alone, never
on the rows beside it, so a request gets the same text alone or among others (the engines keep each row's
numerics independent of the batch). Speculative decoding is not used here.

One scheduler thread (Scheduler) loops: it starts queued requests in free rows (prefill and first id),
runs one step for every active row, appends each id to its row's list (per token nothing more than that
and integer checks: <|endoftext|>, max_tokens, the context's end), and frees an ended row at once. Each
connection has its own thread (the standard library's ThreadingHTTPServer: no dependency), which wakes
when its request has new ids, at most every FLUSH seconds, decodes all of them at once (UTF-8 cut between
tokens waits for its end), scans them for stop strings (a stop frees the row at the next step) and writes
the text in one piece. A client that closes its connection frees its place: a queued request is dropped,
a running one's rows are freed at the next step. The serve mode runs the scheduler and the decoder in a
process of their own (Engine, forked at the start; requests and retirements go to it through a pipe, and
a relay thread applies its reports to the jobs), so no step or prefill waits for the GIL that the
connection threads share: on an H200, 32 / 64 clients of big got 16% / 25% more tokens/s than with the
scheduler as a thread of the server's process (make_server's default, which the tests' fakes use). And it
takes requests in --workers HTTP processes (this one and forks of it, on the one listening socket, each
with a pipe of its own to the engine), so that a burst of requests is parsed and tokenized several at a
time, not one after another under one GIL (~0.4 ms each: 64 at once took 23-39 ms).

Sections: errors | requests | generation | HTTP | command line.
"""
import codecs
import collections
import errno
import hmac
import ipaddress
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

import pipeline as pl

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "chat.html")
MAX_BODY = 1 << 20          # bytes of a request body
MAX_STOPS = 4               # stop strings per request, as OpenAI allows
POLL = 0.1                  # seconds between two looks at a waiting client's socket
FLUSH = 0.02                # seconds at least between two writes of one stream: a busy batch's tokens
                            # go out a few at a time, not one wake-up and one write per token each
MAX_QUEUE = 256             # requests waiting for a row, by default; one more is answered 429
KEY_ENV = "NANOEULER_API_KEY"   # the API key's environment variable (--api-key)
WORKERS = 4                 # HTTP processes by default (--workers), at most half the cores: the engine and its
                            # clients need the rest (2 cores, CPU engine, 8 clients: 2 workers 3.0x one client's,
                            # 1 worker 3.3-3.5x; H200 host, 64 clients: 4 workers 62-68K tokens/s, 1: 45-54K)

# ----------------------------------------------------------------------------------------------------
# errors: each becomes an OpenAI-style JSON answer

class ApiError(Exception):
    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers or {}

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def busy(waiting):
    """The answer to a request beyond --max-queue: 429, and when to try again."""
    return ApiError(429, f"the server is busy: {waiting} requests are waiting; try again shortly",
                    code="rate_limit_exceeded", kind="rate_limit_error", headers={"Retry-After": "1"})


def _reject_constant(name):                       # json.loads reads NaN and Infinity unless told not to
    raise ValueError(f"{name} is not JSON")


# ----------------------------------------------------------------------------------------------------
# requests: a JSON body -> a Job (prompt ids, how many tokens, how to sample), or an ApiError

@dataclass(eq=False)
class Job:
    prompt: list                  # ids, fewer than ctx
    max_new: int
    sampling: pl.Sampling
    seed: int                     # choice i draws with seed + i
    stop: list                    # strings that end the text (not included)
    path: str                     # the route, for the log
    n: int = 1                    # choices: rows of the batch
    ignore_eos: bool = False      # <|endoftext|> does not end a choice (vLLM's ignore_eos: load tests)
    choices: list = field(default_factory=list)    # Choice i: its ids as the scheduler draws them
    ends: int = 0                 # choices the scheduler has ended (the connection compares it with its last look)
    error: str = None             # why the job failed (then it has no more ids)
    waiting: bool = False         # its connection's thread sleeps until the next id: wake it
    wake: threading.Event = field(default_factory=threading.Event)
    live: int = 0                 # its rows in the batch (the scheduler's count)
    limit: int = 0                # ids a choice may draw: max_tokens, or fewer where the context ends
    t0: float = 0.0
    id: int = -1                  # its number between the server and the engine process
    gone: bool = False            # its client left

    def __post_init__(self):
        self.choices = [Choice(self, i) for i in range(self.n)]

    def notify(self):
        """(the scheduler) It has new ids: wake its connection's thread if that sleeps until the next."""
        if self.waiting:
            self.waiting = False
            self.wake.set()


@dataclass(eq=False)
class Choice:
    """One of a job's answers, a row of the batch. The scheduler appends its ids (nothing else per token) and
    sets end; the connection's thread decodes every id since its last look, scans them for stop strings and
    tells the scheduler when one ends the text."""
    job: Job
    index: int
    ids: list = field(default_factory=list)        # drawn, in order (appended by the scheduler alone)
    end: str = None               # "stop" (<|endoftext|>) or "length", set by the scheduler after the last id
    row: int = -1


def _number(body, name, default, lo, hi, integer=False, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    what = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise ApiError(400, f"{name} must be {what}, not {json.dumps(v)}", name)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        raise ApiError(400, f"{name} {v} is out of range: give {what} in {'(' if lo_open else '['}{lo}, {hi}]", name)
    return v


def _text(v, param):
    """A message's content: a string, or OpenAI's list of {"type": "text", "text": ...} parts."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in v):
        return "".join(p["text"] for p in v)
    raise ApiError(400, f"{param} must be a string (or a list of text parts); this model reads text only", param)


def _messages(body):
    """messages -> [(user text, answer text)] of the earlier turns and the last user text. System messages go
    in front of the next user message; consecutive messages of one role are joined by a blank line."""
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "messages is missing: give a list of {role, content} objects", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    roles, texts, system = [], [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role {json.dumps(role)}: give system, user or assistant",
                           f"messages[{i}].role")
        if "content" not in m:
            raise ApiError(400, f"messages[{i}].content is missing", f"messages[{i}].content")
        text = _text(m["content"], f"messages[{i}].content")
        if role in ("system", "developer"):
            system.append(text)
            continue
        if role == "user" and system:
            text, system = "\n\n".join(system + [text]), []
        if roles and roles[-1] == role:
            texts[-1] += "\n\n" + text
        else:
            roles.append(role)
            texts.append(text)
    if not roles or roles[-1] != "user":
        raise ApiError(400, "the last message must be the user's: it is the one answered", "messages")
    if roles[0] != "user":
        raise ApiError(400, "the conversation must start with a user message (after any system message)", "messages")
    return list(zip(texts[:-1:2], texts[1::2])), texts[-1]


class Requests:
    """What the handlers share: the model's facts, the request defaults, the tokenizer (thread-safe) and the
    generator of seeds for requests that give none (behind a lock)."""

    def __init__(self, tok, ctx, chat, name, defaults, seed, capacity, vocab):
        self.tok, self.ctx, self.chat, self.name, self.defaults = tok, ctx, chat, name, defaults
        self.bytes = [tok.decode_bytes([t]) for t in range(max(vocab, tok.vocab_size))]   # id -> its bytes (a list
        self.bytes[tok.eot] = b""                 # reads faster than the tokenizer's dict); <|endoftext|> is no text
        self.capacity = capacity                  # rows of the batch: the most choices (n) of a request
        self.lock = threading.Lock()
        self.seeds = np.random.default_rng(seed)

    def job(self, body, chat):
        """Checks a request's fields (OpenAI's names and ranges) and builds its prompt."""
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"the model {json.dumps(model)} does not exist; this server has {self.name!r}",
                           "model", "model_not_found")
        n = _number(body, "n", 1, 1, self.capacity, integer=True)     # (its bound: the batch's rows, --max-batch)
        if not isinstance(body.get("ignore_eos", False), bool):
            raise ApiError(400, "ignore_eos must be true or false", "ignore_eos")
        if body.get("logprobs"):
            raise ApiError(400, "logprobs are not served", "logprobs")
        d, ctx = self.defaults, self.ctx
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_new = _number(body, key, min(d["max_tokens"], ctx - 1), 1, ctx - 1, integer=True)
        sampling = pl.Sampling(_number(body, "temperature", d["temperature"], 0, 2),
                               _number(body, "top_k", d["top_k"], 0, 1 << 31, integer=True),
                               _number(body, "top_p", d["top_p"], 0, 1, lo_open=True),
                               _number(body, "repetition_penalty", d["repetition_penalty"], 0, 100, lo_open=True))
        seed = body.get("seed")
        if seed is None:
            with self.lock:
                seed = int(self.seeds.integers(1 << 63))
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise ApiError(400, f"seed must be an integer, not {json.dumps(seed)}", "seed")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) and s for s in stop)):
            raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "stream must be true or false", "stream")
        if not isinstance(body.get("stream_options") or {}, dict):
            raise ApiError(400, "stream_options must be an object, as {\"include_usage\": true}", "stream_options")
        prompt = self.chat_prompt(body, max_new) if chat else self.text_prompt(body, max_new)
        path = "/v1/chat/completions" if chat else "/v1/completions"      # an empty prompt starts a document:
        return Job(prompt or [self.tok.eot], max_new, sampling, seed % (1 << 64), stop, path,        # <|endoftext|>
                   n, body.get("ignore_eos", False))

    def tail(self, ids, max_new):
        """A prompt that does not fit the context keeps its last tokens, leaving room to answer as sample does
        (pipeline.prompt_keep: max_tokens, at most half the context, at least one). One that fits is kept whole
        (max_tokens beyond the room left ends the answer there, "length")."""
        return ids if len(ids) < self.ctx else ids[len(ids) - pl.prompt_keep(self.ctx, max_new):]

    def chat_prompt(self, body, max_new):
        turns, last = _messages(body)
        tok, chat = self.tok, self.chat
        ids = [(pl.user_turn(tok, u, chat, first=i == 0), tok.encode(a) + ([tok.eot] if chat else []))   # a chat
               for i, (u, a) in enumerate(turns)]                  # checkpoint's answers close with <|endoftext|>
        new = self.tail(pl.user_turn(tok, last, chat, first=not turns), max_new)    # the oldest turns go first
        return pl.fit_turns(ids, new, self.ctx, max_new)[0]

    def text_prompt(self, body, max_new):
        p = body.get("prompt")
        if p is None:
            raise ApiError(400, "prompt is missing: give the text to continue", "prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            ids = self.tok.encode(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids = p
            if any(not 0 <= t < self.tok.vocab_size for t in ids):
                raise ApiError(400, f"prompt holds token ids outside 0..{self.tok.vocab_size - 1}", "prompt")
        else:
            raise ApiError(400, "prompt must be a string, or a list of token ids (one prompt per request)", "prompt")
        return self.tail(ids, max_new)


# ----------------------------------------------------------------------------------------------------
# generation: one scheduler thread runs every active request's rows a decode step at a time

class StopScan:
    """Text in, text safe to send out: holds back an ending that may begin a stop string; says when one is
    complete (the text before it goes out, the stop string does not)."""

    def __init__(self, stops):
        self.stops, self.text, self.sent = stops, "", 0

    def feed(self, piece):
        """-> (text to send, stopped)."""
        if not self.stops:                               # (the common case, once per token)
            return piece, False
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        end = min(hits) if hits else len(self.text) - max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out, bool(hits)

    def rest(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Scheduler:
    """Runs the jobs as rows of the decoder's batch: each turn of its loop starts the queued jobs that
    free rows can take (in arrival order; a job of n choices takes n rows), then runs one decoder step for
    every active row and appends each its id: per token nothing else than that and a few integer checks.
    A row ends at <|endoftext|> (unless ignore_eos), max_tokens or the context's end, and its slot is free
    for the next turn; a stop string (found by the connection's thread, which decodes the text) or a client
    that has gone ends its rows at the next turn (retire); a row whose logits are not finite fails its job alone."""

    def __init__(self, tok, decoder, log, max_queue, turn=None):      # log(record, the job it is about)
        self.tok, self.decoder, self.log, self.max_queue, self.turn = tok, decoder, log, max_queue, turn
        self.waiting, self.active = collections.deque(), {}          # jobs in arrival order; row -> Choice
        self.retiring = []                                           # (job, None): its client left; (job, choice): a stop
        self.free = list(range(decoder.capacity))[::-1]              # rows 0, 1, .. first; then the last freed
        self.cond, self.closed, self.skipped = threading.Condition(), False, 0
        self.thread = threading.Thread(target=self.loop, name="scheduler", daemon=True)
        self.thread.start()

    def submit(self, job):
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise busy(len(self.waiting))
            self.waiting.append(job)
            self.cond.notify()

    def retire(self, job, choice=None):
        """From a connection's thread: the client has gone (choice None), or a stop string ended that choice."""
        with self.cond:
            self.retiring.append((job, choice))
            self.cond.notify()

    def loop(self):
        while True:
            with self.cond:
                while not (self.closed or self.waiting or self.active or self.retiring):
                    self.cond.wait()
                if self.closed:
                    return
                retiring, self.retiring = self.retiring, []
                for job, ch in retiring:
                    if ch is None and job in self.waiting:
                        self.waiting.remove(job)
                        job.gone = True
                        self.skipped += 1
                        self.log(dict(event="skipped", path=job.path, note="the client left while it waited"), job)
                starting = []
                while self.waiting and self.waiting[0].n <= len(self.free):
                    job = self.waiting.popleft()
                    starting.append((job, [self.free.pop() for _ in range(job.n)]))
            for job, ch in retiring:
                if ch is not None and self.active.get(ch.row) is ch:          # a stop string: the text has ended
                    self.release(ch)
                elif ch is None and job.live:
                    self.end(job, "left", note="the client left")
            if starting:
                self.start(starting)
            if self.active:
                self.step()
            if self.turn:                                # (the engine process: what changed goes to the server)
                self.turn()

    def start(self, starting):
        """Prefills the starting jobs' rows (all at once where the decoder has starts()) and hands out their
        first ids."""
        items, choices = [], []
        for job, rows in starting:
            job.t0, job.limit = time.perf_counter(), min(job.max_new, self.decoder.ctx - len(job.prompt))
            for i, (ch, row) in enumerate(zip(job.choices, rows)):
                ch.row = row
                self.active[row] = ch
                items.append((row, job.prompt, job.sampling, (job.seed + i) % (1 << 64)))
                choices.append(ch)
            job.live = job.n
        many = getattr(self.decoder, "starts", None)
        try:
            firsts = many(items) if many else [self.decoder.start(*it) for it in items]
        except Exception as e:                           # an engine failure ends these requests, not the server
            for job, _ in starting:
                self.fail(job, f"generation failed: {type(e).__name__}: {e}")
            return
        for ch, t in zip(choices, firsts):
            if ch.job.error is not None:                 # (an earlier choice of its job failed it)
                continue
            if t >= 0:
                ch.ids.append(t)
            if not self.ended(ch, t):
                ch.job.notify()

    def step(self):
        rows = sorted(self.active)
        try:
            ids = self.decoder.step(rows).tolist()
        except Exception as e:
            for job in {ch.job for ch in self.active.values()}:
                self.fail(job, f"generation failed: {type(e).__name__}: {e}")
            return
        active, eot, ended = self.active, self.tok.eot, []
        for row, t in zip(rows, ids):                    # per token: an append and integer checks
            ch = active[row]
            if t < 0:                                    # (never in the list: a connection may read it now)
                ended.append((ch, t))
                continue
            drawn = ch.ids
            drawn.append(t)
            job = ch.job
            if t == eot or len(drawn) >= job.limit:
                ended.append((ch, t))
            else:                                        # its connection, if it sleeps: it has text now
                job.notify()
        for ch, t in ended:
            if self.active.get(ch.row) is ch and not self.ended(ch, t):
                ch.job.notify()                          # (<|endoftext|> under ignore_eos)

    def ended(self, ch, t):
        """After a row's id t: whether it ends there (<|endoftext|>, max_tokens, the context's end, or -1: the
        job fails). A choice the scheduler ends gets its end and wakes its connection."""
        job = ch.job
        if t < 0:
            self.fail(job, "generation failed: the model's logits are not finite (NaN or infinity)")
            return True
        if t == self.tok.eot and not job.ignore_eos:
            reason = "stop"
        elif len(ch.ids) >= job.limit:                   # max_tokens or the context's end
            reason = "length"
        else:
            return False
        self.release(ch)
        ch.end = reason
        job.ends += 1
        job.wake.set()
        return True

    def release(self, ch):
        del self.active[ch.row]
        self.decoder.free(ch.row)
        self.free.append(ch.row)
        ch.job.live -= 1

    def end(self, job, event, note):
        """Frees a job's rows at once."""
        for ch in job.choices:
            if self.active.get(ch.row) is ch:
                self.release(ch)
        self.log(dict(event=event, path=job.path, prompt_tokens=len(job.prompt),
                      completion_tokens=sum(len(ch.ids) for ch in job.choices), note=note), job)

    def fail(self, job, message):
        self.end(job, "failed", message)
        job.error = message
        job.wake.set()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify()


class Engine:
    """The scheduler and the decoder in a process of their own (the serve mode's; make_server(workers=W)),
    fed by W HTTP worker processes: the connection threads of one process share one GIL, and a scheduler
    thread beside them queued for it after every wait for the device (a starts() of 4 prompts: 9-14 ms inside
    serve against 1.5 alone, H200); one process's threads parsed a burst of 64 requests one after another
    (~0.4 ms each), W processes parse it W at a time. Each worker holds its Jobs; it sends the engine each
    job's fields and each retirement through a pipe of its own, and its relay thread applies what the engine
    sends back after each turn (new ids, ends, failures, log lines) to them, so a connection's thread reads
    its job as with the scheduler beside it. --max-queue counts every worker's waiting requests (queued: a
    worker adds its request, the engine takes it off when the request starts or is skipped). Forked: the
    decoder is made in the child (the parent must not have touched the GPU), by decoder_factory(rows)."""

    def __init__(self, decoder_factory, rows, tok, workers=1, max_queue=MAX_QUEUE):
        ctx = multiprocessing.get_context("fork")
        pipes = [ctx.Pipe() for _ in range(workers)]
        self.conns = [ours for ours, _ in pipes]             # worker w's end of its pipe
        self.conn = self.conns[0]                            # this process's (attach: worker w's)
        self.queued = ctx.Value("i", 0)                      # requests waiting for a row, every worker's
        self.proc = ctx.Process(target=_engine_main, args=([theirs for _, theirs in pipes], self.conns, decoder_factory,
                                                           rows, tok, self.queued), daemon=True, name="engine")
        self.proc.start()
        for _, theirs in pipes:
            theirs.close()
        try:
            kind, value = self.conn.recv()
        except EOFError:
            kind, value = "error", f"the engine process ended at its start (exit code {self.proc.exitcode})"
        if kind == "error":
            self.proc.join(5)
            raise pl.UserError(value)
        self.capacity, self.max_queue, self.jobs, self.ids = value, max_queue, {}, itertools.count()   # jobs: id ->
        self.lock, self.stopped, self.skipped, self.workers, self.log = threading.Lock(), False, 0, [], None  # Job

    @property
    def waiting(self):
        """Requests that wait for a row, every worker's."""
        return self.queued.value

    def serve(self, server):
        """Forks the server's other HTTP workers, copies of this process before any thread of it starts (each
        accepts on the one listening socket: a connection goes to the first that takes it), then relays to
        this one, worker 0."""
        self.log = server.log
        server.socket.setblocking(False)                 # a worker that loses the race for a connection goes back
        ctx = multiprocessing.get_context("fork")        # to its select(), not to wait in accept() for the next
        self.workers = [ctx.Process(target=_worker_main, args=(server, w, os.getpid()), daemon=True, name=f"http-{w}")
                        for w in range(1, len(self.conns))]
        for p in self.workers:
            p.start()
        self.attach(0)

    def attach(self, w):
        """This process is worker w: its pipe (the others' ends are closed here, so that the engine reads the
        end of each worker's pipe when that worker ends), its relay."""
        self.conn = self.conns[w]
        for c in self.conns:
            if c is not self.conn:
                c.close()
        threading.Thread(target=self.relay, name="relay", daemon=True).start()

    def send(self, *msg):
        with self.lock:
            try:
                self.conn.send(msg)
            except OSError:                              # the engine has gone: the relay fails its jobs
                pass

    def submit(self, job):
        with self.lock:
            if self.stopped:
                raise ApiError(500, "the engine process has stopped; restart the server", kind="server_error")
            with self.queued.get_lock():
                if self.queued.value >= self.max_queue:
                    raise busy(self.queued.value)
                self.queued.value += 1
            job.id = next(self.ids)
            self.jobs[job.id] = job
        self.send("submit", job.id, {k: getattr(job, k) for k in ENGINE_FIELDS})

    def retire(self, job, choice=None):
        self.send("retire", job.id, None if choice is None else choice.index)

    def relay(self):
        """Applies the engine's reports to the jobs, ids before ends (a connection reads ends first)."""
        while True:
            try:
                changes, logs = self.conn.recv()
            except (EOFError, OSError):
                break
            for jid, t0, chs, error, done in changes:
                job = self.jobs.get(jid)
                if job is None:
                    continue
                job.t0 = t0
                for i, ids, end in chs:
                    ch = job.choices[i]
                    ch.ids.extend(ids)
                    if end:
                        ch.end = end
                        job.ends += 1
                        job.wake.set()
                if error is not None:
                    job.error = error
                    job.wake.set()
                elif chs:
                    job.notify()
                if done:
                    del self.jobs[jid]
            for record in logs:
                self.skipped += record["event"] == "skipped"
                self.log(record)
        with self.lock:                                  # the engine has gone: its jobs fail, no more are taken
            self.stopped = True
        for job in list(self.jobs.values()):
            job.error = "generation failed: the engine process stopped"
            job.wake.set()

    def close(self):
        """(worker 0) Stops the other workers, then the engine process."""
        for p in self.workers:
            p.terminate()
        for p in self.workers:
            p.join(5)
        self.send("close")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


ENGINE_FIELDS = ("prompt", "max_new", "sampling", "seed", "path", "n", "ignore_eos")   # a Job as the engine needs it


def _worker_main(server, w, owner):
    """HTTP worker w >= 1 (forked by Engine.serve): serves until worker 0 stops it, or ends when its parent
    process (worker 0) has gone without a word (killed): no worker outlives the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C stops worker 0, which stops this
    r = server.requests
    r.seeds = np.random.Generator(r.seeds.bit_generator.jumped(w))    # seeds (of requests without one) and answer
    server.ids, server.owner = itertools.count(1 + w * 10 ** 12), owner   # ids of its own, not a copy of worker 0's
    server.scheduler.attach(w)
    server.serve_forever(poll_interval=0.2)


def _engine_main(conns, server_ends, decoder_factory, rows, tok, queued):
    """The engine process: makes the decoder, then feeds a Scheduler what the workers send (a job's id here:
    (its worker, its id there)) and reports each turn's changes (Reports). A worker that has gone (its pipe
    closed) leaves its jobs, as their clients would; the engine ends when worker 0 says so or every worker
    has gone."""
    for c in server_ends:                            # (else a worker's death would never close its pipe here)
        c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a Ctrl-C stops the server, which stops this
    try:
        decoder = decoder_factory(rows)
    except Exception as e:
        conns[0].send(("error", str(e) if isinstance(e, pl.UserError) else
                       f"the decoder failed: {type(e).__name__}: {e}"))
        return
    conns[0].send(("ready", decoder.capacity))
    reports = Reports(conns, queued)
    scheduler = Scheduler(tok, decoder, reports.log, float("inf"), turn=reports.send)   # (the workers queue)
    live = list(conns)
    while live:
        for conn in multiprocessing.connection.wait(live):
            w = conns.index(conn)
            try:
                msg = conn.recv()
            except EOFError:
                live.remove(conn)
                for (jw, _), (job, _) in list(reports.jobs.items()):
                    if jw == w:
                        scheduler.retire(job)
                continue
            if msg[0] == "submit":
                job = Job(**msg[2], stop=[], id=(w, msg[1]))
                reports.jobs[job.id] = [job, None]           # (before the scheduler may end it)
                scheduler.submit(job)
            elif msg[0] == "retire" and (w, msg[1]) in reports.jobs:
                job = reports.jobs[w, msg[1]][0]
                scheduler.retire(job, None if msg[2] is None else job.choices[msg[2]])
            elif msg[0] == "close":
                live.clear()
                break
    scheduler.close()
    scheduler.thread.join(10)


class Reports:
    """The engine's side of the relays: after each scheduler turn, one message to each worker with news: for
    each of its jobs with news (id, t0, [(choice, new ids, end)], error, done: no row left, or skipped) and
    its log lines. A started job has news at once (its first ids, or its failure); one that stops waiting
    (started or skipped) comes off the count of waiting requests."""

    def __init__(self, conns, queued):
        self.conns, self.queued, self.jobs, self.logs = conns, queued, {}, []   # jobs: (worker, id) -> [Job, ids
                                                         # sent per choice (-1: its end too), None while it waits]
        self.left = 0                                    # waits ended, not yet taken off queued

    def log(self, record, job):
        self.logs.append((job.id[0], record))

    def send(self):
        news = collections.defaultdict(lambda: ([], []))               # worker -> (changes, log lines)
        for key, entry in list(self.jobs.items()):
            job, sent = entry
            if sent is None:
                if not job.t0 and job.error is None:
                    if job.gone:                         # skipped while it waited
                        news[key[0]][0].append((key[1], 0.0, [], None, True))
                        del self.jobs[key]
                        self.left += 1
                    continue
                sent = entry[1] = [0] * job.n
                self.left += 1
            chs = []
            for ch, k in zip(job.choices, sent):
                if k >= 0 and (len(ch.ids) > k or ch.end):
                    chs.append((ch.index, ch.ids[k:], ch.end))
                    sent[ch.index] = -1 if ch.end else len(ch.ids)
            done = job.error is not None or job.live == 0
            if chs or done:
                news[key[0]][0].append((key[1], job.t0, chs, job.error, done))
            if done:
                del self.jobs[key]
        if self.left and self.queued.get_lock().acquire(False):    # never waits: a worker's thread that holds
            self.queued.value -= self.left                            # it may wait for its own process's GIL
            self.left = 0
            self.queued.get_lock().release()
        for w, record in self.logs:
            news[w][1].append(record)
        self.logs = []
        for w, msg in news.items():
            try:
                self.conns[w].send(msg)
            except OSError:                              # its worker has gone (the loop retires its jobs)
                pass


# ----------------------------------------------------------------------------------------------------
# HTTP: routes, OpenAI's response shapes, server-sent events, a disconnected client noticed

def client_gone(sock):
    """True when the peer has closed its end: the socket reads as ready but holds no byte."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"                    # keep-alive for the JSON answers; a stream closes its connection
    server_version = "nanoeuler"
    timeout = 60                                     # seconds a silent client may hold its thread

    def log_message(self, fmt, *args):               # the server logs requests itself (Server.log)
        pass

    # -- replies

    def reply(self, status, body, content_type="application/json", close=False, headers=None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")      # (which also closes it on this side)
        self.end_headers()
        self.wfile.write(data)

    def fail(self, e):
        self.server.log(dict(event="refused", path=getattr(self, "path", None), status=e.status, note=str(e)))
        self.reply(e.status, e.body(), close=True, headers=e.headers)    # the body may be unread: done

    def send_error(self, code, message=None, explain=None):    # the library's own errors, as JSON too
        self.fail(ApiError(code, message or HTTPStatus(code).phrase, code=None))

    # -- routes

    def locked(self, path):
        """An API request without the server's key: answered 401, as OpenAI answers a missing or wrong key."""
        key = self.server.api_key
        if not key or not path.startswith("/v1"):
            return False
        given = self.headers.get("Authorization") or ""
        if hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return False
        self.fail(ApiError(401, "Incorrect API key provided: give this server's key as `Authorization: Bearer KEY`"
                           if given else "You didn't provide an API key: give this server's key as "
                           "`Authorization: Bearer KEY`", code="invalid_api_key"))
        return True

    def do_GET(self):
        path = self.path.split("?")[0]
        if self.locked(path):
            return
        r, started = self.server.requests, self.server.started
        model = {"id": r.name, "object": "model", "created": started, "owned_by": "nanoeuler",
                 "context_length": r.ctx, "chat": r.chat}
        if path in ("/", "/index.html"):
            self.reply(200, self.server.page, "text/html; charset=utf-8")
        elif path == "/v1/models":
            self.reply(200, {"object": "list", "data": [model]})
        elif path == f"/v1/models/{r.name}":
            self.reply(200, model)
        elif path.startswith("/v1/models/"):
            self.fail(ApiError(404, f"the model {path[len('/v1/models/'):]!r} does not exist; this server has "
                                    f"{r.name!r}", "model", "model_not_found"))
        elif path in ("/v1/chat/completions", "/v1/completions"):
            self.fail(ApiError(405, f"{path} takes POST", code="method_not_allowed"))
        else:
            self.fail(ApiError(404, f"unknown URL: GET {path}", code="unknown_url"))

    def do_POST(self):
        path = self.path.split("?")[0]
        if self.locked(path):
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self.fail(ApiError(404, f"unknown URL: POST {path}", code="unknown_url"))
        chat = path == "/v1/chat/completions"
        try:
            body = self.body()
            job = self.server.requests.job(body, chat)
            self.server.scheduler.submit(job)
        except ApiError as e:
            return self.fail(e)
        if body.get("stream"):
            self.stream(job, chat, bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            self.answer(job, chat)

    def body(self):
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ApiError(400, "Content-Length is not a number") from None
        if n > MAX_BODY:
            raise ApiError(413, f"the body is {n} bytes, more than {MAX_BODY}")
        try:
            return json.loads(self.rfile.read(n), parse_constant=_reject_constant)
        except ValueError as e:                          # JSONDecodeError and UnicodeDecodeError both
            raise ApiError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None

    # -- the answer, whole or streamed

    def events(self, job, eager):
        """Lists of the job's events, [("text", i, s)..., ("done", i, finish_reason, ids drawn)..., ("error",
        message)], made in this thread from the ids the scheduler has appended since the last look, until the
        last: each look decodes every new id of a choice at once (a UTF-8 character cut between tokens waits
        for its end) and scans it for stop strings. A stream (eager) looks as soon as there are ids, at most
        every FLUSH seconds; an answer without stop strings waits for its ends. Returns early, retiring the
        job, when the client has closed its connection (the scheduler then drops it, queued or running)."""
        scheduler, table = self.server.scheduler, self.server.requests.bytes
        state = [(ch, codecs.getincrementaldecoder("utf-8")(errors="replace"), StopScan(job.stop)) for ch in job.choices]
        sent, counts = [0] * job.n, [0] * job.n          # ids of each choice decoded; drawn by an ended one
        looked, wrote, seen = time.monotonic(), 0.0, -1  # seen: job.ends at the last look
        while True:
            job.wake.clear()
            if job.ends == seen and job.error is None and wrote + FLUSH > time.monotonic():
                job.wake.wait(wrote + FLUSH - time.monotonic())         # (an end wakes it at once)
                job.wake.clear()
            job.waiting = eager
            if job.ends == seen and job.error is None and not (eager and any(
                    ch is not None and len(ch.ids) > k for (ch, _, _), k in zip(state, sent))):
                job.wake.wait(POLL)
            job.waiting = False
            ends, error = job.ends, job.error           # read before the ids: every id before an end is there
            events = []
            for j, (ch, dec, scan) in enumerate(state):
                if ch is None:
                    continue
                end, drawn, k = ch.end, ch.ids, sent[j]
                new = drawn[k:]
                sent[j] += len(new)
                hit = False
                if new and job.stop:                     # a stop string may end the text at any id
                    text = ""
                    for m, t in enumerate(new):
                        if table[t]:
                            piece, hit = scan.feed(dec.decode(table[t]))
                            text += piece
                            if hit:
                                n = k + m + 1
                                break
                else:
                    text = dec.decode(b"".join([table[t] for t in new])) if new else ""
                if end is not None and not hit:          # the end: what was held back was no stop string
                    piece, hit = scan.feed(dec.decode(b"", final=True))
                    text += piece if hit else piece + scan.rest()
                    n = len(drawn)
                if text:
                    events.append(("text", j, text))
                if hit or end is not None:
                    events.append(("done", j, "stop" if hit else end, n))
                    counts[j] = n
                    state[j] = (None, None, None)
                    if hit and end is None:
                        scheduler.retire(job, ch)        # free its row at the next step
            if error is not None:
                events.append(("error", error))
            if not events or time.monotonic() - looked > POLL:
                looked = time.monotonic()
                if client_gone(self.connection):
                    scheduler.retire(job)
                    return
            seen = ends
            if events:
                if all(ch is None for ch, _, _ in state) and error is None:
                    self.done(job, sum(counts), events[-1][2])
                yield events
                wrote = time.monotonic()
                if error is not None or all(ch is None for ch, _, _ in state):
                    return

    def done(self, job, tokens, reason):
        """The log's line of an answered job, written before its client can see the end."""
        dt = time.perf_counter() - job.t0
        self.server.log(dict(event="done", path=job.path, prompt_tokens=len(job.prompt), completion_tokens=tokens,
                             seconds=round(dt, 4), tokens_per_s=round(tokens / max(dt, 1e-9), 1), finish_reason=reason))

    def head(self, chat):
        """The fields every answer and chunk of one request carry."""
        ident = ("chatcmpl-" if chat else "cmpl-") + f"{self.server.started}-{next(self.server.ids)}"
        return {"id": ident, "created": int(time.time()), "model": self.server.requests.name}

    @staticmethod
    def usage(job, n):
        return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n}

    def answer(self, job, chat):
        head = self.head(chat)
        texts, finish, error = [[] for _ in range(job.n)], {}, None
        for events in self.events(job, eager=bool(job.stop)):
            for ev in events:
                if ev[0] == "text":
                    texts[ev[1]].append(ev[2])
                elif ev[0] == "done":
                    finish[ev[1]] = ev[2:]
                else:
                    error = ev[1]
        if error is not None:
            return self.fail(ApiError(500, error, kind="server_error"))
        if len(finish) < job.n:                          # the client has gone: nobody to answer
            self.close_connection = True
            return
        choices = []
        for i, parts in enumerate(texts):
            text = "".join(parts)
            choices.append(dict({"index": i, "message": {"role": "assistant", "content": text}} if chat
                                else {"index": i, "text": text}, logprobs=None, finish_reason=finish[i][0]))
        self.reply(200, dict(head, object="chat.completion" if chat else "text_completion", choices=choices,
                             usage=self.usage(job, sum(f[1] for f in finish.values()))))

    def stream(self, job, chat, include_usage):
        """Server-sent events: each wake-up of this thread writes, in one piece, a chunk per choice with all
        the text that choice made since the last (several tokens' when the server is busy)."""
        head = self.head(chat)
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        chunk = lambda i, delta, finish=None: dict(head, choices=[dict(
            {"delta": delta} if chat else {"text": delta.get("content", ""), "logprobs": None},
            index=i, finish_reason=finish)])
        self.close_connection = True                     # the stream ends when the connection does
        started, done, tokens = False, 0, 0
        try:
            for events in self.events(job, eager=True):
                if not started and events[0][0] == "error":  # failed before its first id: a plain 500
                    return self.fail(ApiError(500, events[0][1], kind="server_error"))
                out = []
                if not started:
                    started = True
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    if chat:
                        out += [chunk(i, {"role": "assistant", "content": ""}) for i in range(job.n)]
                for ev in events:                        # (a look has at most one text a choice, before its end)
                    if ev[0] == "text":
                        out.append(chunk(ev[1], {"content": ev[2]}))
                    elif ev[0] == "done":
                        out.append(chunk(ev[1], {}, ev[2]))
                        done, tokens = done + 1, tokens + ev[3]
                        if done == job.n and include_usage:
                            out.append(dict(head, choices=[], usage=self.usage(job, tokens)))
                    elif ev[0] == "error":
                        out.append(ApiError(500, ev[1], kind="server_error").body())
                data = b"".join(b"data: " + json.dumps(obj).encode() + b"\n\n" for obj in out)
                self.wfile.write(data + (b"data: [DONE]\n\n" if done == job.n else b""))
        except OSError:                                  # the client has gone: stop generating for it
            self.server.scheduler.retire(job)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128                         # connections waiting to be accepted (a burst of clients)

    def __init__(self, address, requests, decoder, page, log_path=None, quiet=False, api_key=None, max_queue=None):
        self.requests, self.page, self.quiet, self.log_path, self.api_key = requests, page, quiet, log_path, api_key
        self.started, self.ids, self.log_lock = int(time.time()), itertools.count(1), threading.Lock()
        super().__init__(address, Handler)
        self.scheduler = decoder if isinstance(decoder, Engine) else \
            Scheduler(requests.tok, decoder, lambda record, job: self.log(record), max_queue or MAX_QUEUE)
        self.connections, self.idle, self.threads = queue.SimpleQueue(), 0, 0   # accepted; threads waiting; all
        self.pool_lock, self.owner = threading.Lock(), None      # owner: a forked worker's parent, worker 0

    def service_actions(self):
        """(every turn of serve_forever) A forked worker whose parent has gone ends: the server was killed."""
        if self.owner and os.getppid() != self.owner:
            os._exit(1)

    def process_request(self, request, client_address):
        """A connection goes to a thread that has finished its last one, or to a new thread when none waits
        (a new thread a connection cost ~0.15 ms more of the server's CPU a request, on 2 cores)."""
        with self.pool_lock:
            spawn = self.idle == 0
            self.idle -= not spawn
            self.threads += spawn
        if spawn:
            threading.Thread(target=self.connection_thread, daemon=True).start()
        self.connections.put((request, client_address))

    def connection_thread(self):
        while True:
            request, client_address = self.connections.get()
            if request is None:
                return
            self.process_request_thread(request, client_address)
            with self.pool_lock:
                self.idle += 1

    def handle_error(self, request, client_address):
        """A connection that failed (reset, timed out, closed under a reply) costs one line; a bug a traceback."""
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):
            return super().handle_error(request, client_address)
        self.log(dict(event="dropped", path=None, note=f"{client_address[0]}: {type(e).__name__}: {e}"))

    def log(self, record):
        """One line per request on stderr; one JSON line per request in the log file, if any."""
        record = dict(time=round(time.time(), 3), **record)
        with self.log_lock:
            if not self.quiet:
                rest = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("time", "event", "path"))
                print(f"[serve] {record['event']} {record['path']} | {rest}", file=sys.stderr, flush=True)
            if self.log_path:
                with open(self.log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")

    def server_close(self):
        super().server_close()
        if hasattr(self, "scheduler"):                   # not when the address could not be bound
            self.scheduler.close()
            for _ in range(self.threads):                # each connection thread ends after its connection
                self.connections.put((None, None))


# ----------------------------------------------------------------------------------------------------
# command line: the serve mode of both engines

DESCRIPTION = ("serve a checkpoint over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
               "with a chat page at /. The sampling flags are the defaults of requests that omit them; requests "
               "without a seed draw theirs from a generator seeded by --seed")


def add_serve_flags(p, ckpt, max_batch_help):
    """The serve mode's flags (both engines): the sampling flags of sample and chat (no --speculative: the
    batch does not speculate), the batch and the queue, then where to listen and the key."""
    pl.add_sample_flags(p, ckpt=ckpt, temperature=0.7, speculative=False,
                        tokens_help="max_tokens of a request that gives none (default 200; at most the context - 1)",
                        seed_help="seeds the generator of the seeds of requests that give none (default 0)")
    p.add_argument("--max-batch", dest="max_batch", type=int,
                   help=f"requests decoded at once, each a row of one batch, the rest queued ({max_batch_help}); "
                        "speculative decoding is not used")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=MAX_QUEUE,
                   help=f"requests that may wait for a row; one more is answered 429 (default {MAX_QUEUE})")
    p.add_argument("--workers", type=int,
                   help=f"HTTP processes that take the requests (parse, tokenize, stream) for the one engine "
                        f"process (default {WORKERS}, or half the CPU cores if fewer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                        "anyone who can reach the machine: give --api-key)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--api-key", dest="api_key", default=os.environ.get(KEY_ENV) or None,
                   help=f"API requests must send `Authorization: Bearer KEY` (default ${KEY_ENV}, else none: open "
                        "to whoever reaches the port)")
    p.add_argument("--name", help="the model's name in the API (default nanoeuler-CONFIG-KIND)")
    p.add_argument("--log", help="append one JSON line per request to this file (default: none)")


def make_server(a, tok, cfg, chat, decoder_factory, quiet=False, workers=0):
    """A Server on a.host:a.port, its scheduler started over decoder_factory(a.max_batch) (None: the
    engine's default), in this process (workers 0) or in an Engine fed by `workers` HTTP processes (this one
    and workers - 1 forked: a.workers is the serve mode's); serve_forever() serves. Bad flags raise
    UserError."""
    pl.check_sampling(a)
    if not 0 <= a.port <= 65535:
        raise pl.UserError(f"--port {a.port}: give a port in 0..65535 (0: any free one)")
    for flag, v in (("--max-batch", a.max_batch), ("--max-queue", a.max_queue), ("--workers", a.workers)):
        if v is not None and v < 1:
            raise pl.UserError(f"{flag} {v}: give a whole number{' of requests' * (flag != '--workers')}, at least 1")
    if a.api_key is not None and not (a.api_key.isprintable() and a.api_key.strip() == a.api_key != ""):
        raise pl.UserError("--api-key: give a non-empty key of printable characters, without spaces at its ends")
    name = a.name or f"nanoeuler-{pl.config_name(cfg)}-{'chat' if chat else 'base'}"
    defaults = dict(asdict(pl.sampling_of(a)), max_tokens=a.tokens)
    if a.log:
        pl.writable(a.log, "--log", force=True)       # appended to: one already there is fine
        try:
            open(a.log, "a").close()
        except OSError as e:                          # a file there that is not ours to write
            raise pl.UserError(f"--log {a.log}: cannot write it ({e.strerror})") from None
    with open(PAGE, "rb") as f:
        page = f.read()
    decoder = Engine(decoder_factory, a.max_batch, tok, workers, a.max_queue) if workers else \
        decoder_factory(a.max_batch)
    requests = Requests(tok, cfg.ctx, chat, name, defaults, a.seed, decoder.capacity, cfg.vocab)
    try:
        server = Server((a.host, a.port), requests, decoder, page, a.log, quiet, a.api_key, a.max_queue)
    except OSError as e:
        if workers:
            decoder.close()
        why = "in use: give another with --port" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise pl.UserError(f"cannot listen on {a.host}:{a.port} ({why})") from None
    if workers:
        decoder.serve(server)                         # (forks the other workers)
    return server


def loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(a, tok, cfg, chat, decoder_factory, engine):
    """The serve mode: serves until Ctrl-C. decoder_factory(max_batch) -> the engine's Decoder (module
    docstring) with max_batch rows (None: the engine's default), called in the engine process."""
    workers = a.workers or max(1, min(WORKERS, (os.cpu_count() or 1) // 2))
    server = make_server(a, tok, cfg, chat, decoder_factory, workers=workers)
    host, port = server.server_address[:2]
    r = server.requests
    print(f"serving {r.name} ({'chat: the SFT template' if chat else 'base: plain text'}, context {cfg.ctx}) on the "
          f"{engine} engine, {r.capacity} requests at once, {workers} HTTP worker{'s' * (workers > 1)}, at "
          f"http://{host}:{port}/ (the chat page; the API "
          f"under /v1{', locked by --api-key' if a.api_key else ''}); Ctrl-C stops", flush=True)
    if not a.api_key and not loopback(host):
        print(f"warning: {host} is reachable from other machines and the API has no key: anyone who reaches "
              f"port {port} can use it (give --api-key or ${KEY_ENV})", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("[stopped]", flush=True)
        raise                                         # status 130, as every mode's Ctrl-C
    finally:
        server.server_close()


if __name__ == "__main__":                          # a library of the engines, not a command of its own
    raise SystemExit("error: serve.py is the serve mode: "
                     "python3 nanoeuler.py serve --help (or nanoeuler_cuda.py serve)")
