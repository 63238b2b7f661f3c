"""
serve.py -- an OpenAI-compatible HTTP server and a web chat page, over either engine.

    python3 nanoeuler.py serve --ckpt out_chat [--host 127.0.0.1] [--port 8000]       # the CPU engine
    python3 nanoeuler_cuda.py serve --ckpt out_chat                                    # the GPU engine

Routes: GET / is the chat page (chat.html, beside this file); GET /v1/models and /v1/models/NAME; POST
/v1/chat/completions and /v1/completions, streamed as server-sent events (`data: {chunk}` lines, then
`data: [DONE]`) when the request says "stream": true. Honoured: model, max_tokens (or
max_completion_tokens), temperature, top_p, stop, seed, stream, stream_options.include_usage, and top_k and
repetition_penalty beyond OpenAI's set; n must be 1; other fields are ignored. A mistake gets a 4xx answer
with OpenAI's error body {"error": {"message", "type", "param", "code"}}.

Chat messages take the SFT template of CONTRACT.md (a chat checkpoint) or are joined as plain text (a base
checkpoint, which continues it), one turn per user message, as the chat mode does (pipeline.user_turn and
fit_turns): the oldest turns are dropped when the conversation outgrows the context. A system message goes
in front of the next user message. Generation ends at <|endoftext|> or a stop string ("stop"), at
max_tokens or the context's end ("length").

The engine is a function generate(ids, max_new, sampling, rng) -> iterator of ids (sampling a
pipeline.Sampling, rng a numpy Generator). One worker thread runs the requests one at a time in arrival
order; each connection has its own thread (the standard library's ThreadingHTTPServer: no dependency), which
waits for its request's text. A client that closes its connection frees its place: a queued request is
skipped, a running one stops at its next token.

Sections: errors | requests | generation | HTTP | command line.
"""
import errno
import itertools
import json
import os
import queue
import select
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

# ----------------------------------------------------------------------------------------------------
# errors: each becomes an OpenAI-style JSON answer

class ApiError(Exception):
    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _reject_constant(name):                       # json.loads reads NaN and Infinity unless told not to
    raise ValueError(f"{name} is not JSON")


# ----------------------------------------------------------------------------------------------------
# requests: a JSON body -> a Job (prompt ids, how many tokens, how to sample), or an ApiError

@dataclass
class Job:
    prompt: list                  # ids, fewer than ctx
    max_new: int
    sampling: pl.Sampling
    seed: int
    stop: list                    # strings that end the text (not included)
    path: str                     # the route, for the log
    out: queue.Queue = field(default_factory=queue.Queue)     # ("text", s)..., ("done", finish, n) or ("error", s)
    gone: threading.Event = field(default_factory=threading.Event)   # the client closed its connection


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

    def __init__(self, tok, ctx, chat, name, defaults, seed):
        self.tok, self.ctx, self.chat, self.name, self.defaults = tok, ctx, chat, name, defaults
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
        if body.get("n", 1) != 1:
            raise ApiError(400, "n must be 1: one answer per request", "n")
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
        prompt = self.chat_prompt(body, max_new) if chat else self.text_prompt(body)
        path = "/v1/chat/completions" if chat else "/v1/completions"      # an empty prompt starts a document:
        return Job(prompt or [self.tok.eot], max_new, sampling, seed % (1 << 64), stop, path)        # <|endoftext|>

    def too_long(self, n, param):
        return ApiError(400, f"the prompt is {n} tokens; this model's context is {self.ctx} tokens, and at least one "
                             "must be left to answer in: shorten it", param, "context_length_exceeded")

    def chat_prompt(self, body, max_new):
        turns, last = _messages(body)
        tok, chat = self.tok, self.chat
        ids = [(pl.user_turn(tok, u, chat, first=i == 0), tok.encode(a) + ([tok.eot] if chat else []))   # a chat
               for i, (u, a) in enumerate(turns)]                  # checkpoint's answers close with <|endoftext|>
        new = pl.user_turn(tok, last, chat, first=not turns)
        if len(new) >= self.ctx:
            raise self.too_long(len(new), "messages")
        return pl.fit_turns(ids, new, self.ctx, max_new)[0]

    def text_prompt(self, body):
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
        if len(ids) >= self.ctx:
            raise self.too_long(len(ids), "prompt")
        return ids


# ----------------------------------------------------------------------------------------------------
# generation: one worker thread runs the queued jobs in order; text goes out as it is decoded

class StopScan:
    """Text in, text safe to send out: holds back an ending that may begin a stop string; says when one is
    complete (the text before it goes out, the stop string does not)."""

    def __init__(self, stops):
        self.stops, self.text, self.sent = stops, "", 0

    def feed(self, piece):
        """-> (text to send, stopped)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        end = min(hits) if hits else len(self.text) - max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out, bool(hits)

    def rest(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Worker:
    """Runs jobs one at a time: generate(ids, max_new, sampling, rng) yields ids; the worker decodes them
    (UTF-8 characters cut between tokens wait for their end), stops at <|endoftext|>, a stop string, max_new
    or the context, and stops early, closing the generator, when the job's client has gone."""

    def __init__(self, tok, generate, log):
        self.tok, self.generate, self.log = tok, generate, log
        self.jobs = queue.Queue()
        self.skipped = 0                                 # jobs whose client left while they waited
        self.thread = threading.Thread(target=self.loop, name="generation", daemon=True)
        self.thread.start()

    def loop(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.gone.is_set():
                self.skipped += 1
                self.log(dict(event="skipped", path=job.path, note="the client left while it waited"))
                continue
            self.run(job)

    def run(self, job):
        t0 = time.perf_counter()
        dec, scan, n, finish, hit, ids = self.tok.stream(), StopScan(job.stop), 0, "length", False, None
        try:
            ids = self.generate(job.prompt, job.max_new, job.sampling, np.random.default_rng(job.seed))
            for t in ids:
                n += 1
                if t == self.tok.eot:
                    finish = "stop"
                    break
                text, hit = scan.feed(dec.text(t))
                if text:
                    job.out.put(("text", text))
                if hit:
                    finish = "stop"
                    break
                if job.gone.is_set():
                    finish = "gone"
                    break
            if not hit and finish != "gone":             # the end: what was held back was no stop string
                text, hit = scan.feed(dec.end())
                text += "" if hit else scan.rest()
                finish = "stop" if hit else finish
                if text:
                    job.out.put(("text", text))
        except Exception as e:                           # an engine failure ends this request, not the server
            self.log(dict(event="failed", path=job.path, prompt_tokens=len(job.prompt), completion_tokens=n,
                          note=repr(e)))
            job.out.put(("error", f"generation failed: {type(e).__name__}: {e}"))
            return
        finally:
            getattr(ids, "close", lambda: None)()        # a generator stopped early is closed at once
        dt = time.perf_counter() - t0
        self.log(dict(event="left" if finish == "gone" else "done", path=job.path, prompt_tokens=len(job.prompt),
                      completion_tokens=n, seconds=round(dt, 4), tokens_per_s=round(n / max(dt, 1e-9), 1),
                      finish_reason=finish))                  # logged before the client can see its answer
        job.out.put(("done", finish, n))

    def close(self):
        self.jobs.put(None)


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

    def reply(self, status, body, content_type="application/json", close=False):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")      # (which also closes it on this side)
        self.end_headers()
        self.wfile.write(data)

    def fail(self, e):
        self.server.log(dict(event="refused", path=getattr(self, "path", None), status=e.status, note=str(e)))
        self.reply(e.status, e.body(), close=True)       # the body may be unread: this connection is done

    def send_error(self, code, message=None, explain=None):    # the library's own errors, as JSON too
        self.fail(ApiError(code, message or HTTPStatus(code).phrase, code=None))

    # -- routes

    def do_GET(self):
        path = self.path.split("?")[0]
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
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return self.fail(ApiError(404, f"unknown URL: POST {path}", code="unknown_url"))
        chat = path == "/v1/chat/completions"
        try:
            body = self.body()
            job = self.server.requests.job(body, chat)
        except ApiError as e:
            return self.fail(e)
        self.server.worker.jobs.put(job)
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

    def events(self, job):
        """The job's events until its last; returns early, setting job.gone, when the client has closed its
        connection (the worker then skips the job, or stops it at its next token)."""
        looked = time.monotonic()
        while True:
            try:
                ev = job.out.get(timeout=POLL)
            except queue.Empty:
                ev = None
            if ev is None or time.monotonic() - looked > POLL:
                looked = time.monotonic()
                if client_gone(self.connection):
                    job.gone.set()
                    return
            if ev is not None:
                yield ev
                if ev[0] != "text":
                    return

    def head(self, chat):
        """The fields every answer and chunk of one request carry."""
        ident = ("chatcmpl-" if chat else "cmpl-") + f"{self.server.started}-{next(self.server.ids)}"
        return {"id": ident, "created": int(time.time()), "model": self.server.requests.name}

    @staticmethod
    def usage(job, n):
        return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n}

    def answer(self, job, chat):
        head = self.head(chat)
        parts, last = [], None
        for ev in self.events(job):
            if ev[0] == "text":
                parts.append(ev[1])
            else:
                last = ev
        if last is None:                                 # the client has gone: nobody to answer
            self.close_connection = True
            return
        if last[0] == "error":
            return self.fail(ApiError(500, last[1], kind="server_error"))
        text = "".join(parts)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=last[1])
        self.reply(200, dict(head, object="chat.completion" if chat else "text_completion", choices=[choice],
                             usage=self.usage(job, last[2])))

    def stream(self, job, chat, include_usage):
        head = self.head(chat)
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        chunk = lambda text, finish=None: dict(head, choices=[dict(
            {"delta": {} if text is None else {"content": text}} if chat else {"text": text or "", "logprobs": None},
            index=0, finish_reason=finish)])
        self.close_connection = True                     # the stream ends when the connection does
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            if chat:
                first = chunk("")
                first["choices"][0]["delta"]["role"] = "assistant"
                self.event(first)
            for ev in self.events(job):
                if ev[0] == "text":
                    self.event(chunk(ev[1]))
                elif ev[0] == "done":
                    self.event(chunk(None, ev[1]))
                    if include_usage:
                        self.event(dict(head, choices=[], usage=self.usage(job, ev[2])))
                    self.wfile.write(b"data: [DONE]\n\n")
                else:
                    self.event(ApiError(500, ev[1], kind="server_error").body())
        except OSError:                                  # the client has gone: stop generating for it
            job.gone.set()

    def event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128                         # connections waiting to be accepted (a burst of clients)

    def __init__(self, address, requests, generate, page, log_path=None, quiet=False):
        self.requests, self.page, self.quiet, self.log_path = requests, page, quiet, log_path
        self.started, self.ids, self.log_lock = int(time.time()), itertools.count(1), threading.Lock()
        super().__init__(address, Handler)
        self.worker = Worker(requests.tok, generate, self.log)

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
        if hasattr(self, "worker"):                      # not when the address could not be bound
            self.worker.close()


# ----------------------------------------------------------------------------------------------------
# command line: the serve mode of both engines

DESCRIPTION = ("serve a checkpoint over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models) "
               "with a chat page at /. The sampling flags are the defaults of requests that omit them; requests "
               "without a seed draw theirs from a generator seeded by --seed")


def add_serve_flags(p, ckpt, speculative_help=None):
    """The serve mode's flags (both engines): the sampling flags of sample and chat (--speculative by default
    as pl.speculative_for decides per request), then where to listen."""
    pl.add_sample_flags(p, ckpt=ckpt, temperature=0.7, speculative_help=speculative_help,
                        tokens_help="max_tokens of a request that gives none (default 200; at most the context - 1)",
                        seed_help="seeds the generator of the seeds of requests that give none (default 0)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                        "anyone who can reach the machine)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed)")
    p.add_argument("--name", help="the model's name in the API (default nanoeuler-CONFIG-KIND)")
    p.add_argument("--log", help="append one JSON line per request to this file (default: none)")


def make_server(a, tok, cfg, chat, generate, quiet=False):
    """A Server on a.host:a.port, its worker started; serve_forever() serves. Bad flags raise UserError."""
    pl.check_sampling(a)
    if not 0 <= a.port <= 65535:
        raise pl.UserError(f"--port {a.port}: give a port in 0..65535 (0: any free one)")
    name = a.name or f"nanoeuler-{pl.config_name(cfg)}-{'chat' if chat else 'base'}"
    defaults = dict(asdict(pl.sampling_of(a)), max_tokens=a.tokens)
    requests = Requests(tok, cfg.ctx, chat, name, defaults, a.seed)
    if a.log:
        pl.writable(a.log, "--log", force=True)       # appended to: one already there is fine
        try:
            open(a.log, "a").close()
        except OSError as e:                          # a file there that is not ours to write
            raise pl.UserError(f"--log {a.log}: cannot write it ({e.strerror})") from None
    with open(PAGE, "rb") as f:
        page = f.read()
    try:
        return Server((a.host, a.port), requests, generate, page, a.log, quiet)
    except OSError as e:
        why = "in use: give another with --port" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise pl.UserError(f"cannot listen on {a.host}:{a.port} ({why})") from None


def run(a, tok, cfg, chat, generate, engine):
    """The serve mode: serves until Ctrl-C."""
    server = make_server(a, tok, cfg, chat, generate)
    host, port = server.server_address[:2]
    r = server.requests
    print(f"serving {r.name} ({'chat: the SFT template' if chat else 'base: plain text'}, context {cfg.ctx}) on the "
          f"{engine} engine at http://{host}:{port}/ (the chat page; the API under /v1)"
          f"{'; every interface: anyone who can reach this machine can use it' if host == '0.0.0.0' else ''}"
          "; Ctrl-C stops", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("[stopped]", flush=True)
        raise                                         # status 130, as every mode's Ctrl-C
    finally:
        server.server_close()
