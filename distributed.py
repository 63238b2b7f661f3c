"""
distributed.py -- the GPU engine on several GPUs: data parallelism with one process per GPU, NCCL through
CuPy's bindings (cupy.cuda.nccl), and ZeRO-1 as llm.c does it.

    python3 nanoeuler_cuda.py train big --gpus 2        # two ranks on GPUs 0 and 1 of this machine
    RANK=r WORLD_SIZE=n LOCAL_RANK=g MASTER_ADDR=host MASTER_PORT=port python3 nanoeuler_cuda.py train big
                                                        # one rank started by hand, on any number of machines

Sections:
- environment: the torchrun-style variables that make a process one rank of a run.
- launcher: --gpus N starts N ranks of the same command with those variables (and NVLink multicast off),
  relays Ctrl-C to them, and as soon as one rank fails stops the others and ends with one error line and a
  non-zero exit.
- rendezvous and watchdog: rank 0 serves a small TCP endpoint at MASTER_ADDR:MASTER_PORT where the ranks
  meet (the NCCL unique id is handed out there), wait for each other (barriers) and send a heartbeat every
  second from a thread. A rank whose connection closes before its goodbye (killed, crashed), or that sends
  no heartbeat for 30 s, makes every other rank print one error line and exit: an NCCL collective with a
  dead peer would otherwise wait forever. Ranks end with os._exit, since NCCL's threads can keep a finished
  process alive.
- ZeRO-1: every rank holds the whole weights (fp32, and their bf16 copy) and gradient buffer; the AdamW
  moments and the update are sharded. The flat layout is cut into buckets, one per layer (the final norm
  with the output heads one, the embedding one), in the order the backward pass completes them; as soon as
  a bucket's gradients are final (Model.on_grads) it is reduce-scattered with NCCL's average on a side
  stream while the backward goes on, so rank r receives the r-th piece of every bucket. After the last
  micro-step each rank clips with the norm of the whole gradient (the float64 sums of squares of the shards
  added over the ranks), runs AdamW on its pieces, and the pieces are all-gathered into every rank's weights
  (then the bf16 copy is refreshed). Checkpoints gather the moments to rank 0 in the single-GPU layout.
Shapes: n parameters; npad, n rounded up to a multiple of the number of ranks W; S = npad / W, a shard.
"""
import contextlib
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import numpy as np

import pipeline as pl
from pipeline import UserError

# ----------------------------------------------------------------------------------------------------
# environment

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ADDR, PORT = "127.0.0.1", 29500   # MASTER_ADDR and MASTER_PORT of ranks started by hand without them
HEARTBEAT_S = 1.0                 # each rank's heartbeat period
SILENT_S = 30.0                   # a rank (or rank 0's rendezvous) silent this long is taken for dead
JOIN_S = 300.0                    # every rank must have joined within this


@dataclass
class RankEnv:
    rank: int
    world: int
    local_rank: int
    addr: str
    port: int


def _int_var(env, key, default=None, lo=0, hi=None):
    v = env.get(key, default)
    try:
        x = int(v)
    except (TypeError, ValueError):
        raise UserError(f"{key}={v!r} is not a whole number") from None
    if x < lo or (hi is not None and x > hi):
        raise UserError(f"{key}={x} is out of range ({lo} to {hi if hi is not None else 'more'})")
    return x


def rank_env(env=None):
    """This process's place in a run from the torchrun-style variables, or None when neither RANK nor
    WORLD_SIZE is set. LOCAL_RANK (the GPU) defaults to RANK, MASTER_ADDR and MASTER_PORT to 127.0.0.1:29500."""
    env = os.environ if env is None else env
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    if "RANK" not in env or "WORLD_SIZE" not in env:
        raise UserError("a rank needs both RANK and WORLD_SIZE (and LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    world = _int_var(env, "WORLD_SIZE", lo=1)
    rank = _int_var(env, "RANK", hi=world - 1)
    return RankEnv(rank, world, _int_var(env, "LOCAL_RANK", rank), env.get("MASTER_ADDR", ADDR),
                   _int_var(env, "MASTER_PORT", PORT, lo=1, hi=65535))


def add_gpus_flag(p):
    p.add_argument("--gpus", type=int, metavar="N",
                   help="train on N GPUs of this machine, one process each (data parallel, ZeRO-1; --batch is per GPU; "
                        "default 1). On several machines start each rank with RANK, WORLD_SIZE, LOCAL_RANK, "
                        "MASTER_ADDR and MASTER_PORT set instead (README)")


def launching(gpus):
    """True in the process that must start the ranks: --gpus N > 1, itself no rank."""
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus {gpus}: give a whole number of at least 1")
    return (gpus or 1) > 1 and rank_env() is None


def join(gpus):
    """-> this process's Group when its environment makes it one rank of a run, else None (one GPU)."""
    env = rank_env()
    if env is None:
        return None
    if gpus is not None and gpus != env.world:
        raise UserError(f"--gpus {gpus} disagrees with WORLD_SIZE={env.world}; leave --gpus out of a rank started "
                        "by hand")
    return Group(env)


@contextlib.contextmanager
def rank_zero_first(group):
    """The body runs on rank 0 before the others (it prepares and caches the data they then read)."""
    if group is not None and group.rank:
        group.barrier()
    yield
    if group is not None and not group.rank:
        group.barrier()


# ----------------------------------------------------------------------------------------------------
# launcher

def gpu_count():
    """The number of GPUs, asked without creating a CUDA context (the launcher holds no GPU memory)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or a CuPy without its CUDA libraries or a driver
        raise UserError(f"--gpus needs CuPy and NVIDIA GPUs; none is usable here ({type(e).__name__}: {e})") from None


def _port_error(addr, port, e):
    return UserError(f"cannot serve the rendezvous at {addr}:{port} ({e.strerror or e}): is another run using the "
                     "port? set MASTER_PORT to a free one")


def check_port(addr, port):
    """The rendezvous port must be free here (SO_REUSEADDR, as the server: a closed run's lingering connections
    do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            raise _port_error(addr, port, e) from None
        return s.getsockname()[1]


def launch(n, cmd):
    """Runs cmd (an argument list) as n ranks on GPUs 0..n-1 of this machine and waits for them. Rank 0's output is
    ours; the others' stdout is dropped and their stderr relayed, with only the first error line of all. Ctrl-C is
    passed on to every rank (a third one kills them). -> the exit code: 0, 130 after Ctrl-C, 1 if a rank failed."""
    have = gpu_count()
    if n > have:
        raise UserError(f"--gpus {n}: this machine has {have} GPU{'' if have == 1 else 's'}; use --gpus {have} or "
                        "fewer")
    addr = os.environ.get("MASTER_ADDR", ADDR)
    port = check_port(addr, _int_var(os.environ, "MASTER_PORT", 0, hi=65535))   # unset: a free port
    env = {**NO_MULTICAST, **os.environ, "WORLD_SIZE": str(n), "MASTER_ADDR": addr, "MASTER_PORT": str(port),
           "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.DEVNULL,
                              stdout=None if r == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)      # Ctrl-C reaches them through us, once
             for r in range(n)]
    print(f"{n} ranks on GPUs 0-{n - 1}, rendezvous at {addr}:{port} (pids {' '.join(str(p.pid) for p in procs)})",
          flush=True)
    first_error, lock = [], threading.Lock()

    def relay(stream):
        for line in iter(stream.readline, b""):
            text = line.decode(errors="replace")
            with lock:
                if text.startswith("error:"):
                    if first_error:
                        continue
                    first_error.append(text)
                sys.stderr.write(text)
                sys.stderr.flush()

    def signal_all(sig):
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)

    interrupts = [0]

    def on_interrupt(signum, frame):
        interrupts[0] += signum == signal.SIGINT
        signal_all(signal.SIGKILL if interrupts[0] >= 3 else signum)

    relays = [threading.Thread(target=relay, args=(p.stderr,), daemon=True) for p in procs]
    for t in relays:
        t.start()
    previous = {s: signal.signal(s, on_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    failed, deadline = None, None
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.05)
            for r, p in enumerate(procs):
                if failed is None and p.poll() not in (None, 0, 130):
                    failed, deadline = (r, p.returncode), time.time() + 5   # the others may say why, then stop
            if failed and time.time() > deadline:
                signal_all(signal.SIGKILL)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        signal_all(signal.SIGKILL)                  # nothing outlives the launcher
    for t in relays:
        t.join(5)
    if interrupts[0]:
        return 130
    if failed is not None:
        if not first_error:
            r, rc = failed
            how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
            print(f"error: rank {r} {how}; the other ranks were stopped", file=sys.stderr, flush=True)
        return 1
    return 130 if any(p.returncode == 130 for p in procs) else 0


# ----------------------------------------------------------------------------------------------------
# rendezvous and watchdog: one line per request over TCP ("wait RANK K", "beat RANK", "bye RANK", "quit RANK
# WHY"), one line back ("ok [payload]" or "fail WHY")

class _Server(socketserver.ThreadingTCPServer):
    """Rank 0's rendezvous: the ranks' barriers (the first hands out the NCCL unique id) and heartbeats. The first
    failure it sees is what every rank's next heartbeat or barrier gets back."""
    allow_reuse_address = daemon_threads = True

    def __init__(self, addr, port, world):
        try:
            super().__init__((addr, port), _Handler)
        except OSError as e:
            raise _port_error(addr, port, e) from None
        self.world, self.cond = world, threading.Condition()
        self.arrived, self.payload = {}, {}         # barrier k -> the ranks there; -> what its waiters get back
        self.last_beat, self.done, self.failure = {}, set(), None
        threading.Thread(target=self.serve_forever, args=(0.2,), daemon=True).start()
        threading.Thread(target=self._check, daemon=True).start()

    def fail(self, why):
        with self.cond:
            self.failure = self.failure or why
            self.cond.notify_all()

    def barrier(self, rank, k):
        with self.cond:
            here = self.arrived.setdefault(k, set())
            if rank in here:
                self.fail(f"two processes have RANK={rank}")
            here.add(rank)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.failure or len(here) == self.world)
            return f"fail {self.failure}" if self.failure else f"ok {self.payload.get(k, '')}"

    def _check(self):
        start = time.time()
        while True:
            time.sleep(0.5)
            now = time.time()
            with self.cond:
                joined = len(self.arrived.get(0, ()))
                if joined < self.world and now - start > JOIN_S:
                    self.fail(f"only {joined} of {self.world} ranks joined within {JOIN_S:.0f} s; start one process "
                              f"per rank, RANK 0 to {self.world - 1}, each with WORLD_SIZE={self.world}")
                for r, t in self.last_beat.items():
                    if r not in self.done and now - t > SILENT_S:
                        self.fail(f"rank {r} sent no heartbeat for {SILENT_S:.0f} s (hung or stopped)")


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        s, beating = self.server, None
        try:
            for line in self.rfile:
                verb, rank, *arg = line.decode().split(maxsplit=2)
                rank = int(rank)
                if verb == "beat":
                    beating = rank
                    with s.cond:
                        s.last_beat[rank] = time.time()
                        reply = f"fail {s.failure}" if s.failure else "ok"
                elif verb in ("bye", "quit"):           # the end of a rank: clean, or with the reason it failed
                    with s.cond:
                        s.done.add(rank)
                        if verb == "quit":
                            s.fail(f"rank {rank} {arg[0].strip()}")
                        s.cond.notify_all()
                    reply = "ok"
                else:
                    reply = s.barrier(rank, int(arg[0]))
                self.wfile.write(reply.encode() + b"\n")
        except (OSError, ValueError, IndexError):
            pass
        if beating is not None and beating not in s.done:     # its heartbeat connection closed before its goodbye
            s.fail(f"rank {beating} stopped (killed or crashed: its connection closed before the end of the run)")


class _Conn:
    """A connection to the rendezvous, tried until JOIN_S has passed (rank 0 may start last)."""

    def __init__(self, addr, port, timeout):
        deadline = time.time() + JOIN_S
        while True:
            try:
                self.sock = socket.create_connection((addr, port), timeout=5)
                break
            except OSError as e:
                if time.time() > deadline:
                    raise UserError(f"no rendezvous at {addr}:{port} after {JOIN_S:.0f} s ({e}); is rank 0 running "
                                    "with the same MASTER_ADDR and MASTER_PORT?") from None
                time.sleep(0.5)
        self.sock.settimeout(timeout)
        self.file = self.sock.makefile("rb")

    def ask(self, line):
        self.sock.sendall(line.encode() + b"\n")
        reply = self.file.readline()
        if not reply:
            raise ConnectionError("connection closed")
        return reply.decode().strip()


class Rendezvous:
    """The ranks' meeting point and watchdog; pure Python (the tests run it without a GPU)."""

    def __init__(self, rank, world, addr, port):
        self.rank, self.world, self.where, self.finished, self.k = rank, world, f"{addr}:{port}", False, 0
        self.server = _Server(addr, port, world) if rank == 0 else None
        self.ctrl = _Conn(addr, port, None)
        beats = _Conn(addr, port, SILENT_S)
        self._ask(beats, f"beat {self.rank}")        # watched from here on, before any barrier
        threading.Thread(target=self._watch, args=(beats,), daemon=True).start()

    def barrier(self, payload=None):
        """Waits until every rank is here. -> rank 0's payload (a string without blanks), on every rank."""
        if payload is not None and self.server is not None:
            self.server.payload[self.k] = payload
        reply = self._ask(self.ctrl, f"wait {self.rank} {self.k}")
        self.k += 1
        return reply[3:]

    def _ask(self, conn, line):
        """conn.ask(line); a failure anywhere, or a lost rendezvous, ends this rank."""
        try:
            reply = conn.ask(line)
        except OSError as e:                          # closed, reset or silent for SILENT_S (socket.timeout)
            self.die(f"lost rank 0's rendezvous at {self.where} ({type(e).__name__}): rank 0 ended, was killed or "
                     "hangs")
            return "ok"                                # (after goodbye, when nothing matters any more)
        if reply.startswith("fail"):
            self.die(reply[5:])
        return reply

    def _watch(self, conn):
        while not self.finished:
            time.sleep(HEARTBEAT_S)
            self._ask(conn, f"beat {self.rank}")

    def die(self, why):
        """One error line, and this process ends at once (its NCCL calls may never return)."""
        if self.finished:
            return
        self.finished = True
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print(f"error: {why}; stopping rank {self.rank}", file=sys.stderr, flush=True)
        if self.server is not None:
            time.sleep(2 * HEARTBEAT_S)               # the others' heartbeats learn why before the rendezvous ends
        os._exit(1)

    def goodbye(self, why=None):
        """The end of this rank: clean (why None), and the others stop watching it; or failed, and they stop
        with `why` ("failed: ..."). Rank 0's process serves the rendezvous: after a clean end it waits (60 s at
        most) until every rank has said goodbye, after a failure until the others' heartbeats heard why."""
        self.finished = True
        with contextlib.suppress(OSError, ConnectionError):
            self.ctrl.ask(f"bye {self.rank}" if why is None else f"quit {self.rank} {' '.join(why.split())}")
        if self.server is not None and why is None:
            s = self.server
            with s.cond:
                s.cond.wait_for(lambda: len(s.done) == self.world or s.failure, timeout=60)
        elif self.server is not None:
            time.sleep(2 * HEARTBEAT_S)


class Group:
    """This process as one rank of a run: its GPU (LOCAL_RANK), the rendezvous and watchdog, and the NCCL
    communicator of all the ranks. Build it before anything touches the GPU (it picks the device)."""

    def __init__(self, env):
        self.rank, self.world, self.local_rank = env.rank, env.world, env.local_rank
        self.stopped_together = False                  # set when the ranks agreed to stop (Ctrl-C)
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)                # before NCCL reads them
        if self.rank:
            sys.stdout = open(os.devnull, "w")          # only rank 0 prints progress; errors go to stderr
        self.rdv = Rendezvous(env.rank, env.world, env.addr, env.port)
        try:
            import cupy
            from cupy.cuda import nccl
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            raise UserError(f"a rank needs CuPy with NCCL and a GPU; not usable here ({type(e).__name__}: "
                            f"{e})") from None
        if not nccl.available or nccl.get_version() < 21000:
            raise UserError("NCCL 2.10 or later is needed (averaging reductions); install nvidia-nccl for your CUDA")
        if self.local_rank >= count:
            raise UserError(f"LOCAL_RANK={self.local_rank}: this machine has {count} GPU{'' if count == 1 else 's'}")
        cupy.cuda.Device(self.local_rank).use()
        uid = bytes(b % 256 for b in nccl.get_unique_id()).hex() if self.rank == 0 else None   # bytes or chars
        uid = bytes.fromhex(self.rdv.barrier(uid))
        self.nccl = nccl
        try:                                            # CuPy 14 takes the id as bytes, older ones as signed chars
            self.comm = nccl.NcclCommunicator(self.world, uid, self.rank)
        except TypeError:
            self.comm = nccl.NcclCommunicator(self.world, tuple(b - 256 if b > 127 else b for b in uid), self.rank)

    def barrier(self):
        self.rdv.barrier()

    def run(self, fn):
        """Runs this rank's work fn(), says how it ended as nanoeuler_cuda.main would (one error line), and ends
        the process with its code: a finished NCCL process may not exit by itself (DEVICE-NOTES.md)."""
        rc, why = 1, None
        try:
            fn()
            rc = 0
        except UserError as e:
            why = f"failed: {e}"
            print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            rc = 130
            if not self.stopped_together:              # a Ctrl-C in the middle of a step leaves the others waiting
                why = "was interrupted (Ctrl-C) in the middle of a step"
        except BaseException as e:  # noqa: B036 -- whatever happened, the process must end below
            why = f"failed: {type(e).__name__}: {e}"
            if type(e).__name__ == "OutOfMemoryError":
                print(f"error: out of GPU memory ({e}); lower --batch or --seq", file=sys.stderr)
            else:
                traceback.print_exc()
        finally:
            self.rdv.goodbye(why)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(rc)


# ----------------------------------------------------------------------------------------------------
# ZeRO-1. A bucket is a range [a, b) of the (padded) flat layout, a and b multiples of W; rank r owns its
# piece [a + r c, a + (r+1) c), c = (b - a) / W, at [a / W, a / W + c) of its shard: the shard holds the
# rank's pieces of every bucket in layout order, exactly what NCCL's reduce-scatter of the bucket gives it.

def buckets(ready, n, world):
    """ready: the flat offsets from which every gradient is final, in the order the backward reaches them
    (decreasing, ending with 0). -> ({offset: (a, b)} for the offsets that complete a bucket, npad): each
    bucket runs from the offset rounded up to a multiple of world to where the previous one began."""
    npad = -(-n // world) * world
    plan, end = {}, npad
    for o in ready:
        a = -(-o // world) * world
        if a < end:
            plan[o], end = (a, end), a
    assert end == 0 and 0 in plan, "the last ready offset must be 0"
    return plan, npad


def shard_of(flat, plan, rank, world):
    """Rank rank's shard (S,) of a padded flat array: its piece of every bucket, in layout order."""
    return np.concatenate([flat[a + rank * (b - a) // world:a + (rank + 1) * (b - a) // world]
                           for a, b in sorted(plan.values())])


def unshard(shards, plan, world):
    """The padded flat array from every rank's shard, shards (W, S): shard_of's inverse."""
    out = np.empty(shards.size, shards.dtype)
    for a, b in plan.values():
        out[a:b] = shards[:, a // world:b // world].reshape(-1)
    return out


class ZeRO:
    """ZeRO-1 data parallelism of one nanoeuler_cuda Model over a Group (engine: the nanoeuler_cuda module, which
    runs as __main__ and must not be imported a second time). Every NCCL call runs on one side stream, in the
    same order on every rank; the compute stream waits for it where it needs its results."""

    def __init__(self, engine, group, cfg, accum=1):
        nccl = group.nccl
        self.nc, self.cp, self.nccl, self.group = engine, engine.cp, nccl, group
        self.comm, self.rank, self.world, self.accum, self.micro = group.comm, group.rank, group.world, accum, 0
        self.avg = getattr(nccl, "NCCL_AVG", 4)       # ncclAvg (NCCL 2.10): older CuPy lacks the constant
        self.cfg, self.n = cfg, pl.num_params(cfg)
        off = engine._param_offsets(cfg)
        ready = [off["norm"][0]] + [off[f"layers.{l}.attn_norm"][0] for l in reversed(range(cfg.n_layers))] + [0]
        self.plan, self.npad = buckets(ready, self.n, self.world)
        self.S = self.npad // self.world
        cp, f32 = self.cp, np.float32
        self.P_full, self.G_full = cp.zeros(self.npad, f32), cp.zeros(self.npad, f32)   # the model's weights, gradient
        self.gshard = cp.zeros(self.S, f32)                        # this rank's shard of the averaged gradient
        self.gtmp = cp.zeros(self.S, f32) if accum > 1 else None   # the reduced gradient of micro-steps after the first
        self.stream = cp.cuda.Stream(non_blocking=True)            # not synchronised with the legacy default stream
        event = lambda: cp.cuda.Event(disable_timing=True)
        self.ready_ev = {o: event() for o in self.plan}
        self.queued, self.reduced, self.done = event(), event(), event()
        self.Pb, self._pieces = None, None

    def params(self):
        """The model's weights: a view of the padded buffer that the all-gather fills."""
        return self.nc.DeviceParams(self.cfg, flat=self.P_full[:self.n])

    def attach(self, model):
        """Gives the model (built on params()) the padded gradient buffer and the reduce-scatter hook, and makes
        every rank's weights rank 0's (the same init everywhere by construction; one broadcast makes sure)."""
        assert model.P.flat.data.ptr == self.P_full.data.ptr
        model.G = self.nc.DeviceParams(self.cfg, flat=self.G_full[:self.n])
        model.on_grads = self.reduce
        self.Pb = model.Pb

        def work():
            self.comm.broadcast(self.P_full.data.ptr, self.P_full.data.ptr, self.npad, self.nccl.NCCL_FLOAT32, 0,
                                self.stream.ptr)
            if self.Pb is not None:
                self.nc.to_bf16(self.P_full[:self.n], self.Pb.flat)
        self._on_side(work)

    def _on_side(self, work):
        """work() on the side stream after everything queued so far; the compute stream then waits for it."""
        cur = self.cp.cuda.get_current_stream()
        self.queued.record(cur)
        self.stream.wait_event(self.queued)
        with self.stream:
            work()
            self.done.record(self.stream)
        cur.wait_event(self.done)

    def reduce(self, offset):
        """Model.on_grads: every gradient from flat offset `offset` on is final. Reduce-scatters the bucket it
        completes (averaged over the ranks) on the side stream, while the backward goes on."""
        bucket = self.plan.get(offset)
        if bucket is None:
            return
        (a, b), W, F32 = bucket, self.world, self.nccl.NCCL_FLOAT32
        ev = self.ready_ev[offset]
        ev.record()                                      # on the compute stream, after the bucket's last kernel
        self.stream.wait_event(ev)
        dst = self.gshard if self.micro == 0 else self.gtmp
        self.comm.reduceScatter(self.G_full.data.ptr + 4 * a, dst.data.ptr + 4 * (a // W), (b - a) // W, F32,
                                self.avg, self.stream.ptr)
        if offset == 0:                                  # the backward's last bucket: this micro-step is reduced
            with self.stream:
                if self.micro:
                    self.gshard += self.gtmp
                if self.accum > 1 and self.micro == self.accum - 1:
                    self.gshard *= 1.0 / self.accum        # as one GPU's (g1 + g2 + ..) / accum
                self.reduced.record(self.stream)
            self.micro = (self.micro + 1) % self.accum

    def wait_reduced(self):
        """Before a micro-step writes the gradient buffer again: the previous one's reductions have read it."""
        self.cp.cuda.get_current_stream().wait_event(self.reduced)

    def pieces(self, opt):
        """(weights, gradient, m, v, flat offset) of this rank's piece of each bucket: views made once."""
        if self._pieces is None:
            r, W = self.rank, self.world
            self._pieces = []
            for a, b in self.plan.values():
                c, s = (b - a) // W, a // W
                self._pieces.append((self.P_full[a + r * c:a + (r + 1) * c], self.gshard[s:s + c], opt.m[s:s + c],
                                     opt.v[s:s + c], a + r * c))
        return self._pieces

    def step(self, opt, lr, loss):
        """The optimizer step after the last micro-step's backward: the step's per-head losses (loss, on the
        device) averaged over the ranks; the clip with the whole gradient's norm; AdamW on this rank's pieces;
        the pieces all-gathered into every rank's weights and the bf16 copy refreshed."""
        nccl, comm, W, r = self.nccl, self.comm, self.world, self.rank

        def work():
            s = self.stream.ptr
            comm.allReduce(loss.data.ptr, loss.data.ptr, loss.size, nccl.NCCL_FLOAT32, self.avg, s)
            opt.grad_norm(self.gshard, reduce=lambda part: comm.allReduce(part.data.ptr, part.data.ptr, part.size,
                                                                           nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s))
            opt.next_step(lr)
            for p, g, m, v, first in self.pieces(opt):
                opt.update(p, g, m, v, None, first)
            nccl.groupStart()                            # one launch for every bucket's all-gather (in place)
            for a, b in self.plan.values():
                c = (b - a) // W
                comm.allGather(self.P_full.data.ptr + 4 * (a + r * c), self.P_full.data.ptr + 4 * a, c,
                               nccl.NCCL_FLOAT32, s)
            nccl.groupEnd()
            if self.Pb is not None:
                self.nc.to_bf16(self.P_full[:self.n], self.Pb.flat)
        self._on_side(work)

    def host_state(self, model, opt):
        """A collective (every rank calls it at the same step): -> (weights, m, v) as host Params in the
        single-GPU layout on rank 0, None on the others."""
        cp, W, S, F32 = self.cp, self.world, self.S, self.nccl.NCCL_FLOAT32
        full = cp.empty((2, W, S), np.float32)

        def work():
            self.nccl.groupStart()
            for i, x in enumerate((opt.m, opt.v)):
                self.comm.allGather(x.data.ptr, full[i].data.ptr, S, F32, self.stream.ptr)
            self.nccl.groupEnd()
        self._on_side(work)
        self.stream.synchronize()
        if self.rank:
            return None
        m, v = (pl.Params(self.cfg, np.float32, unshard(a, self.plan, W)[:self.n].copy()) for a in cp.asnumpy(full))
        return model.P.download(), m, v

    def load_moments(self, opt, m, v):
        """This rank's shard of a checkpoint's moments (host Params, from a run on any number of GPUs)."""
        for dst, src in ((opt.m, m), (opt.v, v)):
            flat = np.zeros(self.npad, np.float32)
            flat[:self.n] = src.flat
            dst.set(shard_of(flat, self.plan, self.rank, self.world))

    def any(self, flag):
        """A collective: True on every rank if flag is True on any (the ranks stop at the same step)."""
        x = self.cp.array([int(bool(flag))], np.int32)
        self._on_side(lambda: self.comm.allReduce(x.data.ptr, x.data.ptr, 1, self.nccl.NCCL_INT32,
                                                  self.nccl.NCCL_MAX, self.stream.ptr))
        self.stream.synchronize()
        agreed = bool(x.get()[0])
        self.group.stopped_together |= agreed
        return agreed


if __name__ == "__main__":                          # a library of the engines, not a command of its own
    raise SystemExit("error: distributed.py is --gpus N of the GPU engine: "
                     "python3 nanoeuler_cuda.py train --gpus 2 --help")
