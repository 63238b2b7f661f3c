"""
bench/serve_load.py -- the serve mode under load: N clients at once, through real HTTP (issue 33).

    python3 bench/serve_load.py --engine cpu --ckpt out_chat --clients 1 8 --tokens 100
    python3 bench/serve_load.py --engine gpu --ckpt out_chat --clients 1 8 32 64 --tokens 100
    python3 bench/serve_load.py --engine fake --ckpt out_chat --clients 1 8 32 64     # serve's own ceiling

Starts `nanoeuler.py serve` (cpu) or `nanoeuler_cuda.py serve` (gpu) on a free port, then for each level
N sends N streamed chat completions at once from N threads (the standard library's http.client), each a
different prompt of about 70 tokens, temperature 0.8, max_tokens --tokens and ignore_eos (vLLM's flag,
which serve honours: <|endoftext|> does not end an answer, so every answer runs its --tokens tokens), and
--rounds such waves a level. Prints per level: aggregate tokens/s (every answer's tokens, from the usage
chunk, over the wave's wall time), time to first token (the first chunk with text) and latency (until
[DONE]), p50 and p95 over the level's requests, and the server process's CPU time per token (all its
threads; a figure that other load on the machine does not change much). The clients run on the server's
machine and take some of its CPU: on a 2-core machine that lowers the CPU engine's figures. The fake
engine (--engine fake: the checkpoint's tokenizer and context, a decoder whose step returns ids at once)
measures what serve itself costs: its ceiling in tokens/s, whatever the engine.
"""
import argparse
import http.client
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                                  # (fake-serve imports serve and pipeline)
SCRIPTS = {"cpu": "nanoeuler.py", "gpu": "nanoeuler_cuda.py", "fake": "bench/serve_load.py"}
FAKE_ROWS = 64              # the fake engine's default batch, the GPU's largest
WORDS = ("Write a short story about the sea, a city at night or an old clock. It should have a beginning, a "
         "middle and an end, a main character with a name, one surprising event, and a closing line that makes "
         "the reader smile. Use simple words, short sentences and no more than two paragraphs, and tell it in "
         "the past tense, as a grandmother would tell it by the fire on a winter evening.").split()


def prompt(i, words):
    """Plain English, a different text per client: its number, then the first `words` words of WORDS."""
    return f"Story {i}: " + " ".join(WORDS[:words])


def prompt_tokens(port, words):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": prompt(0, words)}],
                                                            "max_tokens": 1}))
    n = json.loads(conn.getresponse().read())["usage"]["prompt_tokens"]
    conn.close()
    return n


def words_for(port, target):
    """How many of WORDS make prompts of about `target` tokens with this server's tokenizer and template."""
    full, none = prompt_tokens(port, len(WORDS)), prompt_tokens(port, 0)
    return max(0, min(len(WORDS), round((target - none) / max(full - none, 1) * len(WORDS))))


class Request:
    """One streamed chat completion on a non-blocking socket (HTTP/1.1 by hand; the stream ends with its
    connection), read as its bytes come: the first chunks parsed until one has text, then only the usage.
    A wave's requests share one thread: 64 client threads with http.client cost this process about as much
    CPU a request as the server spends, on the server's machine. -> .result = (time to first token, latency,
    completion tokens, usage) or an exception."""

    def __init__(self, port, i, tokens, words, sel):
        body = json.dumps({"messages": [{"role": "user", "content": prompt(i, words)}], "max_tokens": tokens,
                           "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True},
                           "ignore_eos": True}).encode()
        self.out = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self.buf, self.head, self.first, self.usage, self.result = b"", None, None, None, None
        self.t0 = time.perf_counter()
        self.sock = socket.socket()
        self.sock.setblocking(False)
        self.sock.connect_ex(("127.0.0.1", port))
        sel.register(self.sock, selectors.EVENT_WRITE, self)

    def ready(self, sel):
        """The socket can be written (the request) or read (the answer) -> True once the answer is whole."""
        if self.out:
            self.out = self.out[self.sock.send(self.out):]
            if not self.out:
                sel.modify(self.sock, selectors.EVENT_READ, self)
            return False
        data = self.sock.recv(1 << 16)
        self.buf += data
        if self.head is None:
            if b"\r\n\r\n" not in self.buf:
                if not data:
                    raise ConnectionError(f"closed before its headers: {self.buf[:200]!r}")
                return False
            self.head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            if self.head.split()[1:2] != [b"200"]:
                raise RuntimeError(f"{self.head.splitlines()[0].decode()}: {self.buf[:200]!r}")
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: [DONE]"):
                self.result = (self.first, time.perf_counter() - self.t0,
                               self.usage["completion_tokens"] if self.usage else 0, self.usage)
                return True
            if self.first is None and line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                    self.first = time.perf_counter() - self.t0
                self.usage = ev.get("usage") or self.usage
            elif b'"usage"' in line:
                self.usage = json.loads(line[6:])["usage"]
        if not data:
            raise ConnectionError("closed before data: [DONE]")
        return False


def wave(port, n, tokens, words=len(WORDS)):
    """n requests at once -> ([(ttft, latency, tokens, usage)], wall seconds)."""
    sel = selectors.DefaultSelector()
    t0 = time.perf_counter()
    reqs, left = [Request(port, i, tokens, words, sel) for i in range(n)], n
    while left:
        events = sel.select(timeout=600)
        if not events:
            raise SystemExit(f"error: {left} of {n} requests had no answer in 600 s")
        for key, _ in events:
            r = key.data
            try:
                done = r.ready(sel)
            except Exception as e:                   # reported below, with the others' figures
                r.result, done = e, True
            if done:
                sel.unregister(r.sock)
                r.sock.close()
                left -= 1
    wall = time.perf_counter() - t0
    errors = [r.result for r in reqs if isinstance(r.result, Exception)]
    if errors:
        raise SystemExit(f"error: {len(errors)} of {n} requests failed: {errors[0]}")
    return [r.result for r in reqs], wall


def cpu_seconds(pid):
    """The server's CPU time so far (user + system, all threads), its engine process's too, from /proc; None
    elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{pid}/children") as f:              # (serve forks its engine process)
            kids = [cpu_seconds(int(k)) for k in f.read().split()]
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(k or 0 for k in kids)
    except (OSError, ValueError, IndexError):
        return None


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def start_server(a):
    cmd = [sys.executable, os.path.join(ROOT, SCRIPTS[a.engine]), "fake-serve" if a.engine == "fake" else "serve", "--ckpt", a.ckpt, "--port", "0",
           "--temperature", "0.8", "--max-queue", str(max(a.clients) + 1)]
    if a.max_batch:
        cmd += ["--max-batch", str(a.max_batch)]
    p = subprocess.Popen(cmd + a.serve_args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = p.stdout.readline()
    m = re.search(r"at http://[\d.]+:(\d+)/", line)
    if not m:
        p.kill()
        raise SystemExit(f"error: the server did not start ({' '.join(cmd)}): {line.strip() or 'no output'}")
    return p, int(m.group(1)), line.strip()


class FakeDecoder:
    """serve's decoder interface (serve.py's docstring) at no cost: every row draws the same cycle of
    ordinary text ids, a step returns them at once, so what a level costs is serve's own work."""

    def __init__(self, tok, ctx, capacity):
        import numpy as np
        self.capacity, self.ctx = capacity, ctx
        cycle = tok.encode(" ".join(WORDS))                      # text ids, never <|endoftext|>
        self.ids = np.tile(np.array(cycle, dtype=np.int64)[:, None], (1, capacity))   # (len(cycle), capacity)
        self.k = 0

    def start(self, row, ids, sampling, seed):
        return int(self.ids[0, 0])

    def step(self, rows):
        self.k = (self.k + 1) % len(self.ids)
        return self.ids[self.k, :len(rows)]

    def free(self, row):
        pass


def fake_serve(argv):
    """The serve mode over FakeDecoder: `python3 bench/serve_load.py fake-serve SERVE_FLAGS`."""
    import pipeline as pl
    import serve
    p = pl.Parser(prog="serve_load.py fake-serve", description="serve over a decoder that costs nothing")
    serve.add_serve_flags(p, ckpt=None, max_batch_help=f"default {FAKE_ROWS}")
    a = p.parse_args(argv)
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    serve.run(a, tok, P.cfg, extra.get("kind") == "chat", lambda rows: FakeDecoder(tok, P.cfg.ctx, rows or FAKE_ROWS),
              "fake")


def main():
    if sys.argv[1:2] == ["fake-serve"]:
        import pipeline as pl
        try:
            return fake_serve(sys.argv[2:])
        except KeyboardInterrupt:
            return
        except pl.UserError as e:
            raise SystemExit(f"error: {e}") from None
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    ap.add_argument("--engine", choices=SCRIPTS, default="cpu")
    ap.add_argument("--ckpt", required=True, help="the checkpoint (file or run folder) to serve")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8], help="levels: requests at once (default 1 8)")
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens of each request (default 100)")
    ap.add_argument("--rounds", type=int, default=2, help="waves per level (default 2)")
    ap.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=70,
                    help="about how long each prompt is, in the served model's tokens (default 70)")
    ap.add_argument("--max-batch", dest="max_batch", type=int, help="the server's --max-batch (default: its own)")
    ap.add_argument("serve_args", nargs="*", help="more serve flags, after --")
    a = ap.parse_args()
    if min(a.clients) < 1 or a.tokens < 1 or a.rounds < 1:
        raise SystemExit("error: --clients, --tokens and --rounds must be at least 1")
    p, port, banner = start_server(a)
    try:
        print(banner, flush=True)
        words = words_for(port, a.prompt_tokens)
        print(f"prompts of about {a.prompt_tokens} tokens: {words} words", file=sys.stderr)
        wave(port, max(a.clients), 8, words)         # warm-up: compiles, graphs, first touches
        rows = []
        for n in a.clients:
            res, walls, cpu0 = [], [], cpu_seconds(p.pid)
            for _ in range(a.rounds):
                out, wall = wave(port, n, a.tokens, words)
                res += out
                walls.append(wall)
            tokens, cpu1 = sum(r[2] for r in res), cpu_seconds(p.pid)
            ttft, lat = [r[0] for r in res], [r[1] for r in res]
            cpu = (cpu1 - cpu0) / tokens * 1e3 if cpu0 is not None and cpu1 is not None else float("nan")
            rows.append((n, tokens / sum(walls), tokens / len(res), res[0][3]["prompt_tokens"],
                         pct(ttft, 50), pct(ttft, 95), pct(lat, 50), pct(lat, 95), cpu))
            print(f"  {n} clients: {rows[-1][1]:,.0f} tokens/s", file=sys.stderr, flush=True)
        print(f"\n{a.engine} engine, {a.ckpt}: {a.rounds} waves a level, max_tokens {a.tokens}, ignore_eos, "
              "temperature 0.8")
        print("| clients | aggregate tokens/s | tokens/answer | prompt tokens | TTFT p50 / p95 (ms) | "
              "latency p50 / p95 (s) | server CPU ms/token |")
        print("|---|---|---|---|---|---|---|")
        for n, tps, per, pt, t50, t95, l50, l95, cpu in rows:
            print(f"| {n} | {tps:,.0f} | {per:.0f} | {pt} | {t50 * 1e3:,.0f} / {t95 * 1e3:,.0f} | {l50:.2f} / {l95:.2f} "
                  f"| {cpu:.2f} |")
        base = rows[0]
        if base[0] == 1:
            print("\n" + ", ".join(f"{n} clients: {tps / base[1]:.1f}x one client's" for n, tps, *_ in rows[1:]))
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    main()
