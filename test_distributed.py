"""
test_distributed.py -- several GPUs (distributed.py): the launcher's checks, the rendezvous and watchdog, the
batch split and the ZeRO-1 shard layout, which need no GPU (CI runs them); and, marked gpu and skipped without
two GPUs, 2 GPUs against 1 GPU with --grad-accum 2, ranks started by hand, resuming on another number of GPUs,
and the faults (a rank killed, a port in use, too many GPUs, Ctrl-C).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import distributed as dist
import pipeline as pl
from conftest import GPUS, ROOT, ctrl_c_as_from_a_shell, one_error_line, run_gpu, run_here


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ====================================================================================================
# no GPU needed

def test_rank_env_reads_and_checks_the_torchrun_variables():
    assert dist.rank_env({}) is None
    e = dist.rank_env({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (e.rank, e.world, e.local_rank, e.addr, e.port) == (1, 4, 1, "10.0.0.1", 1234)
    e = dist.rank_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (e.local_rank, e.addr, e.port) == (1, "127.0.0.1", 29500)
    for bad, word in (({"RANK": "0"}, "WORLD_SIZE"), ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2"),
                      ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK"), ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
                      ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT")):
        with pytest.raises(pl.UserError, match=word):
            dist.rank_env(bad)


def fake_cupy(tmp_path, gpus):
    """A cupy module that only counts GPUs: enough for the launcher's checks, which run before any rank."""
    (tmp_path / "cupy").mkdir(exist_ok=True)
    (tmp_path / "cupy" / "__init__.py").write_text(
        f"class cuda:\n    class runtime:\n        getDeviceCount = staticmethod(lambda: {gpus})\n")
    return {"PYTHONPATH": str(tmp_path)}


def test_launcher_mistakes_give_one_error_line(tmp_path, monkeypatch):
    """The first in a process with the stand-in cupy; the others in this process (conftest.run_here), with
    the stand-in imported in sys.modules."""
    import importlib
    import nanoeuler_cuda as nc
    two = fake_cupy(tmp_path, 2)
    r = run_gpu("train", "small", "--gpus", 3, env=two)
    assert one_error_line(r, "--gpus 3", "has 2 GPUs"), r.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", importlib.import_module("cupy"))
    monkeypatch.setattr(nc, "cp", None)
    gpu = lambda *args, env=None: run_here("nanoeuler_cuda.py", *args, env=env)
    assert one_error_line(gpu("train", "--gpus", 0), "--gpus 0"), r.stderr
    assert one_error_line(gpu("bench", "--gpus", 3), "has 2 GPUs")
    with socket.socket() as s:                      # the rendezvous port taken by another program
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = gpu("train", "small", "--gpus", 2, env={"MASTER_PORT": str(s.getsockname()[1])})
        assert one_error_line(r, "cannot serve the rendezvous", str(s.getsockname()[1]), "MASTER_PORT"), r.stderr
    r = gpu("train", "small", "--gpus", 2, env={"RANK": "0", "WORLD_SIZE": "3"})
    assert one_error_line(r, "--gpus 2", "WORLD_SIZE=3"), r.stderr
    r = gpu("train", "small", env={"RANK": "3", "WORLD_SIZE": "2"})
    assert one_error_line(r, "RANK=3"), r.stderr
    monkeypatch.setitem(sys.modules, "cupy", None)   # a cupy that cannot be imported
    assert one_error_line(gpu("train", "--gpus", 2), "CuPy")


# ---------------------------------------------------------------- the rendezvous and its watchdog, CPU only

RANK = r"""
import os, signal, sys, time
import distributed as d
rank, world, port, role = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    g = d.Rendezvous(rank, world, "127.0.0.1", port)
except d.UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
print("payload", g.barrier("id-of-rank-0" if rank == 0 else None), flush=True)
if role == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if role == "fail":
    g.goodbye("failed: no data (test)")
    os._exit(1)
if role == "wait":                      # until the watchdog ends it
    time.sleep(60)
    os._exit(3)
g.barrier()
g.goodbye()
os._exit(0)
"""


def start_ranks(roles, port):
    return [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(len(roles)), str(port), role], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r, role in enumerate(roles)]


def finish(p, timeout=20):
    t0 = time.time()
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.time() - t0


def test_rendezvous_barriers_and_clean_end():
    ranks = start_ranks(["ok", "ok", "ok"], free_port())
    for p in ranks:
        r, _ = finish(p)
        assert r.returncode == 0 and "payload id-of-rank-0" in r.stdout and not r.stderr, r.stderr


@pytest.mark.parametrize("roles, survivor, words", [
    (["wait", "die"], 0, ["rank 1 stopped", "killed or crashed", "stopping rank 0"]),
    (["die", "wait"], 1, ["lost rank 0's rendezvous", "stopping rank 1"]),
    (["wait", "fail"], 0, ["rank 1 failed: no data (test)", "stopping rank 0"]),
    (["wait", "wait", "die"], 1, ["rank 2 stopped"]),
])
def test_watchdog_stops_the_others_when_a_rank_dies(roles, survivor, words):
    """A rank killed (kill -9), or failing, while the others wait: they end with one error line in seconds."""
    ranks = start_ranks(roles, free_port())
    r, waited = finish(ranks[survivor])
    for p in ranks:
        p.kill()
        p.wait()
    assert one_error_line(r, *words), (r.returncode, r.stderr)
    assert waited < 10


def test_rendezvous_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r, _ = finish(start_ranks(["ok", "ok"], s.getsockname()[1])[0])
    assert one_error_line(r, "cannot serve the rendezvous"), r.stderr


# ---------------------------------------------------------------- batches and the ZeRO-1 layout

def test_each_rank_reads_its_part_of_the_global_batch():
    """Ranks of W GPUs x B rows read disjoint parts of the batch that one GPU with W*B rows reads, step by step,
    and one GPU with batch B is unchanged (the windows of the generator's first B draws)."""
    tokens = np.arange(5000, dtype=np.uint16)
    for W, B in ((2, 3), (4, 2)):
        one = pl.Batches(tokens, W * B, 16, seed=7)
        ranks = [pl.Batches(tokens, B, 16, seed=7, rank=r, world=W) for r in range(W)]
        for _ in range(3):
            x, y = one.next()
            parts = [b.next() for b in ranks]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), y)
        assert all(b.state() == one.state() for b in ranks)
    starts = np.random.default_rng(3).integers(0, 4500 - 16, 4)
    x, _ = pl.Batches(tokens, 4, 16, seed=3).next()
    assert np.array_equal(x[:, 0], starts)


@pytest.mark.parametrize("name", list(pl.CONFIGS))
def test_zero_buckets_tile_the_layout_and_shards_invert(name):
    """Every bucket starts at a multiple of W, at or after the offset from which its gradients are final, and
    the buckets tile [0, npad); each rank's shard of a bucket is what NCCL's reduce-scatter gives it, and the
    shards of all ranks (all-gathered) give back the flat array."""
    cfg, rng = pl.CONFIGS[name], np.random.default_rng(0)
    P = pl.Params(cfg)
    n = pl.num_params(cfg)
    ready = ([P.offsets["norm"][0]] + [P.offsets[f"layers.{l}.attn_norm"][0] for l in reversed(range(cfg.n_layers))]
             + [0])
    for W in (1, 2, 3, 8):
        plan, npad = dist.buckets(ready, n, W)
        assert npad % W == 0 and n <= npad < n + W
        spans = sorted(plan.values())
        assert spans[0][0] == 0 and spans[-1][1] == npad
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
        assert all(a % W == 0 and a >= o and b > a for o, (a, b) in plan.items())
        if name not in ("tiny", "small"):
            continue
        grads = rng.standard_normal((W, npad)).astype(np.float32)     # each rank's gradient
        mean = grads.mean(0)
        for r in range(W):
            shard = np.concatenate([mean[a + r * (b - a) // W:a + (r + 1) * (b - a) // W] for a, b in spans])
            assert np.array_equal(dist.shard_of(mean, plan, r, W), shard)
        shards = np.stack([dist.shard_of(mean, plan, r, W) for r in range(W)])
        assert np.array_equal(dist.unshard(shards, plan, W), mean)


def test_adamw_pieces_see_the_decay_mask_of_their_offset():
    """The GPU AdamW kernel finds the norm weights by offset arithmetic; a ZeRO-1 piece of the flat layout that
    starts at `first` passes layers_start - first: the kernel's rule, written out, gives the contract's mask."""
    cfg = pl.CONFIGS["small"]
    P, mask = pl.Params(cfg), pl.decay_mask(cfg)
    start = P.offsets["layers.0.attn_norm"][0]
    size = P.offsets["layers.1.attn_norm"][0] - start
    ffn = P.offsets["layers.0.ffn_norm"][0] - start
    D, L = cfg.dim, cfg.n_layers

    def kernel_decay(i, ls):                        # adamw_body's rule for element i of a launch
        end = ls + size * L
        if ls <= i < end:
            o = (i - ls) % size
            return 0.0 if o < D or ffn <= o < ffn + D else 1.0
        return 0.0 if end <= i < end + D else 1.0
    n = pl.num_params(cfg)
    ready = [P.offsets["norm"][0]] + [P.offsets[f"layers.{l}.attn_norm"][0] for l in reversed(range(L))] + [0]
    plan, npad = dist.buckets(ready, n, 2)
    for a, b in plan.values():
        for r in range(2):
            first, c = a + r * (b - a) // 2, (b - a) // 2
            got = [kernel_decay(j, start - first) for j in range(c) if first + j < n]
            assert np.array_equal(got, mask[first:first + len(got)]), (a, b, r)


def test_train_loop_on_a_rank_other_than_0_writes_nothing(tmp_path):
    """Rank 1 of 2 takes part in the checkpoint (a collective) but writes no file, counts every rank's tokens,
    and asks the others whether to stop, then whether a checkpoint is due by time, at each progress line
    only (every rank in the same order, or the collectives would pair wrongly)."""
    import bpe
    calls = []

    class Rank1:
        sync_every_step, rank, world = False, 1, 2

        def step(self, x, y, lr):
            calls.append("step")

        def results(self):                          # read every 2 steps
            return [(1.0, [1.0, 1.0, 1.0], 0.5)] * 2

        def host_state(self):
            calls.append("host_state")

        def any_rank(self, flag):
            calls.append("any_rank")
            return False
    batches = pl.Batches(np.arange(1000, dtype=np.uint16) % 256, 2, 8)
    args = dict(pl.TRAIN_DEFAULTS, steps=4, schedule_steps=4, log_every=2, ckpt_every=4)
    pl.train_loop(Rank1(), bpe.Tokenizer([]), batches, args, str(tmp_path))
    assert os.listdir(tmp_path) == []
    assert calls == ["step", "step", "any_rank", "any_rank", "step", "step", "any_rank", "any_rank", "host_state"]


def test_cpu_engine_grad_accum_is_the_larger_batch(tmp_path):
    """The CPU engine takes --grad-accum K as one batch of K x batch rows: the same losses as --batch K*B."""
    logs = []
    for i, flags in enumerate((["--batch", "4"], ["--batch", "2", "--grad-accum", "2"])):
        out = tmp_path / str(i)
        r = run_here("nanoeuler.py", "train", "tiny", "--steps", "3", "--seq", "16", "--log-every", "1", "--eval-every",
                     "3", "--sample-every", "0", "--out", str(out), *flags, plots=False)   # no loss plot: 1-2 s
        assert r.returncode == 0, r.stderr
        logs.append([json.loads(l)["loss"] for l in open(out / "train_log.jsonl")])
    assert logs[0] == logs[1] and len(logs[0]) == 3


# ====================================================================================================
# two GPUs

FP32 = ["small", "--precision", "fp32", "--batch", 4, "--seq", 128, "--steps", 50, "--warmup", 5, "--lr", "3e-3",
        "--log-every", 1, "--eval-every", 1000, "--ckpt-every", 1000]


def losses(run):
    return np.array([json.loads(l)["loss"] for l in open(run / "train_log.jsonl")])


def ckpt_diff(a, b):
    """Largest difference of any weight or Adam moment between two checkpoints, relative to the array's max."""
    za, zb = np.load(a / "ckpt.npz"), np.load(b / "ckpt.npz")
    assert set(za.files) == set(zb.files)
    return max(float(np.abs(za[k] - zb[k]).max() / max(np.abs(za[k]).max(), 1e-30))
               for k in za.files if za[k].dtype == np.float32)


def hand_started(args, world=2, port=None, rank_env=None):
    """The ranks started by hand with the torchrun-style variables, as on several machines."""
    port = port or free_port()
    return [subprocess.Popen([sys.executable, os.path.join(ROOT, "nanoeuler_cuda.py"), *map(str, args)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(r), "WORLD_SIZE": str(world),
                                  "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  **(rank_env or {})})
            for r in range(world)]


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    """The same 50 fp32 steps of small, global batch 8: 2 GPUs x 4 (launcher), 1 GPU x 4 x 2 micro-batches, and 2
    GPUs x 4 started by hand."""
    d = tmp_path_factory.mktemp("runs")
    t0 = time.time()
    r = run_gpu("train", *FP32, "--gpus", 2, "--out", d / "two")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "global batch 8 sequences" in r.stdout and "ZeRO-1" in r.stdout, r.stdout
    print(f"\n2 GPUs: {time.time() - t0:.1f} s for the run, its start and its end")
    r = run_gpu("train", *FP32, "--grad-accum", 2, "--out", d / "one")
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = hand_started(["train", *FP32, "--out", d / "hand"])
    for p in ranks:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
    return d


@pytest.mark.gpu(2)
def test_two_gpus_equal_one_gpu_with_grad_accum(fp32_runs):
    """2 GPUs x batch 4 and 1 GPU x batch 4 with --grad-accum 2: the same loss at every step and the same
    checkpoint, to 1e-5; the ranks started by hand (torchrun-style variables) too."""
    one = losses(fp32_runs / "one")
    for run in ("two", "hand"):
        other = losses(fp32_runs / run)
        rel = float(np.max(np.abs(other - one) / np.abs(one)))
        diff = ckpt_diff(fp32_runs / run, fp32_runs / "one")
        print(f"\n{run} vs one GPU with --grad-accum 2: {len(one)} steps, loss max rel diff {rel:.2e}, "
              f"checkpoint max rel diff {diff:.2e}; losses {one[0]:.4f} -> {one[-1]:.4f}")
        assert len(other) == len(one) == 50 and rel <= 1e-5 and diff <= 1e-5


@pytest.mark.gpu(2)
def test_resume_on_another_number_of_gpus(fp32_runs, tmp_path):
    """25 steps on 2 GPUs, then resumed on 1 GPU with --grad-accum 2 (the same global batch): the checkpoint of
    50 uninterrupted steps; and that checkpoint loads on the CPU engine's side (pipeline.load_checkpoint)."""
    r = run_gpu("train", *FP32, "--gpus", 2, "--stop-after", 25, "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_gpu("resume", "--grad-accum", 2, "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    diff = ckpt_diff(tmp_path, fp32_runs / "one")
    print(f"\n2 GPUs for 25 steps, then 1 GPU x 2 micro-batches: checkpoint max rel diff {diff:.2e} against 50 steps")
    assert diff <= 1e-5
    P, _, state, _ = pl.load_checkpoint(str(tmp_path), want_state=True)
    assert state["step"] == 50 and np.isfinite(P.flat).all()


def wait_for(path, timeout):
    t0 = time.time()
    while not os.path.exists(path):
        assert time.time() - t0 < timeout, f"{path} did not appear in {timeout} s"
        time.sleep(0.2)


LONG = ["small", "--batch", 4, "--seq", 128, "--steps", 100000, "--log-every", 10, "--eval-every", 100000,
        "--ckpt-every", 20]


@pytest.mark.gpu(2)
def test_a_rank_killed_mid_run_stops_the_others(tmp_path):
    """kill -9 of one rank: under the launcher, and started by hand (rank 1, then rank 0 killed), the others end
    with one error line within 60 s, and the last checkpoint loads and resumes."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "nanoeuler_cuda.py"), "train", *map(str, LONG),
                          "--gpus", "2", "--out", str(tmp_path / "a")], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids = p.stdout.readline().split("(pids ")[1].rstrip(")\n").split()
    wait_for(tmp_path / "a" / "ckpt.npz", 120)
    time.sleep(1)
    os.kill(int(pids[1]), signal.SIGKILL)
    t0 = time.time()
    r, _ = finish(p, 90)
    print(f"\nlauncher, rank 1 killed: exit {r.returncode} after {time.time() - t0:.1f} s: {r.stderr.strip()}")
    assert one_error_line(r, "rank 1") and time.time() - t0 < 60, r.stderr
    for victim in (1, 0):
        out = tmp_path / f"hand{victim}"
        ranks = hand_started(["train", *LONG, "--out", out])
        wait_for(out / "ckpt.npz", 120)
        time.sleep(1)
        ranks[victim].kill()
        t0 = time.time()
        r, _ = finish(ranks[1 - victim], 90)
        print(f"by hand, rank {victim} killed: rank {1 - victim} exit {r.returncode} after {time.time() - t0:.1f} s: "
              f"{r.stderr.strip()}")
        assert one_error_line(r, f"rank {victim}") and time.time() - t0 < 60, r.stderr
        ranks[victim].wait()
    for run in ("a", "hand1", "hand0"):
        P, _, state, _ = pl.load_checkpoint(str(tmp_path / run), want_state=True)
        assert state["step"] % 20 == 0 and state["step"] > 0
    r = run_gpu("resume", "--steps", int(state["step"]) + 2, "--out", tmp_path / "hand0")
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu(2)
def test_gpu_faults_give_one_error_line(tmp_path):
    have = GPUS
    r = run_gpu("train", "small", "--gpus", have + 1, "--out", tmp_path)
    assert one_error_line(r, f"has {have} GPUs"), r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_gpu("train", "small", "--gpus", 2, "--out", tmp_path, env={"MASTER_PORT": str(port)})
        assert one_error_line(r, "cannot serve the rendezvous", str(port)), r.stderr
        ranks = hand_started(["train", "small", "--out", tmp_path], port=port)
        r, _ = finish(ranks[0], 60)
        ranks[1].kill()
        ranks[1].wait()
        assert one_error_line(r, "cannot serve the rendezvous"), r.stderr


@pytest.mark.gpu(2)
def test_ctrl_c_stops_every_rank_with_a_checkpoint(tmp_path):
    """Ctrl-C to the launcher: every rank stops at the next progress line, rank 0 writes the checkpoint, exit 130."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "nanoeuler_cuda.py"), "train", *map(str, LONG),
                          "--gpus", "2", "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_from_a_shell)
    wait_for(tmp_path / "ckpt.npz", 120)
    p.send_signal(signal.SIGINT)
    r, waited = finish(p, 60)
    assert r.returncode == 130, r.stdout[-2000:] + r.stderr
    state = pl.load_checkpoint(str(tmp_path), want_state=True)[2]
    log = [json.loads(l)["step"] for l in open(tmp_path / "train_log.jsonl")]
    print(f"\nCtrl-C: exit 130 after {waited:.1f} s, checkpoint at step {state['step']} (log to step {log[-1]})")
    assert state["step"] == log[-1] and state["step"] % 10 == 0
