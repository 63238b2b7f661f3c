"""
nanoeuler_cuda.py -- the GPU engine of NanoEuler: the model, loss and AdamW of CONTRACT.md in CUDA on CuPy.

Every kernel is a CUDA source string below, next to the Python function that launches it, compiled at
first use with cupy.RawModule (NVRTC); the matrix products go to cuBLAS through CuPy's handle. Three
precisions (--precision, CONTRACT.md "Precision on the GPU"): fp32 (the reference of the checks), tf32
(fp32 storage, TF32 tensor-core GEMMs) and bf16, the default for training: mixed precision as llm.c does it,
fp32 master weights, gradients and Adam moments, a bf16 copy of the weights that the AdamW kernel refreshes,
bf16 activations and GEMM inputs with fp32 accumulation (cublasGemmEx), the residual stream, norm
statistics, softmax, log-sum-exp and loss in fp32, tensor-core FlashAttention in bf16 (mma.sync, wgmma on sm_90,
through inline PTX), and the logits + MTP cross-entropy fused and chunked over rows, so the N x (n_mtp V) logits
never exist at once. Parameters, gradients and Adam moments are each one flat device buffer
with the layout of pipeline.Params.flat, so moving weights in or out is one copy. No float atomics
anywhere: every reduction has a fixed order, so a run is bit-reproducible and a resumed run continues
the uninterrupted one exactly. It needs numpy and CuPy; the CPU engine (nanoeuler.py, Numba) only for the
float64 references of selftest and gradcheck.

Modes: `python nanoeuler_cuda.py --help` lists them (MODES, section 10), each a word or the seed's letter,
e.g. `python nanoeuler_cuda.py train small`, `python nanoeuler_cuda.py i "It was"`; no mode runs selftest.
Each mode's --help lists its flags and their defaults. Configs: tiny, small, medium, big, large.

Sections (each begins with a bar and the same number and name):
    1. GPU runtime: CuPy, the device profile (and its emulation), launches, cuBLAS and cublasLt, CUDA graphs,
       the kernel registry
    2. training kernels: embedding, RMSNorm, RoPE, SwiGLU, cross-entropy, attention (fp32 flash,
       bf16 tensor-core flash, naive), each beside its launcher
    3. model: DeviceParams, Model (forward, backward)
    4. optimiser: AdamW and Muon (--optim muon) with their kernels
    5. training: Trainer, train and resume
    6. generation: the decode kernels by concern (products, cache attention, sampling, speculation)
       beside the Sampler that launches them, and the Decoder of serve's batch (with its steps' residual
       products on tensor cores, dec_add)
    7. fine-tuning and evaluation: SFT, chat, serve, DPO, eval, plot
    8. verification: the NVRTC compile check, the self-test, the gradient check
    9. bench: training, attention and generation speed, and serve's batch
    10. command line: the modes and main
Shapes: B batch, T positions, N = B*T rows, D dim, Hq/Hkv heads, hd head dim, Cq = Hq*hd, Ck = Hkv*hd,
S = Cq + 2*Ck (one row of the fused q|k|v product), F ffn width, V vocab, L layers. A bf16 array is a
uint16 CuPy array holding the bits (CuPy has no bfloat16 dtype; the kernels see 2-byte elements).
"""
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import pipeline as pl
from pipeline import UserError

HERE = os.path.dirname(os.path.abspath(__file__))


def _evaluate():
    """evaluate.py (the run report, HellaSwag, bits per byte, loss curves), loaded by the modes that use it."""
    import evaluate
    return evaluate


def _distributed():
    """distributed.py (several GPUs, --gpus), loaded by the modes that take it and by a trainer of a group."""
    import distributed
    return distributed

# ----------------------------------------------------------------------------------------------------
# 1. GPU runtime: CuPy (imported lazily, so that the compile check and the error messages work without
# it), the device profile that every plan reads, launches, cuBLAS and cublasLt, CUDA graphs, and the kernel
# registry that compiles the sources

cp = None          # the cupy module, once gpu() has run
cublas = None      # cupy_backends.cuda.libs.cublas
_handle = None


def gpu():
    """Imports CuPy and checks for a device; without either, one line and a non-zero exit."""
    global cp, cublas, _handle
    if cp is not None:
        return cp
    try:
        import cupy
        from cupy_backends.cuda.libs import cublas as _cublas
    except Exception as e:  # ImportError, or a CuPy that cannot find its CUDA libraries
        raise UserError(f"the GPU engine needs CuPy and an NVIDIA GPU; CuPy is not usable here ({type(e).__name__}: {e}); "
                        "install the CuPy build of your CUDA (pip install cupy-cuda12x or cupy-cuda13x)") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:
        raise UserError(f"the GPU engine needs an NVIDIA GPU; none is usable here ({type(e).__name__}: {e}); "
                        "the CPU engine is nanoeuler.py") from None
    cp, cublas = cupy, _cublas
    _handle = cupy.cuda.device.get_cublas_handle()
    _probe_scalar_convention()
    _start_profile()
    return cp


# --- the device profile: the figures every launch plan reads (SMs, shared memory, memory, peak), read once by
#     gpu(). NANOEULER_EMULATE=<key of EMULATE> replaces it by that GPU's published figures, never above the real
#     device's: an H200 then plans grids, tiles and shared memory as that GPU would, its memory caps CuPy's pool,
#     its peak is MFU's. The planners (flash_fits, matvec_plan, attn_chunk, memory_estimate, ...) are functions
#     of (profile, shapes) alone, so a CPU test checks them for every profile. ---

@dataclass(frozen=True)
class DeviceProfile:
    name: str
    cc: tuple              # compute capability (major, minor)
    sms: int               # multiProcessorCount
    smem_block: int        # bytes of shared memory a block may opt in to, static included (sharedMemPerBlockOptin)
    smem_sm: int           # bytes of shared memory an SM has (sharedMemPerMultiprocessor)
    threads_sm: int        # maxThreadsPerMultiProcessor
    regs_sm: int           # regsPerMultiprocessor
    l2: int                # l2CacheSize, bytes
    total: int             # device memory, bytes
    free: int              # free at start-up, bytes (emulated: what the emulated GPU would have free, the pool's cap)
    peak_tflops: float     # dense bf16 tensor-core peak, fp32 accumulation (fp16 before sm_80): MFU's denominator
    emulated: bool = False

    @property
    def bf16(self):
        """bf16 tensor cores, cp.async and TF32: sm_80 on; before it the engine runs fp32."""
        return self.cc >= (8, 0)

    @property
    def wgmma(self):
        """Warpgroup MMA (sm_90a): the bf16 flash kernels at head dim 64 use it. sm_90 alone: the 'a' features are
        the chip's own (an emulated older GPU runs the mma.sync kernels)."""
        return self.cc == (9, 0)

    @property
    def pdl(self):
        """Programmatic dependent launch (griddepcontrol): sm_90 on."""
        return self.cc >= (9, 0)

    @property
    def arch(self):
        return f"sm_{self.cc[0]}{self.cc[1]}"


MIN_CC = (7, 5)     # the oldest chip whose kernels the CI compiles (fp32 only); bf16 and tf32 from sm_80
MiB, GiB = 1 << 20, 1 << 30
# Published figures. Shared memory a block (opt-in) / an SM, threads and registers an SM: the CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability" (7.5: 64 / 64 KB, 1024 threads; 8.0:
# 163 / 164 KB, 2048; 8.6 and 8.9: 99 / 100 KB, 1536; 9.0: 227 / 228 KB, 2048; 64K registers an SM on all).
# SMs, L2 and memory (as nvidia-smi reports it): NVIDIA's whitepapers and datasheets (GA100 / A100 40 GB SXM4:
# 108 SMs, 40 MB L2; GA102 / RTX 3090: 82 SMs, 6 MB, 24 GB; Ada / RTX 4070 (AD104): 46 SMs, 36 MB, 12 GB; L4
# (AD104): 58 SMs, 48 MB, 24 GB; Turing / T4: 40 SMs, 4 MB, 16 GB; H200 SXM: 132 SMs, 50 MB, 141 GB).
# free = total less ~0.5 GiB (the CUDA context and libraries). Peaks: PEAKS.
EMULATE = {key: DeviceProfile(name, cc, sms, sb << 10, ss << 10, th, 65536, l2 * MiB, tot * MiB, (tot - 512) * MiB,
                              peak)
           for key, name, cc, sms, sb, ss, th, l2, tot, peak in (
               ("rtx4070", "NVIDIA GeForce RTX 4070", (8, 9), 46, 99, 100, 1536, 36, 12282, 58.3),
               ("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 82, 99, 100, 1536, 6, 24268, 71.0),
               ("a100", "NVIDIA A100-SXM4-40GB", (8, 0), 108, 163, 164, 2048, 40, 40536, 312.0),
               ("l4", "NVIDIA L4", (8, 9), 58, 99, 100, 1536, 48, 23034, 121.0),
               ("t4", "Tesla T4", (7, 5), 40, 64, 64, 1024, 4, 15360, 65.0),
               ("h200", "NVIDIA H200", (9, 0), 132, 227, 228, 2048, 50, 143771, 989.0))}

# Dense bf16 tensor-core peaks with fp32 accumulation, TFLOP/s, by compute capability and a part of the name
# (the first row that matches); sparse figures halved. Sources: H100 datasheet (SXM 1,979, PCIe 1,513, NVL
# 1,671 sparse), H200 datasheet (1,979 sparse), A100 datasheet (312 dense), A30 datasheet (330 sparse), A40
# datasheet (299.4 sparse), GA102 whitepaper (RTX 3090: 71 dense with fp32 accumulate), L40 datasheet (724
# sparse), L4 datasheet (242 sparse), Ada whitepaper (RTX 4090: 165.2 dense with fp32 accumulate; the RTX 4070
# at the same 512 FLOP an SM and clock: 46 SMs x 2.475 GHz x 512 = 58.3; 29 TFLOP/s is its fp32 CUDA-core rate,
# not its tensor cores'), T4 datasheet (65 fp16/fp32 mixed).
PEAKS = (((9, 0), "PCIe", 756.0), ((9, 0), "NVL", 835.0), ((9, 0), "", 989.0),
         ((8, 0), "A30", 165.0), ((8, 0), "", 312.0),
         ((8, 6), "A40", 149.7), ((8, 6), "RTX 3090", 71.0),
         ((8, 9), "L40", 362.0), ((8, 9), "L4", 121.0), ((8, 9), "RTX 4090", 165.2), ((8, 9), "RTX 4070", 58.3),
         ((7, 5), "T4", 65.0))
# elsewhere: FLOP an SM and clock x SMs x clock (the rows above at their boost clocks: A100 2048, H100 4096,
# GeForce Ampere and Ada 512 with fp32 accumulation (their data-center parts twice that), Turing 512)
PEAK_PER_SM_CLOCK = {(7, 5): 512, (8, 0): 2048, (8, 6): 512, (8, 7): 512, (8, 9): 512, (9, 0): 4096}


def peak_tflops(cc, name, sms, clock_khz):
    """The device's dense bf16 peak (PEAKS, else PEAK_PER_SM_CLOCK), TFLOP/s; 0 where neither knows it."""
    for c, part, tf in PEAKS:
        if c == cc and part in name:
            return tf
    rate = PEAK_PER_SM_CLOCK.get(cc, PEAK_PER_SM_CLOCK[max(PEAK_PER_SM_CLOCK)] if cc > max(PEAK_PER_SM_CLOCK) else 0)
    return rate * sms * clock_khz * 1e3 / 1e12


def emulate(real, key):
    """The profile of EMULATE[key] as run on the real device: its limits, never above the real one's (its
    kernels run there); free, what that GPU has free alone (several emulated runs may share one device)."""
    if not key:
        return real
    if key not in EMULATE:
        raise UserError(f"NANOEULER_EMULATE={key}: no such profile; use one of {', '.join(EMULATE)} (or unset it)")
    e = EMULATE[key]
    lim = lambda f: min(getattr(e, f), getattr(real, f))
    return DeviceProfile(f"{e.name} (emulated on {real.name})", min(e.cc, real.cc), e.sms, lim("smem_block"),
                         lim("smem_sm"), lim("threads_sm"), lim("regs_sm"), e.l2, lim("total"),
                         min(e.free, real.free), e.peak_tflops, True)


PROFILE = None      # the device's DeviceProfile, once gpu() has run


def device():
    """The profile of this process's device (gpu() reads it once)."""
    gpu()
    return PROFILE


def _start_profile():
    """Reads the device's profile once (emulated where NANOEULER_EMULATE says), caps the memory pool under
    emulation, and refuses a chip older than MIN_CC with one line."""
    global PROFILE
    rt = cp.cuda.runtime
    dev = cp.cuda.Device().id
    p = rt.getDeviceProperties(dev)

    def prop(key, attr):         # getDeviceProperties' field, else cudaDeviceGetAttribute's (cudaDeviceAttr number)
        v = p.get(key)
        return int(v) if v is not None else int(rt.deviceGetAttribute(attr, dev))
    name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    cc, sms = (prop("major", 75), prop("minor", 76)), prop("multiProcessorCount", 16)
    try:
        clock = prop("clockRate", 13)                                  # kHz (not in CUDA 13's cudaDeviceProp)
    except Exception:
        clock = 0
    free, total = rt.memGetInfo()
    real = DeviceProfile(name, cc, sms, prop("sharedMemPerBlockOptin", 97), prop("sharedMemPerMultiprocessor", 81),
                         prop("maxThreadsPerMultiProcessor", 39), prop("regsPerMultiprocessor", 82),
                         prop("l2CacheSize", 38), int(total), int(free), peak_tflops(cc, name, sms, clock))
    prof = emulate(real, os.environ.get("NANOEULER_EMULATE", "").strip().lower())
    if prof.cc < MIN_CC:
        raise UserError(f"this GPU ({name}, sm_{cc[0]}{cc[1]}) is older than the GPU engine supports: fp32 needs "
                        f"sm_{MIN_CC[0]}{MIN_CC[1]} (T4, RTX 20 series), bf16 and tf32 sm_80 (A100, RTX 30/40 series, "
                        "L4, H100); the CPU engine nanoeuler.py runs anywhere")
    if prof.emulated:
        cp.get_default_memory_pool().set_limit(size=prof.free)
        print(f"[emulating {prof.name}: {prof.sms} SMs, {prof.smem_block >> 10} KB shared memory a block, "
              f"{prof.free / GiB:.1f} of {prof.total / GiB:.1f} GiB free, {prof.peak_tflops:g} TFLOP/s bf16]",
              file=sys.stderr)
    PROFILE = prof


_scalar_by_pointer = False      # CuPy 14's cuBLAS bindings take alpha/beta as host pointers, older ones as floats
_scalars = {}


def _probe_scalar_convention():
    """A 1x1 product 2*3 with alpha/beta given as pointers: 6 only if the binding takes pointers (an old
    binding reads the pointer's address as a huge alpha instead; nothing is dereferenced then)."""
    global _scalar_by_pointer
    _scalar_by_pointer = True
    a, b, c = (cp.full((1, 1), v, np.float32) for v in (2.0, 3.0, 0.0))
    try:
        cublas.sgemm(_handle, 0, 0, 1, 1, 1, _s(1.0), a.data.ptr, 1, b.data.ptr, 1, _s(0.0), c.data.ptr, 1)
        _scalar_by_pointer = float(cp.asnumpy(c)[0, 0]) == 6.0
    except Exception:
        _scalar_by_pointer = False


def _s(v):
    """alpha/beta as the binding wants them: a pointer to a host float32 kept alive here, or the float."""
    if not _scalar_by_pointer:
        return float(v)
    return _ptr(v)


def _ptr(v):
    """A pointer to a host float32 holding v, kept alive here (gemmEx always takes alpha/beta by pointer)."""
    arr = _scalars.get(v)
    if arr is None:
        arr = _scalars[v] = np.array([v], np.float32)
    return arr.ctypes.data


_tf32 = False


def set_tf32(on):
    """TF32 tensor cores for the float32 GEMMs (10-bit mantissa inputs, fp32 accumulation): on to train,
    off for the checks. cuBLAS's math mode on CuPy's handle; CUPY_TF32 would only reach cupy.matmul."""
    global _tf32
    _tf32 = bool(on)
    cublas.setMathMode(_handle, 3 if on else 0)   # CUBLAS_TF32_TENSOR_OP_MATH / CUBLAS_DEFAULT_MATH


NAIVE_TF32 = False   # the naive attention's score/value products stay fp32 (CONTRACT.md), unless set for a comparison


# cudaDataType / cublasComputeType_t / cublasGemmAlgo_t values for cublasGemmEx
CUDA_R_32F, CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 0, 14, 68, -1
BF = np.uint16      # the dtype of bf16 arrays: the bits, see the module's docstring


def mm(C, A, B, ta=False, tb=False, alpha=1.0, beta=0.0):
    """Row-major C (M, N) = alpha * op(A) @ op(B) + beta * C on cuBLAS, no copies: a row-major matrix is
    its transpose in column-major, so cuBLAS computes C^T = op(B)^T op(A)^T. op(X) = X.T when t* is set.
    fp32 A, B: sgemm (TF32 when set_tf32 is on). bf16 A, B: gemmEx on the tensor cores with fp32
    accumulation, C bf16 (an activation, a residual branch, training's logits) or fp32 (a weight gradient,
    the log-probs' logits)."""
    M, N = C.shape
    K = A.shape[0] if ta else A.shape[1]
    assert A.shape == ((K, M) if ta else (M, K)) and B.shape == ((N, K) if tb else (K, N)), \
        (C.shape, A.shape, B.shape, ta, tb)
    assert A.flags.c_contiguous and B.flags.c_contiguous and C.flags.c_contiguous
    if A.dtype == BF:
        assert B.dtype == BF and C.dtype in (BF, np.float32), (A.dtype, B.dtype, C.dtype)
        return _gemm_ex(int(tb), int(ta), N, M, K, alpha, B, B.shape[1], A, A.shape[1], beta, C, N, CUBLAS_COMPUTE_32F)
    assert A.dtype == B.dtype == C.dtype == np.float32, (A.dtype, B.dtype, C.dtype)
    cublas.sgemm(_handle, int(tb), int(ta), N, M, K, _s(alpha), B.data.ptr, B.shape[1], A.data.ptr, A.shape[1],
                 _s(beta), C.data.ptr, N)


_blas = None        # [libcublas through ctypes, its workspace], or [None] where it cannot be found


def _loaded(name):
    """The path of a shared library this process has loaded (libname.so[.N..]), by /proc/self/maps, or None."""
    with open("/proc/self/maps") as f:
        return next((l.split()[-1] for l in f if re.search(rf"/{re.escape(name)}\.so[.\d]*$", l.strip())), None)


def _blas_lib():
    """The libcublas that CuPy has loaded, through ctypes (or None): CuPy's binding refuses any cuBLAS call
    while a stream is captured into a CUDA graph, cuBLAS itself does not, given a workspace of its own (set
    here on CuPy's handle, as graphs need)."""
    global _blas
    if _blas is None:
        import ctypes
        _blas = [None]
        path = _loaded("libcublas")
        if path is not None:
            lib = ctypes.CDLL(path)
            work = cp.empty(32 << 20, np.uint8)
            if lib.cublasSetWorkspace_v2(ctypes.c_void_p(_handle), ctypes.c_void_p(work.data.ptr),
                                         ctypes.c_size_t(work.size)) == 0:
                i, v = ctypes.c_int, ctypes.c_void_p
                lib.cublasGemmEx.argtypes = [v, i, i, i, i, i, v, v, i, i, v, i, i, v, v, i, i, i, i]
                _blas = [lib, work]
    return _blas[0]


def _data_type(x):
    """An array's cudaDataType."""
    return CUDA_R_16BF if x.dtype == BF else CUDA_R_32F


def _gemm_ex(opb, opa, n, m, k, alpha, B, ldb, A, lda, beta, C, ldc, compute):
    """C = alpha op(B) op(A) + beta C on CuPy's handle, column-major (as mm calls it), the types the arrays':
    cublasLt with a per-shape algorithm (_lt_plan), else cublasGemmEx through ctypes (both capturable), or
    CuPy's binding where neither library is found."""
    lt = _lt_lib()
    if lt is not None:
        plan = _lt_plan((opb, opa, n, m, k, ldb, lda, ldc, B.dtype.str, A.dtype.str, C.dtype.str, compute,
                         beta != 0, _align(B), _align(A), _align(C)), B, A, C, alpha, beta)
        return _lt_run(plan, plan.algo, alpha, B, A, beta, C)
    t = _data_type
    args = (_handle, opb, opa, n, m, k, _ptr(alpha), B.data.ptr, t(B), ldb, A.data.ptr, t(A), lda, _ptr(beta),
            C.data.ptr, t(C), ldc, compute, CUBLAS_GEMM_DEFAULT)
    lib = _blas_lib()
    if lib is None:
        return cublas.gemmEx(*args)
    err = lib.cublasGemmEx(*args)
    if err:
        raise RuntimeError(f"cublasGemmEx failed with status {err}")


# --- cublasLt: cuBLAS's own heuristic ranks a few algorithms for a GEMM's shape, and its first is not always
#     the fastest (big's w1|w3 product at B=64: 287 us first, 265 us sixth). The first call of each shape
#     times the ranked algorithms on its own operands and keeps the fastest of those whose result equals the
#     first's bit for bit: the same bits whichever wins, in every process (resume is checked bit for bit),
#     only sooner (0.5 ms a B=64 training step; the batched decode step's products). ---
_lt = None          # [libcublasLt, its handle, ctypes], or [None] where it cannot be found
_lt_plans = {}
LT_ALGOS = 8        # the heuristic's candidates timed for a shape


def _lt_lib():
    global _lt
    if _lt is None:
        _lt = [None]
        if _blas_lib() is not None:                  # cuBLAS's workspace, which Lt shares (same stream order)
            import ctypes
            path = _loaded("libcublasLt")
            if path is not None:
                lib, v, i = ctypes.CDLL(path), ctypes.c_void_p, ctypes.c_int
                lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(v), i, ctypes.c_uint64, ctypes.c_uint64,
                                                           ctypes.c_int64]
                lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(v), i, i]
                lib.cublasLtMatmulDescSetAttribute.argtypes = [v, i, v, ctypes.c_size_t]
                lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [v, i, v, ctypes.c_size_t]
                lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [v, v, v, v, v, v, v, i, v, ctypes.POINTER(i)]
                lib.cublasLtMatmul.argtypes = [v] * 14 + [ctypes.c_size_t, v]
                h = v()
                if lib.cublasLtCreate(ctypes.byref(h)) == 0:
                    _lt = [lib, h, ctypes]
    return _lt[0]


def _align(x):
    """The largest power of two up to 256 that divides x's address (Lt's algorithms need to know)."""
    p = x.data.ptr
    return min(256, p & -p) if p else 256


class _LtPlan:
    pass


def _lt_plan(key, B, A, C, alpha, beta):
    """The descriptors of key's GEMM and its algorithm: chosen at the first call (see above), on that call's
    operands (and C, where beta != 0); during a graph capture, the heuristic's first."""
    plan = _lt_plans.get(key)
    if plan is not None:
        return plan
    lib, h, ctypes = _lt
    opb, opa, n, m, k, ldb, lda, ldc, _, _, _, compute, _, alB, alA, alC = key
    t, plan, v = _data_type, _LtPlan(), ctypes.c_void_p

    def layout(dt, rows, cols, ld):
        d = v()
        assert lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), dt, rows, cols, ld) == 0
        return d
    plan.a = layout(t(B), k if opb else n, n if opb else k, ldb)     # cuBLAS's A, B: our B, A (row-major)
    plan.b = layout(t(A), m if opa else k, k if opa else m, lda)
    plan.c = layout(t(C), n, m, ldc)
    plan.desc = v()
    assert lib.cublasLtMatmulDescCreate(ctypes.byref(plan.desc), compute, CUDA_R_32F) == 0
    for attr, val in ((3, opb), (4, opa)):                           # CUBLASLT_MATMUL_DESC_TRANSA, TRANSB
        x = ctypes.c_int32(val)
        assert lib.cublasLtMatmulDescSetAttribute(plan.desc, attr, ctypes.byref(x), 4) == 0
    pref = v()
    assert lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)) == 0
    ws = ctypes.c_uint64(_blas[1].size)
    assert lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), 8) == 0   # MAX_WORKSPACE_BYTES
    for attr, al in ((5, alB), (6, alA), (7, alC), (8, alC)):       # MIN_ALIGNMENT_A/B/C/D_BYTES
        x = ctypes.c_uint32(al)
        assert lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(x), 4) == 0
    res, cnt = (ctypes.c_uint8 * (96 * LT_ALGOS))(), ctypes.c_int()  # cublasLtMatmulHeuristicResult_t[]: 96 B
    err = lib.cublasLtMatmulAlgoGetHeuristic(h, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, LT_ALGOS, res,
                                             ctypes.byref(cnt))
    lib.cublasLtMatmulPreferenceDestroy(pref)
    base = ctypes.addressof(res)
    algos = [ctypes.create_string_buffer(bytes(res[96 * j:96 * j + 64]), 64) for j in range(cnt.value)
             if err == 0 and ctypes.c_int32.from_address(base + 96 * j + 72).value == 0]
    if not algos:
        raise RuntimeError(f"cublasLt has no algorithm for the GEMM {key}")
    plan.algo, plan.timed = algos[0], []
    if len(algos) > 1 and not cp.cuda.get_current_stream().is_capturing():
        C0 = C.copy() if beta else None                # C is read: each candidate starts from it

        def run(a):
            if beta:
                C[...] = C0
            _lt_run(plan, a, alpha, B, A, beta, C)
        # every 97th element: a different order of the sums changes nearly all, and each output tile has
        # hundreds of them (the sample keeps the pool small: a full copy of big's w1|w3 output is 256 MB)
        sample = lambda: C.ravel()[::97].view(np.uint16 if C.dtype == BF else np.uint32)
        run(algos[0])
        ref = sample().copy()
        for a in algos:
            run(a)
            same = a is algos[0] or bool(cp.array_equal(sample(), ref))
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(5):
                _lt_run(plan, a, alpha, B, A, beta, C)
            e1.record()
            e1.synchronize()
            plan.timed.append((cp.cuda.get_elapsed_time(e0, e1) / 5, same, a))
        plan.algo = min((t for t in plan.timed if t[1]), key=lambda t: t[0])[2]
        if beta:
            C[...] = C0                                # the caller's product runs on the C it gave
        del ref, C0
    _lt_plans[key] = plan
    return plan


def _lt_run(plan, algo, alpha, B, A, beta, C):
    lib, h, ctypes = _lt
    err = lib.cublasLtMatmul(h, plan.desc, _ptr(alpha), B.data.ptr, plan.a, A.data.ptr, plan.b, _ptr(beta),
                             C.data.ptr, plan.c, C.data.ptr, plan.c, algo, _blas[1].data.ptr, _blas[1].size,
                             cp.cuda.get_current_stream().ptr)
    if err:
        raise RuntimeError(f"cublasLtMatmul failed with status {err}")


def capture(stream, fn, what):
    """fn's launches on `stream` (on_stream) as a CUDA graph, or None, with a one-line note, where capture
    fails (e.g. a library that cannot be captured): the caller launches from Python, slower, still right."""
    try:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
        return graph
    except Exception as e:
        print(f"[CUDA graph capture of {what} failed ({type(e).__name__}: {e}); launching from Python]",
              file=sys.stderr)
        return None


def on_stream(stream):
    """A context: kernels and cuBLAS calls on `stream` (a CUDA graph captures a stream of its own)."""
    class _On:
        def __enter__(self):
            stream.__enter__()
            cublas.setStream(_handle, stream.ptr)

        def __exit__(self, *exc):
            cublas.setStream(_handle, 0)
            stream.__exit__(*exc)
    return _On()


def bmm(C, A, B, ta=False, tb=False, alpha=1.0, beta=0.0):
    """mm over a batch: C (nb, M, N), A (nb, ...), B (nb, ...), one strided-batched cuBLAS call.
    Used by the naive attention only, so it runs in fp32 even when TF32 is on (unless NAIVE_TF32)."""
    if _tf32 and not NAIVE_TF32:
        cublas.setMathMode(_handle, 0)
        try:
            return _bmm(C, A, B, ta, tb, alpha, beta)
        finally:
            cublas.setMathMode(_handle, 3)
    return _bmm(C, A, B, ta, tb, alpha, beta)


def _bmm(C, A, B, ta, tb, alpha, beta):
    nb, M, N = C.shape
    K = A.shape[1] if ta else A.shape[2]
    assert A.shape == ((nb, K, M) if ta else (nb, M, K)) and B.shape == ((nb, N, K) if tb else (nb, K, N)), \
        (C.shape, A.shape, B.shape, ta, tb)
    assert A.flags.c_contiguous and B.flags.c_contiguous and C.flags.c_contiguous
    cublas.sgemmStridedBatched(_handle, int(tb), int(ta), N, M, K, _s(alpha),
                               B.data.ptr, B.shape[2], B.shape[1] * B.shape[2],
                               A.data.ptr, A.shape[2], A.shape[1] * A.shape[2],
                               _s(beta), C.data.ptr, N, M * N, nb)


I32, F32 = np.int32, np.float32
NULL = np.uint64(0)     # a null pointer argument


def _pinned(n, dtype=np.int32, device=False):
    """A page-locked host array (asynchronous copies), or a plain one if CuPy cannot provide it (device: one
    that kernels write, which only page-locked memory can be)."""
    try:
        import cupyx
        return cupyx.empty_pinned((n,), dtype)
    except Exception:
        if device:
            raise
        return np.empty(n, dtype)


def _blocks(n, threads=256):
    return ((n + threads - 1) // threads,)


_launch_ex = None   # [cuLaunchKernelEx, its config and attribute types], or [None] where the driver lacks it


def launch(kernel, grid, block, args, shared_mem=0, pdl=True):
    """kernel<<<grid, block, shared_mem>>>(*args) on the current stream, as a programmatic dependent launch:
    the kernel may start while the stream's previous kernel still runs, and must dep_wait() (COMMON) before
    it reads what that kernel writes. The decode step's kernels start early to load their weights. Where
    cuLaunchKernelEx is missing, or before sm_90 (PROFILE.pdl), a plain launch: the same results, without the
    overlap. args: CuPy arrays, numpy int32 / float32 / int64 scalars (as the kernel's parameters are typed),
    NULL for a null pointer. pdl=False: a plain launch (the kernel reads what the previous one wrote before its
    dep_wait: a Decoder's prompt rows, whose keys the same pass appends)."""
    global _launch_ex
    if _launch_ex is None:
        import ctypes
        _launch_ex = [None]
        try:
            lib = ctypes.CDLL("libcuda.so.1")

            class Attr(ctypes.Structure):   # CUlaunchAttribute: an id, then a 64-byte value union
                _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_int),
                            ("rest", ctypes.c_char * 60)]

            class Config(ctypes.Structure):   # CUlaunchConfig
                _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                            ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("nattrs", ctypes.c_uint)]
            fn = lib.cuLaunchKernelEx
            fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            attr = Attr(id=6, val=1)          # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1
            _launch_ex = [fn, Config, attr, ctypes]
        except (OSError, AttributeError):
            pass
    fn, Config, attr, ctypes = (_launch_ex + [None] * 3)[:4]
    if fn is None or not PROFILE.pdl or not pdl:
        return kernel(grid, block, args, shared_mem=shared_mem)
    c = {np.int32: ctypes.c_int, np.float32: ctypes.c_float, np.int64: ctypes.c_longlong, np.uint64: ctypes.c_uint64}
    vals = [ctypes.c_void_p(a.data.ptr) if hasattr(a, "data") and hasattr(a.data, "ptr") else c[type(a)](a)
            for a in args]
    ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
    g, b = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    cfg = Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem, cp.cuda.get_current_stream().ptr,
                 ctypes.pointer(attr), 1)
    err = fn(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), ptrs, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx failed with error {err}")


STATIC_SMEM = 1 << 10     # bytes a block's static shared memory may take beside its dynamic (matvec's: 768)


def smem_fits(dynamic, prof=None):
    """Whether a block of `dynamic` bytes of dynamic shared memory (and static up to STATIC_SMEM) fits the
    device (prof, default PROFILE): the test every planner makes before it asks."""
    return dynamic + STATIC_SMEM <= (prof or PROFILE).smem_block


def shared_memory(kernel, smem):
    """Lets kernel take smem bytes of dynamic shared memory, and asks for the largest shared-memory carveout:
    an SM set up for one small kernel's blocks cannot take the next kernel's beside them, so the decode
    step's kernels would not start early (a big decode step: 362 -> 298 us). Only raised: a captured
    graph keeps its launches. smem was planned to fit (smem_fits)."""
    assert smem_fits(smem), f"{smem} bytes of shared memory planned beyond {PROFILE.name}'s {PROFILE.smem_block}"
    if kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
        kernel.preferred_shared_memory_carveout = 100      # percent of the unified L1/shared memory


def bf16_bits(a):
    """Host: float -> bf16 bits (uint16), round to nearest even, as the device's cvt.rn does."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def bf16_float(b):
    """Host: bf16 bits -> float32 (exact)."""
    return (np.asarray(b).astype(np.uint32) << np.uint32(16)).view(np.float32)


# --- kernel registry: each CUDA source is declared as a module with the names of its kernels (cuda_source),
#     so every kernel name is declared once; _k(name) compiles the name's module, COMMON + its source, on
#     first use (CuPy caches the binaries)

NVRTC_OPTIONS = ("-std=c++17",)
SOURCES = {}        # module -> its CUDA source
KERNELS = {}        # kernel name -> module
_modules, _kernels = {}, {}


def cuda_source(module, names, src):
    """Declares a module: its CUDA source src and the names of the kernels src defines; -> src."""
    assert module not in SOURCES and not KERNELS.keys() & set(names), module
    SOURCES[module] = src
    KERNELS.update(dict.fromkeys(names, module))
    return src


def kernel_names(src):
    """The kernels a CUDA source defines, read from its text (the tests' cross-check of KERNELS)."""
    return re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)', src)


def _k(name):
    """The compiled kernel of a declared name."""
    k = _kernels.get(name)
    if k is None:
        assert name in KERNELS, f"no kernel {name}"
        mod = KERNELS[name]
        if mod not in _modules:
            _modules[mod] = cp.RawModule(code=COMMON + SOURCES[mod],
                                         options=NVRTC_OPTIONS + (("-arch=sm_90a",) if mod in WG_MODULES else ()))
        k = _kernels[name] = _modules[mod].get_function(name)
    return k


# ----------------------------------------------------------------------------------------------------
# 2. training kernels: CUDA sources, each next to its launcher. COMMON is prepended to every module.

COMMON = f"""
#define RMS_EPS {pl.RMS_EPS!r}f
""" + r"""#define NEG_INF (-__int_as_float(0x7f800000))
typedef long long i64;
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// block-wide sum / max (blockDim.x a multiple of 32); every thread gets the result; fixed order
template <bool MAX> __device__ float block_reduce(float v) {
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : (MAX ? NEG_INF : 0.f);
    r = MAX ? warp_max(r) : warp_sum(r);
    __syncthreads();
    return r;
}
__device__ __forceinline__ float block_sum(float v) { return block_reduce<false>(v); }
__device__ __forceinline__ float block_max(float v) { return block_reduce<true>(v); }
// float64 block sum (the gradient norm's and Muon's partial sums): warp trees, then thread 0 adds the warps'
// sums in order; thread 0's return value is the sum
__device__ double block_sum_f64(double acc) {
    __shared__ double sh[32];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = acc;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) s += sh[i];
    return s;
}
// (value, id) pairs: the larger value first, the smaller id on a tie (numpy's first argmax)
__device__ __forceinline__ bool before(float a, int ai, float b, int bi) { return a > b || (a == b && ai < bi); }
__device__ void block_argmax(float& v, int& i) {          // every thread gets the block's first argmax
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    if (lane == 0) { sv[w] = v; si[w] = i; }
    __syncthreads();
    v = lane < nw ? sv[lane] : NEG_INF;
    i = lane < nw ? si[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (before(ov, oi, v, i)) { v = ov; i = oi; }
    }
    __syncthreads();
}
// Programmatic dependent launch (sm_90; no-ops before it). A kernel started by launch() may begin while
// the stream's previous kernels still run, back to the last plain launch: before dep_wait() it may read
// only what was written before that launch began (the weights; in a decode step, which starts with the
// plain embed_fwd, also the position and the cache rows of earlier steps), never this step's activations.
// dep_trigger() lets the next kernel start now, so that its loads overlap this kernel.
__device__ __forceinline__ void dep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void dep_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// cp.async (sm_80+): 16-byte (or 4-byte) global -> shared copies without registers; src_bytes = 0 writes
// zeros (the flash kernels' rows past T). fb_wait<N>: all but the N newest committed groups have landed.
// Before sm_80 (the fp32 kernels on sm_75) a plain copy through registers, and commit and wait do nothing.
__device__ __forceinline__ unsigned fb_sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void fb_cp16(void* dst, const void* src, int src_bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(fb_sa(dst)), "l"(src), "r"(src_bytes) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = src_bytes ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}
__device__ __forceinline__ void fb_cp4(void* dst, const void* src, int src_bytes) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(fb_sa(dst)), "l"(src), "r"(src_bytes) : "memory");
#else
    *reinterpret_cast<unsigned*>(dst) = src_bytes ? *reinterpret_cast<const unsigned*>(src) : 0u;
#endif
}
__device__ __forceinline__ void fb_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void fb_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
#endif
}
// bf16 as its bits (no cuda_bf16.h: NVRTC without CUDA's include folder compiles this too). Conversions
// round to nearest even (cvt.rn); arithmetic is always fp32. x2: two adjacent elements in one 32-bit word,
// the lower column in the low half.
typedef unsigned short bf16;
__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float((unsigned)v << 16); }
__device__ __forceinline__ bf16 f2bf(float f) {
#if __CUDA_ARCH__ >= 800
    unsigned short r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
#else                                      // the same rounding in integers (a NaN stays a quiet NaN)
    const unsigned u = __float_as_uint(f);
    return (u & 0x7fffffffu) > 0x7f800000u ? (bf16)((u >> 16) | 0x40u) : (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
#else
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
#endif
}
__device__ __forceinline__ float2 unpack_bf2(unsigned v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
// one value to or from fp32 or bf16 storage (kernels templated on their operands' type)
__device__ __forceinline__ void stf(float* p, float v) { *p = v; }
__device__ __forceinline__ void stf(bf16* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ float ldf(const float* p) { return *p; }
__device__ __forceinline__ float ldf(const bf16* p) { return bf2f(*p); }
// VEC (2, 4 or 8) consecutive bf16 <-> floats in one 4-, 8- or 16-byte access (p aligned to it)
template <int VEC> __device__ __forceinline__ void ldbf(const bf16* p, float* f) {
    if constexpr (VEC == 8) {
        uint4 q = *reinterpret_cast<const uint4*>(p);
        float2 a = unpack_bf2(q.x), b = unpack_bf2(q.y), c = unpack_bf2(q.z), d = unpack_bf2(q.w);
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
    } else if constexpr (VEC == 4) {
        uint2 q = *reinterpret_cast<const uint2*>(p);
        float2 a = unpack_bf2(q.x), b = unpack_bf2(q.y);
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
    } else {
        float2 a = unpack_bf2(*reinterpret_cast<const unsigned*>(p));
        f[0] = a.x; f[1] = a.y;
    }
}
template <int VEC> __device__ __forceinline__ void stbf(bf16* p, const float* f) {
    if constexpr (VEC == 8) {
        uint4 q;
        q.x = pack_bf2(f[0], f[1]); q.y = pack_bf2(f[2], f[3]); q.z = pack_bf2(f[4], f[5]); q.w = pack_bf2(f[6], f[7]);
        *reinterpret_cast<uint4*>(p) = q;
    } else if constexpr (VEC == 4) {
        uint2 q;
        q.x = pack_bf2(f[0], f[1]); q.y = pack_bf2(f[2], f[3]);
        *reinterpret_cast<uint2*>(p) = q;
    } else {
        *reinterpret_cast<unsigned*>(p) = pack_bf2(f[0], f[1]);
    }
}
// VEC consecutive values of either type <-> floats: fp32 16 bytes at a time (VEC 1 or a multiple of 4), bf16 as above
template <int VEC> __device__ __forceinline__ void ldv(const float* p, float* f) {
    if constexpr (VEC == 1) f[0] = *p;
    else
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
            const float4 q = *reinterpret_cast<const float4*>(p + e);
            f[e] = q.x; f[e + 1] = q.y; f[e + 2] = q.z; f[e + 3] = q.w;
        }
}
template <int VEC> __device__ __forceinline__ void ldv(const bf16* p, float* f) { ldbf<VEC>(p, f); }
template <int VEC> __device__ __forceinline__ void stv(float* p, const float* f) {
    if constexpr (VEC == 1) *p = f[0];
    else
#pragma unroll
        for (int e = 0; e < VEC; e += 4) *reinterpret_cast<float4*>(p + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
}
template <int VEC> __device__ __forceinline__ void stv(bf16* p, const float* f) { stbf<VEC>(p, f); }
// A row of D bf16 values (D <= 1024, D % 4 == 0) in a warp's registers, 8 x 4 a lane (zeros past D), and its
// RMSNorm statistic 1/sqrt(mean(x^2) + eps), which every lane gets: the kernels after a Decoder's products
// with a norm's weight folded in. No block barrier, so a kernel issues these loads beside its own, and
// reduces once all have landed (big: a step of 1 row 0.02 ms shorter than with a block's reduction first).
__device__ __forceinline__ void warp_row(const bf16* __restrict__ x, int D, float (&v)[8][4]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int c = 4 * (lane + 32 * i);
        if (c < D) ldbf<4>(x + c, v[i]);
        else v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.f;
    }
}
__device__ __forceinline__ float warp_row_rstd(const float (&v)[8][4], int D) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 8; i++) ss += v[i][0] * v[i][0] + v[i][1] * v[i][1] + v[i][2] * v[i][2] + v[i][3] * v[i][3];
    return 1.0f / sqrtf(warp_sum(ss) / D + RMS_EPS);
}
"""

# --- embedding: x[n] = tok_emb[idx[n]]; backward without atomics: the host sorts the positions by
#     token (order, starts), and one block per vocabulary row sums its positions in a fixed order ---

EMBED_SRC = cuda_source("embed", ["embed_fwd", "embed_fwd_bf16", "embed_bwd"], r"""
template <typename T> __device__ void embed_fwd_body(const float* __restrict__ emb, const int* __restrict__ idx,
                                                     T* __restrict__ x, int D) {
    dep_trigger();                                        // (generation: the first layer's weights load now)
    const float* e = emb + (i64)idx[blockIdx.x] * D;
    T* o = x + (i64)blockIdx.x * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x) stf(o + c, e[c]);
}
extern "C" __global__ void embed_fwd(const float* __restrict__ emb, const int* __restrict__ idx,
                                     float* __restrict__ x, int D) {
    embed_fwd_body(emb, idx, x, D);
}
// a bf16 residual stream (a Decoder's)
extern "C" __global__ void embed_fwd_bf16(const float* __restrict__ emb, const int* __restrict__ idx,
                                          bf16* __restrict__ x, int D) {
    embed_fwd_body(emb, idx, x, D);
}
extern "C" __global__ void embed_bwd(const float* __restrict__ dx, const int* __restrict__ order,
                                     const int* __restrict__ starts, float* __restrict__ demb, int D) {
    int v = blockIdx.x, s = starts[v], e = starts[v + 1];
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;   // 4 loads in flight for frequent tokens
        int i = s;
        for (; i + 3 < e; i += 4) {
            a0 += dx[(i64)order[i] * D + c];
            a1 += dx[(i64)order[i + 1] * D + c];
            a2 += dx[(i64)order[i + 2] * D + c];
            a3 += dx[(i64)order[i + 3] * D + c];
        }
        for (; i < e; i++) a0 += dx[(i64)order[i] * D + c];
        demb[(i64)v * D + c] = (a0 + a1) + (a2 + a3);
    }
}
""")


def embed_fwd(emb, idx, x):
    """x = emb[idx]: fp32 x, or bf16 (a Decoder's residual stream, rounded)."""
    N, D = x.shape
    _k("embed_fwd_bf16" if x.dtype == BF else "embed_fwd")((N,), (128,), (emb, idx, x, I32(D)))


def embed_bwd(dx, order, starts, demb):
    V, D = demb.shape
    _k("embed_bwd")((V,), (256,), (dx, order, starts, demb, I32(D)))


def sort_tokens(idx, V):
    """Host side of the deterministic embedding backward: positions sorted by token, and where each
    token's run starts. (N,) int32 each, (V+1,) int32."""
    idx = idx.reshape(-1)
    order = np.argsort(idx, kind="stable").astype(np.int32)
    starts = np.zeros(V + 1, np.int32)
    np.cumsum(np.bincount(idx, minlength=V), out=starts[1:])
    return order, starts


# --- RMSNorm, one warp per row, the residual add of the previous Euler step fused in:
#     xout = x + add (if has_add); h = xout * rstd * w, rstd = 1/sqrt(mean(xout^2) + RMS_EPS).
#     The residual stream x, xout and the statistics are fp32 in every precision; h (the next GEMM's
#     input) is fp32 or bf16 ---

RMSNORM_SRC = cuda_source("rmsnorm", ["rmsnorm_fwd", "rmsnorm_fwd_bf16", "rmsnorm_fwd_xbf16", "rmsnorm_bwd",
                                      "rmsnorm_bwd_d768", "rmsnorm_bwd_bf16", "rmsnorm_bwd_bf16_d768", "col_sum"], r"""
// the 4 values at p[4c .. 4c+3] as a float4: fp32, or bf16 widened / rounded to nearest (16- or 8-byte accesses)
template <typename T> __device__ __forceinline__ float4 ld4(const T* p, i64 c) {
    float f[4]; ldv<4>(p + 4 * c, f); return make_float4(f[0], f[1], f[2], f[3]);
}
template <typename T> __device__ __forceinline__ void st4(T* p, i64 c, float4 v) {
    const float f[4] = {v.x, v.y, v.z, v.w}; stv<4>(p + 4 * c, f);
}
// Forward, a warp per row: lane holds columns 4(lane + 32j) .. +3 (j < 8: D <= 1024, D % 4 == 0) of
// x [+ add] in registers, read once with 16-byte loads; the sum of squares is reduced once. add is the branch
// a GEMM wrote (TA fp32, or bf16 on the bf16 path); x, xout (the new residual) and the statistics are fp32
// (x bf16: a Decoder's residual stream; h null: the statistics alone).
template <typename TA, typename TH, typename TX = float>
__device__ __forceinline__ void rmsnorm_fwd_body(const TX* __restrict__ x, const TA* __restrict__ add,
        int has_add, const float* __restrict__ w, float* __restrict__ xout, TH* __restrict__ h,
        float* __restrict__ rstd, int N, int D) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31, D4 = D >> 2;
    dep_wait();                                // (a Decoder's launch may start it early: see launch())
    if (row >= N) return;                      // whole warps leave; no block barrier below
    const TX* xr = x + (i64)row * D;
    float4 v[8];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int c = lane + 32 * j;
        if (c < D4) {
            v[j] = ld4(xr, c);
            if (has_add) {
                const float4 a = ld4(add + (i64)row * D, c);
                v[j].x += a.x; v[j].y += a.y; v[j].z += a.z; v[j].w += a.w;
                st4(xout + (i64)row * D, c, v[j]);
            }
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
    }
    ss = warp_sum(ss);
    const float r = 1.0f / sqrtf(ss / D + RMS_EPS);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int c = lane + 32 * j;
        if (c < D4 && h != nullptr) {
            const float4 wv = __ldg(reinterpret_cast<const float4*>(w) + c);
            st4(h + (i64)row * D, c, make_float4(v[j].x * r * wv.x, v[j].y * r * wv.y, v[j].z * r * wv.z, v[j].w * r * wv.w));
        }
    }
    if (lane == 0) rstd[row] = r;
}
extern "C" __global__ void rmsnorm_fwd(const float* __restrict__ x, const float* __restrict__ add, int has_add,
                                       const float* __restrict__ w, float* __restrict__ xout,
                                       float* __restrict__ h, float* __restrict__ rstd, int N, int D) {
    rmsnorm_fwd_body<float, float>(x, add, has_add, w, xout, h, rstd, N, D);
}
extern "C" __global__ void rmsnorm_fwd_bf16(const float* __restrict__ x, const bf16* __restrict__ add, int has_add,
                                            const float* __restrict__ w, float* __restrict__ xout,
                                            bf16* __restrict__ h, float* __restrict__ rstd, int N, int D) {
    rmsnorm_fwd_body<bf16, bf16>(x, add, has_add, w, xout, h, rstd, N, D);
}
extern "C" __global__ void rmsnorm_fwd_xbf16(const bf16* __restrict__ x, const float* __restrict__ w,
                                             bf16* __restrict__ h, float* __restrict__ rstd, int N, int D) {
    rmsnorm_fwd_body<bf16, bf16, bf16>(x, nullptr, 0, w, nullptr, h, rstd, N, D);
}

// Backward in one pass over dy and x: dx (+)= r*g - r^3 * x * mean(g*x), g = dy*w (fp32 math; DY float, or
// bf16 on the bf16 path, where dy is a GEMM's output; there, when dxb is given, also a bf16 copy of the new dx,
// the next GEMMs' input), and dw's partial sums without atomics. A block is
// 4 warps; a warp takes rpw consecutive rows, one at a time, its lane holding the row's columns
// 4(lane + 32j) .. +3 (j < NV: D <= 128 NV; NV = 6 or 8 sizes the registers to the row; D % 4 == 0), all
// loaded (dy, x and the dx it adds to) before the row's one reduction, 16 bytes at a time; its lanes hold
// their columns' share of dw = sum_rows dy*x*r; the 4 warps are added in warp order into part[block][D]
// and col_sum adds the blocks in order. Every sum has a fixed order. rpw: about 1024 blocks.
template <int NV, typename DY>
__device__ __forceinline__ void rmsnorm_bwd_body(const DY* __restrict__ dy, const float* __restrict__ x,
        const float* __restrict__ w, const float* __restrict__ rstd, float* __restrict__ dx, bf16* __restrict__ dxb,
        int accumulate, float* __restrict__ part, int N, int D, int rpw) {
    __shared__ float4 sh[4][32];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, D4 = D >> 2;
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4 acc[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int row0 = (blockIdx.x * 4 + wp) * rpw;
    for (int i = 0; i < rpw; i++) {
        const int row = row0 + i;
        if (row >= N) break;                                       // uniform over the warp
        const DY* dyr = dy + (i64)row * D;
        const float4* xr = reinterpret_cast<const float4*>(x + (i64)row * D);
        float4* dxr = reinterpret_cast<float4*>(dx + (i64)row * D);
        float4 g[NV], xv[NV], old[NV];
        float gx = 0.f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int c = lane + 32 * j;
            g[j] = xv[j] = old[j] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c < D4) {
                g[j] = ld4(dyr, c); xv[j] = xr[c];
                if (accumulate) old[j] = dxr[c];
                const float4 wv = __ldg(w4 + c);
                gx += g[j].x * wv.x * xv[j].x + g[j].y * wv.y * xv[j].y + g[j].z * wv.z * xv[j].z + g[j].w * wv.w * xv[j].w;
            }
        }
        gx = warp_sum(gx);
        const float r = rstd[row], k = r * r * r * gx / D;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int c = lane + 32 * j;
            if (c < D4) {
                const float4 wv = __ldg(w4 + c);
                float4 v = make_float4(r * g[j].x * wv.x - k * xv[j].x + old[j].x, r * g[j].y * wv.y - k * xv[j].y + old[j].y,
                                       r * g[j].z * wv.z - k * xv[j].z + old[j].z, r * g[j].w * wv.w - k * xv[j].w + old[j].w);
                dxr[c] = v;
                if (dxb != nullptr) st4(dxb + (i64)row * D, c, v);
                acc[j].x += g[j].x * xv[j].x * r; acc[j].y += g[j].y * xv[j].y * r;
                acc[j].z += g[j].z * xv[j].z * r; acc[j].w += g[j].w * xv[j].w * r;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NV; j++) {                                 // the 4 warps, 128 columns at a time
        if (128 * j >= D) break;                                   // uniform over the block
        sh[wp][lane] = acc[j];
        __syncthreads();
        if (wp == 0 && lane + 32 * j < D4) {
            const float4 a = sh[0][lane], b = sh[1][lane], c = sh[2][lane], d = sh[3][lane];
            reinterpret_cast<float4*>(part + (i64)blockIdx.x * D)[lane + 32 * j] =
                make_float4(((a.x + b.x) + c.x) + d.x, ((a.y + b.y) + c.y) + d.y, ((a.z + b.z) + c.z) + d.z,
                            ((a.w + b.w) + c.w) + d.w);
        }
        __syncthreads();
    }
}
// D <= 1024 (NV 8) and D <= 768 (NV 6: fewer registers, more blocks per SM); fp32 dy and dx, or (_bf16) bf16 dy,
// fp32 dx and, unless dxb is null, its bf16 copy
#define RMS_BWD_PARAMS const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ rstd, \
        float* __restrict__ dx, bf16* __restrict__ dxb, int accumulate, float* __restrict__ part, int N, int D, int rpw
#define RMS_BWD_ARGS x, w, rstd, dx, dxb, accumulate, part, N, D, rpw
extern "C" __global__ void __launch_bounds__(128) rmsnorm_bwd(const float* __restrict__ dy, RMS_BWD_PARAMS) {
    rmsnorm_bwd_body<8>(dy, RMS_BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) rmsnorm_bwd_d768(const float* __restrict__ dy, RMS_BWD_PARAMS) {
    rmsnorm_bwd_body<6>(dy, RMS_BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) rmsnorm_bwd_bf16(const bf16* __restrict__ dy, RMS_BWD_PARAMS) {
    rmsnorm_bwd_body<8>(dy, RMS_BWD_ARGS);
}
extern "C" __global__ void __launch_bounds__(128) rmsnorm_bwd_bf16_d768(const bf16* __restrict__ dy, RMS_BWD_PARAMS) {
    rmsnorm_bwd_body<6>(dy, RMS_BWD_ARGS);
}
// out[c] = sum over chunks of part[chunk][c] in a fixed order: a block is 32 columns x 32 lanes; lane y
// adds chunks y, y+32, ... in order, then the 32 lanes are added in order (coalesced 128-byte rows)
extern "C" __global__ void __launch_bounds__(1024) col_sum(const float* __restrict__ part, float* __restrict__ out,
                                                           int nchunks, int D) {
    __shared__ float sh[32][33];
    int cx = threadIdx.x & 31, y = threadIdx.x >> 5, c = blockIdx.x * 32 + cx;
    float acc = 0.f;
    if (c < D)
        for (int i = y; i < nchunks; i += 32) acc += part[(i64)i * D + c];
    sh[y][cx] = acc;
    __syncthreads();
    if (y == 0 && c < D) {
        float t = 0.f;
        for (int q = 0; q < 32; q++) t += sh[q][cx];
        out[c] = t;
    }
}
""")


def rms_rows_per_warp(N):
    """Rows per warp of the RMSNorm backward: about 1024 blocks of 4 warps for any N (enough to fill the
    GPU, few partial sums for col_sum)."""
    return max(1, min(16, -(-N // 4096)))


def rms_part_rows(N):
    """Rows of the RMSNorm backward's part scratch (one per block)."""
    return -(-N // (4 * rms_rows_per_warp(N)))


def rmsnorm_fwd(x, w, h, rstd, add=None, xout=None, pdl=False):
    """h = rmsnorm(x [+ add]) * w: h and add fp32, or both bf16 (the bf16 path); with add, the sum is also
    written to xout (the new residual, fp32). x bf16 (a Decoder's residual stream): h bf16, or None for the
    statistics alone. D <= 1024, D % 4 == 0, rows 16-byte aligned. pdl: a programmatic dependent launch (a
    Decoder's step: its launch overlaps the product before it)."""
    N, D = x.shape
    if x.dtype == BF:
        assert add is None and (h is None or h.dtype == BF) and D <= 1024 and D % 4 == 0
        return launch(_k("rmsnorm_fwd_xbf16"), _blocks(N, 8), (256,),
                      (x, NULL if h is None else w, NULL if h is None else h, rstd, I32(N), I32(D)), pdl=pdl)
    has = add is not None
    assert D <= 1024 and D % 4 == 0 and (not has or add.dtype == h.dtype), (D, has and add.dtype, h.dtype)
    launch(_k("rmsnorm_fwd_bf16" if h.dtype == BF else "rmsnorm_fwd"), _blocks(N, 8), (256,),
           (x, add if has else x, I32(has), w, xout if has else x, h, rstd, I32(N), I32(D)), pdl=pdl)


def check_width(cfg):
    """The RMSNorm kernels' limit on the residual width, as a UserError."""
    if cfg.dim > 1024 or cfg.dim % 4:
        raise UserError(f"config {cfg}: the RMSNorm kernels take a width of at most 1024, a multiple of 4")


def rmsnorm_bwd(dy, x, w, rstd, dx, dw, part, accumulate=True, dxb=None):
    """dx (+)= d/dx; dw = sum over rows, via part: a (rms_part_rows(N), D) scratch. dy fp32, or bf16 (the bf16
    path), which may also write dxb = bf16(dx). D <= 1024, D % 4 == 0, rows 16-byte aligned."""
    N, D = x.shape
    rpw = rms_rows_per_warp(N)
    nb = -(-N // (4 * rpw))
    assert part.shape[0] >= nb and part.shape[1] == D and D <= 1024 and D % 4 == 0
    assert dy.dtype == BF or dxb is None
    name = {(False, False): "rmsnorm_bwd", (False, True): "rmsnorm_bwd_d768", (True, False): "rmsnorm_bwd_bf16",
            (True, True): "rmsnorm_bwd_bf16_d768"}[dy.dtype == BF, D <= 768]
    _k(name)((nb,), (128,), (dy, x, w, rstd, dx, dxb if dxb is not None else np.uint64(0), I32(accumulate), part,
                             I32(N), I32(D), I32(rpw)))
    _k("col_sum")(((D + 31) // 32,), (1024,), (part, dw, I32(nb), I32(D)))


# --- RoPE, half-split, in place on the first `heads` head-vectors of each row (q heads then k heads of
#     the fused q|k|v buffer); position = pos0 + row % T; sign -1 rotates back (the fp32 backward pass) ---

ROPE_SRC = cuda_source("rope", ["rope", "rope_bf16"], r"""
extern "C" __global__ void rope(float* __restrict__ u, const float* __restrict__ cosv, const float* __restrict__ sinv,
                                int N, int T, int pos0, int heads, int hd, int S, float sign) {
    int half = hd / 2;
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * heads * half) return;
    int i = idx % half, hh = (idx / half) % heads;
    i64 n = idx / ((i64)half * heads);
    int p = pos0 + (int)(n % T);
    float c = cosv[p * half + i], s = sign * sinv[p * half + i];
    float* r = u + n * S + hh * hd;
    float a = r[i], b = r[i + half];
    r[i] = a * c - b * s;
    r[i + half] = b * c + a * s;
}
// bf16 q|k|v: each thread rotates 8 consecutive pairs (i .. i+7, i+half .. i+half+7), i a multiple of 8,
// with 16-byte loads (hd % 16 == 0); the rotation in fp32
extern "C" __global__ void rope_bf16(bf16* __restrict__ u, const float* __restrict__ cosv,
                                     const float* __restrict__ sinv, int N, int T, int pos0, int heads, int hd,
                                     int S) {
    int half = hd / 2, hv = hd / 16;
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * heads * hv) return;
    int i = (int)(idx % hv) * 8, hh = (int)((idx / hv) % heads);
    i64 n = idx / ((i64)hv * heads);
    int p = pos0 + (int)(n % T);
    float a[8], b[8], c[8], s[8], ra[8], rb[8];
    bf16* pa = u + n * S + hh * hd + i;
    ldbf<8>(pa, a);
    ldbf<8>(pa + half, b);
    const float4* c4 = reinterpret_cast<const float4*>(cosv + p * half + i);
    const float4* s4 = reinterpret_cast<const float4*>(sinv + p * half + i);
    float4 c0 = c4[0], c1 = c4[1], s0 = s4[0], s1 = s4[1];
    c[0] = c0.x; c[1] = c0.y; c[2] = c0.z; c[3] = c0.w; c[4] = c1.x; c[5] = c1.y; c[6] = c1.z; c[7] = c1.w;
    s[0] = s0.x; s[1] = s0.y; s[2] = s0.z; s[3] = s0.w; s[4] = s1.x; s[5] = s1.y; s[6] = s1.z; s[7] = s1.w;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        ra[k] = a[k] * c[k] - b[k] * s[k];
        rb[k] = b[k] * c[k] + a[k] * s[k];
    }
    stbf<8>(pa, ra);
    stbf<8>(pa + half, rb);
}
""")


def rope(u, cos, sin, T, heads, hd, sign=1.0, pos0=0):
    N, S = u.shape
    if u.dtype == BF:                                      # forward only: flash's backward rotates dq, dk back
        assert hd % 16 == 0 and S % 8 == 0 and sign == 1.0
        _k("rope_bf16")(_blocks(N * heads * hd // 16), (256,), (u, cos, sin, I32(N), I32(T), I32(pos0), I32(heads),
                                                                I32(hd), I32(S)))
        return
    _k("rope")(_blocks(N * heads * hd // 2), (256,), (u, cos, sin, I32(N), I32(T), I32(pos0), I32(heads),
                                                      I32(hd), I32(S), F32(sign)))


# --- SwiGLU on gu = [g | u] (N, 2F): act = silu(g) * u; backward writes [dg | du] over gu ---

SWIGLU_SRC = cuda_source("swiglu", ["swiglu_fwd", "swiglu_fwd_to_bf16", "swiglu_fwd_norm", "swiglu_bwd",
                                    "swiglu_fwd_bf16", "swiglu_fwd_bf16_v8", "swiglu_bwd_bf16", "swiglu_bwd_bf16_v8"],
                         r"""
template <typename TO>
__device__ __forceinline__ void swiglu_fwd_body(const float* __restrict__ gu, TO* __restrict__ act, int N, int F) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * F) return;
    i64 n = idx / F; int f = idx % F;
    float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
    stf(act + idx, g / (1.f + expf(-g)) * u);
}
extern "C" __global__ void swiglu_fwd(const float* __restrict__ gu, float* __restrict__ act, int N, int F) {
    swiglu_fwd_body(gu, act, N, F);
}
// fp32 gu, bf16 act: the Sampler's batched decode step's (its next product takes bf16)
extern "C" __global__ void swiglu_fwd_to_bf16(const float* __restrict__ gu, bf16* __restrict__ act, int N, int F) {
    swiglu_fwd_body(gu, act, N, F);
}
// A Decoder's (its residual stream x bf16, the FFN norm's weight folded into w1|w3, so gu = x (w*W)^T): act =
// silu(r g) * (r u), r row n's 1/rms of x, which each warp takes itself (warp_row; x was written before the
// product ahead of this kernel began, so its loads go out before dep_wait). A block per (F-chunk, row).
extern "C" __global__ void swiglu_fwd_norm(const float* __restrict__ gu, const bf16* __restrict__ x,
                                           bf16* __restrict__ act, int F, int D) {
    const i64 n = blockIdx.y;
    const int f = blockIdx.x * blockDim.x + threadIdx.x, fl = min(f, F - 1);
    float xv[8][4];
    dep_trigger();                                        // (dec_add after it loads its weights now)
    warp_row(x + n * D, D, xv);
    dep_wait();
    const float g0 = gu[n * 2 * F + fl], u0 = gu[n * 2 * F + F + fl], r = warp_row_rstd(xv, D);
    const float g = r * g0, u = r * u0;
    if (f < F) act[n * F + f] = f2bf(g / (1.f + expf(-g)) * u);
}
extern "C" __global__ void swiglu_bwd(const float* __restrict__ dact, float* __restrict__ gu, int N, int F) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * F) return;
    i64 n = idx / F; int f = idx % F;
    float* r = gu + n * 2 * F;
    float g = r[f], u = r[F + f], d = dact[idx];
    float sig = 1.f / (1.f + expf(-g));
    r[f] = d * u * sig * (1.f + g * (1.f - sig));      // silu'(g) = sig * (1 + g * (1 - sig))
    r[F + f] = d * g * sig;
}
// bf16: VEC adjacent columns per thread, 16-byte accesses when F % 8 == 0 (VEC 8), else 4-byte (VEC 2,
// F even); fp32 math
template <int VEC>
__device__ __forceinline__ void swiglu_fwd_bf16_body(const bf16* __restrict__ gu, bf16* __restrict__ act, int N, int F) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int FV = F / VEC;
    if (idx >= (i64)N * FV) return;
    i64 n = idx / FV; int f = (int)(idx % FV) * VEC;
    float g[VEC], u[VEC], a[VEC];
    ldbf<VEC>(gu + n * 2 * F + f, g);
    ldbf<VEC>(gu + n * 2 * F + F + f, u);
#pragma unroll
    for (int k = 0; k < VEC; k++) a[k] = g[k] / (1.f + expf(-g[k])) * u[k];
    stbf<VEC>(act + n * F + f, a);
}
extern "C" __global__ void swiglu_fwd_bf16(const bf16* __restrict__ gu, bf16* __restrict__ act, int N, int F) {
    swiglu_fwd_bf16_body<2>(gu, act, N, F);
}
extern "C" __global__ void swiglu_fwd_bf16_v8(const bf16* __restrict__ gu, bf16* __restrict__ act, int N, int F) {
    swiglu_fwd_bf16_body<8>(gu, act, N, F);
}
// backward: gu <- [dg | du]
template <int VEC>
__device__ __forceinline__ void swiglu_bwd_bf16_body(const bf16* __restrict__ dact, bf16* __restrict__ gu, int N, int F) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int FV = F / VEC;
    if (idx >= (i64)N * FV) return;
    i64 n = idx / FV; int f = (int)(idx % FV) * VEC;
    float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
    ldbf<VEC>(gu + n * 2 * F + f, g);
    ldbf<VEC>(gu + n * 2 * F + F + f, u);
    ldbf<VEC>(dact + n * F + f, d);
#pragma unroll
    for (int k = 0; k < VEC; k++) {
        float sg = 1.f / (1.f + expf(-g[k]));
        dg[k] = d[k] * u[k] * sg * (1.f + g[k] * (1.f - sg));     // silu'(g) = sig * (1 + g * (1 - sig))
        du[k] = d[k] * g[k] * sg;
    }
    stbf<VEC>(gu + n * 2 * F + f, dg);
    stbf<VEC>(gu + n * 2 * F + F + f, du);
}
extern "C" __global__ void swiglu_bwd_bf16(const bf16* __restrict__ dact, bf16* __restrict__ gu, int N, int F) {
    swiglu_bwd_bf16_body<2>(dact, gu, N, F);
}
extern "C" __global__ void swiglu_bwd_bf16_v8(const bf16* __restrict__ dact, bf16* __restrict__ gu, int N, int F) {
    swiglu_bwd_bf16_body<8>(dact, gu, N, F);
}
""")


def swiglu_fwd(gu, act):
    N, F = act.shape
    if gu.dtype == np.float32 and act.dtype == BF:
        return _k("swiglu_fwd_to_bf16")(_blocks(N * F), (256,), (gu, act, I32(N), I32(F)))
    if act.dtype == BF:
        v8 = F % 8 == 0
        _k("swiglu_fwd_bf16_v8" if v8 else "swiglu_fwd_bf16")(_blocks(N * F // (8 if v8 else 2)), (256,),
                                                                (gu, act, I32(N), I32(F)))
        return
    _k("swiglu_fwd")(_blocks(N * F), (256,), (gu, act, I32(N), I32(F)))


def swiglu_norm(gu, x, act):
    """act (bf16) = SwiGLU of gu's rows (fp32) each scaled by its row's 1/rms of x (bf16): a Decoder's, whose
    w1|w3 hold the FFN norm's weight (see Decoder). A programmatic launch."""
    N, F = act.shape
    launch(_k("swiglu_fwd_norm"), (-(-F // 256), N), (256,), (gu, x, act, I32(F), I32(x.shape[1])))


def swiglu_bwd(dact, gu):
    """gu <- [dg | du] (bf16: F even)."""
    N, F = dact.shape
    if dact.dtype == BF:
        v8 = F % 8 == 0
        _k("swiglu_bwd_bf16_v8" if v8 else "swiglu_bwd_bf16")(_blocks(N * F // (8 if v8 else 2)), (256,),
                                                                (dact, gu, I32(N), I32(F)))
        return
    _k("swiglu_bwd")(_blocks(N * F), (256,), (dact, gu, I32(N), I32(F)))


# --- cross-entropy of the MTP heads: one block per (row, head) does softmax, loss and gradient in one
#     kernel, writing scale_k * (softmax - onehot) over the logits. Head k at row n = b*T + t reads
#     target targets[n + k] when t + k < T; -1 is ignored. scales[k] = weight_k / count_k ---

XENT_SRC = cuda_source("xent", ["xent", "xent_chunk", "xent_chunk_bl", "loss_reduce"], r"""
// One (row, head): -log p(target) into *loss and, with want_grad, sc * (softmax - onehot) into drow: the
// row itself for fp32 (in place), or bf16 dl, the next GEMMs' input, in the bf16 path. tgt < 0 counts
// nothing and has a zero gradient. The statistics (max, sum of exp, log-sum-exp) are fp32. A row of
// V <= XENT_NPT * blockDim (V a multiple of VEC, the row 16-byte aligned) is read once, into registers,
// VEC = 16 bytes of logits (4 fp32 or 8 bf16) at a time; other rows are read three times.
#define XENT_NPT 16
template <typename L, typename G> __device__ void xent_row(const L* row, G* drow, int tgt, float sc, float* loss, int V,
                                                           int want_grad) {
    constexpr int VEC = 16 / sizeof(L), NV = XENT_NPT / VEC;
    if (tgt < 0) {                                        // uniform over the block: no barrier is skipped
        if (want_grad) for (int c = threadIdx.x; c < V; c += blockDim.x) stf(drow + c, 0.f);
        if (threadIdx.x == 0) *loss = 0.f;
        return;
    }
    const float xt = ldf(row + tgt);                      // read before any thread overwrites the row
    float m = NEG_INF, z = 0.f, lse;
    if (V % VEC == 0 && V <= XENT_NPT * (int)blockDim.x && ((size_t)row & 15) == 0 && ((size_t)drow & 15) == 0) {
        float v[XENT_NPT];                                // uniform: the row in registers
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int c = (threadIdx.x + j * blockDim.x) * VEC;
            if (c < V) ldv<VEC>(row + c, v + j * VEC);
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                if (c >= V) v[j * VEC + e] = NEG_INF;
                m = fmaxf(m, v[j * VEC + e]);
            }
        }
        m = block_max(m);
#pragma unroll
        for (int j = 0; j < XENT_NPT; j++) z += expf(v[j] - m);     // exp(-inf) = 0 for the padding
        lse = m + logf(block_sum(z));
        if (want_grad) {
#pragma unroll
            for (int j = 0; j < NV; j++) {
                const int c = (threadIdx.x + j * blockDim.x) * VEC;
                if (c >= V) continue;
                float g[VEC];
#pragma unroll
                for (int e = 0; e < VEC; e++) g[e] = (expf(v[j * VEC + e] - lse) - (c + e == tgt ? 1.f : 0.f)) * sc;
                stv<VEC>(drow + c, g);
            }
        }
    } else {
        for (int c = threadIdx.x; c < V; c += blockDim.x) m = fmaxf(m, ldf(row + c));
        m = block_max(m);
        for (int c = threadIdx.x; c < V; c += blockDim.x) z += expf(ldf(row + c) - m);
        lse = m + logf(block_sum(z));
        if (want_grad)
            for (int c = threadIdx.x; c < V; c += blockDim.x)
                stf(drow + c, (expf(ldf(row + c) - lse) - (c == tgt ? 1.f : 0.f)) * sc);
    }
    if (threadIdx.x == 0) *loss = lse - xt;
}
// fp32: every row of logits (N, nmtp*V), the gradient in place
extern "C" __global__ void __launch_bounds__(256) xent(float* __restrict__ logits, const int* __restrict__ targets,
                                                       const float* __restrict__ scales, float* __restrict__ rowloss,
                                                       int N, int T, int V, int nmtp, int sstride, int want_grad) {
    int n = blockIdx.x, k = blockIdx.y, t = n % T;
    float* row = logits + ((i64)n * nmtp + k) * V;
    xent_row(row, row, (t + k < T) ? targets[n + k] : -1, scales[(n / T) * sstride + k], rowloss + (i64)k * N + n, V,
             want_grad);
}
// bf16: the chunk of rows n0 .. n0 + gridDim.x, logits (rows, nmtp*V) made by one GEMM from the bf16 hf and
// heads (fp32, or bf16 for _bl); the gradient as bf16 into dl, which may be the bf16 logits themselves (in
// place, as xent_row allows); the chunk's rows sit at rowloss[k, n0 + r]
template <typename L>
__device__ __forceinline__ void xent_chunk_body(const L* logits, bf16* dl,
        const int* __restrict__ targets, const float* __restrict__ scales, float* __restrict__ rowloss, int n0,
        int N, int T, int V, int nmtp, int sstride, int want_grad) {
    int r = blockIdx.x, k = blockIdx.y, n = n0 + r, t = n % T;
    xent_row(logits + ((i64)r * nmtp + k) * V, dl + ((i64)r * nmtp + k) * V, (t + k < T) ? targets[n + k] : -1,
             scales[(n / T) * sstride + k], rowloss + (i64)k * N + n, V, want_grad);
}
#define XENT_CHUNK_PARAMS bf16* dl, const int* __restrict__ targets, const float* __restrict__ scales, \
        float* __restrict__ rowloss, int n0, int N, int T, int V, int nmtp, int sstride, int want_grad
#define XENT_CHUNK_ARGS dl, targets, scales, rowloss, n0, N, T, V, nmtp, sstride, want_grad
extern "C" __global__ void __launch_bounds__(256) xent_chunk(const float* logits, XENT_CHUNK_PARAMS) {
    xent_chunk_body(logits, XENT_CHUNK_ARGS);
}
extern "C" __global__ void __launch_bounds__(256) xent_chunk_bl(const bf16* logits, XENT_CHUNK_PARAMS) {
    xent_chunk_body(logits, XENT_CHUNK_ARGS);
}
// ce[k] = sum_n rowloss[k, n] * inv_count[k]; one block per head, fixed order
extern "C" __global__ void loss_reduce(const float* __restrict__ rowloss, const float* __restrict__ inv_count,
                                       float* __restrict__ ce, int N) {
    int k = blockIdx.x;
    float acc = 0.f;
    for (int n = threadIdx.x; n < N; n += blockDim.x) acc += rowloss[(i64)k * N + n];
    acc = block_sum(acc);
    if (threadIdx.x == 0) ce[k] = acc * inv_count[k];
}
""")


def xent(logits, targets, scales, rowloss, T, nmtp, want_grad, per_seq=False):
    """scales (nmtp,): each head's gradient scale; per_seq: (sequences, nmtp), a row of them per sequence."""
    N = logits.shape[0]
    V = logits.shape[1] // nmtp
    _k("xent")((N, nmtp), (256,), (logits, targets, scales, rowloss, I32(N), I32(T), I32(V), I32(nmtp),
                                   I32(nmtp if per_seq else 0), I32(want_grad)))


def xent_chunk(logits, dl, targets, scales, rowloss, n0, T, nmtp, want_grad, per_seq=False):
    """logits (rows, nmtp*V) fp32 or bf16 of rows n0.., dl the same shape bf16 (written with want_grad; it may be
    the bf16 logits, in place); scales as xent's."""
    rows = logits.shape[0]
    V = logits.shape[1] // nmtp
    _k("xent_chunk_bl" if logits.dtype == BF else "xent_chunk")(
        (rows, nmtp), (256,), (logits, dl, targets, scales, rowloss, I32(n0), I32(rowloss.shape[1]), I32(T), I32(V),
                               I32(nmtp), I32(nmtp if per_seq else 0), I32(want_grad)))


def loss_reduce(rowloss, inv_count, ce):
    nmtp, N = rowloss.shape
    _k("loss_reduce")((nmtp,), (1024,), (rowloss, inv_count, ce, I32(N)))


def loss_weights(targets, n_mtp, mtp_weight):
    """Host: per-head (gradient scale, 1/count) as float32, from nanoeuler's MTP weighting."""
    counts, scales = pl.mtp_scales(targets, n_mtp, mtp_weight)
    return scales.astype(np.float32), np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0).astype(np.float32)


# --- FlashAttention, causal, grouped-query, fp32, head dim HD in {32, 64}.
#
# Forward: one block of 256 threads per (query tile of 64 rows, query head, batch); the K/V tiles of
# 64 keys stream through shared memory with an online softmax, so no T x T matrix exists; it saves the
# log-sum-exp per row (base 2: scores are pre-scaled by scale*log2(e)) for the backward pass.
# Thread (ty, tx) = (tid / 16, tid % 16) owns score rows ty + 16 i and key columns tx + 16 j (i, j < 4):
# the 16 threads of a row are one half-warp, so row max and sum are 4 shuffles. It owns output columns
# tx*DPT .. tx*DPT+DPT-1 (DPT = HD/16), read as one 16-byte (or 8-byte) vector from shared memory.
# Rows of the shared tiles are padded by 4 floats so the strided K reads hit distinct banks.
#
# Backward (FlashAttention-2 with the GQA sum done in-block): one block per (key tile, kv head, batch)
# keeps dK, dV of its 64 keys in registers and loops over the G query heads that share the kv head and
# every query tile at or below the diagonal, recomputing P from the saved log-sum-exp. dQ needs a sum
# over key tiles, i.e. over blocks: instead of float atomics (non-deterministic) each block writes its
# partial dQ to dqp[key tile] and flash_dq_sum adds the partials in a fixed order.

FLASH_HEAD_DIMS = (32, 64)


def flash_name(kind, hd, bf16=False, wg=False):
    """The flash attention kernel of a kind (fwd, bwd; bf16: fwd, dq, dkdv) for head dim hd (wg: on wgmma)."""
    return f"flash{'_bf16' if bf16 else ''}_{kind}_{hd}{'_wg' if wg else ''}"


FLASH_SRC = cuda_source("flash", ["flash_bwd_pre", "flash_dq_sum"] +
                        [flash_name(kind, hd) for kind in ("fwd", "bwd") for hd in FLASH_HEAD_DIMS], r"""
template <int DPT> struct Vec;
template <> struct Vec<4> {
    static __device__ __forceinline__ void ld(const float* p, float* d) {
        float4 v = *reinterpret_cast<const float4*>(p); d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w; }
};
template <> struct Vec<2> {
    static __device__ __forceinline__ void ld(const float* p, float* d) {
        float2 v = *reinterpret_cast<const float2*>(p); d[0] = v.x; d[1] = v.y; }
};

// copy rows [r0, r0+64) of a (.., ld) matrix (columns col..col+HD) into smem [64][HD+4]; zero past T
template <int HD>
__device__ __forceinline__ void load_tile(float* dst, const float* src, int r0, int T, i64 ld, int col, float mul) {
    constexpr int V4 = HD / 4, LD = HD + 4;
    for (int f = threadIdx.x; f < 64 * V4; f += 256) {
        int r = f / V4, c = (f % V4) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r0 + r < T) v = *reinterpret_cast<const float4*>(src + (i64)(r0 + r) * ld + col + c);
        v.x *= mul; v.y *= mul; v.z *= mul; v.w *= mul;
        *reinterpret_cast<float4*>(dst + r * LD + c) = v;
    }
}

// acc[i][j] += sum_d A[ty+16i][d] * Bm[tx+16j][d]   (A, Bm: smem [64][HD+4])
template <int HD>
__device__ __forceinline__ void tile_abt(float acc[4][4], const float* A, const float* Bm, int ty, int tx) {
    constexpr int LD = HD + 4;
#pragma unroll 4
    for (int d = 0; d < HD; d += 4) {
        float4 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) a[i] = *reinterpret_cast<const float4*>(A + (ty + 16 * i) * LD + d);
#pragma unroll
        for (int j = 0; j < 4; j++) b[j] = *reinterpret_cast<const float4*>(Bm + (tx + 16 * j) * LD + d);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                acc[i][j] += a[i].x * b[j].x + a[i].y * b[j].y + a[i].z * b[j].z + a[i].w * b[j].w;
    }
}

// acc[i][jj] += sum_c P[ty+16i][c] * M[c][tx*DPT+jj]   (P: smem [64][68], M: smem [64][HD+4])
template <int HD>
__device__ __forceinline__ void tile_pm(float acc[4][HD / 16], const float* P, const float* M, int ty, int tx) {
    constexpr int LD = HD + 4, DPT = HD / 16, LDP = 68;
#pragma unroll 2
    for (int c = 0; c < 64; c += 4) {
        float4 p[4];
        float m[4][DPT];
#pragma unroll
        for (int i = 0; i < 4; i++) p[i] = *reinterpret_cast<const float4*>(P + (ty + 16 * i) * LDP + c);
#pragma unroll
        for (int cc = 0; cc < 4; cc++) Vec<DPT>::ld(M + (c + cc) * LD + tx * DPT, m[cc]);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int jj = 0; jj < DPT; jj++)
                acc[i][jj] += p[i].x * m[0][jj] + p[i].y * m[1][jj] + p[i].z * m[2][jj] + p[i].w * m[3][jj];
    }
}

template <int HD>
__device__ __forceinline__ void flash_fwd_body(const float* __restrict__ qkv, float* __restrict__ out,
                                               float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) {
    constexpr int LD = HD + 4, LDP = 68, DPT = HD / 16;
    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;                 // [64][LD]  queries, pre-scaled by scale*log2(e)
    float* Ks = Qs + 64 * LD;         // [64][LD]
    float* Vs = Ks + 64 * LD;         // [64][LD]
    float* Ps = Vs + 64 * LD;         // [64][LDP] probabilities of this tile
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int nqt = (T + 63) / 64, qt = nqt - 1 - blockIdx.x;      // the longest rows start first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (Hq / Hkv);
    const int Cq = Hq * HD, Ck = Hkv * HD, S = Cq + 2 * Ck;
    const float* base = qkv + (i64)b * T * S;
    const int q0 = qt * 64;
    load_tile<HD>(Qs, base, q0, T, S, h * HD, sl2);
    float o[4][DPT], m[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m[i] = NEG_INF; l[i] = 0.f;
#pragma unroll
        for (int jj = 0; jj < DPT; jj++) o[i][jj] = 0.f;
    }
    for (int kt = 0; kt <= qt; kt++) {
        const int k0 = kt * 64;
        __syncthreads();                                          // the previous tile is consumed
        load_tile<HD>(Ks, base, k0, T, S, Cq + kvh * HD, 1.f);
        load_tile<HD>(Vs, base, k0, T, S, Cq + Ck + kvh * HD, 1.f);
        __syncthreads();
        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s[i][j] = 0.f;
        tile_abt<HD>(s, Qs, Ks, ty, tx);
        if (kt == qt) {                                           // causal mask on the diagonal tile
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (tx + 16 * j > ty + 16 * i) s[i][j] = NEG_INF;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {                             // online softmax, base 2
            float mx = fmaxf(fmaxf(s[i][0], s[i][1]), fmaxf(s[i][2], s[i][3]));
#pragma unroll
            for (int o_ = 8; o_ > 0; o_ >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o_));
            float mn = fmaxf(m[i], mx);                           // finite: every row sees a key per tile
            float corr = exp2f(m[i] - mn);
            float rs = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) { s[i][j] = exp2f(s[i][j] - mn); rs += s[i][j]; }
#pragma unroll
            for (int o_ = 8; o_ > 0; o_ >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, o_);
            l[i] = l[i] * corr + rs;
            m[i] = mn;
#pragma unroll
            for (int jj = 0; jj < DPT; jj++) o[i][jj] *= corr;
#pragma unroll
            for (int j = 0; j < 4; j++) Ps[(ty + 16 * i) * LDP + tx + 16 * j] = s[i][j];
        }
        __syncthreads();
        tile_pm<HD>(o, Ps, Vs, ty, tx);
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = q0 + ty + 16 * i;
        if (t < T) {
            float inv = 1.f / l[i];
            float* dst = out + ((i64)b * T + t) * Cq + h * HD + tx * DPT;
#pragma unroll
            for (int jj = 0; jj < DPT; jj++) dst[jj] = o[i][jj] * inv;
            if (tx == 0) lse[((i64)b * Hq + h) * T + t] = m[i] + log2f(l[i]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) flash_fwd_32(const float* __restrict__ qkv, float* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { flash_fwd_body<32>(qkv, out, lse, T, Hq, Hkv, sl2); }
extern "C" __global__ void __launch_bounds__(256) flash_fwd_64(const float* __restrict__ qkv, float* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { flash_fwd_body<64>(qkv, out, lse, T, Hq, Hkv, sl2); }

// Dv[b, h, t] = sum_d dout * out (natural units), one warp per (row, head)
extern "C" __global__ void flash_bwd_pre(const float* __restrict__ out, const float* __restrict__ dout,
                                         float* __restrict__ Dv, int N, int T, int Hq, int hd) {
    i64 gw = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (gw >= (i64)N * Hq) return;
    i64 n = gw / Hq; int h = gw % Hq;
    const float* o = out + n * Hq * hd + h * hd;
    const float* d = dout + n * Hq * hd + h * hd;
    float acc = 0.f;
    for (int c = lane; c < hd; c += 32) acc += o[c] * d[c];
    acc = warp_sum(acc);
    if (lane == 0) Dv[((n / T) * Hq + h) * T + n % T] = acc;
}

template <int HD>
__device__ __forceinline__ void flash_bwd_body(const float* __restrict__ qkv, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ Dv, float* __restrict__ dqkv,
        float* __restrict__ dqp, int N, int T, int Hq, int Hkv, float scale, float sl2) {
    constexpr int LD = HD + 4, LDP = 68, DPT = HD / 16;
    extern __shared__ __align__(16) float smem[];
    float* Ks = smem;                 // [64][LD] keys of this block
    float* Vs = Ks + 64 * LD;         // [64][LD]
    float* Qs = Vs + 64 * LD;         // [64][LD] queries of the current tile (unscaled)
    float* dOs = Qs + 64 * LD;        // [64][LD]
    float* PT = dOs + 64 * LD;        // [64 keys][LDP]: P^T, then dS^T
    float* dSs = PT + 64 * LDP;       // [64 queries][LDP]: dS
    float* ls = dSs + 64 * LDP;       // [64] log-sum-exp of the query rows
    float* Ds = ls + 64;              // [64] rowsum(dO * O)
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int nqt = (T + 63) / 64, kt = blockIdx.x, j = blockIdx.y, b = blockIdx.z;
    const int G = Hq / Hkv, Cq = Hq * HD, Ck = Hkv * HD, S = Cq + 2 * Ck;
    const float* base = qkv + (i64)b * T * S;
    const int k0 = kt * 64;
    load_tile<HD>(Ks, base, k0, T, S, Cq + j * HD, 1.f);
    load_tile<HD>(Vs, base, k0, T, S, Cq + Ck + j * HD, 1.f);
    float dk[4][DPT], dv[4][DPT];     // rows k0 + ty + 16 i, columns tx*DPT + jj
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int jj = 0; jj < DPT; jj++) { dk[i][jj] = 0.f; dv[i][jj] = 0.f; }
    for (int g = 0; g < G; g++) {
        const int h = j * G + g;
        for (int qt = kt; qt < nqt; qt++) {
            const int q0 = qt * 64;
            __syncthreads();                                      // the previous tile is consumed
            load_tile<HD>(Qs, base, q0, T, S, h * HD, 1.f);
            load_tile<HD>(dOs, dout + (i64)b * T * Cq, q0, T, Cq, h * HD, 1.f);
            if (threadIdx.x < 64) {
                int t = q0 + threadIdx.x;
                ls[threadIdx.x] = t < T ? lse[((i64)b * Hq + h) * T + t] : 0.f;
                Ds[threadIdx.x] = t < T ? Dv[((i64)b * Hq + h) * T + t] : 0.f;
            }
            __syncthreads();
            float p[4][4], ds[4][4];                              // rows q0+ty+16i, keys k0+tx+16j
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) { p[i][jj] = 0.f; ds[i][jj] = 0.f; }
            tile_abt<HD>(p, Qs, Ks, ty, tx);                      // scores
            tile_abt<HD>(ds, dOs, Vs, ty, tx);                    // dP = dO V^T
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int q = q0 + ty + 16 * i;
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    int k = k0 + tx + 16 * jj;
                    float pv = (k <= q && q < T) ? exp2f(p[i][jj] * sl2 - ls[ty + 16 * i]) : 0.f;
                    PT[(tx + 16 * jj) * LDP + ty + 16 * i] = pv;
                    dSs[(ty + 16 * i) * LDP + tx + 16 * jj] = pv * (ds[i][jj] - Ds[ty + 16 * i]);
                }
            }
            __syncthreads();
            tile_pm<HD>(dv, PT, dOs, ty, tx);                     // dV += P^T dO
            float dq[4][DPT];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < DPT; jj++) dq[i][jj] = 0.f;
            tile_pm<HD>(dq, dSs, Ks, ty, tx);                     // partial dQ = dS K
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int t = q0 + ty + 16 * i;
                if (t < T) {
                    float* dst = dqp + ((i64)kt * N + (i64)b * T + t) * Cq + h * HD + tx * DPT;
#pragma unroll
                    for (int jj = 0; jj < DPT; jj++) dst[jj] = dq[i][jj] * scale;
                }
            }
            __syncthreads();                                      // P^T is consumed: reuse it for dS^T
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++)
                    PT[(tx + 16 * jj) * LDP + ty + 16 * i] = dSs[(ty + 16 * i) * LDP + tx + 16 * jj];
            __syncthreads();
            tile_pm<HD>(dk, PT, Qs, ty, tx);                      // dK += dS^T Q
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = k0 + ty + 16 * i;
        if (t < T) {
            float* dst = dqkv + ((i64)b * T + t) * S + Cq + j * HD + tx * DPT;
#pragma unroll
            for (int jj = 0; jj < DPT; jj++) { dst[jj] = dk[i][jj] * scale; dst[Ck + jj] = dv[i][jj]; }
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) flash_bwd_32(const float* __restrict__ qkv, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ Dv, float* __restrict__ dqkv, float* __restrict__ dqp,
        int N, int T, int Hq, int Hkv, float scale, float sl2) {
    flash_bwd_body<32>(qkv, dout, lse, Dv, dqkv, dqp, N, T, Hq, Hkv, scale, sl2); }
extern "C" __global__ void __launch_bounds__(256) flash_bwd_64(const float* __restrict__ qkv, const float* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ Dv, float* __restrict__ dqkv, float* __restrict__ dqp,
        int N, int T, int Hq, int Hkv, float scale, float sl2) {
    flash_bwd_body<64>(qkv, dout, lse, Dv, dqkv, dqp, N, T, Hq, Hkv, scale, sl2); }

// dq[n, c] = sum over key tiles kt <= t/64 of dqp[kt, n, c], written into the q columns of dqkv
extern "C" __global__ void flash_dq_sum(const float* __restrict__ dqp, float* __restrict__ dqkv,
                                        int N, int T, int Cq, int S) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * Cq) return;
    i64 n = idx / Cq; int c = idx % Cq;
    int last = (int)(n % T) / 64;
    float acc = 0.f;
    for (int kt = 0; kt <= last; kt++) acc += dqp[((i64)kt * N + n) * Cq + c];
    dqkv[n * S + c] = acc;
}
""")

_FLASH_SMEM = {"fwd": lambda hd: (3 * 64 * (hd + 4) + 64 * 68) * 4,
               "bwd": lambda hd: (4 * 64 * (hd + 4) + 2 * 64 * 68 + 128) * 4}


_smem_raised = set()


def _smem_kernel(name, smem):
    """(kernel, smem): the kernel opted in to smem bytes of dynamic shared memory when that is over 48 KB."""
    assert smem_fits(smem), f"{name}: {smem} bytes of shared memory beyond {PROFILE.name}'s {PROFILE.smem_block}"
    k = _k(name)
    if smem > 48 * 1024 and name not in _smem_raised:
        k.max_dynamic_shared_size_bytes = smem
        _smem_raised.add(name)
    return k, smem


def _flash_kernel(kind, hd):
    if hd not in FLASH_HEAD_DIMS:
        raise UserError(f"flash attention supports head dims 32 and 64, not {hd} (use --attn naive)")
    return _smem_kernel(flash_name(kind, hd), _FLASH_SMEM[kind](hd))


def flash_fwd(qkv, out, lse, B, T, Hq, Hkv, hd):
    """qkv (N, S) with rotated q, k -> out (N, Cq), lse (B, Hq, T) (base 2)."""
    k, smem = _flash_kernel("fwd", hd)
    sl2 = 1.0 / math.sqrt(hd) * math.log2(math.e)
    k(((T + 63) // 64, Hq, B), (256,), (qkv, out, lse, I32(T), I32(Hq), I32(Hkv), F32(sl2)), shared_mem=smem)


def flash_bwd(qkv, out, dout, lse, dqkv, Dv, dqp, B, T, Hq, Hkv, hd):
    """-> dqkv (N, S): dq, dk, dv (before the RoPE backward). Dv (B, Hq, T) and dqp (T/64, N, Cq) scratch."""
    N = B * T
    Cq = Hq * hd
    _k("flash_bwd_pre")(_blocks(N * Hq * 32), (256,), (out, dout, Dv, I32(N), I32(T), I32(Hq), I32(hd)))
    k, smem = _flash_kernel("bwd", hd)
    scale = 1.0 / math.sqrt(hd)
    k(((T + 63) // 64, Hkv, B), (256,), (qkv, dout, lse, Dv, dqkv, dqp, I32(N), I32(T), I32(Hq), I32(Hkv),
                                         F32(scale), F32(scale * math.log2(math.e))), shared_mem=smem)
    _k("flash_dq_sum")(_blocks(N * Cq), (256,), (dqp, dqkv, I32(N), I32(T), I32(Cq), I32(dqkv.shape[1])))


# --- FlashAttention on bf16 tensor cores (mma.sync m16n8k16 and ldmatrix through inline PTX), causal,
# grouped-query, head dim HD in {32, 64, 128}: the bf16 path's attention. The WMMA API is not used: it does
# not compile with the pip CUDA headers; inline PTX does, and needs no header at all.
#
# Layout as the fp32 kernel: qkv (N, S) bf16, N = B*T, S = Cq + 2*Ck, columns [q heads | k heads | v heads]
# (q, k rotated); out (N, Cq) bf16; lse (B, Hq, T) fp32 in base 2 (log2-sum-exp of scores * scale*log2(e));
# dqkv (N, S) bf16. Query head h reads kv head h / (Hq/Hkv): K/V are never repeated. The RoPE backward is
# fused: the backward kernels rotate dq and dk back in registers before they store them (their epilogues).
# (The forward's rotation stays a pass of its own: done in this kernel's prologue it cost more than the pass,
# 241 against 164 + 37 us at B=64 on an H200, as every k tile is loaded, so rotated, by up to T/64 blocks.)
#
# Every block is 4 warps (128 threads); a tile is 64 rows. Each warp owns 16 rows of the 64 and computes
# 16 x 64 score tiles with m16n8k16 (A row-major 16x16 in 4 regs, B 16x8 "col" in 2 regs, C 16x8 fp32 in
# 4 regs: lane l holds rows l/4 and l/4+8, columns 2*(l%4)+{0,1}). Operands come from shared memory through
# ldmatrix (x4); the C fragments of P (or dS) are re-packed in registers as the A operand of the next product
# (no shared-memory round trip). Shared tiles are [64][HD+8] bf16: the 16-byte row pad puts the 8 rows
# of each ldmatrix phase in distinct banks. Global->shared copies are cp.async (16 B, rows past T are
# zero-filled), double-buffered so the next tile loads while this one is multiplied. Softmax statistics,
# accumulators and lse are fp32.
#
# Forward: one block per (query tile, query head, batch), longest rows first; K/V tiles stream through with
# an online softmax (FlashAttention-2: the row sum is rescaled per thread, reduced over the 4 lanes at the end).
#
# Backward, no atomics (deterministic), nothing T x T in fp32, three kernels:
#  flash_bf16_dpre: D = rowsum(dO * O) (B, Hq, T) fp32.
#  flash_bf16_dkdv: one block per (key tile [and its mirror tile when pair=1, so every block has the same
#    causal work], kv head, batch); keeps dK, dV of its 64 keys in registers and loops over the G query heads
#    of the kv head and the query tiles at or below the diagonal: S^T = K Q^T, P^T, dV += P^T dO,
#    dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q. The GQA sum over the G heads is in-block, in order.
#    It also stores each 64 x 64 tile of dS (bf16, the operand precision) for the dQ kernel, already as that
#    kernel's A fragments: every 8 x 8 piece is transposed in registers (movmatrix), so both kernels move
#    16 bytes a lane, coalesced. (B * Hq * nt(nt+1)/2 tiles of 8 KB, nt = T/64 rounded up: 226 MB at B=64, T=512.)
#  flash_bf16_dq: one block per (query tile, query head, batch): dQ = sum over key tiles <= the diagonal of
#    dS K, in order; one product a tile, where recomputing P and dS took three (and exp2 of every score).
#    (Measured on an H200 at B=64: 245 us a layer before, when the dQ kernel recomputed dS.)
# Rows past T need no masks: their Q, dO rows are zero-filled, lse and D read as 0, so they contribute 0.
# (Measured on an H200, B=16 T=512 Hq/Hkv=12/4 hd=64: fwd+bwd 0.19 ms against 1.29 for the fp32 kernel.)
#
# On sm_90 at head dim 64 the same three kernels run their products on wgmma (module flash_bf16_wg, template
# parameter WG): the block's 4 warps are one warpgroup, the 64-row tiles are 128-byte swizzled, the tensor cores
# read them from shared memory through descriptors, and the C fragments are the same (so the same bits: equal on
# every shape tried). H200, B=16 / 64, big's shapes, us a layer: fwd 48.0 -> 39.5 / 162 -> 132, dK/dV 75.8 -> 57.6
# / 260 -> 197, dQ 33.4 -> 28.8 / 108 -> 98; the training step 15.5 -> 15.1 / 57.9 -> 55.6 ms.

BF16_HEAD_DIMS = (32, 64, 128)
MMA_SRC = r"""
// c (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col): lane l holds a's rows l/4 and l/4+8, columns
// 2(l%4)+{0,1} (a[0], a[1]) and +8 (a[2], a[3]); b's column l/4, rows 2(l%4)+{0,1} (b0) and +8 (b1); c's rows
// l/4 (c[0], c[1]) and l/4+8 (c[2], c[3]), columns 2(l%4)+{0,1}. The tensor-core modules' (BF16_MODULES)
__device__ __forceinline__ void fb_mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""
FLASH_BF16_BODY = MMA_SRC + r"""
// four 8x8 bf16 matrices; lane l gives the row address of matrix l/8, row l%8
__device__ __forceinline__ void fb_ldm4(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fb_sa(p)));
}
__device__ __forceinline__ void fb_ldm4t(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fb_sa(p)));
}
// two floats -> bf16x2 (lo in the low half: the lower column index), round to nearest even
__device__ __forceinline__ unsigned fb_pack(float lo, float hi) { return pack_bf2(lo, hi); }
__device__ __forceinline__ float fb_exp2(float x) {     // ex2.approx: exp2(-inf) = 0
    float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}

// a tile's row stride in elements: [64][HD+8] for ldmatrix (mma.sync); [64][64] swizzled for wgmma (WG)
template <int HD, bool WG> __device__ constexpr int fb_lds() { return WG ? HD : HD + 8; }
// a flash kernel's dynamic shared memory; WG: from its first 1024-byte boundary (1 KB more is asked for)
template <bool WG> __device__ __forceinline__ unsigned char* fb_smem_base() {
    extern __shared__ __align__(16) unsigned char fb_smem[];
    return WG ? fb_smem + ((1024 - (fb_sa(fb_smem) & 1023)) & 1023) : fb_smem;
}
// rows [r0, r0+64) of a row-major (.., ld) bf16 matrix, columns col..col+HD -> a smem tile; zeros past T.
// WG: 16-byte chunk ch of row r goes to chunk ch ^ (r % 8) of the row (the 128-byte swizzle wgmma reads)
template <int HD, bool WG>
__device__ __forceinline__ void fb_load_tile(bf16* dst, const bf16* src, int r0, int T, long long ld, int col) {
    static_assert(!WG || HD == 64, "wgmma tiles are rows of 128 bytes");
    constexpr int CH = HD / 8, LDS = fb_lds<HD, WG>();
#pragma unroll
    for (int f = threadIdx.x; f < 64 * CH; f += 128) {
        int r = f / CH, c = (f % CH) * 8;
        bool ok = r0 + r < T;
        fb_cp16(dst + r * LDS + (WG ? ((f % CH) ^ (r & 7)) * 8 : c), src + (long long)(ok ? r0 + r : 0) * ld + col + c,
                ok ? 16 : 0);
    }
}
// after a thread's cp.async groups landed, before the barrier: makes its writes visible to wgmma's reads
template <bool WG> __device__ __forceinline__ void fb_fence_async() {
    if constexpr (WG) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// the double-buffered key loop of the forward and dq kernels: the K and V tiles after tile kt (up to last)
// start loading into the other buffer, and tile kt, in buffer kt & 1, is waited for
template <int HD, bool WG>
__device__ __forceinline__ void fb_next_kv(bf16* Ks, bf16* Vs, const bf16* base, int kt, int last, int T, long long S,
                                           int kcol, int vcol) {
    constexpr int TILE = 64 * fb_lds<HD, WG>();
    if (kt < last) {
        const int nb = (kt + 1) & 1;
        fb_load_tile<HD, WG>(Ks + nb * TILE, base, (kt + 1) * 64, T, S, kcol);
        fb_load_tile<HD, WG>(Vs + nb * TILE, base, (kt + 1) * 64, T, S, vcol);
        fb_commit();
        fb_wait<1>();
    } else {
        fb_wait<0>();
    }
    fb_fence_async<WG>();
    __syncthreads();                                               // tile kt is in shared memory
}
// src[r0 .. r0+64) fp32 -> smem [64]; zeros past T
__device__ __forceinline__ void fb_load_vec(float* dst, const float* src, int r0, int T) {
    if (threadIdx.x < 64) {
        int t = r0 + threadIdx.x;
        bool ok = t < T;
        fb_cp4(dst + threadIdx.x, src + (ok ? t : 0), ok ? 4 : 0);
    }
}

// --- wgmma (sm_90a; module flash_bf16_wg): a warpgroup (the block's 4 warps) multiplies 64-row tiles, the tensor
// cores reading the shared operands through descriptors (no ldmatrix, a few instructions a product). Its C
// fragments are fb_mma's: warp w holds rows 16w..16w+15, acc[n] columns 8n..8n+7. Tiles are 64 rows of 128
// bytes, swizzled (fb_load_tile<64, true>), 1024-byte aligned. Inline and unused elsewhere: no PTX off sm_90a.
// descriptor: start address / 16, leading offset 16 B (unused when swizzled), 8 rows = 1024 B apart, 128-B swizzle
__device__ __forceinline__ unsigned long long wg_desc(const bf16* p) {
    return ((fb_sa(p) & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
#define WG_C "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WG_ACC4(a, n) "+f"(a[n][0]), "+f"(a[n][1]), "+f"(a[n][2]), "+f"(a[n][3])
#define WG_ACC(a) WG_ACC4(a, 0), WG_ACC4(a, 1), WG_ACC4(a, 2), WG_ACC4(a, 3), WG_ACC4(a, 4), WG_ACC4(a, 5), \
                  WG_ACC4(a, 6), WG_ACC4(a, 7)
// The products run asynchronously: wg_abt / wg_pm fence (acc and the A registers were written), issue, commit
// and wait (wg_wait). Until then a product's registers are its own: wg_hold, after the wait, marks them written
// there, so the compiler moves no read of an output, nor a write over a register operand, above the wait.
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void wg_hold(float acc[8][4]) { asm volatile("" : WG_ACC(acc) :: "memory"); }
__device__ __forceinline__ void wg_hold(unsigned pa[4][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        asm volatile("" : "+r"(pa[kk][0]), "+r"(pa[kk][1]), "+r"(pa[kk][2]), "+r"(pa[kk][3]) :: "memory");
}
// acc (64 x 64) += A (64 x HD) * Bm (64 x HD)^T, both K-major tiles
template <int HD> __device__ __forceinline__ void wg_abt(float acc[8][4], const bf16* A, const bf16* Bm) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_C ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WG_ACC(acc) : "l"(wg_desc(A + kk * 16)), "l"(wg_desc(Bm + kk * 16)), "r"(1));
    wg_wait();
    wg_hold(acc);
}
// acc (64 x HD) += P (64 x 64, A fragments pa[k-step] in registers) * M (64 x HD tile, read transposed: MN-major)
template <int HD> __device__ __forceinline__ void wg_pm(float acc[8][4], unsigned pa[4][4], const bf16* M) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_C ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
                     : WG_ACC(acc) : "r"(pa[kk][0]), "r"(pa[kk][1]), "r"(pa[kk][2]), "r"(pa[kk][3]),
                       "l"(wg_desc(M + kk * 16 * HD)), "r"(1));
    wg_wait();
    wg_hold(acc);
    wg_hold(pa);
}

// acc (16 x 64, n-tile n = columns 8n..8n+7) += A (16 x HD) * Bm (64 x HD)^T, the warp's 16 rows of the A tile;
// WG: the warpgroup's 64 (wg_abt)
template <int HD, bool WG>
__device__ __forceinline__ void fb_abt(float acc[8][4], const bf16* A, const bf16* Bm, int lane) {
    if constexpr (WG) {
        wg_abt<HD>(acc, A, Bm);
        return;
    }
    constexpr int LDS = HD + 8;
    A += (threadIdx.x >> 5) * 16 * LDS;
#pragma unroll (HD == 128 ? 2 : 4)     // full unroll at HD=128 spills in the dK/dV kernel (255 registers)
    for (int kk = 0; kk < HD / 16; kk++) {
        unsigned a[4];                  // matrices: rows 0-7 | 8-15 of k 0-7, then of k 8-15
        fb_ldm4(a, A + (lane & 15) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int p = 0; p < 4; p++) {   // keys 16p..16p+15: matrices (keys 0-7: k 0-7 | 8-15), (keys 8-15: ...)
            unsigned b[4];
            fb_ldm4(b, Bm + (16 * p + (lane & 7) + ((lane >> 4) << 3)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
            fb_mma(acc[2 * p], a, b[0], b[1]);
            fb_mma(acc[2 * p + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x HD) += P (16 x 64, A fragments pa[k-step]) * M (64 x HD, smem rows of HD+8); .trans gives B = M[k][n].
// WG: wg_pm
template <int HD, bool WG>
__device__ __forceinline__ void fb_pm(float acc[HD / 8][4], unsigned pa[4][4], const bf16* M, int lane) {
    if constexpr (WG) {
        wg_pm<HD>(acc, pa, M);
        return;
    }
    constexpr int LDS = HD + 8;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int p = 0; p < HD / 16; p++) {   // matrices: (k 0-7 | 8-15 of cols 16p..+7), then of cols 16p+8..+15
            unsigned b[4];
            fb_ldm4t(b, M + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + 16 * p + (lane >> 4) * 8);
            fb_mma(acc[2 * p], pa[kk], b[0], b[1]);
            fb_mma(acc[2 * p + 1], pa[kk], b[2], b[3]);
        }
    }
}

// C fragments of a 16 x 64 tile -> A fragments (bf16) of the same tile, k-step kk = columns 16kk..16kk+15
__device__ __forceinline__ void fb_c2a(unsigned pa[4][4], const float s[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        pa[kk][0] = fb_pack(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = fb_pack(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = fb_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = fb_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// RoPE backward in the epilogue: a warp's C fragments acc (16 x HD; lane: rows g, g+8, columns 8n + 2c + {0,1})
// times scale, rotated back by each row's position, to the bf16 rows dst + t * ld (row t of r0 + g + 8r, t < T).
// The pair of column i is column i + HD/2: n-tile n + HD/16 in the same lane.
template <int HD>
__device__ __forceinline__ void fb_store_unrotated(const float acc[HD / 8][4], bf16* dst, long long ld, int r0, int T,
                                                   float scale, const float* __restrict__ cosv,
                                                   const float* __restrict__ sinv, int g, int c) {
    constexpr int HALF = HD / 2;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int t = r0 + g + 8 * r;
        if (t >= T) continue;
        bf16* d = dst + t * ld + 2 * c;
#pragma unroll
        for (int n = 0; n < HD / 16; n++) {
            const float2 cs = *reinterpret_cast<const float2*>(cosv + (long long)t * HALF + 8 * n + 2 * c);
            const float2 sn = *reinterpret_cast<const float2*>(sinv + (long long)t * HALF + 8 * n + 2 * c);
            const float a0 = acc[n][2 * r] * scale, a1 = acc[n][2 * r + 1] * scale;
            const float b0 = acc[n + HD / 16][2 * r] * scale, b1 = acc[n + HD / 16][2 * r + 1] * scale;
            *reinterpret_cast<unsigned*>(d + 8 * n) = fb_pack(a0 * cs.x + b0 * sn.x, a1 * cs.y + b1 * sn.y);
            *reinterpret_cast<unsigned*>(d + HALF + 8 * n) = fb_pack(b0 * cs.x - a0 * sn.x, b1 * cs.y - a1 * sn.y);
        }
    }
}

template <int HD, bool WG>
__device__ __forceinline__ void fb_fwd_body(const bf16* __restrict__ qkv, bf16* __restrict__ out,
                                            float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) {
    constexpr int TILE = 64 * fb_lds<HD, WG>();
    bf16* Qs = reinterpret_cast<bf16*>(fb_smem_base<WG>());   // [64][LDS]
    bf16* Ks = Qs + TILE;                              // [2][64][LDS]
    bf16* Vs = Ks + 2 * TILE;                          // [2][64][LDS]
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int nqt = (T + 63) / 64, qt = nqt - 1 - blockIdx.x;      // the longest rows start first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (Hq / Hkv);
    const int Cq = Hq * HD, Ck = Hkv * HD, S = Cq + 2 * Ck;
    const bf16* base = qkv + (long long)b * T * S;
    const int q0 = qt * 64;
    fb_load_tile<HD, WG>(Qs, base, q0, T, S, h * HD);
    fb_load_tile<HD, WG>(Ks, base, 0, T, S, Cq + kvh * HD);
    fb_load_tile<HD, WG>(Vs, base, 0, T, S, Cq + Ck + kvh * HD);
    fb_commit();
    float o[HD / 8][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};   // rows w*16 + g + 8r
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[n][e] = 0.f;
    for (int kt = 0; kt <= qt; kt++) {
        fb_next_kv<HD, WG>(Ks, Vs, base, kt, qt, T, S, Cq + kvh * HD, Cq + Ck + kvh * HD);
        const bf16* Kc = Ks + (kt & 1) * TILE;
        const bf16* Vc = Vs + (kt & 1) * TILE;
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[n][e] = 0.f;
        fb_abt<HD, WG>(s, Qs, Kc, lane);
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = s[n][e] * sl2;                           // base-2 logits
                if (kt == qt && 8 * n + 2 * c + (e & 1) > w * 16 + g + 8 * (e >> 1)) v = NEG_INF;   // causal
                s[n][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {                              // the 4 lanes of a row: xor 1, 2
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float mn = fmaxf(m[r], mx[r]);                   // finite: every row sees its own key
            const float corr = fb_exp2(m[r] - mn);
            m[r] = mn;
            l[r] *= corr;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) { o[n][2 * r] *= corr; o[n][2 * r + 1] *= corr; }
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = fb_exp2(s[n][e] - m[e >> 1]);
                s[n][e] = p;
                l[e >> 1] += p;                                    // this lane's part of the row sum
            }
        unsigned pa[4][4];
        fb_c2a(pa, s);
        fb_pm<HD, WG>(o, pa, Vc, lane);                            // O += P V
        __syncthreads();                                           // buffer kt&1 is refilled next iteration
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int t = q0 + w * 16 + g + 8 * r;
        if (t < T) {
            const float inv = 1.f / l[r];
            bf16* dst = out + ((long long)b * T + t) * Cq + h * HD + 2 * c;
#pragma unroll
            for (int n = 0; n < HD / 8; n++)
                *reinterpret_cast<unsigned*>(dst + 8 * n) = fb_pack(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
            if (c == 0) lse[((long long)b * Hq + h) * T + t] = m[r] + __log2f(l[r]);
        }
    }
}

// an 8x8 b16 matrix held as mma fragments (lane l: row l/4, columns 2(l%4), +1) -> its transpose, same layout
__device__ __forceinline__ unsigned fb_trans(unsigned a) {
    unsigned d; asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a)); return d;
}

// dQ of query tile qt: sum over key tiles kt <= qt of dS_kt K_kt, dS's A fragments read from dsf (written by the
// dK/dV kernel: tile (b, h, qt, kt) at index qt(qt+1)/2 + kt of the (b, h) run, 512 uint4: [warp's 16 queries]
// [16 keys][lane]); K and dS tiles pass through shared memory in FB_DQ_STAGES buffers (cp.async, a group per
// tile, loading two tiles ahead); the RoPE backward in the epilogue
#define FB_DQ_STAGES 3
template <int HD, bool WG>
__device__ __forceinline__ void fb_dq_body(const bf16* __restrict__ qkv, const uint4* __restrict__ dsf,
        bf16* __restrict__ dqkv, const float* __restrict__ cosv, const float* __restrict__ sinv, int T, int Hq,
        int Hkv, float scale) {
    constexpr int TILE = 64 * fb_lds<HD, WG>();
    uint4* dSs = reinterpret_cast<uint4*>(fb_smem_base<WG>());    // [STAGES][512]
    bf16* Ks = reinterpret_cast<bf16*>(dSs + FB_DQ_STAGES * 512);  // [STAGES][64][LDS]
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int nqt = (T + 63) / 64, qt = nqt - 1 - blockIdx.x;      // the longest rows start first
    const int h = blockIdx.y, b = blockIdx.z, kvh = h / (Hq / Hkv);
    const int Cq = Hq * HD, Ck = Hkv * HD, S = Cq + 2 * Ck;
    const bf16* base = qkv + (long long)b * T * S;
    const uint4* src = dsf + (((long long)b * Hq + h) * (nqt * (nqt + 1) / 2) + qt * (qt + 1) / 2) * 512;
    auto issue = [&](int kt) {                                     // tile kt's group (empty past the last)
        if (kt <= qt) {
            const int st = kt % FB_DQ_STAGES;
            fb_load_tile<HD, WG>(Ks + st * TILE, base, kt * 64, T, S, Cq + kvh * HD);
#pragma unroll
            for (int f = threadIdx.x; f < 512; f += 128) fb_cp16(dSs + st * 512 + f, src + kt * 512 + f, 16);
        }
        fb_commit();
    };
    issue(0);
    issue(1);
    float dq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[n][e] = 0.f;
    for (int kt = 0; kt <= qt; kt++) {
        issue(kt + 2);
        fb_wait<2>();
        fb_fence_async<WG>();
        __syncthreads();                                           // tile kt is in shared memory
        const int st = kt % FB_DQ_STAGES;
        unsigned pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint4 v = dSs[st * 512 + w * 128 + kk * 32 + lane];
            pa[kk][0] = v.x; pa[kk][1] = v.y; pa[kk][2] = v.z; pa[kk][3] = v.w;
        }
        fb_pm<HD, WG>(dq, pa, Ks + st * TILE, lane);               // dQ += dS K
        __syncthreads();                                           // its buffers are refilled next iteration
    }
    fb_store_unrotated<HD>(dq, dqkv + (long long)b * T * S + h * HD, S, qt * 64 + w * 16, T, scale, cosv, sinv, g, c);
}

#define FB_DQ_PARAMS const bf16* __restrict__ qkv, const uint4* __restrict__ dsf, bf16* __restrict__ dqkv, \
        const float* __restrict__ cosv, const float* __restrict__ sinv, int T, int Hq, int Hkv, float scale
#define FB_DQ_ARGS qkv, dsf, dqkv, cosv, sinv, T, Hq, Hkv, scale
// dK, dV of key tile kt (keys kt*64 .. kt*64+63) of kv head blockIdx.y, batch blockIdx.z
template <int HD, bool WG>
__device__ __forceinline__ void fb_dkdv_tile(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ Dv, bf16* __restrict__ dqkv, uint4* __restrict__ dsf,
        const float* __restrict__ cosv, const float* __restrict__ sinv,
        int T, int Hq, int Hkv, float scale, float sl2, const int kt) {
    constexpr int TILE = 64 * fb_lds<HD, WG>();
    bf16* Ks = reinterpret_cast<bf16*>(fb_smem_base<WG>());   // [64][LDS] keys of this block
    bf16* Vs = Ks + TILE;                              // [64][LDS]
    bf16* Qs = Vs + TILE;                              // [2][64][LDS] query tiles
    bf16* dOs = Qs + 2 * TILE;                         // [2][64][LDS]
    float* Ls = reinterpret_cast<float*>(dOs + 2 * TILE);   // [2][64] lse of the query rows
    float* Ds = Ls + 128;                                    // [2][64] D of the query rows
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int nkt = (T + 63) / 64, j = blockIdx.y, b = blockIdx.z, G = Hq / Hkv;
    const int Cq = Hq * HD, Ck = Hkv * HD, S = Cq + 2 * Ck;
    const bf16* base = qkv + (long long)b * T * S;
    const bf16* dbase = dout + (long long)b * T * Cq;
    {
        const int k0 = kt * 64, nq = nkt - kt, niter = G * nq;     // (query head, query tile kt..nkt-1)
        auto issue = [&](int it, int buf) {
            const int hh = j * G + it / nq, qq0 = (kt + it % nq) * 64;
            fb_load_tile<HD, WG>(Qs + buf * TILE, base, qq0, T, S, hh * HD);
            fb_load_tile<HD, WG>(dOs + buf * TILE, dbase, qq0, T, Cq, hh * HD);
            fb_load_vec(Ls + buf * 64, lse + ((long long)b * Hq + hh) * T, qq0, T);
            fb_load_vec(Ds + buf * 64, Dv + ((long long)b * Hq + hh) * T, qq0, T);
        };
        fb_load_tile<HD, WG>(Ks, base, k0, T, S, Cq + j * HD);
        fb_load_tile<HD, WG>(Vs, base, k0, T, S, Cq + Ck + j * HD);
        issue(0, 0);
        fb_commit();
        float dk[HD / 8][4], dv[HD / 8][4];                        // keys k0 + w*16 + g + 8r
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) { dk[n][e] = 0.f; dv[n][e] = 0.f; }
        for (int it = 0; it < niter; it++) {
            if (it + 1 < niter) {
                issue(it + 1, (it + 1) & 1);
                fb_commit();
                fb_wait<1>();
            } else {
                fb_wait<0>();
            }
            fb_fence_async<WG>();
            __syncthreads();
            const int buf = it & 1;
            const bool diag = it % nq == 0;                        // query tile == key tile
            const bf16* Qc = Qs + buf * TILE;
            const bf16* dOc = dOs + buf * TILE;
            const float* Lc = Ls + buf * 64;
            const float* Dc = Ds + buf * 64;
            float p[8][4], dp[8][4];                               // rows: keys; columns: queries 8n + 2c + (e&1)
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) { p[n][e] = 0.f; dp[n][e] = 0.f; }
            fb_abt<HD, WG>(p, Ks, Qc, lane);                       // S^T = K Q^T
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const float2 L2 = *reinterpret_cast<const float2*>(Lc + 8 * n + 2 * c);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = fb_exp2(p[n][e] * sl2 - ((e & 1) ? L2.y : L2.x));
                    if (diag && 8 * n + 2 * c + (e & 1) < w * 16 + g + 8 * (e >> 1)) v = 0.f;   // key > query
                    p[n][e] = v;
                }
            }
            unsigned pa[4][4];
            fb_c2a(pa, p);
            fb_pm<HD, WG>(dv, pa, dOc, lane);                      // dV += P^T dO
            fb_abt<HD, WG>(dp, Vs, dOc, lane);                     // dP^T = V dO^T
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const float2 D2 = *reinterpret_cast<const float2*>(Dc + 8 * n + 2 * c);
                if constexpr (HD == 128) {     // P^T from its bf16 copy: 16 fewer live registers, no spills
                    const float2 lo = unpack_bf2(pa[n >> 1][(n & 1) * 2]);
                    const float2 hi = unpack_bf2(pa[n >> 1][(n & 1) * 2 + 1]);
                    p[n][0] = lo.x; p[n][1] = lo.y; p[n][2] = hi.x; p[n][3] = hi.y;
                }
#pragma unroll
                for (int e = 0; e < 4; e++) dp[n][e] = p[n][e] * (dp[n][e] - ((e & 1) ? D2.y : D2.x));   // dS^T
            }
            fb_c2a(pa, dp);
            {   // dS (queries x keys) as the dQ kernel's A fragments: its 16 queries 16kk.. by this warp's 16 keys
                const int qi = kt + it % nq;
                uint4* dst = dsf + (((long long)b * Hq + j * G + it / nq) * (nkt * (nkt + 1) / 2) + qi * (qi + 1) / 2 + kt) * 512
                             + w * 32 + lane;
#pragma unroll
                for (int kk = 0; kk < 4; kk++)
                    dst[kk * 128] = make_uint4(fb_trans(pa[kk][0]), fb_trans(pa[kk][2]), fb_trans(pa[kk][1]), fb_trans(pa[kk][3]));
            }
            fb_pm<HD, WG>(dk, pa, Qc, lane);                       // dK += dS^T Q
            __syncthreads();                                       // buffer it&1 is refilled next iteration
        }
        bf16* drow = dqkv + (long long)b * T * S + Cq + j * HD;
        fb_store_unrotated<HD>(dk, drow, S, k0 + w * 16, T, scale, cosv, sinv, g, c);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int t = k0 + w * 16 + g + 8 * r;
            if (t < T) {
#pragma unroll
                for (int n = 0; n < HD / 8; n++)
                    *reinterpret_cast<unsigned*>(drow + t * S + Ck + 2 * c + 8 * n) = fb_pack(dv[n][2 * r], dv[n][2 * r + 1]);
            }
        }
    }
}

// pair: the block takes key tiles x and nkt-1-x, so every block has the same causal work
template <int HD, bool WG>
__device__ __forceinline__ void fb_dkdv_body(const bf16* __restrict__ qkv, const bf16* __restrict__ dout,
        const float* __restrict__ lse, const float* __restrict__ Dv, bf16* __restrict__ dqkv, uint4* __restrict__ dsf,
        const float* __restrict__ cosv, const float* __restrict__ sinv, int T, int Hq, int Hkv, float scale,
        float sl2, int pair) {
    const int nkt = (T + 63) / 64, kt = blockIdx.x, kt2 = nkt - 1 - kt;
    fb_dkdv_tile<HD, WG>(qkv, dout, lse, Dv, dqkv, dsf, cosv, sinv, T, Hq, Hkv, scale, sl2, kt);
    if (pair && kt2 != kt) {
        __syncthreads();                                           // the first key tile's shared memory is consumed
        fb_dkdv_tile<HD, WG>(qkv, dout, lse, Dv, dqkv, dsf, cosv, sinv, T, Hq, Hkv, scale, sl2, kt2);
    }
}

#define FB_DKDV_PARAMS const bf16* __restrict__ qkv, const bf16* __restrict__ dout, const float* __restrict__ lse, \
        const float* __restrict__ Dv, bf16* __restrict__ dqkv, uint4* __restrict__ dsf, const float* __restrict__ cosv, \
        const float* __restrict__ sinv, int T, int Hq, int Hkv, float scale, float sl2, int pair
#define FB_DKDV_ARGS qkv, dout, lse, Dv, dqkv, dsf, cosv, sinv, T, Hq, Hkv, scale, sl2, pair
"""
FLASH_BF16_SRC = cuda_source("flash_bf16", ["flash_bf16_dpre"] + [
    flash_name(kind, hd, bf16=True) for kind in ("fwd", "dq", "dkdv") for hd in BF16_HEAD_DIMS], FLASH_BF16_BODY + r"""
extern "C" __global__ void __launch_bounds__(128) flash_bf16_fwd_32(const bf16* __restrict__ qkv, bf16* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { fb_fwd_body<32, false>(qkv, out, lse, T, Hq, Hkv, sl2); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_fwd_64(const bf16* __restrict__ qkv, bf16* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { fb_fwd_body<64, false>(qkv, out, lse, T, Hq, Hkv, sl2); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_fwd_128(const bf16* __restrict__ qkv, bf16* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { fb_fwd_body<128, false>(qkv, out, lse, T, Hq, Hkv, sl2); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_dq_32(FB_DQ_PARAMS) { fb_dq_body<32, false>(FB_DQ_ARGS); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_dq_64(FB_DQ_PARAMS) { fb_dq_body<64, false>(FB_DQ_ARGS); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_dq_128(FB_DQ_PARAMS) { fb_dq_body<128, false>(FB_DQ_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 3) flash_bf16_dkdv_32(FB_DKDV_PARAMS) { fb_dkdv_body<32, false>(FB_DKDV_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 3) flash_bf16_dkdv_64(FB_DKDV_PARAMS) { fb_dkdv_body<64, false>(FB_DKDV_ARGS); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_dkdv_128(FB_DKDV_PARAMS) { fb_dkdv_body<128, false>(FB_DKDV_ARGS); }

// D = rowsum(dO * O) in fp32 (natural units) per (row, query head): two threads each, hd/2 columns apiece,
// 16-byte loads (hd % 16 == 0)
extern "C" __global__ void flash_bf16_dpre(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                                           float* __restrict__ Dv, int N, int T, int Hq, int hd) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;       // (row, head, half); N * Hq * 2 < 2^31
    const int n = (int)(i / (2 * Hq)), h = (int)((i >> 1) % Hq), half = (int)(i & 1);
    float acc = 0.f;
    if (n < N) {
        const long long off = ((long long)n * Hq + h) * hd + half * (hd / 2);
        for (int k = 0; k < hd / 2; k += 8) {
            float fo[8], fd[8];
            ldbf<8>(out + off + k, fo);
            ldbf<8>(dout + off + k, fd);
#pragma unroll
            for (int e = 0; e < 8; e++) acc += fo[e] * fd[e];
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (n < N && half == 0) Dv[((long long)(n / T) * Hq + h) * T + n % T] = acc;
}
""")
# the same kernels on wgmma, head dim WG_HEAD_DIM (compiled for sm_90a: WG_MODULES)
WG_HEAD_DIM = 64               # wgmma's tiles are rows of 128 bytes (fb_load_tile)
FLASH_BF16_WG_SRC = cuda_source("flash_bf16_wg", [flash_name(kind, WG_HEAD_DIM, bf16=True, wg=True)
                                                  for kind in ("fwd", "dq", "dkdv")],
                                FLASH_BF16_BODY + r"""
extern "C" __global__ void __launch_bounds__(128) flash_bf16_fwd_64_wg(const bf16* __restrict__ qkv, bf16* __restrict__ out,
        float* __restrict__ lse, int T, int Hq, int Hkv, float sl2) { fb_fwd_body<64, true>(qkv, out, lse, T, Hq, Hkv, sl2); }
extern "C" __global__ void __launch_bounds__(128) flash_bf16_dq_64_wg(FB_DQ_PARAMS) { fb_dq_body<64, true>(FB_DQ_ARGS); }
extern "C" __global__ void __launch_bounds__(128, 3) flash_bf16_dkdv_64_wg(FB_DKDV_PARAMS) { fb_dkdv_body<64, true>(FB_DKDV_ARGS); }
""")


# shared memory per block (bytes): tiles of [64][hd+8] bf16 (+ fp32 vectors); wg: of [64][hd], 1 KB more to align
_fb_tiles = lambda n, hd, wg: n * 64 * (hd if wg else hd + 8) * 2 + 1024 * wg
_FLASH_BF16_SMEM = {"fwd": lambda hd, wg=False: _fb_tiles(5, hd, wg),
                    "dq": lambda hd, wg=False: _fb_tiles(3, hd, wg) + 3 * 8192,    # FB_DQ_STAGES x (K, dS tiles)
                    "dkdv": lambda hd, wg=False: _fb_tiles(6, hd, wg) + 256 * 4}
FLASH_BF16_PAIR = 1            # dK/dV blocks take key tiles x and nkt-1-x: equal causal work per block


def flash_fits(hd, bf16=False, train=True, prof=None):
    """Whether the flash kernels (fp32, or bf16) of head dim hd fit the device's shared memory a block (fp32's
    backward at hd 64 takes 102.5 KB: over the 99 KB of sm_86 / sm_89; bf16's dK/dV at hd 128, 103 KB)."""
    sizes = _FLASH_BF16_SMEM if bf16 else _FLASH_SMEM
    return all(smem_fits(f(hd), prof) for kind, f in sizes.items() if train or kind == "fwd")


def attention_for(attn, cfg, bf16, train=True, prof=None):
    """The attention a model runs: flash as asked, unless fp32 flash's tiles do not fit the device (naive then)."""
    if attn == "flash" and not bf16 and cfg.head_dim in FLASH_HEAD_DIMS and not flash_fits(cfg.head_dim, False,
                                                                                          train, prof):
        return "naive"
    return attn


def flash_wg(hd, prof=None):
    """Whether the bf16 flash kernels of head dim hd run on wgmma on the device (prof: a DeviceProfile)."""
    return (prof or PROFILE).wgmma and hd == WG_HEAD_DIM


def _flash_bf16_kernel(kind, hd, wg=None):
    """The kernel of a kind at head dim hd: on wgmma where flash_wg (wg: True / False forces either, for the
    self-test and bench)."""
    if hd not in BF16_HEAD_DIMS:
        raise UserError(f"bf16 flash attention supports head dims 32, 64 and 128, not {hd} "
                        "(use --precision tf32 or fp32)")
    wg = flash_wg(hd) if wg is None else wg
    return _smem_kernel(flash_name(kind, hd, bf16=True, wg=wg), _FLASH_BF16_SMEM[kind](hd, wg))


def flash_bf16_fwd(qkv, out, lse, B, T, Hq, Hkv, hd, wg=None):
    """qkv (N, S) bf16 with rotated q, k -> out (N, Cq) bf16, lse (B, Hq, T) fp32 (base 2)."""
    k, smem = _flash_bf16_kernel("fwd", hd, wg)
    sl2 = 1.0 / math.sqrt(hd) * math.log2(math.e)
    k(((T + 63) // 64, Hq, B), (128,), (qkv, out, lse, I32(T), I32(Hq), I32(Hkv), F32(sl2)), shared_mem=smem)


def flash_bf16_scratch(B, T, Hq):
    """The backward's device scratch: D (B, Hq, T) fp32 and the dS tiles (8 KB each) as dQ's fragments."""
    nt = (T + 63) // 64
    return {"D": cp.empty((B, Hq, T), np.float32), "dS": cp.empty((B * Hq * nt * (nt + 1) // 2, 512, 4), np.uint32)}


def flash_bf16_bwd(qkv, out, dout, lse, dqkv, ws, cos, sin, B, T, Hq, Hkv, hd, pair=None, wg=None):
    """-> dqkv (N, S) bf16: dq, dk (rotated back by the RoPE tables cos, sin (ctx, hd/2): the RoPE backward), dv.
    ws: flash_bf16_scratch(B, T, Hq)."""
    pair = FLASH_BF16_PAIR if pair is None else int(pair)
    kq, sq = _flash_bf16_kernel("dq", hd, wg)
    kd, sd = _flash_bf16_kernel("dkdv", hd, wg)
    scale = 1.0 / math.sqrt(hd)
    nt, N = (T + 63) // 64, B * T
    assert N * Hq * 2 < 2 ** 31
    _k("flash_bf16_dpre")(_blocks(N * Hq * 2), (256,), (out, dout, ws["D"], I32(N), I32(T), I32(Hq), I32(hd)))
    kd(((nt + 1) // 2 if pair else nt, Hkv, B), (128,),
       (qkv, dout, lse, ws["D"], dqkv, ws["dS"], cos, sin, I32(T), I32(Hq), I32(Hkv), F32(scale),
        F32(scale * math.log2(math.e)), I32(pair)), shared_mem=sd)
    kq((nt, Hq, B), (128,), (qkv, ws["dS"], dqkv, cos, sin, I32(T), I32(Hq), I32(Hkv), F32(scale)), shared_mem=sq)


# --- naive attention (for teaching and the speed comparison): the T x T scores are materialised.
#     q, k, v are copied to (B, H, T, hd); the G query heads of a kv head are then one (G*T, hd) matrix,
#     so every product is one strided-batched cuBLAS call over the B*Hkv groups and sums over the G heads
#     come out of the products themselves. ---

NAIVE_SRC = cuda_source("naive", ["heads_copy", "causal_softmax", "softmax_bwd"], r"""
// dst (B, H, T, hd) <- src columns col0 + h*hd + d of (N, S) rows; back=1 copies the other way
extern "C" __global__ void heads_copy(float* __restrict__ src, float* __restrict__ dst, int N, int T, int H,
                                     int hd, int S, int col0, int back) {
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)N * H * hd) return;
    int d = idx % hd, h = (idx / hd) % H;
    i64 n = idx / ((i64)hd * H);
    i64 a = n * S + col0 + h * hd + d, g = (((n / T) * H + h) * T + n % T) * hd + d;
    if (back) src[a] = dst[g]; else dst[g] = src[a];
}
// scores (rows, T) -> causal softmax in place; row r is position r % T; one block per row
extern "C" __global__ void causal_softmax(float* __restrict__ s, int T) {
    i64 r = blockIdx.x;
    int t = r % T;
    float* x = s + r * T;
    float m = NEG_INF;
    for (int c = threadIdx.x; c <= t; c += blockDim.x) m = fmaxf(m, x[c]);
    m = block_max(m);
    float z = 0.f;
    for (int c = threadIdx.x; c <= t; c += blockDim.x) { float e = expf(x[c] - m); x[c] = e; z += e; }
    z = block_sum(z);
    float inv = 1.f / z;
    for (int c = threadIdx.x; c < T; c += blockDim.x) x[c] = c <= t ? x[c] * inv : 0.f;
}
// dP -> dS = P * (dP - sum_c P dP) * scale, in place
extern "C" __global__ void softmax_bwd(const float* __restrict__ p, float* __restrict__ dp, int T, float scale) {
    i64 r = blockIdx.x;
    const float* pr = p + r * T;
    float* dr = dp + r * T;
    float s = 0.f;
    for (int c = threadIdx.x; c < T; c += blockDim.x) s += pr[c] * dr[c];
    s = block_sum(s);
    for (int c = threadIdx.x; c < T; c += blockDim.x) dr[c] = pr[c] * (dr[c] - s) * scale;
}
""")


def _heads_copy(buf, dst, T, H, hd, col0, back=False):
    N, S = buf.shape
    _k("heads_copy")(_blocks(N * H * hd), (256,), (buf, dst, I32(N), I32(T), I32(H), I32(hd), I32(S), I32(col0),
                                                    I32(back)))


def naive_scratch(B, T, Hq, Hkv, hd):
    z = lambda *s: cp.empty(s, np.float32)
    return dict(q=z(B, Hq, T, hd), k=z(B, Hkv, T, hd), v=z(B, Hkv, T, hd), o=z(B, Hq, T, hd),
                do=z(B, Hq, T, hd), dq=z(B, Hq, T, hd), dk=z(B, Hkv, T, hd), dv=z(B, Hkv, T, hd),
                dp=z(B, Hq, T, T))


def naive_fwd(qkv, out, P, ws, B, T, Hq, Hkv, hd):
    """P (B, Hq, T, T): the probabilities, kept for the backward pass."""
    G, Cq, Ck = Hq // Hkv, Hq * hd, Hkv * hd
    _heads_copy(qkv, ws["q"], T, Hq, hd, 0)
    _heads_copy(qkv, ws["k"], T, Hkv, hd, Cq)
    _heads_copy(qkv, ws["v"], T, Hkv, hd, Cq + Ck)
    qg = ws["q"].reshape(B * Hkv, G * T, hd)
    Pg = P.reshape(B * Hkv, G * T, T)
    bmm(Pg, qg, ws["k"].reshape(B * Hkv, T, hd), tb=True, alpha=1.0 / math.sqrt(hd))   # S = Q K^T * scale
    _k("causal_softmax")((B * Hq * T,), (128,), (P, I32(T)))
    bmm(ws["o"].reshape(B * Hkv, G * T, hd), Pg, ws["v"].reshape(B * Hkv, T, hd))     # O = P V
    _heads_copy(out, ws["o"], T, Hq, hd, 0, back=True)


def naive_bwd(qkv, dout, P, dqkv, ws, B, T, Hq, Hkv, hd):
    G, Cq, Ck = Hq // Hkv, Hq * hd, Hkv * hd
    _heads_copy(qkv, ws["q"], T, Hq, hd, 0)                    # the scratch holds the last layer's heads
    _heads_copy(qkv, ws["k"], T, Hkv, hd, Cq)
    _heads_copy(qkv, ws["v"], T, Hkv, hd, Cq + Ck)
    _heads_copy(dout, ws["do"], T, Hq, hd, 0)
    dog = ws["do"].reshape(B * Hkv, G * T, hd)
    Pg, dPg = P.reshape(B * Hkv, G * T, T), ws["dp"].reshape(B * Hkv, G * T, T)
    bmm(ws["dv"].reshape(B * Hkv, T, hd), Pg, dog, ta=True)                           # dV = P^T dO
    bmm(dPg, dog, ws["v"].reshape(B * Hkv, T, hd), tb=True)                            # dP = dO V^T
    _k("softmax_bwd")((B * Hq * T,), (128,), (P, ws["dp"], I32(T), F32(1.0 / math.sqrt(hd))))
    bmm(ws["dq"].reshape(B * Hkv, G * T, hd), dPg, ws["k"].reshape(B * Hkv, T, hd))   # dQ = dS K
    bmm(ws["dk"].reshape(B * Hkv, T, hd), dPg, ws["q"].reshape(B * Hkv, G * T, hd), ta=True)   # dK = dS^T Q
    _heads_copy(dqkv, ws["dq"], T, Hq, hd, 0, back=True)
    _heads_copy(dqkv, ws["dk"], T, Hkv, hd, Cq, back=True)
    _heads_copy(dqkv, ws["dv"], T, Hkv, hd, Cq + Ck, back=True)


# ----------------------------------------------------------------------------------------------------
# 3. model: the forward and backward passes of CONTRACT.md over preallocated device buffers for one (B, T)

def _param_offsets(cfg):
    """name -> (start, end, shape) in the flat buffer: nanoeuler.param_shapes' order, no padding."""
    off, out = 0, {}
    for name, shape in pl.param_shapes(cfg):
        n = int(np.prod(shape))
        out[name] = (off, off + n, shape)
        off += n
    return out


class DeviceParams:
    """A flat float32 (or bf16) device buffer with the layout of nanoeuler.Params.flat and named views of it."""

    def __init__(self, cfg, flat=None, dtype=np.float32):
        self.cfg = cfg
        self.offsets = _param_offsets(cfg)
        self.flat = cp.zeros(pl.num_params(cfg), dtype) if flat is None else flat
        self.views = {n: self.flat[a:b].reshape(s) for n, (a, b, s) in self.offsets.items()}
        self._rows = {}

    def __getitem__(self, name):
        return self.views[name]

    def rows(self, first, last):
        """Consecutive matrices as one (rows, in) matrix: wq|wk|wv, w1|w3, heads.0..n (a view, made once)."""
        v = self._rows.get((first, last))
        if v is None:
            a, b = self.offsets[first][0], self.offsets[last][1]
            v = self._rows[(first, last)] = self.flat[a:b].reshape(-1, self.offsets[first][2][1])
        return v

    def upload(self, P):
        assert P.flat.shape == self.flat.shape
        self.flat.set(np.ascontiguousarray(P.flat, np.float32))

    def download(self):
        return pl.Params(self.cfg, np.float32, cp.asnumpy(self.flat))


PRECISIONS = ("bf16", "tf32", "fp32")
LOGIT_CHUNK = (1024, 4096)   # rows of the bf16 path's logits per chunk: N/4 within these bounds; their gradient
                             # is written over them: for big (n_mtp*V = 20,480) 80 MiB at B=16, 160 MiB at B=64


def logit_chunk(N):
    """Rows of one chunk of the bf16 path's logits (LOGIT_CHUNK). The heads' three products run nearer
    cuBLAS's speed in longer chunks (dhf's output, chunk x 768, has few tiles): big's 8,192 rows (B=16) on an
    H200 take 1.30 / 1.09 / 1.02 / 1.05 ms in chunks of 1,024 / 2,048 / 4,096 / 8,192 rows (N/2 would
    take B=16's peak memory past 5.44 GiB for its 0.2 ms)."""
    return min(N, max(LOGIT_CHUNK[0], min(LOGIT_CHUNK[1], N // 4)))


def check_precision(precision, cfg, attn, explicit=True):
    """The precision a run uses: bf16 needs the tensor-core flash kernel (flash attention, head dims 32, 64,
    128, F even). Asked for explicitly, anything else is an error; as the default it falls back to tf32."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    why, fallback, prof = None, "tf32", PROFILE
    if prof is not None and precision != "fp32" and not prof.bf16:
        why, fallback = (f"{precision} needs the tensor cores of sm_80 or newer (A100, RTX 30/40 series, L4, H100); "
                         f"this GPU ({prof.name}, {prof.arch}) runs --precision fp32"), "fp32"
    elif precision == "bf16":
        if attn != "flash":
            why = "the bf16 path runs flash attention only (--attn naive needs --precision tf32 or fp32)"
        elif cfg.head_dim not in BF16_HEAD_DIMS or cfg.ffn % 2:
            why = (f"bf16 flash attention supports head dims {', '.join(map(str, BF16_HEAD_DIMS))}, this config "
                   f"has {cfg.head_dim}; use --precision tf32 or fp32")
        elif prof is not None and not flash_fits(cfg.head_dim, True, prof=prof):
            why = (f"bf16 flash attention at head dim {cfg.head_dim} takes more shared memory a block than "
                   f"{prof.name} has ({prof.smem_block >> 10} KB); use --precision tf32 or fp32")
    if why and explicit:
        raise UserError(why)
    if why:
        print(f"precision: {fallback}, not the default {precision} ({why})", flush=True)
        return fallback
    return precision


class Model:
    """Device buffers for batches of (B, T) and the passes over them. attn: 'flash' or 'naive';
    precision: 'fp32' / 'tf32' (fp32 buffers; TF32 is cuBLAS's math mode, set_tf32) or 'bf16' (mixed:
    self.P fp32 master weights and self.Pb their bf16 copy, bf16 activations, fp32 residual stream)."""

    def __init__(self, cfg, B, T, attn="flash", train=True, params=None, precision="fp32"):
        gpu()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
            raise UserError(f"config {cfg}: dim must split into heads, and query heads into kv groups")
        check_width(cfg)
        if T > cfg.ctx:
            raise UserError(f"--seq {T} is longer than the context of {cfg.ctx}")
        self.bf = check_precision(precision, cfg, attn) == "bf16"
        if attn == "flash" and not self.bf and cfg.head_dim not in (32, 64):
            raise UserError(f"fp32 flash attention supports head dims 32 and 64, this config has {cfg.head_dim} "
                            "(use --attn naive, or --precision bf16)")
        if attention_for(attn, cfg, self.bf, train) != attn:
            print(f"attention: naive, not flash (fp32 flash attention at head dim {cfg.head_dim} takes more shared "
                  f"memory a block than {PROFILE.name} has, {PROFILE.smem_block >> 10} KB)", flush=True)
            attn = "naive"
        self.cfg, self.B, self.T, self.attn, self.train, self.precision = cfg, B, T, attn, train, precision
        self.P = params if params is not None else DeviceParams(cfg)
        self.G = DeviceParams(cfg) if train else None
        self.Pb = DeviceParams(cfg, dtype=BF) if self.bf else None
        self.on_grads = None        # several GPUs: distributed.ZeRO's hook, see _grads_done
        self._inputs()
        (self._alloc_bf16 if self.bf else self._alloc_fp32)()

    def load(self, P):
        """Host Params -> the device weights (and their bf16 copy)."""
        self.P.upload(P)
        self.weights_changed()

    def weights_changed(self):
        """Call after writing self.P other than through AdamW: refreshes the bf16 copy."""
        if self.Pb is not None:
            to_bf16(self.P.flat, self.Pb.flat)

    def _inputs(self):
        cfg, N, V, K = self.cfg, self.B * self.T, self.cfg.vocab, self.cfg.n_mtp
        self.N = N
        hd = cfg.head_dim
        self.S = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
        cos, sin = pl.rope_tables(cfg.ctx, hd, np.float64)
        self.cos, self.sin = cp.asarray(cos.astype(np.float32)), cp.asarray(sin.astype(np.float32))
        # inputs, uploaded in one copy per step: idx | targets | order | starts | (scales, 1/counts) as bits
        self.inp = cp.zeros(3 * N + V + 1 + 2 * K, np.int32)
        # two pinned host staging buffers, so the upload is an asynchronous copy in stream order and the
        # host never waits for the GPU between steps; an event guards the reuse of each buffer
        self._stage = [_pinned(self.inp.size) for _ in range(2)]
        self._stage_ev, self._stage_i = [None, None], 0
        self.idx, self.tgt = self.inp[:N], self.inp[N:2 * N]
        self.order, self.starts = self.inp[2 * N:3 * N], self.inp[3 * N:3 * N + V + 1]
        w = self.inp[3 * N + V + 1:].view(np.float32)
        self.scales, self.inv_count = w[:K], w[K:]

    def _alloc_bf16(self):
        """Saved per layer: the fp32 residual stream entering it (xs) and after its attention step (xm), their
        rstd, the bf16 normed inputs h1, h2, q|k|v (rotated), the attention output, [g | u] and silu(g) * u
        (recomputing it in the backward pass cost more time, 0.5 ms a step at B=64, than its N x F bf16 a layer
        cost memory); lse. Not saved: the logits, made and consumed chunk by chunk."""
        cfg, B, T, N = self.cfg, self.B, self.T, self.N
        D, F, V, L, K = cfg.dim, cfg.ffn, cfg.vocab, cfg.n_layers, cfg.n_mtp
        Hq, Cq = cfg.n_heads, cfg.n_heads * cfg.head_dim
        f32 = lambda *s: cp.empty(s, np.float32)
        b16 = lambda *s: cp.empty(s, BF)
        self.xs = [f32(N, D) for _ in range(L + 1)]
        self.xm = [f32(N, D) for _ in range(L)]
        self.h1, self.h2 = [b16(N, D) for _ in range(L)], [b16(N, D) for _ in range(L)]
        self.r1, self.r2 = [f32(N) for _ in range(L)], [f32(N) for _ in range(L)]
        self.qkv = [b16(N, self.S) for _ in range(L)]
        self.att = [b16(N, Cq) for _ in range(L)]
        self.lse = [f32(B, Hq, T) for _ in range(L)]
        self.gu = [b16(N, 2 * F) for _ in range(L)]       # [g | u]; the backward writes [dg | du] over it
        self.act = [b16(N, F) for _ in range(L)] if self.train else [b16(N, F)] * L    # silu(g) * u
        self.hf, self.rf = b16(N, D), f32(N)
        self.chunk = logit_chunk(N)
        self.lchunk = b16(self.chunk, K * V)              # a chunk's logits, then their gradient
        self.rowloss, self.ce = f32(K, N), cp.zeros(K, np.float32)
        self.tmp = b16(N, D)                              # a @ wo.T, act @ w2.T before the fused residual add
        if self.train:
            self.dx, self.dxb = f32(N, D), b16(N, D)      # the residual's gradient, fp32 and its bf16 copy
            self.dh = b16(N, D)                             # a branch's gradient into its RMSNorm (GEMM output)
            self.da, self.dqkv, self.dact = b16(N, Cq), b16(N, self.S), b16(N, F)
            self.fws = flash_bf16_scratch(B, T, Hq)          # the attention backward's D and dS
            self.part = f32(rms_part_rows(N), D)
        # the chunks' views, made once (each CuPy view costs host time in every step)
        self.chunks = [(n0, self.lchunk[:min(self.chunk, N - n0)], self.hf[n0:n0 + self.chunk],
                        self.dh[n0:n0 + self.chunk] if self.train else None) for n0 in range(0, N, self.chunk)]

    def _alloc_fp32(self):
        cfg, B, T, N, S, attn = self.cfg, self.B, self.T, self.N, self.S, self.attn
        D, F, V, L, K = cfg.dim, cfg.ffn, cfg.vocab, cfg.n_layers, cfg.n_mtp
        hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        Cq = Hq * hd
        e = lambda *s: cp.empty(s, np.float32)
        # activations saved for the backward pass
        self.xs = [e(N, D) for _ in range(L + 1)]     # residual stream entering each layer; xs[L] final
        self.xm = [e(N, D) for _ in range(L)]         # after the attention step
        self.h1, self.h2 = [e(N, D) for _ in range(L)], [e(N, D) for _ in range(L)]
        self.r1, self.r2 = [e(N) for _ in range(L)], [e(N) for _ in range(L)]
        self.qkv = [e(N, S) for _ in range(L)]        # q and k rotated
        self.att = [e(N, Cq) for _ in range(L)]
        self.lse = [e(B, Hq, T) for _ in range(L)] if attn == "flash" else None
        self.probs = [e(B, Hq, T, T) for _ in range(L)] if attn == "naive" else None
        self.gu = [e(N, 2 * F) for _ in range(L)]     # [g | u]; the backward writes [dg | du] over it
        self.act = [e(N, F) for _ in range(L)]
        self.hf, self.rf = e(N, D), e(N)
        self.logits = e(N, K * V)                     # all heads from one GEMM; dlogits in place
        self.rowloss, self.ce = e(K, N), cp.zeros(K, np.float32)
        self.tmp = e(N, D)                            # a @ wo.T, act @ w2.T before the fused residual add
        self.nws = naive_scratch(B, T, Hq, Hkv, hd) if attn == "naive" else None
        if self.train:
            self.dx, self.dh, self.da = e(N, D), e(N, D), e(N, Cq)
            self.dqkv, self.dact = e(N, S), e(N, F)
            self.Dv = e(B, Hq, T)
            self.dqp = e((T + 63) // 64, N, Cq) if attn == "flash" else None
            self.part = e(rms_part_rows(N), D)

    # --- inputs ---
    def set_batch(self, x, y=None, want_grad=False):
        """x, y (B, T) int32 host arrays; one host-to-device copy."""
        cfg, N, V, K = self.cfg, self.N, self.cfg.vocab, self.cfg.n_mtp
        assert x.shape == (self.B, self.T), (x.shape, self.B, self.T)
        if x.min() < 0 or x.max() >= V:
            raise UserError(f"token ids must lie in 0..{V - 1}")
        i = self._stage_i
        self._stage_i ^= 1
        if self._stage_ev[i] is not None:
            self._stage_ev[i].synchronize()          # its previous copy has left the buffer
        buf = self._stage[i]
        buf[:] = 0
        buf[:N] = x.reshape(-1)
        if y is not None:
            buf[N:2 * N] = y.reshape(-1)
            sc, inv = loss_weights(y, K, cfg.mtp_weight)
            buf[3 * N + V + 1:] = np.concatenate([sc, inv]).view(np.int32)
        if want_grad:
            order, starts = sort_tokens(x, V)
            buf[2 * N:3 * N], buf[3 * N:3 * N + V + 1] = order, starts
        self.inp.set(buf, stream=cp.cuda.get_current_stream())
        ev = cp.cuda.Event()
        ev.record()
        self._stage_ev[i] = ev

    # --- forward ---
    def forward(self, want_loss=True, want_grad=False):
        """Runs the model on the uploaded batch; with want_loss, self.ce holds the per-head CE on the
        device and (with want_grad) self.logits the gradient of the objective with respect to them (the
        bf16 path instead does the heads' backward here, chunk by chunk: G's heads and self.dh)."""
        if self.bf:
            return self._forward_bf16(want_loss, want_grad)
        cfg, P, B, T = self.cfg, self.P, self.B, self.T
        L, hd, Hq, Hkv = cfg.n_layers, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        embed_fwd(P["tok_emb"], self.idx, self.xs[0])
        rmsnorm_fwd(self.xs[0], P["layers.0.attn_norm"], self.h1[0], self.r1[0])
        for l in range(L):
            p = f"layers.{l}."
            mm(self.qkv[l], self.h1[l], P.rows(p + "wq", p + "wv"), tb=True)           # (N, S)
            rope(self.qkv[l], self.cos, self.sin, T, Hq + Hkv, hd)
            if self.attn == "flash":
                flash_fwd(self.qkv[l], self.att[l], self.lse[l], B, T, Hq, Hkv, hd)
            else:
                naive_fwd(self.qkv[l], self.att[l], self.probs[l], self.nws, B, T, Hq, Hkv, hd)
            mm(self.tmp, self.att[l], P[p + "wo"], tb=True)
            rmsnorm_fwd(self.xs[l], P[p + "ffn_norm"], self.h2[l], self.r2[l], add=self.tmp, xout=self.xm[l])
            mm(self.gu[l], self.h2[l], P.rows(p + "w1", p + "w3"), tb=True)            # (N, 2F)
            swiglu_fwd(self.gu[l], self.act[l])
            mm(self.tmp, self.act[l], P[p + "w2"], tb=True)
            last = l == L - 1
            rmsnorm_fwd(self.xm[l], P["norm" if last else f"layers.{l + 1}.attn_norm"],
                        self.hf if last else self.h1[l + 1], self.rf if last else self.r1[l + 1],
                        add=self.tmp, xout=self.xs[l + 1])
        if not want_loss:
            return
        mm(self.logits, self.hf, P.rows("heads.0", f"heads.{cfg.n_mtp - 1}"), tb=True)  # (N, K*V)
        xent(self.logits, self.tgt, self.scales, self.rowloss, T, cfg.n_mtp, want_grad)
        loss_reduce(self.rowloss, self.inv_count, self.ce)

    # --- backward: gradients into self.G (every tensor is written, none accumulated across steps) ---
    def backward(self):
        if self.bf:
            return self._backward_bf16()
        cfg, P, G, B, T = self.cfg, self.P, self.G, self.B, self.T
        L, hd, Hq, Hkv = cfg.n_layers, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        heads = ("heads.0", f"heads.{cfg.n_mtp - 1}")
        mm(G.rows(*heads), self.logits, self.hf, ta=True)                   # dHeads = dlogits^T hf
        mm(self.dh, self.logits, P.rows(*heads))                            # dhf = dlogits Heads
        rmsnorm_bwd(self.dh, self.xs[L], P["norm"], self.rf, self.dx, G["norm"], self.part, accumulate=False)
        self._grads_done("norm")
        for l in reversed(range(L)):
            p = f"layers.{l}."
            # Euler step 2: x = x + swiglu(h2 @ [w1|w3].T) @ w2.T
            mm(G[p + "w2"], self.dx, self.act[l], ta=True)
            mm(self.dact, self.dx, P[p + "w2"])
            swiglu_bwd(self.dact, self.gu[l])                               # gu[l] now holds [dg | du]
            mm(G.rows(p + "w1", p + "w3"), self.gu[l], self.h2[l], ta=True)
            mm(self.dh, self.gu[l], P.rows(p + "w1", p + "w3"))
            rmsnorm_bwd(self.dh, self.xm[l], P[p + "ffn_norm"], self.r2[l], self.dx, G[p + "ffn_norm"], self.part)
            # Euler step 1: x = x + attention(rope(h1 @ [wq|wk|wv].T)) @ wo.T
            mm(G[p + "wo"], self.dx, self.att[l], ta=True)
            mm(self.da, self.dx, P[p + "wo"])
            if self.attn == "flash":
                flash_bwd(self.qkv[l], self.att[l], self.da, self.lse[l], self.dqkv, self.Dv, self.dqp,
                          B, T, Hq, Hkv, hd)
            else:
                naive_bwd(self.qkv[l], self.da, self.probs[l], self.dqkv, self.nws, B, T, Hq, Hkv, hd)
            rope(self.dqkv, self.cos, self.sin, T, Hq + Hkv, hd, sign=-1.0)
            mm(G.rows(p + "wq", p + "wv"), self.dqkv, self.h1[l], ta=True)
            mm(self.dh, self.dqkv, P.rows(p + "wq", p + "wv"))
            rmsnorm_bwd(self.dh, self.xs[l], P[p + "attn_norm"], self.r1[l], self.dx, G[p + "attn_norm"], self.part)
            self._grads_done(p + "attn_norm")
        embed_bwd(self.dx, self.order, self.starts, G["tok_emb"])
        self._grads_done("tok_emb")

    def _grads_done(self, name):
        """Every gradient from tensor `name` to the end of the flat layout is final: on several GPUs the hook
        (distributed.ZeRO.reduce) starts reducing them while the backward goes on."""
        if self.on_grads is not None:
            self.on_grads(self.G.offsets[name][0])

    # --- the bf16 path: bf16 GEMM inputs (Pb, activations), fp32 accumulation, fp32 residual stream ---
    def _forward_bf16(self, want_loss, want_grad):
        cfg, P, Pb, B, T = self.cfg, self.P, self.Pb, self.B, self.T
        L, hd, Hq, Hkv = cfg.n_layers, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        embed_fwd(P["tok_emb"], self.idx, self.xs[0])                       # fp32 rows of the master weights
        rmsnorm_fwd(self.xs[0], P["layers.0.attn_norm"], self.h1[0], self.r1[0])
        for l in range(L):
            p = f"layers.{l}."
            mm(self.qkv[l], self.h1[l], Pb.rows(p + "wq", p + "wv"), tb=True)          # (N, S) bf16
            rope(self.qkv[l], self.cos, self.sin, T, Hq + Hkv, hd)
            flash_bf16_fwd(self.qkv[l], self.att[l], self.lse[l], B, T, Hq, Hkv, hd)
            mm(self.tmp, self.att[l], Pb[p + "wo"], tb=True)                          # bf16 branch
            rmsnorm_fwd(self.xs[l], P[p + "ffn_norm"], self.h2[l], self.r2[l], add=self.tmp, xout=self.xm[l])
            mm(self.gu[l], self.h2[l], Pb.rows(p + "w1", p + "w3"), tb=True)           # (N, 2F) bf16
            swiglu_fwd(self.gu[l], self.act[l])
            mm(self.tmp, self.act[l], Pb[p + "w2"], tb=True)
            last = l == L - 1
            rmsnorm_fwd(self.xm[l], P["norm" if last else f"layers.{l + 1}.attn_norm"],
                        self.hf if last else self.h1[l + 1], self.rf if last else self.r1[l + 1],
                        add=self.tmp, xout=self.xs[l + 1])
        if want_loss:
            self._loss_head_bf16(want_grad)

    def _loss_head_bf16(self, want_grad):
        """Logits + MTP cross-entropy, fused and chunked over rows: per chunk one GEMM makes the logits of all
        heads (bf16, as autocast has them; 0.5 ms less a B=64 step than fp32), xent_chunk the loss from fp32
        statistics (max, sum of exp, log-sum-exp) and the bf16 gradient over the logits, and (want_grad) two GEMMs
        take the chunk's share of dHeads (accumulated over the chunks in order: deterministic) and its rows of
        dhf. Only a (chunk, n_mtp*V) block of logits ever exists."""
        T, K = self.T, self.cfg.n_mtp
        heads = ("heads.0", f"heads.{K - 1}")
        Wb = self.Pb.rows(*heads)                                            # (K*V, D) bf16
        for n0, lg, hf, dh in self.chunks:
            mm(lg, hf, Wb, tb=True)
            xent_chunk(lg, lg, self.tgt, self.scales, self.rowloss, n0, T, K, want_grad)   # dl over the logits
            if want_grad:
                mm(self.G.rows(*heads), lg, hf, ta=True, beta=1.0 if n0 else 0.0)   # dHeads (+)= dl^T hf
                mm(dh, lg, Wb)                                                     # dhf rows (bf16)
        loss_reduce(self.rowloss, self.inv_count, self.ce)

    def _backward_bf16(self):
        """After _forward_bf16(want_grad=True), which left dhf in self.dh and the heads' gradient in G."""
        cfg, P, Pb, G, B, T = self.cfg, self.P, self.Pb, self.G, self.B, self.T
        L, hd, Hq, Hkv = cfg.n_layers, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        rmsnorm_bwd(self.dh, self.xs[L], P["norm"], self.rf, self.dx, G["norm"], self.part, accumulate=False,
                    dxb=self.dxb)
        self._grads_done("norm")
        for l in reversed(range(L)):
            p = f"layers.{l}."
            # Euler step 2: x = x + swiglu(h2 @ [w1|w3].T) @ w2.T
            mm(self.dact, self.dxb, Pb[p + "w2"])
            swiglu_bwd(self.dact, self.gu[l])                               # gu[l] <- [dg | du]
            mm(G[p + "w2"], self.dxb, self.act[l], ta=True)
            mm(G.rows(p + "w1", p + "w3"), self.gu[l], self.h2[l], ta=True)
            mm(self.dh, self.gu[l], Pb.rows(p + "w1", p + "w3"))
            rmsnorm_bwd(self.dh, self.xm[l], P[p + "ffn_norm"], self.r2[l], self.dx, G[p + "ffn_norm"], self.part,
                        dxb=self.dxb)
            # Euler step 1: x = x + attention(rope(h1 @ [wq|wk|wv].T)) @ wo.T
            mm(G[p + "wo"], self.dxb, self.att[l], ta=True)
            mm(self.da, self.dxb, Pb[p + "wo"])
            flash_bf16_bwd(self.qkv[l], self.att[l], self.da, self.lse[l], self.dqkv, self.fws, self.cos, self.sin,
                           B, T, Hq, Hkv, hd)                                  # dq, dk rotated back
            mm(G.rows(p + "wq", p + "wv"), self.dqkv, self.h1[l], ta=True)
            mm(self.dh, self.dqkv, Pb.rows(p + "wq", p + "wv"))
            rmsnorm_bwd(self.dh, self.xs[l], P[p + "attn_norm"], self.r1[l], self.dx, G[p + "attn_norm"], self.part,
                        dxb=self.dxb if l else None)
            self._grads_done(p + "attn_norm")
        embed_bwd(self.dx, self.order, self.starts, G["tok_emb"])
        self._grads_done("tok_emb")

    def losses(self):
        """(objective, per-head CE) from the device (a sync)."""
        ces = [float(c) for c in cp.asnumpy(self.ce)]
        return pl.mtp_objective(ces, self.cfg.mtp_weight), ces

    def batch_loss(self, x, y):
        """Head-0 CE of one batch, forward only (validation)."""
        self.set_batch(x, y)
        self.forward(want_loss=True, want_grad=False)
        return self.losses()[1][0]


# ----------------------------------------------------------------------------------------------------
# 4. optimiser: AdamW (nanoeuler.AdamW's update rule) with the moments on the device, Muon, and their kernels

# --- optimiser: global gradient norm (float64 partial sums in a fixed order), then one fused AdamW
#     launch over the flat buffer. Weight decay on matrices and the embedding only: the norm weights sit
#     at fixed offsets of each layer's block (attn_norm at 0, ffn_norm at ffn_off) and after the layers ---

OPTIM_SRC = cuda_source("optim", ["sumsq_partial", "sumsq_final", "adamw", "adamw_bf16", "to_bf16"], r"""
extern "C" __global__ void sumsq_partial(const float* __restrict__ g, i64 n, double* __restrict__ part) {
    double acc = 0.0;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        acc += (double)g[i] * g[i];
    double s = block_sum_f64(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
extern "C" __global__ void sumsq_final(const double* __restrict__ part, int np, float* __restrict__ norm) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        double s = 0.0;
        for (int i = 0; i < np; i++) s += part[i];
        norm[0] = (float)sqrt(s);
    }
}
// AdamW over the flat buffer in one pass; with WB (the bf16 path) it also writes the bf16 copy of each
// updated weight that the GEMMs read, so the copy never needs a pass of its own. VEC 4 (the bf16 path, the whole
// flat buffer): 16-byte accesses, 1.05 -> 0.93 ms for big on an H200; the layout's offsets are multiples of 4,
// so the decay mask is the same for the 4 (the host checks). VEC 1: ZeRO's pieces start anywhere
template <bool WB, int VEC>
__device__ __forceinline__ void adamw_body(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
        float* __restrict__ v, bf16* __restrict__ pb, const float* __restrict__ norm, i64 n,
        const float* __restrict__ hyper, float beta1, float beta2, float eps, float wd,
        float clip, i64 layers_start, i64 layer_size, int n_layers, i64 ffn_off, int D, int skip_matrices) {
    const float gscale = fminf(1.f, clip / (norm[0] + 1e-6f));      // global norm clipping
    const float lr = hyper[0], bc1 = hyper[1], bc2 = hyper[2];      // the step's, on the device: a graph replays
    i64 layers_end = layers_start + layer_size * n_layers;
    for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < n / VEC; q += (i64)gridDim.x * blockDim.x) {
        const i64 i = q * VEC;
        float decay = 1.f;
        if (i >= layers_start && i < layers_end) {
            unsigned o = (unsigned)(i - layers_start) % (unsigned)layer_size;   // 32-bit: cheap
            if (o < D || (o >= ffn_off && o < ffn_off + D)) decay = 0.f;
            else if (skip_matrices) continue;                            // --optim muon: Muon updates them
        } else if (i >= layers_end && i < layers_end + D) decay = 0.f;
        float gs[VEC], ms[VEC], vs[VEC], ps[VEC];
        ldv<VEC>(g + i, gs); ldv<VEC>(m + i, ms); ldv<VEC>(v + i, vs); ldv<VEC>(p + i, ps);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            float gi = gs[k] * gscale;
            float mi = beta1 * ms[k] + (1.f - beta1) * gi;
            float vi = beta2 * vs[k] + (1.f - beta2) * gi * gi;
            ms[k] = mi;
            vs[k] = vi;
            float pi = ps[k];
            pi -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + wd * decay * pi);
            ps[k] = pi;
        }
        stv<VEC>(m + i, ms); stv<VEC>(v + i, vs); stv<VEC>(p + i, ps);
        if constexpr (WB) stv<VEC>(pb + i, ps);
    }
}
extern "C" __global__ void adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                 float* __restrict__ v, const float* __restrict__ norm, i64 n,
                                 const float* __restrict__ hyper, float beta1, float beta2, float eps, float wd,
                                 float clip, i64 layers_start, i64 layer_size, int n_layers, i64 ffn_off,
                                 int D, int skip_matrices) {
    adamw_body<false, 1>(p, g, m, v, nullptr, norm, n, hyper, beta1, beta2, eps, wd, clip, layers_start,
                         layer_size, n_layers, ffn_off, D, skip_matrices);
}
extern "C" __global__ void adamw_bf16(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                      float* __restrict__ v, bf16* __restrict__ pb, const float* __restrict__ norm,
                                      i64 n, const float* __restrict__ hyper, float beta1, float beta2, float eps,
                                      float wd, float clip, i64 layers_start, i64 layer_size, int n_layers,
                                      i64 ffn_off, int D, int skip_matrices) {
    adamw_body<true, 4>(p, g, m, v, pb, norm, n, hyper, beta1, beta2, eps, wd, clip, layers_start,
                        layer_size, n_layers, ffn_off, D, skip_matrices);
}
// the bf16 copy of fp32 weights (after an upload; AdamW keeps it current after that)
extern "C" __global__ void to_bf16(const float* __restrict__ x, bf16* __restrict__ y, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = f2bf(x[i]);
}
""")


def to_bf16(x, y):
    """y (bf16) = x (fp32), same number of elements."""
    assert x.size == y.size and y.dtype == BF
    _k("to_bf16")((min(PROFILE.sms * 8, max(1, (x.size + 255) // 256)),), (256,), (x, y, np.int64(x.size)))


class AdamW:
    def __init__(self, P, G, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, Pb=None, shard=None):
        """P, G: DeviceParams of the weights and their gradients (updated in place); Pb: the bf16 copy of P
        (the bf16 path), rewritten by the same kernel pass. shard: ZeRO-1 on several GPUs (distributed.ZeRO), the
        size of this rank's shard of the moments, which it updates piece by piece with update()."""
        cfg = P.cfg
        self.P, self.G, self.beta1, self.beta2, self.eps, self.wd, self.clip = P, G, beta1, beta2, eps, weight_decay, clip
        self.Pb = Pb
        self.m, self.v = ((DeviceParams(cfg), DeviceParams(cfg)) if shard is None else
                          (cp.zeros(shard, np.float32), cp.zeros(shard, np.float32)))
        self.step_count = 0
        self.nblk = 1024
        self.part = cp.zeros(self.nblk, np.float64)
        self.norm = cp.zeros(1, np.float32)
        self.hyper = cp.zeros(4, np.float32)          # the step's lr, 1 - beta1^t, 1 - beta2^t, Muon's lr (next_step)
        self.muon_ratio, self.skip_matrices = 0.0, 0  # Muon's rate over lr; 1: the AdamW pass leaves the matrices
        off = P.offsets
        self.layers_start = off["layers.0.attn_norm"][0]
        self.layer_size = off["layers.1.attn_norm"][0] - self.layers_start if cfg.n_layers > 1 else \
            off["norm"][0] - self.layers_start
        self.ffn_off = off["layers.0.ffn_norm"][0] - self.layers_start
        # the kernel finds the norm weights by offset arithmetic: check it covers exactly the 1-D tensors
        for name, (a, b, shape) in off.items():
            want = 0.0 if len(shape) == 1 else 1.0
            for i in {a, b - 1}:
                if self._decay_at(i, cfg.dim, cfg.n_layers) != want:
                    raise AssertionError(f"weight-decay layout wrong at {name}")

    def _decay_at(self, i, D, L):
        end = self.layers_start + self.layer_size * L
        if self.layers_start <= i < end:
            o = (i - self.layers_start) % self.layer_size
            return 0.0 if o < D or self.ffn_off <= o < self.ffn_off + D else 1.0
        return 0.0 if end <= i < end + D else 1.0

    def grad_norm(self, g, reduce=None):
        """self.norm = the L2 norm of g: float64 partial sums, then their sum in a fixed order. reduce(part), on
        several GPUs, first adds each partial sum over the ranks (g is then one rank's shard)."""
        n = g.size
        _k("sumsq_partial")((self.nblk,), (256,), (g, np.int64(n), self.part))
        if reduce is not None:
            reduce(self.part)
        _k("sumsq_final")((1,), (32,), (self.part, I32(self.nblk), self.norm))

    def step(self, lr):
        """Clips the global gradient norm to self.clip and updates the parameters (all on the device)."""
        self.next_step(lr)
        self.apply()

    def next_step(self, lr):
        """Counts a step; its lr and bias corrections to the device, where the update kernel reads them, so
        that a captured step replays with each step's values. A copy on the current stream."""
        self.step_count += 1
        t = self.step_count
        self.hyper.set(np.array([lr, 1.0 - self.beta1 ** t, 1.0 - self.beta2 ** t, lr * self.muon_ratio], np.float32))

    def apply(self):
        """The gradient norm and the update with the hyper-parameters on the device: capturable."""
        self.grad_norm(self.G.flat)
        self.update(self.P.flat, self.G.flat, self.m.flat, self.v.flat, None if self.Pb is None else self.Pb.flat)

    def update(self, p, g, m, v, pb, first=0):
        """One fused AdamW pass, clipped by self.norm, over a range of the flat layout that starts at element
        `first` (p, g, m, v and the bf16 copy pb or None: that range of each); the decay mask moves with it."""
        cfg = self.P.cfg
        head = (p, g, m, v) + ((pb,) if pb is not None else ())
        if pb is not None:                               # adamw_bf16's float4s: see its comment
            assert (p.size | first | self.layers_start | self.layer_size | self.ffn_off | cfg.dim) % 4 == 0 and \
                all(a.data.ptr % 16 == 0 for a in head[:4]) and pb.data.ptr % 8 == 0
        _k("adamw_bf16" if pb is not None else "adamw")(
            (PROFILE.sms * 8,), (256,), head + (self.norm, np.int64(p.size), self.hyper, F32(self.beta1), F32(self.beta2),
                                        F32(self.eps), F32(self.wd), F32(self.clip),
                                        np.int64(self.layers_start - first), np.int64(self.layer_size),
                                        I32(cfg.n_layers), np.int64(self.ffn_off), I32(cfg.dim),
                                        I32(self.skip_matrices)))


# --- Muon (--optim muon, CONTRACT.md; nanoeuler.Muon's update rule): the blocks' matrices, each kind (wq of every
#     layer, wk of every layer, ...) L matrices one layer's stride apart in the flat buffer. Per kind: the
#     momentum and the partial sums of squares of the Nesterov mix u (muon_momentum), then X = u / (|u|_F + eps)
#     into a batch of the kinds of one shape (muon_x); five Newton-Schulz steps on that batch as strided-batched
#     GEMMs, bf16 operands with fp32 accumulation on the bf16 path (as nanochat's muon.py and modded-nanogpt
#     run it), fp32 on the others; then p -= lr_muon * max(1, rows/cols)^0.5 * X (muon_apply, with the bf16
#     copy of the weights on the bf16 path). A step X <- a X + (b A + c A^2) X with A = X X^T is three GEMMs
#     and one elementwise pass: A = X X^T; Bm = c A A; Bm += b A + a I (muon_poly); X' = Bm X. A tall X (w1,
#     w3) takes the same step on its transpose without moving it: A = X^T X, X' = X Bm (Bm is symmetric), so
#     every pass reads and writes in the weights' own order. Grid (MUON_PARTS, L): a block per part of one
#     matrix, so each matrix's sum of squares is MUON_PARTS partial sums added in a fixed order. ---

MUON_SRC = cuda_source("muon", ["muon_momentum", "muon_x_f32", "muon_x_bf16", "muon_poly_f32", "muon_poly_bf16",
                                "muon_apply_f32", "muon_apply_bf16"], r"""
// m <- mu m + (1 - mu) g' and the block's part of sum(u^2), u = (1 - mu) g' + mu m, g' the clipped gradient
extern "C" __global__ void muon_momentum(const float* __restrict__ g, float* __restrict__ m,
                                         const float* __restrict__ norm, float clip, float mu, i64 base,
                                         i64 layer_size, int n, double* __restrict__ part) {
    const float gscale = fminf(1.f, clip / (norm[0] + 1e-6f));      // AdamW's clip, the same expression
    const i64 off = base + layer_size * blockIdx.y;
    double acc = 0.0;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        float gi = g[off + e] * gscale;
        float mi = mu * m[off + e] + (1.f - mu) * gi;
        m[off + e] = mi;
        float u = (1.f - mu) * gi + mu * mi;
        acc += (double)u * u;
    }
    double s = block_sum_f64(acc);
    if (threadIdx.x == 0) part[(i64)blockIdx.y * gridDim.x + blockIdx.x] = s;
}
// X[l] = u / (sqrt(sum of the matrix's parts) + eps), u recomputed as muon_momentum made it (m already updated)
template <typename T>
__device__ __forceinline__ void muon_x_body(const float* __restrict__ g, const float* __restrict__ m,
        const float* __restrict__ norm, float clip, float mu, i64 base, i64 layer_size, int n,
        const double* __restrict__ part, float eps, T* __restrict__ X) {
    const float gscale = fminf(1.f, clip / (norm[0] + 1e-6f));
    const i64 off = base + layer_size * blockIdx.y;
    double s = 0.0;
    for (int i = 0; i < (int)gridDim.x; i++) s += part[(i64)blockIdx.y * gridDim.x + i];
    const float den = (float)(sqrt(s) + (double)eps);
    T* x = X + (i64)blockIdx.y * n;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x)
        stf(x + e, ((1.f - mu) * (g[off + e] * gscale) + mu * m[off + e]) / den);
}
extern "C" __global__ void muon_x_f32(const float* __restrict__ g, const float* __restrict__ m,
        const float* __restrict__ norm, float clip, float mu, i64 base, i64 layer_size, int n,
        const double* __restrict__ part, float eps, float* __restrict__ X) {
    muon_x_body<float>(g, m, norm, clip, mu, base, layer_size, n, part, eps, X);
}
extern "C" __global__ void muon_x_bf16(const float* __restrict__ g, const float* __restrict__ m,
        const float* __restrict__ norm, float clip, float mu, i64 base, i64 layer_size, int n,
        const double* __restrict__ part, float eps, bf16* __restrict__ X) {
    muon_x_body<bf16>(g, m, norm, clip, mu, base, layer_size, n, part, eps, X);
}
// Bm <- Bm + b A + a I over a batch of r x r matrices (Bm holds c A A)
template <typename T>
__device__ __forceinline__ void muon_poly_body(T* __restrict__ Bm, const T* __restrict__ A, int r, i64 total,
                                               float a, float b) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        int j = (int)(i % ((i64)r * r));
        stf(Bm + i, ldf(Bm + i) + b * ldf(A + i) + (j / r == j % r ? a : 0.f));
    }
}
extern "C" __global__ void muon_poly_f32(float* __restrict__ Bm, const float* __restrict__ A, int r, i64 total,
                                         float a, float b) {
    muon_poly_body<float>(Bm, A, r, total, a, b);
}
extern "C" __global__ void muon_poly_bf16(bf16* __restrict__ Bm, const bf16* __restrict__ A, int r, i64 total,
                                          float a, float b) {
    muon_poly_body<bf16>(Bm, A, r, total, a, b);
}
// p -= lr_muon * scale * X[l], lr_muon = hyper[3]; WB: the bf16 copy too
template <typename T, bool WB>
__device__ __forceinline__ void muon_apply_body(float* __restrict__ p, bf16* __restrict__ pb,
        const T* __restrict__ X, const float* __restrict__ hyper, float scale, i64 base, i64 layer_size, int n) {
    const float step = hyper[3] * scale;
    const i64 off = base + layer_size * blockIdx.y;
    const T* x = X + (i64)blockIdx.y * n;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        float pi = p[off + e] - step * ldf(x + e);
        p[off + e] = pi;
        if (WB) pb[off + e] = f2bf(pi);
    }
}
extern "C" __global__ void muon_apply_f32(float* __restrict__ p, const float* __restrict__ X,
        const float* __restrict__ hyper, float scale, i64 base, i64 layer_size, int n) {
    muon_apply_body<float, false>(p, nullptr, X, hyper, scale, base, layer_size, n);
}
extern "C" __global__ void muon_apply_bf16(float* __restrict__ p, bf16* __restrict__ pb, const bf16* __restrict__ X,
        const float* __restrict__ hyper, float scale, i64 base, i64 layer_size, int n) {
    muon_apply_body<bf16, true>(p, pb, X, hyper, scale, base, layer_size, n);
}
""")
MUON_PARTS = 64     # blocks per matrix in the momentum, X and update passes (big: 64 x 16 = 1,024 blocks, 8 an SM)


def bmm_ex(C, A, B, ta=False, tb=False, alpha=1.0, beta=0.0):
    """mm over a batch, C (nb, M, N) = alpha op(A) @ op(B) + beta C per matrix, fp32 or bf16 (then fp32
    accumulation), in one cublasGemmStridedBatchedEx through ctypes (capturable, as _gemm_ex), or one mm per
    matrix where libcublas is not found."""
    nb, M, N = C.shape
    K = A.shape[1] if ta else A.shape[2]
    assert A.shape == ((nb, K, M) if ta else (nb, M, K)) and B.shape == ((nb, N, K) if tb else (nb, K, N)), \
        (C.shape, A.shape, B.shape, ta, tb)
    assert A.dtype == B.dtype == C.dtype and A.flags.c_contiguous and B.flags.c_contiguous and C.flags.c_contiguous
    lib = _blas_lib()
    if lib is None:
        for i in range(nb):
            mm(C[i], A[i], B[i], ta=ta, tb=tb, alpha=alpha, beta=beta)
        return
    fn = lib.cublasGemmStridedBatchedEx
    if fn.argtypes is None:
        import ctypes
        i, v, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
        fn.argtypes = [v, i, i, i, i, i, v, v, i, i, ll, v, i, i, ll, v, v, i, i, ll, i, i, i]
    t = _data_type(C)
    # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, as in mm
    err = fn(_handle, int(tb), int(ta), N, M, K, _ptr(alpha), B.data.ptr, t, B.shape[2], B.shape[1] * B.shape[2],
             A.data.ptr, t, A.shape[2], M * K, _ptr(beta), C.data.ptr, t, N, M * N, nb, CUBLAS_COMPUTE_32F,
             CUBLAS_GEMM_DEFAULT)
    if err:
        raise RuntimeError(f"cublasGemmStridedBatchedEx failed with status {err}")


def muon_scratch(cfg):
    """(most, gram): the elements of Muon's largest group of same-shape block matrices (every layer's) and of
    that group's Gram matrices, the largest: X and Xn take the first each, A and Bm the second."""
    shapes = dict(pl.param_shapes(cfg))
    sh = [tuple(shapes[f"layers.0.{w}"]) for w in pl.MUON_MATRICES]
    L = cfg.n_layers
    return max(sh.count(s) * L * s[0] * s[1] for s in sh), max(sh.count(s) * L * min(s) ** 2 for s in sh)


class Muon(AdamW):
    """--optim muon on the device: AdamW's pass (its clip, moments and decay) on the embedding, norms and heads,
    then Muon on the blocks' matrices (the kernels above), their momentum in self.m at their places, as the CPU
    engine keeps it. Its lr is the AdamW lr times muon_ratio, on the device (hyper[3]): a graph replays it."""

    def __init__(self, P, G, muon_ratio, Pb=None, momentum=pl.MUON_MOMENTUM):
        super().__init__(P, G, Pb=Pb)
        self.muon_ratio, self.skip_matrices, self.momentum = muon_ratio, 1, momentum
        L, dt = P.cfg.n_layers, BF if Pb is not None else np.float32
        groups = {}                                   # shape (rows, cols) -> the bases of its kinds
        for w in pl.MUON_MATRICES:
            base, _, shape = P.offsets[f"layers.0.{w}"]
            groups.setdefault(tuple(shape), []).append(base)
        self.groups = list(groups.items())
        most, gram = muon_scratch(P.cfg)
        # one set of scratch for the groups in turn (big, bf16: 2 x 50.3M + 2 x 18.9M elements, 0.28 GB)
        self.X, self.Xn, self.A, self.Bm = cp.empty(most, dt), cp.empty(most, dt), cp.empty(gram, dt), cp.empty(gram, dt)
        self.sums = cp.zeros(max(len(k) for _, k in self.groups) * L * MUON_PARTS, np.float64)

    def apply(self):
        super().apply()                               # the norm, and AdamW on all but the block matrices
        self.orthogonal_update()

    def orthogonal_update(self):
        L, bf, mu, clip = self.P.cfg.n_layers, self.Pb is not None, F32(self.momentum), F32(self.clip)
        a, b, c = pl.MUON_NS_COEFFS
        grid, stride = (MUON_PARTS, L), np.int64(self.layer_size)
        for (rows, cols), kinds in self.groups:
            nb, n, g, tall = len(kinds) * L, rows * cols, min(rows, cols), rows > cols
            X, Xn = self.X[:nb * n].reshape(nb, rows, cols), self.Xn[:nb * n].reshape(nb, rows, cols)
            A, Bm = self.A[:nb * g * g].reshape(nb, g, g), self.Bm[:nb * g * g].reshape(nb, g, g)
            for j, base in enumerate(kinds):
                part = self.sums[j * L * MUON_PARTS:]
                _k("muon_momentum")(grid, (256,), (self.G.flat, self.m.flat, self.norm, clip, mu, np.int64(base),
                                                   stride, I32(n), part))
                _k("muon_x_bf16" if bf else "muon_x_f32")(
                    grid, (256,), (self.G.flat, self.m.flat, self.norm, clip, mu, np.int64(base), stride, I32(n),
                                   part, F32(pl.MUON_NS_EPS), X[j * L:]))
            for _ in range(pl.MUON_NS_STEPS):
                bmm_ex(A, X, X, ta=tall, tb=not tall)                    # A = X X^T (tall: X^T X)
                bmm_ex(Bm, A, A, alpha=c)                                # c A^2
                _k("muon_poly_bf16" if bf else "muon_poly_f32")((min(PROFILE.sms * 8, _blocks(A.size)[0]),), (256,),
                                                                (Bm, A, I32(g), np.int64(A.size), F32(a), F32(b)))
                bmm_ex(Xn, X, Bm) if tall else bmm_ex(Xn, Bm, X)          # (a I + b A + c A^2) X (tall: X (..))
                X, Xn = Xn, X
            for j, base in enumerate(kinds):
                head = (self.P.flat,) + ((self.Pb.flat,) if bf else ())
                _k("muon_apply_bf16" if bf else "muon_apply_f32")(
                    grid, (256,), head + (X[j * L:], self.hyper, F32(pl.muon_scale((rows, cols))), np.int64(base),
                                          stride, I32(n)))


# ----------------------------------------------------------------------------------------------------
# 5. training: nanoeuler's train_loop, run set-up and SFT, with this engine's trainer; checkpoints in
# nanoeuler's format, so either engine resumes the other's run

TRAIN_DEFAULTS = dict(pl.TRAIN_DEFAULTS, config="big", steps=5000, batch=16, seq=512, lr=6e-4, warmup=200,
                      eval_every=500, sample_every=0, ckpt_every=5000, log_every=50, attn="flash", precision="bf16")
PRECISION_HELP = ("bf16: mixed precision (fp32 master weights and Adam moments, bf16 activations and matrix inputs, "
                  "tensor-core flash attention); tf32: fp32 storage, TF32 matrix products; fp32: the reference")


def add_precision_flag(p, default_note="bf16"):
    p.add_argument("--precision", choices=PRECISIONS, help=f"{PRECISION_HELP} (default {default_note})")


def add_model_flags(p):
    """--attn and --precision of the modes that run a loaded checkpoint (sft, dpo, eval)."""
    p.add_argument("--attn", choices=["flash", "naive"], default="flash", help="attention kernel (default flash)")
    add_precision_flag(p)


def precision_of(a, cfg):
    """add_model_flags' precision: as asked (an error where cfg or the device cannot run it), else bf16 where
    it can (the callers have run gpu(): the device's profile is known)."""
    return check_precision(a.precision or "bf16", cfg, a.attn, explicit=a.precision is not None)
DEFAULT_DATA = ("data/pretrain.bin", "data/web.txt", "data/gutenberg.txt")


def default_data():
    """The data pipeline's output if it exists, else None (nanoeuler's embedded default corpus)."""
    return next((p for p in (os.path.join(HERE, d) for d in DEFAULT_DATA) if os.path.isfile(p)), None)


class Trainer:
    """nanoeuler.train_loop's engine interface on the GPU. step() only queues work on the device: each
    step's per-head CE and gradient norm are copied into a row of a device history, and results() reads
    the rows since its last call in one transfer, the loop's only host sync (once per log interval).
    accum: micro-batches per step (x holds accum x B rows), their gradients and losses averaged; one GPU adds
    them up in opt.G, its own buffer. dp: a distributed.ZeRO (several GPUs), which reduces the gradients as
    the backward makes them and runs the sharded update."""
    sync_every_step = False

    def __init__(self, model, opt, accum=1, dp=None):
        self.model, self.opt, self.accum, self.dp, self.n = model, opt, accum, dp, 0
        self.rank, self.world = (dp.rank, dp.world) if dp is not None else (0, 1)
        self.hist = cp.zeros((64, model.cfg.n_mtp + 1), np.float32)
        # bf16 on one GPU without accumulation: the step's ~440 launches (forward, backward, AdamW) are captured
        # as a CUDA graph on a stream of their own at the second step, then replayed: one launch a step (B=16:
        # 498K -> 509K tokens/s on an H200; B=64, where the GPU is never short of queued work, +0.3%)
        self.graph, self.eager = None, 0
        self.stream = cp.cuda.Stream() if model.bf and accum == 1 and dp is None else None

    def step(self, x, y, lr):
        m, K, A, B = self.model, self.model.cfg.n_mtp, self.accum, self.model.B
        if self.n == len(self.hist):
            self.hist = cp.concatenate([self.hist, cp.zeros_like(self.hist)])
        if self.stream is not None:
            return self._graph_step(x, y, lr)
        loss = self.hist[self.n, :K]
        for i in range(A):
            if i and self.dp is not None:
                self.dp.wait_reduced()                 # the last micro-step's reductions have read m.G
            m.set_batch(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B], want_grad=True)
            m.forward(want_loss=True, want_grad=True)
            m.backward()
            if i == 0:
                loss[...] = m.ce
            else:
                loss += m.ce
            if A > 1 and self.dp is None:              # one GPU: g1 + g2 + .. in opt.G
                if i == 0:
                    self.opt.G.flat[...] = m.G.flat
                else:
                    self.opt.G.flat += m.G.flat
        if A > 1:
            loss *= 1.0 / A
            if self.dp is None:
                self.opt.G.flat *= 1.0 / A
        if self.dp is not None:
            self.dp.step(self.opt, lr, loss)
        else:
            self.opt.step(lr)
        self.hist[self.n, K:] = self.opt.norm
        self.n += 1

    def _graph_step(self, x, y, lr):
        """step() as a graph replay: the batch and the lr go to fixed device buffers first, the losses and the
        norm are copied into the history after."""
        m, opt, K = self.model, self.opt, self.model.cfg.n_mtp

        def body():
            m.forward(want_loss=True, want_grad=True)
            m.backward()
            opt.apply()
        with on_stream(self.stream):
            m.set_batch(x, y, want_grad=True)
            opt.next_step(lr)
            if self.graph is None and self.eager:          # warm: kernels compiled, shared memory raised
                self.graph = capture(self.stream, body, "the training step")
                if self.graph is None:
                    self.stream = None
            if self.graph is not None:
                self.graph.launch(self.stream)
            else:
                body()
                self.eager += 1
            self.hist[self.n, :K] = m.ce
            self.hist[self.n, K:] = opt.norm
        self.n += 1

    def mfu(self, tok_s):
        """tokens/s (of all GPUs) as a fraction of their dense bf16 peak (the progress line's MFU)."""
        peak = PROFILE.peak_tflops * 1e12 * self.world
        return tok_s * pl.model_flops_per_token(self.model.cfg, self.model.T) / peak if peak else 0.0

    def any_rank(self, flag):
        """Several GPUs: True on every rank if flag is True on any (a collective)."""
        return self.dp.any(flag)

    def results(self):
        rows, self.n = cp.asnumpy(self.hist[:self.n]), 0
        K, w = self.model.cfg.n_mtp, self.model.cfg.mtp_weight
        return [(pl.mtp_objective([float(c) for c in r[:K]], w), [float(c) for c in r[:K]], float(r[K]))
                for r in rows]

    def host_state(self):
        """(weights, m, v) as host Params; several GPUs: a collective, None on ranks other than 0."""
        if self.dp is not None:
            return self.dp.host_state(self.model, self.opt)
        return self.model.P.download(), self.opt.m.download(), self.opt.v.download()


def make_trainer(P, B, T, attn, state=None, precision="bf16", accum=1, group=None, muon_ratio=None):
    """A device model of batch (B, T) holding the host Params P, its AdamW (resumed from state) and Trainer,
    with accum micro-batches a step; group: a distributed.Group, to train with ZeRO-1 over its ranks;
    muon_ratio: --optim muon (Muon's lr over AdamW's), else AdamW alone."""
    dp = None if group is None else _distributed().ZeRO(sys.modules[__name__], group, P.cfg, accum)
    model = Model(P.cfg, B, T, attn=attn, precision=precision, params=dp and dp.params())
    model.load(P)
    if dp is not None:
        dp.attach(model)
    G = model.G if accum == 1 or dp is not None else DeviceParams(P.cfg)   # one GPU adds micro-batches up in G
    opt = (AdamW(model.P, G, Pb=model.Pb, shard=dp and dp.S) if muon_ratio is None else
           Muon(model.P, G, muon_ratio, Pb=model.Pb))
    if state is not None:
        if dp is not None:
            dp.load_moments(opt, state["adam_m"], state["adam_v"])
        else:
            opt.m.upload(state["adam_m"])
            opt.v.upload(state["adam_v"])
        opt.step_count = state["step"]
    set_tf32(precision == "tf32")
    return Trainer(model, opt, accum, dp)


MUON_ZERO = ("--optim muon trains on one GPU: ZeRO-1 (--gpus N) shards AdamW's moments, and Muon's orthogonalisation "
             "needs whole matrices; drop --gpus or use --optim adamw")

# --- memory: what a training run takes from the pool, estimated before its first step (an upper bound: the
#     buffers of Model, DeviceParams and AdamW (or Muon) counted as they allocate them, then MEM_SLACK for what they do
#     not count: cuBLAS's workspace, cublasLt's timing copies, the sampler, CuPy's rounding). Measured on an
#     H200, big T=512 bf16: 5.44 GiB at B=16, 15.50 at B=64 (bench's peak, 2026-12-03) ---

MEM_SLACK = (1.08, 512 * MiB)       # estimate = counted x 1.08 + 512 MiB


def memory_estimate(cfg, B, T, precision="bf16", attn="flash", accum=1, prof=None, muon=False):
    """Bytes of device memory a training run of (B, T) at this precision takes at its peak (see above); muon:
    with Muon's scratch."""
    N, D, F, V, L, K = B * T, cfg.dim, cfg.ffn, cfg.vocab, cfg.n_layers, cfg.n_mtp
    Hq, hd = cfg.n_heads, cfg.head_dim
    S, Cq, nt = (Hq + 2 * cfg.n_kv_heads) * hd, Hq * hd, (T + 63) // 64
    n_par, bf = pl.num_params(cfg), precision == "bf16"
    attn = attention_for(attn, cfg, bf, prof=prof or PROFILE or EMULATE["h200"])
    weights = n_par * (4 * 4 + (2 if bf else 0) + (4 if accum > 1 else 0))   # P, G, m, v; bf16 copy; accum's G
    if muon:                        # Muon's X, Xn and A, Bm
        weights += 2 * (2 if bf else 4) * sum(muon_scratch(cfg))
    rms = -(-N // (4 * max(1, min(16, -(-N // 4096))))) * D * 4                 # rms_part_rows(N) x D fp32
    if bf:
        per_row = (L * (D * 4 + D * 4 + 2 * D * 2 + 2 * 4 + S * 2 + Cq * 2 + Hq * 4 + 2 * F * 2 + F * 2)
                   + D * 4 + D * 2 + 4 + K * 4 + D * 2                                  # xs[L], hf, rf, rowloss, tmp
                   + D * 4 + 2 * D * 2 + Cq * 2 + S * 2 + F * 2 + Hq * 4)           # dx, dxb, dh, da, dqkv, dact, D
        acts = N * per_row + logit_chunk(N) * K * V * 2 + B * Hq * nt * (nt + 1) // 2 * 8192
    else:
        per_row = (L * (4 * D + 2 + S + Cq + 2 * F + F) + D + D + 1 + K * V + K + D   # layers; xs[L], hf, rf,
                   + 2 * D + Cq + S + F + Hq) * 4 + (L * Hq * 4 if attn == "flash" else 0)  # logits, .. dx, dh, ..
        acts = N * per_row + (nt * N * Cq * 4 if attn == "flash" else 0)
        if attn == "naive":                                                           # probs, naive_scratch
            acts += (L + 1) * B * Hq * T * T * 4 + B * T * hd * 4 * (4 * Hq + 4 * cfg.n_kv_heads)
    return int((weights + acts + rms) * MEM_SLACK[0] + MEM_SLACK[1])


def fit_batch(cfg, T, precision, attn, accum, free, prof=None, muon=False):
    """The largest batch whose memory_estimate fits `free` bytes (0 if none)."""
    lo, hi = 0, 1
    while hi <= 1 << 16 and memory_estimate(cfg, hi, T, precision, attn, accum, prof, muon) <= free:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if memory_estimate(cfg, mid, T, precision, attn, accum, prof, muon) <= free else (lo, mid)
    return lo


AUTO_BATCH_MAX = 64     # --batch auto's ceiling: the batch the engine's speed was measured at (bench)


def check_memory(cfg, B, T, precision, attn, accum, prof=None, muon=False):
    """Before a run's first step: one line, where its memory_estimate exceeds the device's free memory, with
    the largest batch that fits and the --grad-accum that keeps the sequences a step."""
    prof = prof or device()
    need = memory_estimate(cfg, B, T, precision, attn, accum, prof, muon)
    if need <= prof.free:
        return
    what = (f"{pl.config_name(cfg)} at --batch {B} --seq {T} ({precision}) needs about {need / GiB:.1f} GiB of GPU "
            f"memory, {prof.name} has {prof.free / GiB:.1f} GiB free")
    fit, fit_acc = (fit_batch(cfg, T, precision, attn, n, prof.free, prof, muon) for n in (accum, max(accum, 2)))
    if fit_acc < 1:
        raise UserError(f"{what}: not even --batch 1 fits; lower --seq or train a smaller config")
    seqs = B * accum
    b = max(d for d in range(1, fit_acc + 1) if seqs % d == 0)
    raise UserError(f"{what}: --batch {fit} fits at most; --batch {b} --grad-accum {seqs // b} keeps {seqs} "
                    "sequences a step (or --batch auto)")


def auto_batch(a, defaults):
    """--batch auto of a fresh run: the largest batch up to AUTO_BATCH_MAX whose memory_estimate fits the free
    memory, at the precision the run will take."""
    import contextlib
    import io
    cfg = pl.get_config(a.config or defaults["config"])
    T, attn = min(a.seq or defaults["seq"], cfg.ctx), a.attn or defaults["attn"]
    with contextlib.redirect_stdout(io.StringIO()):         # train() says it once
        precision = check_precision(a.precision or defaults["precision"], cfg, attn, explicit=a.precision is not None)
    muon = (a.optim or defaults["optim"]) == "muon"
    B = min(AUTO_BATCH_MAX, fit_batch(cfg, T, precision, attn, a.grad_accum or 1, device().free, muon=muon))
    if B < 1:
        raise UserError(f"--batch auto: not even one sequence of {T} tokens of {a.config or defaults['config']} fits "
                        f"the {device().free / GiB:.1f} GiB free on {device().name}; lower --seq or train a smaller config")
    need = memory_estimate(cfg, B, T, precision, attn, a.grad_accum or 1, muon=muon)
    print(f"--batch auto: {B} (about {need / GiB:.1f} GiB of {device().free / GiB:.1f} GiB free)", flush=True)
    return B


PRECISION_WORDS = {"bf16": "bf16 mixed precision (fp32 master weights), bf16 tensor-core flash attention",
                   "tf32": "fp32 storage, TF32 matmuls", "fp32": "fp32, TF32 off"}


def cmd_train(argv, resume):
    p = pl.Parser(prog="nanoeuler_cuda.py " + ("resume" if resume else "train"),
                  description="resume the run in --out" if resume else "pretrain (default: big on data/pretrain.bin, "
                  "data/web.txt or data/gutenberg.txt, the first that exists, else the embedded corpus)")
    defaults = dict(TRAIN_DEFAULTS, data=default_data())
    pl.add_train_flags(p, out=pl.RUN_DIRS["train"], defaults=defaults,
                       auto_batch=f"auto: the largest batch up to {AUTO_BATCH_MAX} that fits the GPU's free memory")
    p.add_argument("--attn", choices=["flash", "naive"], help="attention kernel (default flash)")
    add_precision_flag(p, "bf16; a resumed run keeps its own")
    distributed = _distributed()
    distributed.add_gpus_flag(p)
    a = p.parse_args(argv)
    a.config, resume = pl.config_arg(a), resume or a.resume
    if a.optim == "muon" and (a.gpus or 1) > 1:
        raise UserError(MUON_ZERO)
    if distributed.launching(a.gpus):               # --gpus N: N ranks of this same command, one per GPU
        return distributed.launch(a.gpus, [sys.executable, os.path.abspath(__file__),
                                           "resume" if resume else "train", *argv])
    group = distributed.join(a.gpus)               # one rank of a run (its environment): picks its GPU
    if group is None:
        return train(a, defaults, resume)
    group.run(lambda: train(a, defaults, resume, group))   # ends the process


def train(a, defaults, resume, group=None):
    """cmd_train's run, on one GPU or as one rank of group (only rank 0 prints, evaluates, samples, writes)."""
    gpu()
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    if a.batch == "auto" and group is not None:     # ranks could size it apart, and their steps would not meet
        raise UserError("--batch auto sizes one GPU's batch; with --gpus give --batch N (per GPU)")
    if a.batch == "auto":                           # a resumed run keeps its own batch
        a.batch = None if resume else auto_batch(a, defaults)
    with _distributed().rank_zero_first(group):       # rank 0 prepares (and caches) the data the others read
        P, tok, tokens, args, state, extra = pl.start_run(a, defaults, resume)
    if args["optim"] == "muon" and group is not None:
        raise UserError(MUON_ZERO)
    B, T, A = args["batch"], args["seq"], args["grad_accum"]
    if state is not None and "precision" not in state["train"] and a.precision is None:
        args["precision"] = "tf32"                  # a run from before --precision trained in TF32: keep it
    # the precision is part of the run's arguments (saved in the checkpoint's train_state, kept on resume);
    # only the default may fall back to tf32 where bf16 cannot run
    args["precision"] = check_precision(args["precision"], P.cfg, args["attn"],
                                        explicit=a.precision is not None or state is not None)
    if world == 1:
        check_memory(P.cfg, B, T, args["precision"], args["attn"], A, muon=args["optim"] == "muon")
    trainer = make_trainer(P, B, T, args["attn"], state, args["precision"], accum=A, group=group,
                           muon_ratio=args["muon_lr"] / args["lr"] if args["optim"] == "muon" else None)
    line = (f"B={B} T={T}, {args['attn']} attention, {PRECISION_WORDS[args['precision']]}, {PROFILE.name} "
            f"(MFU against {PROFILE.peak_tflops:g} TFLOP/s)")
    if world * A > 1:
        line += (f"; global batch {world * A * B} sequences: {world} GPU(s) x {A} micro-batch(es) x {B}"
                 + (", ZeRO-1" if world > 1 else ""))
    if args["optim"] == "muon":
        line += f"; Muon (lr {args['muon_lr']:g}) on the block matrices, AdamW on the rest"
    print(line)
    batches = pl.Batches(tokens, A * B, T, seed=args["seed"], rank=rank, world=world)
    if state is not None:
        batches.set_state(state["data"])
    if rank:                                        # the other ranks train, and that is all
        pl.train_loop(trainer, tok, batches, args, a.out, None, extra, start=state["step"] if state else 0)
        return
    bpt = pl.bytes_per_token(tok, tokens)
    val_fn = lambda: pl.validation_loss(trainer.model.batch_loss, tokens, B, T, 8, bpt)
    sampler = Sampler(trainer.model.P)
    gen = lambda ids, n, rng: sampler.generate(ids, n, pl.Sampling(0.8, 40), rng)
    if state is None:
        print("step 0: val loss {:.4f}, val bpb {:.3f}".format(*val_fn()), flush=True)
    pl.train_loop(trainer, tok, batches, args, a.out, val_fn, extra, start=state["step"] if state else 0,
                  sample_fn=lambda step: pl.print_sample(tok, gen, "\n", 64, seed=step))
    sample = pl.print_sample(tok, gen, "\n", 100, seed=args["seed"])
    report = _evaluate().write_report(a.out, args, P.cfg, *val_fn(), sample, engine="GPU",
                                   peak_tflops=PROFILE.peak_tflops * world)
    print(f"report: {report}")


# ----------------------------------------------------------------------------------------------------
# 6. generation: the prompt prefilled in one pass (flash attention), then decode steps captured once as CUDA
# graphs and replayed, with the next id drawn on the device (plain decoding, any number of streams), or
# the MTP heads drafting ids that head 0 verifies in one step (speculative decoding, one stream; greedy
# rounds are decided on the device too, so the host only reads the ids every few rounds); serve's batch of
# requests, each row as it would be alone (Decoder)

# --- generation on the device. The KV cache of each layer is (streams, Hkv, ctx, hd) fp32. A decode step
#     runs `rows` new tokens of every stream (row n = stream * rows + t) at positions pos + t, where pos is
#     state[0] on the device: the host never passes a position by value, so one captured CUDA graph serves
#     every step. state = [pos, step, ids of the step's rows...].
#     A decode step's layer is five kernels: matvec's RMSNorm-qkv-RoPE-append (the rotated k and v go into the
#     caches), attn_cached (one block per row, query head and stream, over keys 0 .. pos + t), matvec adding
#     the attention's projection to the residual, matvec's RMSNorm-w1|w3-SwiGLU, and matvec adding w2's
#     product. They are launched as programmatic dependent launches (launch()): each starts while the one
#     before it runs and loads its weights (or the cached keys) into shared memory, then waits for its
#     input, so the step is a chain of short waits rather than of loads (big: 1,800 -> 3,075 tokens/s).
#     More rows take cuBLAS: a prompt with rope_store; a batch of streams with attn_warps, a block per kv head
#     and stream, which also rotates the row and appends it to the caches. sample_tokens draws each stream's
#     next id by pipeline.Sampling's rule; argmax_heads and spec_round, greedy speculative decoding. Each row's
#     result depends on that row alone, never on how many rows the step has: a verify step of speculative
#     decoding computes bit for bit what plain decoding computes, so their greedy ids agree ---

# --- decode products: a step of at most MATVEC_ROWS rows multiplies by matvec, the RMSNorm before the
#     product and its epilogue (the residual add, SwiGLU, or RoPE and the cache append) fused in; more
#     rows (a prompt, many streams) take cuBLAS (sgemm_nt) and rope_store ---

DEC_FIELDS = ("SLOT", "POS", "UNI", "TEMP", "TOPK", "TOPP", "PEN", "UIX")   # a Decoder row's record, in order
DEC_REC = 8         # ints a record (DEC_FIELDS, padded)
ROW_SRC = f"""
// A Decoder row's record: DEC_REC ints (`rec`; nullptr outside the Decoder): its cache slot, position, uniform
// number and sampling rule (temperature, top_k, top_p, repetition penalty; floats as their bits), and which of
// its uniform numbers that is
enum {{ ROW_REC = {DEC_REC}, {", ".join(f"ROW_{f} = {i}" for i, f in enumerate(DEC_FIELDS))} }};
"""

MATVEC_SRC = r"""
// The pair (i, i + hd/2) of head hh of a new row of stream b at position p: rotated if a q or k head, written
// back to the row r (its q|k|v), and appended to the cache if a k or v head (heads Hq.. Hq+Hkv-1 are k, the
// rest v). rope_store and matvec's ROPE epilogue.
__device__ __forceinline__ void rope_append(float a, float c, float* __restrict__ r, int hh, int i, int b, int p,
                                            const float* __restrict__ cosv, const float* __restrict__ sinv,
                                            float* __restrict__ kc, float* __restrict__ vc, int Hq, int Hkv, int hd,
                                            int ctx) {
    const int half = hd / 2;
    if (hh < Hq + Hkv) {
        const float cs = cosv[p * half + i], sn = sinv[p * half + i];
        const float ra = a * cs - c * sn, rc = c * cs + a * sn;
        a = ra;
        c = rc;
    }
    r[hh * hd + i] = a;
    r[hh * hd + i + half] = c;
    if (hh >= Hq) {
        const int j = hh < Hq + Hkv ? hh - Hq : hh - Hq - Hkv;
        float* cache = (hh < Hq + Hkv ? kc : vc) + (((i64)b * Hkv + j) * ctx + p) * hd;
        cache[i] = a;
        cache[i + half] = c;
    }
}
// (cuBLAS path) rope_append on every pair of each new row, in place: a thread per (row, head, pair); a
// Decoder's rows (rec): row n at its record's slot and position, and its q|k|v first scaled by rs[n] (its
// 1/rms: the norm's weight is folded into the product; rs null: none)
extern "C" __global__ void rope_store(float* __restrict__ qkv, float* __restrict__ kc, float* __restrict__ vc,
                                      const float* __restrict__ cosv, const float* __restrict__ sinv,
                                      const int* __restrict__ state, int R, int rows, int Hq, int Hkv, int hd,
                                      int ctx, const int* __restrict__ rec, const float* __restrict__ rs) {
    int half = hd / 2, H = Hq + 2 * Hkv;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= R * H * half) return;
    int i = idx % half, hh = (idx / half) % H, n = idx / (half * H);
    float* r = qkv + (i64)n * H * hd;
    const float sc = rs ? rs[n] : 1.f;
    rope_append(sc * r[hh * hd + i], sc * r[hh * hd + i + half], r, hh, i, rec ? rec[ROW_REC * n + ROW_SLOT] : n / rows,
                rec ? rec[ROW_REC * n + ROW_POS] : state[0] + n % rows, cosv, sinv, kc, vc, Hq, Hkv, hd, ctx);
}
// The decode step's products, for its few rows (R <= MATVEC_ROWS): out = EPI(x' @ W^T), x (R, K), W (N, K),
// and x' = RMSNorm(x) * nw (the rows' rstd computed here) for every EPI but ADD, whose x is an activation.
// A unit of work is two of W's rows c1, c2. Block b owns units b*UPB ..: it copies their rows into shared
// memory (cp.async) before dep_wait, so the weights stream in while the previous kernel runs; then x', 8
// rows at a time, into shared memory, and its warps take (unit, part) tasks in turn: PARTS warps split a
// unit's K (16-byte pieces, K % 4 == 0), their partial sums added in a fixed order. UPB and PARTS depend on
// W's shape alone (matvec_plan()), so each row's result is the same for any R. The Decoder's steps take more
// rows, RC a block: blockIdx.y picks the chunk of RC rows (one chunk outside the Decoder); the chunks read
// the same W, which L2 serves after the first (big's largest W, 12.6 MB; an H200's L2, 50 MB). EPI:
//   OUT   units (c, c + N/2): out (R, N) = the product;  ADD the same, out += it (the residual, in place);
//   GLU   W = [w1; w3] (N = 2F), units (f, f + F): out (R, F) = silu(s1) * s2, SwiGLU's activation;
//   ROPE  W = [wq; wk; wv], units (i, i + hd/2) of each head: out = qkv with its q and k heads rotated at
//         the row's position (state[0] + row % rows, or its record's), k and v also appended to the caches kc
//         and vc (at stream row / rows, or the record's slot).
enum { OUT = 0, ADD = 1, GLU = 2, ROPE = 3 };
template <int EPI, int PARTS> __device__ void matvec_rows(
        float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ W,
        const float* __restrict__ nw, int R, int K, int N, int UPB, const int* __restrict__ state,
        const float* __restrict__ cosv, const float* __restrict__ sinv, float* __restrict__ kc,
        float* __restrict__ vc, int rows, int Hq, int Hkv, int hd, int ctx, const int* __restrict__ rec, int RC) {
    constexpr bool NORM = EPI != ADD;
    extern __shared__ __align__(16) float4 sm4[];         // [nu][2][K4] W's rows, [K4] nw, [<= 8][K4] x'
    __shared__ float red[2][8][8];                        // [sum][task][row of the group]
    __shared__ float rs[64];                              // each row's rstd
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, K4 = K >> 2, U = N / 2, half = hd / 2;
    const int rc0 = blockIdx.y * RC;                      // the block's rows: rc0 ..
    x += (i64)rc0 * K;
    out += (i64)rc0 * (EPI == GLU ? U : N);
    R = min(RC, R - rc0);
    const int u0 = blockIdx.x * UPB, nu = min(UPB, U - u0);
    auto cols = [&](int u, int& c1, int& c2) {
        if (EPI == ROPE) { c1 = (u / half) * hd + u % half; c2 = c1 + half; }
        else { c1 = u; c2 = u + U; }
    };
    float4* ws = sm4;
    float4* nws = ws + UPB * 2 * K4;                      // (NORM) the norm's weights
    float4* xs = nws + (NORM ? K4 : 0);
    for (int i = threadIdx.x; i < nu * 2 * K4; i += blockDim.x) {
        const int u = i / (2 * K4), k = i % K4;
        int c1, c2;
        cols(u0 + u, c1, c2);
        fb_cp16(ws + i, W + (i64)((i / K4) & 1 ? c2 : c1) * K + 4 * k, 16);
    }
    if (NORM) for (int k = threadIdx.x; k < K4; k += blockDim.x) fb_cp16(nws + k, nw + 4 * k, 16);
    fb_commit();
    dep_trigger();
    dep_wait();
    if (NORM) {                  // the same sums, in the same order, in every block; rows 0..7 kept raw in xs
        for (int r = warp; r < R; r += 8) {
            const float4* xr = reinterpret_cast<const float4*>(x + (i64)r * K);
            float ss = 0.f;
            for (int k = lane; k < K4; k += 32) {
                const float4 v = xr[k];
                if (r < 8) xs[r * K4 + k] = v;
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            ss = warp_sum(ss);
            if (lane == 0) rs[r] = 1.0f / sqrtf(ss / K + RMS_EPS);
        }
    }
    fb_wait<0>();
    __syncthreads();
    auto epilogue = [&](int r, int u, float s1, float s2) {
        int a, c;
        cols(u, a, c);
        float* o = out + (i64)r * (EPI == GLU ? U : N);
        if (EPI == OUT) { o[a] = s1; o[c] = s2; }
        if (EPI == ADD) { o[a] += s1; o[c] += s2; }
        if (EPI == GLU) o[u] = s1 / (1.f + expf(-s1)) * s2;
        if (EPI == ROPE) {
            const int at = ROW_REC * (rc0 + r);
            rope_append(s1, s2, o, u / half, u % half, rec ? rec[at + ROW_SLOT] : r / rows,
                        rec ? rec[at + ROW_POS] : state[0] + r % rows, cosv, sinv, kc, vc, Hq, Hkv, hd, ctx);
        }
    };
    for (int r0 = 0; r0 < R; r0 += 8) {
        const int nr = min(8, R - r0);
        for (int i = threadIdx.x; i < nr * K4; i += blockDim.x) {     // x' of rows r0 .. r0 + nr - 1
            const int r = i / K4, k = i % K4;
            float4 v = r0 == 0 && NORM ? xs[i] : reinterpret_cast<const float4*>(x + (i64)(r0 + r) * K)[k];
            if (NORM) {
                const float s = rs[r0 + r];
                const float4 g = nws[k];
                v = make_float4(v.x * s * g.x, v.y * s * g.y, v.z * s * g.z, v.w * s * g.w);
            }
            xs[i] = v;
        }
        __syncthreads();
        for (int task = warp; task < nu * PARTS; task += 8) {
            const int u = task / PARTS, part = task % PARTS;
            const float4* w1 = ws + 2 * u * K4;
            const float4* w2 = w1 + K4;
            float a1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, a2[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
            for (int k = part * 32 + lane; k < K4; k += 32 * PARTS) {
                const float4 uu = w1[k], vv = w2[k];
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    if (r < nr) {
                        const float4 xv = xs[r * K4 + k];
                        a1[r] += uu.x * xv.x + uu.y * xv.y + uu.z * xv.z + uu.w * xv.w;
                        a2[r] += vv.x * xv.x + vv.y * xv.y + vv.z * xv.z + vv.w * xv.w;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 8; r++) {
                if (r < nr) {                             // the same for the whole warp
                    const float s1 = warp_sum(a1[r]), s2 = warp_sum(a2[r]);
                    if (PARTS == 1 && lane == 0) epilogue(r0 + r, u0 + u, s1, s2);
                    if (PARTS > 1 && lane == 0) { red[0][task][r] = s1; red[1][task][r] = s2; }
                }
            }
        }
        __syncthreads();                                  // xs is rewritten next; red is complete
        if (PARTS > 1 && threadIdx.x < 8 * nu) {          // nu * PARTS <= 8 tasks: one a warp
            const int u = threadIdx.x >> 3, r = threadIdx.x & 7;
            if (r < nr) {
                float s1 = red[0][u * PARTS][r], s2 = red[1][u * PARTS][r];
                for (int q = 1; q < PARTS; q++) { s1 += red[0][u * PARTS + q][r]; s2 += red[1][u * PARTS + q][r]; }
                epilogue(r0 + r, u0 + u, s1, s2);
            }
        }
    }
}
"""
MATVEC_EPI = ("out", "add", "glu", "rope")     # the decode products' epilogues, in MATVEC_SRC's order
MATVEC_PARTS = (1, 2, 4, 8)                    # the warps that may split a unit's K (matvec_plan)


def matvec_name(epi, parts, rec=False):
    return f"matvec_{epi}_p{parts}" + ("_rec" if rec else "")


# name -> extern "C" instance: the kernels matvec() picks, one per epilogue and K split, and the Decoder's (rec)
# apart, so a lone decode step's kernel has no record to test (a null rec folds away: 2% of its tokens/s)
MATVEC_KERNELS = {
    matvec_name(epi, parts, rec):
    f'extern "C" __global__ void __launch_bounds__(256) {matvec_name(epi, parts, rec)}(float* __restrict__ out, const '
    f'float* __restrict__ x, const float* __restrict__ W, const float* __restrict__ nw, int R, int K, int N, int UPB, '
    f'const int* __restrict__ state, const float* __restrict__ cosv, const float* __restrict__ sinv, float* '
    f'__restrict__ kc, float* __restrict__ vc, int rows, int Hq, int Hkv, int hd, int ctx'
    + (', const int* __restrict__ rec, int RC' if rec else '') + f') {{ matvec_rows<{e}, {parts}>(out, x, W, nw, R, K, '
    f'N, UPB, state, cosv, sinv, kc, vc, rows, Hq, Hkv, hd, ctx, {"rec, RC" if rec else "nullptr, R"}); }}\n'
    for parts in MATVEC_PARTS for e, epi in enumerate(MATVEC_EPI) for rec in (False, True)}
MATVEC_SRC = cuda_source("matvec", ["rope_store", *MATVEC_KERNELS],
                         ROW_SRC + MATVEC_SRC + "".join(MATVEC_KERNELS.values()))


def rope_store(qkv, kc, vc, cos, sin, state, rows, Hq, Hkv, hd, rec=None, rs=None):
    R, ctx = qkv.shape[0], kc.shape[2]
    _k("rope_store")(_blocks(R * (Hq + 2 * Hkv) * hd // 2), (256,), (qkv, kc, vc, cos, sin, state, I32(R), I32(rows),
                                                                     I32(Hq), I32(Hkv), I32(hd), I32(ctx),
                                                                     NULL if rec is None else rec,
                                                                     NULL if rs is None else rs))


MATVEC_ROWS = 16    # decode steps of at most this many rows use matvec; more rows (a prompt, many streams) cuBLAS


def sgemm_nt(C, A, W, beta=0.0):
    """C (M, N) = A (M, K) @ W (N, K).T + beta * C in fp32 by _gemm_ex, which a CUDA graph can capture."""
    (M, K), N = A.shape, W.shape[0]
    assert C.shape == (M, N) and W.shape[1] == K and A.flags.c_contiguous and W.flags.c_contiguous
    assert C.dtype == A.dtype == W.dtype == np.float32
    _gemm_ex(1, 0, N, M, K, 1.0, W, K, A, K, beta, C, N, CUBLAS_COMPUTE_32F)


MATVEC_SMEM = 64 << 10    # a matvec block's rows of W at most, in bytes: blocks of consecutive kernels share an SM


def matvec_smem(upb, K, R, norm=True):
    """matvec's dynamic shared memory: the block's rows of W, the norm's weights, up to 8 rows of x'."""
    return (upb * 2 + norm + min(R, 8)) * K * 4


def matvec_plan(U, K, prof=None):
    """(units a block, warps splitting a unit's K) for W's U units of two rows of K: the units spread over
    the device's SMs, at most MATVEC_SMEM of W and 8 units a block (a unit a warp: with 10, two warps took
    two and the rest waited, 7% of big's decode step), fewer where the block's shared memory (8 rows of x')
    would not fit the device; a block's 8 warps split each unit's K where it has fewer than 8 units. None
    where one unit does not fit (large's w2, K = 2816, on 99 KB): W then takes cuBLAS at every row count.
    A function of W's shape and the device alone: the sum order never depends on R."""
    prof = prof or PROFILE
    upb = max(1, min(-(-U // prof.sms), MATVEC_SMEM // (8 * K), 8))
    while upb > 1 and not smem_fits(matvec_smem(upb, K, 8), prof):
        upb -= 1
    if not smem_fits(matvec_smem(upb, K, 8), prof):
        return None
    parts = 1
    while parts * 2 * upb <= 8 and K // 4 >= 32 * parts * 2:
        parts *= 2
    return upb, parts


def matvec_fits(W):
    """Whether a decode step multiplies by W (N, K) with matvec (else cuBLAS): matvec_plan."""
    return matvec_plan(W.shape[0] // 2, W.shape[1]) is not None


def matvec(out, x, W, epi="out", norm=None, rope=None, rec=None):
    """out = epi(x' @ W.T) for a decode step's R <= MATVEC_ROWS rows, x' = RMSNorm(x) * norm (every epi but
    'add', whose x is an activation); see MATVEC_SRC: 'out' out (R, N) = the product, 'add' out += it, 'glu'
    out (R, N/2) = silu(first half) * second half, 'rope' out = qkv, rotated, its k and v also into the
    caches; rope = (kc, vc, cos, sin, state, rows, Hq, Hkv, hd). rec (a Decoder step's rows' records, their
    slots and positions for 'rope'): any R, MATVEC_ROWS rows a block."""
    (R, K), N = x.shape, W.shape[0]
    assert (norm is None) == (epi == "add") and (rope is None) == (epi != "rope")
    assert R <= MATVEC_ROWS or rec is not None
    assert out.shape == (R, N // 2 if epi == "glu" else N) and W.shape[1] == K and K % 4 == 0 and N % 2 == 0
    assert x.data.ptr % 16 == 0 and W.data.ptr % 16 == 0 and x.flags.c_contiguous and W.flags.c_contiguous
    kc, vc, cos, sin, state, rows, Hq, Hkv, hd = rope or (x, x, x, x, x, 1, 0, 0, 2)
    upb, parts = matvec_plan(N // 2, K)             # callers check matvec_fits
    k = _k(matvec_name(epi, parts, rec is not None))
    rc = min(R, MATVEC_ROWS)                                # rows a block
    smem = matvec_smem(upb, K, R, epi != "add")
    shared_memory(k, smem)
    launch(k, (-(-N // 2 // upb), -(-R // rc)), (256,),
           (out, x, W, x if norm is None else norm, I32(R), I32(K), I32(N), I32(upb), state, cos, sin, kc, vc,
            I32(rows), I32(Hq), I32(Hkv), I32(hd), I32(kc.shape[2] if rope else 0))
           + (() if rec is None else (rec, I32(rc))), shared_mem=smem)


# --- KV-cache attention: each new row's query heads over the keys cached so far (attn_cached_body, a
#     block a query head; attn_warps_body, a block a kv head, for a step of many rows) ---

CACHE_ATTN_SRC = r"""
// One block (ATTN_THREADS = 256) per (row, query head, stream) over keys 0 .. pos + t of the head's kv head,
// in chunks of CH keys (attn_cached() picks CH) staged in shared memory by cp.async: the first chunk's
// keys before pos (written by earlier steps) before dep_wait, so they load while the previous kernel runs;
// the new rows after it. Per chunk: two threads score each key (alternate 16-byte pieces: no bank
// conflicts; rows padded by 8 floats); every warp finds the same chunk max and sum (online softmax across
// chunks) and warp 0 writes p = exp(s - m); thread (d, r) sums output d over the keys k = r mod KG, and the
// KG partial sums of each d are added by shuffles at the end. A row's result depends on CH, never on how
// many rows or streams the step has. A Decoder's step (rec): a block per (query head, row), the row's keys
// 0 .. its position in its record's cache slot.
template <int HD, typename TO> __device__ void attn_cached_body(
        const float* __restrict__ qkv, const float* __restrict__ kc, const float* __restrict__ vc,
        TO* __restrict__ out, const int* __restrict__ state, int rows, int Hq, int Hkv, int ctx, float scale, int CH,
        const int* __restrict__ rec) {
    constexpr int NT = 256, KS = HD + 8, D4 = HD / 4, KG = NT / HD;
    extern __shared__ __align__(16) float sm[];           // [CH][KS] keys, [CH][KS] values, [CH] scores, [CH] p
    __shared__ __align__(16) float qs[HD];
    float* ks = sm;
    float* vs = ks + CH * KS;
    float* sc = vs + CH * KS;
    float* pr = sc + CH;
    const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, j = h / (Hq / Hkv), tid = threadIdx.x, lane = tid & 31;
    const i64 n = (i64)b * rows + t;
    const int Cq = Hq * HD, old = rec ? rec[ROW_REC * b + ROW_POS] : state[0];   // keys before old: earlier steps'
    const i64 cb = rec ? rec[ROW_REC * b + ROW_SLOT] : b;                        // the cache's stream
    const float* K = kc + (cb * Hkv + j) * ctx * HD;
    const float* Vv = vc + (cb * Hkv + j) * ctx * HD;
    auto stage = [&](int k0, int k1, int c0) {          // keys k0 .. k1-1 of the chunk that starts at c0
        for (int i = tid; i < (k1 - k0) * D4; i += NT) {
            const int k = k0 + i / D4, d = 4 * (i % D4);
            fb_cp16(ks + (k - c0) * KS + d, K + (i64)k * HD + d, 16);
            fb_cp16(vs + (k - c0) * KS + d, Vv + (i64)k * HD + d, 16);
        }
        fb_commit();
    };
    stage(0, min(old, CH), 0);
    dep_trigger();
    dep_wait();
    const int nk = old + t + 1, d = tid / KG, r = tid % KG;
    if (tid < HD) qs[tid] = qkv[n * (Cq + 2 * Hkv * HD) + (i64)h * HD + tid] * scale;
    float m = NEG_INF, l = 0.f, acc = 0.f;
    for (int c0 = 0; c0 < nk; c0 += CH) {
        const int nc = min(nk - c0, CH);
        stage(c0 == 0 ? min(old, CH) : c0, c0 + nc, c0);
        fb_wait<0>();
        __syncthreads();
        for (int i0 = 0; i0 < 2 * nc; i0 += NT) {        // scores: threads 2k, 2k+1 take key k's pieces
            const int i = i0 + tid, k = i >> 1, half = i & 1;
            float s0 = 0.f, s1 = 0.f;
            if (k < nc) {
                const float4* kr = reinterpret_cast<const float4*>(ks + k * KS);
                const float4* q4 = reinterpret_cast<const float4*>(qs);
#pragma unroll
                for (int e = half; e < D4; e += 2) {
                    const float4 a = q4[e], c = kr[e];
                    s0 += a.x * c.x + a.y * c.y;
                    s1 += a.z * c.z + a.w * c.w;
                }
            }
            float s = s0 + s1;
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            if (k < nc && half == 0) sc[k] = s;
        }
        __syncthreads();
        float mx = NEG_INF;                               // every warp: the same max and sum, same order
        for (int k = lane; k < nc; k += 32) mx = fmaxf(mx, sc[k]);
        const float mn = fmaxf(m, warp_max(mx)), scl = expf(m - mn);
        float z = 0.f;
        for (int k = lane; k < nc; k += 32) {
            const float p = expf(sc[k] - mn);
            z += p;
            if (tid < 32) pr[k] = p;
        }
        l = l * scl + warp_sum(z);
        m = mn;
        __syncthreads();
        float o0 = 0.f, o1 = 0.f;                          // output d over keys r, r + KG, ..
        int k = r;
        for (; k + KG < nc; k += 2 * KG) {
            o0 += pr[k] * vs[k * KS + d];
            o1 += pr[k + KG] * vs[(k + KG) * KS + d];
        }
        if (k < nc) o0 += pr[k] * vs[k * KS + d];
        acc = acc * scl + (o0 + o1);
        __syncthreads();                                  // the next chunk overwrites the keys and values
    }
#pragma unroll
    for (int o = 1; o < KG; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (r == 0) stf(out + n * Cq + (i64)h * HD + d, acc / l);
}
// The KV-cache attention of a step of many rows (a batch of streams): one block of NW warps per (row, kv
// head, stream) for the GQ query heads that share the kv head, so each key and value is loaded once (a
// block per query head loads them GQ times: L2 bandwidth bound, 9 us a call at 64 streams of big at 116
// keys, against 5.6). A key takes LPK = HD/8 lanes, 8 dims each (of the key, the value, each query and each
// output), so a warp takes KPS = 32/LPK keys a step: a score is summed over LPK lanes by log2(LPK) shuffles
// (a lane a dim: 5 shuffles a key and head, which bound the kernel). Warp w takes G steps a round, their 2G
// loads per lane in flight together, no block barrier. Each key slot of a warp keeps its own online softmax
// per head; at the end the slots are combined by shuffles, then the warps in warp order.
__device__ __forceinline__ void softmax_merge(float& m, float& l, float* acc, float m2, float l2,
                                              const float* acc2, int n) {
    const float M = fmaxf(m, m2);                         // both empty (-inf): stays empty
    const float c1 = m == NEG_INF ? 0.f : expf(m - M), c2 = m2 == NEG_INF ? 0.f : expf(m2 - M);
    l = l * c1 + l2 * c2;
    for (int e = 0; e < n; e++) acc[e] = acc[e] * c1 + acc2[e] * c2;
    m = M;
}
template <int HD, int NW, int G, int GQ, typename TO> __device__ void attn_warps_body(
        const float* __restrict__ qkv, float* __restrict__ kc, float* __restrict__ vc, TO* __restrict__ out,
        const int* __restrict__ state, const float* __restrict__ cosv, const float* __restrict__ sinv, int rows,
        int Hkv, int ctx, float scale, const int* __restrict__ rec, const bf16* __restrict__ xn, int D) {
    constexpr int LPK = HD / 8, KPS = 32 / LPK;
    __shared__ float wm[GQ][NW], wl[GQ][NW];
    __shared__ __align__(16) float wo[GQ][NW][HD];
    const int t = blockIdx.x, j = blockIdx.y, b = blockIdx.z, Cq = GQ * Hkv * HD;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, slot = lane / LPK, d0 = 8 * (lane % LPK);
    const i64 n = (i64)b * rows + t;
    // xn (a Decoder's step, cosv set): the row's q|k|v is x (w*W)^T, the attention norm's weight folded into
    // the product; scaled below by its 1/rms of x (bf16), whose loads go out before dep_wait (x was written
    // before the product ahead of this kernel began) and land beside q|k|v's
    float xv[8][4];
    dep_trigger();                                        // (a step's dec_add after it loads its weights now)
    if (xn != nullptr) warp_row(xn + n * D, D, xv);
    dep_wait();
    const i64 cb = rec ? rec[ROW_REC * b + ROW_SLOT] : b;   // the cache's stream (a Decoder's row: its slot)
    float* K = kc + (cb * Hkv + j) * ctx * HD + d0;           // (written here where cosv: not read-only)
    float* Vv = vc + (cb * Hkv + j) * ctx * HD + d0;
    const int nk = (rec ? rec[ROW_REC * b + ROW_POS] : state[0]) + t + 1, half = HD / 2, i0 = d0 % half;
    const float* row = qkv + n * (Cq + 2 * Hkv * HD);
    // cosv (rows == 1): the row's q and k are rotated here and its k and v appended at position nk - 1, as
    // rope_append does (rope_store's launch saved); a pair's other half is LPK/2 lanes away
    auto load8 = [&](float* r, const float* src, bool rotate) {
        ldv<8>(src, r);
        if (!rotate) return;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float o = __shfl_xor_sync(0xffffffffu, r[e], LPK / 2);
            const float cs = cosv[(nk - 1) * half + i0 + e], sn = sinv[(nk - 1) * half + i0 + e];
            r[e] = d0 < half ? r[e] * cs - o * sn : r[e] * cs + o * sn;
        }
    };
    float kn[8], vn[8];                                   // cosv: the new key and value, which every warp
    if (cosv != nullptr) {                                // takes from here (no barrier); warp 0 appends them
        load8(kn, row + Cq + j * HD + d0, true);
        load8(vn, row + Cq + (Hkv + j) * HD + d0, false);
    }
    float q[GQ][8], acc[GQ][8], m[GQ], l[GQ];
#pragma unroll
    for (int h = 0; h < GQ; h++) load8(q[h], row + (j * GQ + h) * HD + d0, cosv != nullptr);
    const float rs = xn != nullptr ? warp_row_rstd(xv, D) : 1.f;
    if (cosv != nullptr) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            kn[e] *= rs;
            vn[e] *= rs;
        }
        if (w == 0 && slot == 0)
#pragma unroll
            for (int e = 0; e < 8; e++) {
                K[(i64)(nk - 1) * HD + e] = kn[e];
                Vv[(i64)(nk - 1) * HD + e] = vn[e];
            }
    }
#pragma unroll
    for (int h = 0; h < GQ; h++) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[h][e] = q[h][e] * rs * scale;
            acc[h][e] = 0.f;
        }
    }
    for (int k0 = w * G * KPS + slot; k0 < nk + slot; k0 += NW * G * KPS) {   // warp w's round: G steps
        float kv[G][8], vv[G][8], s[GQ][G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int k = min(k0 + g * KPS, nk - 1);      // past the last key: a copy of it, scored -inf below
            ldv<8>(K + (i64)k * HD, kv[g]);
            ldv<8>(Vv + (i64)k * HD, vv[g]);
            if (cosv != nullptr && k0 + g * KPS >= nk - 1)   // the new key, and its copies past it (the cache there
#pragma unroll                                             // may be warp 0's append not yet landed: a former
                for (int e = 0; e < 8; e++) {              // row's NaN times p = 0 would poison the sums)
                    kv[g][e] = kn[e];
                    vv[g][e] = vn[e];
                }
        }
#pragma unroll
        for (int h = 0; h < GQ; h++)
#pragma unroll
            for (int g = 0; g < G; g++) {
                s[h][g] = q[h][0] * kv[g][0];
#pragma unroll
                for (int e = 1; e < 8; e++) s[h][g] += q[h][e] * kv[g][e];
            }
#pragma unroll
        for (int o = 1; o < LPK; o <<= 1)                 // each key's LPK lanes: GQ * G sums, interleaved
#pragma unroll
            for (int h = 0; h < GQ; h++)
#pragma unroll
                for (int g = 0; g < G; g++) s[h][g] += __shfl_xor_sync(0xffffffffu, s[h][g], o);
#pragma unroll
        for (int h = 0; h < GQ; h++) {
            float mx = m[h];
            bool nan = false;                             // (fmaxf drops a NaN score: a poisoned cache's
#pragma unroll                                            // NaN must reach the output)
            for (int g = 0; g < G; g++) {
                if (k0 + g * KPS >= nk) s[h][g] = NEG_INF;
                mx = fmaxf(mx, s[h][g]);
                nan |= isnan(s[h][g]);
            }
            if (nan) mx = __int_as_float(0x7fc00000);
            if (mx == NEG_INF) continue;                  // this slot has no key this round
            const float c = expf(m[h] - mx);
            l[h] *= c;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[h][e] *= c;
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float p = expf(s[h][g] - mx);
                l[h] += p;
#pragma unroll
                for (int e = 0; e < 8; e++) acc[h][e] += p * vv[g][e];
            }
            m[h] = mx;
        }
    }
#pragma unroll
    for (int h = 0; h < GQ; h++) {
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1) {              // the warp's key slots merged (the same in every slot)
            float a2[8];
#pragma unroll
            for (int e = 0; e < 8; e++) a2[e] = __shfl_xor_sync(0xffffffffu, acc[h][e], o);
            const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
            softmax_merge(m[h], l[h], acc[h], m2, l2, a2, 8);
        }
        if (lane == 0) { wm[h][w] = m[h]; wl[h][w] = l[h]; }
        if (slot == 0)
#pragma unroll
            for (int e = 0; e < 8; e++) wo[h][w][d0 + e] = acc[h][e];
    }
    __syncthreads();
    if (w >= GQ) return;                                  // warp h merges head h's warps, in order
    for (int d = lane; d < HD; d += 32) {
        float M = wm[w][0], L = wl[w][0], o = wo[w][0][d];
        for (int i = 1; i < NW; i++) softmax_merge(M, L, &o, wm[w][i], wl[w][i], &wo[w][i][d], 1);
        stf(out + n * Cq + (i64)(j * GQ + w) * HD + d, o / L);
    }
}
"""
ATTN_CACHED_HD = (8, 32, 64, 128)     # head dims of the KV-cache attention (every config's)
ATTN_THREADS = 256                    # its block (the kernel's NT)
ATTN_BATCH_CH = 64                    # keys a chunk when many streams' blocks share the SMs (where
                                      # attn_warps_body does not serve)
ATTN_WARPS_HD = (32, 64, 128)         # head dims of attn_warps_body, which takes a step of many rows
ATTN_WARPS_GQ = (1, 2, 3, 4)          # and query heads a kv head (every config's)
ATTN_WARPS = (4, 4)                   # its warps a block and steps a round (8 warps of 2 steps, 4 of 2: slower
                                      # at 116-500 keys)
DECODER_CH = 64                       # keys a chunk of a Decoder row's attn_cached: its steps and prompt
                                      # passes without bf16 (with bf16 both attend by attn_warps where
                                      # warps_fit): several blocks an SM (big, 64 rows: 1.32 -> 1.00 ms a step
                                      # when steps took it); None: a lone decode step's (the Sampler's bits)


def attn_cached_name(hd, bf16, rec=False):
    return f"attn_cached_{hd}" + ("_bf16" if bf16 else "") + ("_rec" if rec else "")


def attn_warps_name(hd, gq, bf16):
    return f"attn_warps_{hd}_g{gq}" + ("_bf16" if bf16 else "")


ATTN_OUT = ((False, "float"), (True, "bf16"))     # the output's type: fp32, or bf16 (the batched decode step's)
# name -> extern "C" instance: the kernels attn_cached() picks, per head dim (and query heads a kv head) and output,
# the Decoder's (rec) apart, as matvec's
CACHE_ATTN_KERNELS = {
    **{attn_cached_name(hd, bf, rec):
       f'extern "C" __global__ void __launch_bounds__({ATTN_THREADS}) {attn_cached_name(hd, bf, rec)}(const float* '
       f'__restrict__ qkv, const float* __restrict__ kc, const float* __restrict__ vc, {to}* __restrict__ out, const int* '
       f'__restrict__ state, int rows, int Hq, int Hkv, int ctx, float scale, int ch'
       + (', const int* __restrict__ rec' if rec else '') + f') {{ attn_cached_body<{hd}>(qkv, kc, vc, out, state, rows, '
       f'Hq, Hkv, ctx, scale, ch, {"rec" if rec else "nullptr"}); }}\n'
       for hd in ATTN_CACHED_HD for bf, to in ATTN_OUT for rec in (False, True)},
    **{attn_warps_name(hd, gq, bf):
       f'extern "C" __global__ void __launch_bounds__({32 * ATTN_WARPS[0]}) {attn_warps_name(hd, gq, bf)}(const float* '
       f'__restrict__ qkv, float* __restrict__ kc, float* __restrict__ vc, {to}* __restrict__ out, const int* __restrict__ '
       f'state, const float* __restrict__ cosv, const float* __restrict__ sinv, int rows, int Hkv, int ctx, float scale, '
       f'const int* __restrict__ rec, const bf16* __restrict__ xn, int D) {{ attn_warps_body<{hd}, {ATTN_WARPS[0]}, '
       f'{ATTN_WARPS[1]}, {gq}>(qkv, kc, vc, out, state, cosv, sinv, rows, Hkv, ctx, scale, rec, xn, D); }}\n'
       for hd in ATTN_WARPS_HD for gq in ATTN_WARPS_GQ for bf, to in ATTN_OUT}}
CACHE_ATTN_SRC = cuda_source("cache_attn", CACHE_ATTN_KERNELS,
                             ROW_SRC + CACHE_ATTN_SRC + "".join(CACHE_ATTN_KERNELS.values()))


def attn_warps(R, Hq, Hkv, hd):
    """Whether attn_cached takes attn_warps_body: a step of many rows (a Decoder's step: warps_fit)."""
    return R > MATVEC_ROWS and warps_fit(Hq, Hkv, hd)


def warps_fit(Hq, Hkv, hd):
    """Whether attn_warps_body has an instance for these heads."""
    return hd in ATTN_WARPS_HD and Hq // Hkv in ATTN_WARPS_GQ


def attn_cached_smem(ch, hd):
    """attn_cached's shared memory at ch keys a chunk: keys and values (rows padded by 8), scores, p."""
    return ch * (2 * (hd + 8) + 2) * 4


def attn_chunk(hd, R, prof=None, ch=None):
    """Keys a chunk of attn_cached: 16 KB of keys (a few blocks), or ATTN_BATCH_CH (many blocks that share the
    SMs), or ch (a Decoder's DECODER_CH), halved until the chunk fits the device's shared memory a block (hd
    64: 256 keys, 146 KB, on an H200; 128 on 99 KB)."""
    ch = ch or (min(16384 // hd, 1024) if R <= MATVEC_ROWS else ATTN_BATCH_CH)
    while ch > 8 and not smem_fits(attn_cached_smem(ch, hd), prof):
        ch //= 2
    return ch


def attn_cached(qkv, kc, vc, out, state, rows, Hq, Hkv, hd, rope=None, rec=None, pdl=True, xn=None):
    """out = the attention of qkv's rows over the caches (their new rows already appended by rope_store); or,
    rope = (cos, sin) (attn_warps only, a row per stream), qkv as the product left it: rotated and appended
    here. rec (a Decoder's rows, a row per record): each row over its own slot and position, as one row alone;
    by attn_warps with rope or a bf16 output (the tensor-core path's steps and prompt passes, where warps_fit:
    starts() of 32 prompts of big 8.0 -> 6.5 ms against attn_cached_body's chunks); pdl=False where the rows'
    earlier keys are this pass's (a Decoder's prompts: see launch). xn (with rope: a Decoder's step): each
    row's residual (bf16), whose 1/rms scales its q|k|v first (see Decoder)."""
    R, ctx = qkv.shape[0], kc.shape[2]
    assert hd in ATTN_CACHED_HD and R % rows == 0 and Hq % Hkv == 0, (hd, R, rows, Hq, Hkv)
    assert rec is None or rows == 1
    assert xn is None or rope is not None and xn.dtype == BF and xn.shape[0] == R
    if rec is None and attn_warps(R, Hq, Hkv, hd) or rec is not None and (
            rope is not None or out.dtype == BF and warps_fit(Hq, Hkv, hd)):
        assert (rope is None or rows == 1) and warps_fit(Hq, Hkv, hd)       # many blocks that share the SMs
        cos, sin = rope or (NULL, NULL)
        k = _k(attn_warps_name(hd, Hq // Hkv, out.dtype == BF))
        return launch(k, (rows, Hkv, R // rows), (32 * ATTN_WARPS[0],),
                      (qkv, kc, vc, out, state, cos, sin, I32(rows), I32(Hkv), I32(ctx), F32(1.0 / math.sqrt(hd)),
                       NULL if rec is None else rec, NULL if xn is None else xn,
                       I32(0 if xn is None else xn.shape[1])), pdl=pdl)
    assert rope is None
    # keys a chunk: a few blocks (a Decoder's rows: DECODER_CH), or many that share
    # the SMs; either fitted to the device
    ch = attn_chunk(hd, R) if rec is None else attn_chunk(hd, 1, ch=DECODER_CH)
    smem = attn_cached_smem(ch, hd)
    k = _k(attn_cached_name(hd, out.dtype == BF, rec is not None))     # bf16 out: the batched decode step's
    shared_memory(k, smem)
    launch(k, (rows, Hq, R // rows), (ATTN_THREADS,),
           (qkv, kc, vc, out, state, I32(rows), I32(Hq), I32(Hkv), I32(ctx), F32(1.0 / math.sqrt(hd)), I32(ch))
           + (() if rec is None else (rec,)), shared_mem=smem, pdl=pdl)


# --- sampling: each stream's next id drawn on the device by pipeline.Sampling's rule, and the step's
#     position advanced ---

SAMPLING_SRC = cuda_source("sampling", ["sample_tokens", "sample_tokens_rec", "advance"], ROW_SRC + r"""
// block-wide exclusive prefix sum of one value per thread (in thread order); *total gets the sum
__device__ float block_scan(float v, float* total) {
    __shared__ float ws[33];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float inc = v;
    for (int o = 1; o < 32; o <<= 1) { float u = __shfl_up_sync(0xffffffffu, inc, o); if (lane >= o) inc += u; }
    if (lane == 31) ws[w] = inc;
    __syncthreads();
    if (w == 0) {
        float s = lane < nw ? ws[lane] : 0.f, si = s;
        for (int o = 1; o < 32; o <<= 1) { float u = __shfl_up_sync(0xffffffffu, si, o); if (lane >= o) si += u; }
        if (lane < nw) ws[lane] = si - s;
        if (lane == 31) ws[32] = si;
    }
    __syncthreads();
    float r = ws[w] + inc - v;
    *total = ws[32];
    __syncthreads();
    return r;
}
// The k-th largest of sv[0 .. V-1] (finite; k counts repeats), by radix select on the floats' order-keeping
// bit patterns: four passes of a 256-bin histogram of the next 8 bits among the values that share the bits
// found so far. Every thread gets it.
__device__ float kth_largest(const float* sv, int V, int k) {
    __shared__ int hist[256];
    __shared__ int found[2];                              // the digit, and k within it
    unsigned prefix = 0u, mask = 0u;
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) hist[threadIdx.x] = 0;
        __syncthreads();
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const unsigned b = __float_as_uint(sv[v]), u = b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
            if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x < 32) {                           // from the top digit down, to the one holding the k-th:
            const int lane = threadIdx.x;                 // lane l takes digits 255 - 8l .. 248 - 8l, the counts
            int c[8], loc = 0;                            // above its own by a scan over the lanes
#pragma unroll
            for (int i = 0; i < 8; i++) {
                c[i] = hist[255 - 8 * lane - i];
                loc += c[i];
            }
            int above = loc;
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, above, o);
                if (lane >= o) above += u;
            }
            above -= loc;
            if (above < k && k <= above + loc) {          // (one lane; one thread's walk: 21 -> 10 us a row)
                int kk = k - above, d = -1;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (d < 0) {
                        if (c[i] >= kk) d = i;
                        else kk -= c[i];
                    }
                found[0] = 255 - 8 * lane - d;
                found[1] = kk;
            }
        }
        __syncthreads();
        prefix |= (unsigned)found[0] << shift;
        mask |= 255u << shift;
        k = found[1];
        __syncthreads();
    }
    const unsigned b = (prefix >> 31) ? prefix ^ 0x80000000u : ~prefix;
    return __uint_as_float(b);
}
// One block (1024 threads) per stream: pipeline.Sampling's rule on logits row b. z = the logits, with the
// repetition penalty on the ids in seen; greedy takes the first argmax. Else z / temperature; the top_k
// largest are kept (ties with the k-th too); p = exp(z - max); then the smallest prefix of the descending
// order whose mass reaches top_p; the id is where the mass summed in id order first exceeds u * total,
// u = uni[step * streams + b], drawn on the host from --seed's generator. The descending order comes
// from a bitonic sort of (z, id) in shared memory over Vp = V rounded up to a power of two; without top_p
// only the k-th largest value matters (kth_largest; the sort took 82 us a row at V = 4096 on an H200). The id goes
// to tokens[step * streams + b], to state[2 + b] (the next step's input) and into seen. A Decoder's step
// (rec): row b's rule, u and seen row (its cache slot) from its record, and the id -1 where a logit is not
// finite; with idsh (page-locked host memory, which the device writes over the bus) the id also goes to
// idsh[(position & 1) * cap + b], where the host reads it once the step has ended (no copy of its own), and
// the record moves on to the next step: its position, and its next uniform number from unis (the row's, ldu
// apart), so that a step of the same rows needs nothing from the host.
__device__ __forceinline__ void sample_tokens_body(
        const float* __restrict__ logits, int ldl, int V, int Vp, int* __restrict__ seen,
        const float* __restrict__ uni, int* __restrict__ state, int* __restrict__ tokens,
        float temperature, int top_k, float top_p, float penalty, int* __restrict__ rec, int* __restrict__ idsh,
        int cap, const float* __restrict__ unis, int ldu) {
    extern __shared__ __align__(16) float sm[];
    dep_trigger();
    dep_wait();
    float* sv = sm;                                       // [Vp] keys, sorted in place
    int* si = reinterpret_cast<int*>(sm + Vp);            // [Vp] their ids
    float* pv = sm + 2 * Vp;                              // [V] the kept mass in id order
    int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x, streams = gridDim.x, step = state[1];
    int* rr = rec ? rec + ROW_REC * b : rec;              // its record (the Decoder's)
    if (rec) {
        temperature = __int_as_float(rr[ROW_TEMP]);
        top_k = rr[ROW_TOPK];
        top_p = __int_as_float(rr[ROW_TOPP]);
        penalty = __int_as_float(rr[ROW_PEN]);
    }
    const float* z = logits + (i64)b * ldl;
    int* sn = seen + (i64)(rec ? rr[ROW_SLOT] : b) * V;
    int bad = 0;
    for (int v = tid; v < Vp; v += nt) {
        float x = NEG_INF;
        if (v < V) {
            x = z[v];
            bad |= !isfinite(x);
            if (penalty != 1.f && sn[v]) x = x > 0.f ? x / penalty : x * penalty;
        }
        sv[v] = x;
        si[v] = v;
    }
    const bool anybad = __syncthreads_or(bad), fail = anybad && rec;   // (the Decoder's) a logit is not finite
    int tok;
    if (temperature <= 0.f) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int v = tid; v < V; v += nt) if (before(sv[v], v, bv, bi)) { bv = sv[v]; bi = v; }
        block_argmax(bv, bi);
        tok = bi;
    } else if (top_p >= 1.f && !anybad) {                // top_k alone: no order needed, only the k-th value
        float m = NEG_INF;
        int mi = 0x7fffffff;
        for (int v = tid; v < V; v += nt) {
            sv[v] = sv[v] / temperature;
            if (before(sv[v], v, m, mi)) { m = sv[v]; mi = v; }
        }
        block_argmax(m, mi);                              // (syncs: sv is complete)
        const float kth = (top_k > 0 && top_k < V) ? kth_largest(sv, V, top_k) : NEG_INF;
        for (int v = tid; v < V; v += nt) pv[v] = sv[v] >= kth ? expf(sv[v] - m) : 0.f;
        __syncthreads();
    } else {
        for (int v = tid; v < V; v += nt) sv[v] = sv[v] / temperature;
        __syncthreads();
        for (int k = 2; k <= Vp; k <<= 1)
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = tid; i < Vp; i += nt) {
                    int l = i ^ j;
                    if (l > i && ((i & k) == 0 ? before(sv[l], si[l], sv[i], si[i]) : before(sv[i], si[i], sv[l], si[l]))) {
                        float tv = sv[i]; sv[i] = sv[l]; sv[l] = tv;
                        int ti = si[i]; si[i] = si[l]; si[l] = ti;
                    }
                }
                __syncthreads();
            }
        float m = sv[0], kth = (top_k > 0 && top_k < V) ? sv[top_k - 1] : NEG_INF, total;
        int C = (Vp + nt - 1) / nt, j0 = min(tid * C, Vp), j1 = min(j0 + C, Vp);
        float loc = 0.f;
        for (int j = j0; j < j1; j++) loc += sv[j] >= kth ? expf(sv[j] - m) : 0.f;
        float run = block_scan(loc, &total);              // mass before this thread's part of the order
        float cut = top_p < 1.f ? top_p * total : __int_as_float(0x7f800000);
        for (int j = j0; j < j1; j++) {
            float p = sv[j] >= kth ? expf(sv[j] - m) : 0.f;
            if (si[j] < V) pv[si[j]] = (j == 0 || run < cut) ? p : 0.f;
            run += p;
        }
        __syncthreads();
    }
    if (temperature > 0.f) {                              // the id where the mass in id order passes u * total
        float total;
        const int C = (V + nt - 1) / nt, j0 = min(tid * C, V), j1 = min(j0 + C, V);
        float loc = 0.f;
        for (int v = j0; v < j1; v++) loc += pv[v];
        float run = block_scan(loc, &total);
        float target = (rec ? __int_as_float(rr[ROW_UNI]) : uni[(i64)step * streams + b]) * total;
        int first = V - 1;
        for (int v = j0; v < j1; v++) {
            run += pv[v];
            if (run > target) { first = v; break; }
        }
        float fv = -(float)first;                         // the smallest id: the argmax of -id
        block_argmax(fv, first);
        tok = first;
    }
    if (fail) tok = -1;
    if (tid == 0) {
        tokens[(i64)step * streams + b] = tok;
        state[2 + b] = max(tok, 0);
        if (tok >= 0) sn[tok] = 1;
        if (idsh != nullptr) {
            idsh[(rr[ROW_POS] & 1) * cap + b] = tok;
            if (rr[ROW_SLOT] != 0) {                      // (slot 0: a bucket's padding rows stay)
                rr[ROW_POS] += 1;
                rr[ROW_UIX] += 1;
                rr[ROW_UNI] = __float_as_int(unis[(i64)(rr[ROW_SLOT] - 1) * ldu + rr[ROW_UIX]]);
            }
        }
    }
}
// the Sampler's (no records: the null rec folds away) and the Decoder's
extern "C" __global__ void __launch_bounds__(1024) sample_tokens(
        const float* __restrict__ logits, int ldl, int V, int Vp, int* __restrict__ seen,
        const float* __restrict__ uni, int* __restrict__ state, int* __restrict__ tokens,
        float temperature, int top_k, float top_p, float penalty) {
    sample_tokens_body(logits, ldl, V, Vp, seen, uni, state, tokens, temperature, top_k, top_p, penalty, nullptr,
                       nullptr, 0, nullptr, 0);
}
extern "C" __global__ void __launch_bounds__(1024) sample_tokens_rec(
        const float* __restrict__ logits, int ldl, int V, int Vp, int* __restrict__ seen,
        const float* __restrict__ uni, int* __restrict__ state, int* __restrict__ tokens,
        float temperature, int top_k, float top_p, float penalty, int* __restrict__ rec, int* __restrict__ idsh,
        int cap, const float* __restrict__ unis, int ldu) {
    sample_tokens_body(logits, ldl, V, Vp, seen, uni, state, tokens, temperature, top_k, top_p, penalty, rec, idsh,
                       cap, unis, ldu);
}
extern "C" __global__ void advance(int* state, int dpos, int dstep) {
    dep_wait();
    state[0] += dpos;
    state[1] += dstep;
}
""")


def sampling_smem(V):
    """sample_tokens' shared memory: keys and ids of V rounded up to a power of two, the kept mass."""
    return (2 * (1 << max(V - 1, 1).bit_length()) + V) * 4


def sample_tokens(logits, seen, uni, state, tokens, sampling, rec=None, idsh=None, unis=None):
    """One id per stream from logits (streams, >= V) by sampling's rule; see SAMPLING_SRC. rec (a Decoder's):
    one id per row of logits by its record's rule, u and seen row (sampling unused); idsh (page-locked, 2 x
    rows at most) and unis (a Decoder's step): the ids to the host, and the records one step on."""
    streams, V = logits.shape[0], seen.shape[1]
    smem = sampling_smem(V)
    if not smem_fits(smem):
        raise UserError(f"sampling from {V} ids takes {smem >> 10} KB of shared memory a block, over the "
                        f"{PROFILE.smem_block >> 10} KB of {PROFILE.name}; generate with nanoeuler.py")
    Vp = 1 << max(V - 1, 1).bit_length()
    k = _k("sample_tokens" if rec is None else "sample_tokens_rec")
    shared_memory(k, smem)                         # with its static shared memory, over 48 KB from V = 4096
    launch(k, (streams,), (1024,), (logits, I32(logits.shape[1]), I32(V), I32(Vp), seen, uni, state, tokens,
                                    F32(sampling.temperature), I32(sampling.top_k), F32(sampling.top_p),
                                    F32(sampling.repetition_penalty))
           + (() if rec is None else (rec, NULL if idsh is None else np.uint64(idsh.ctypes.data),
                                      I32(0 if idsh is None else idsh.size // 2), NULL if unis is None else unis,
                                      I32(0 if unis is None else unis.shape[1]))), shared_mem=smem)


def advance(state, dpos, dstep):
    """state[0] += dpos (the position), state[1] += dstep (the step)"""
    launch(_k("advance"), (1,), (1,), (state, I32(dpos), I32(dstep)))


# --- speculation: greedy speculative decoding's rounds decided on the device ---

SPEC_SRC = cuda_source("spec", ["argmax_heads", "spec_round"], r"""
// greedy speculative decoding: the first argmax of each head at each row; one block per (row, head)
extern "C" __global__ void argmax_heads(const float* __restrict__ logits, int V, int* __restrict__ out) {
    dep_trigger();
    dep_wait();
    const float* z = logits + (i64)blockIdx.x * V;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int v = threadIdx.x; v < V; v += blockDim.x) if (before(z[v], v, bv, bi)) { bv = z[v]; bi = v; }
    block_argmax(bv, bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}
// A round of greedy speculative decoding (pl.speculative_decode's rule, drafts in a chain) decided on the
// device, so that rounds replay without the host. The round's forward ran state[2 ..] = [z, d_1 .. d_K-1] at
// positions state[0] ..; am (K rows, K heads) holds its argmaxes. Head 0 keeps the drafts equal to its
// argmax, in order, at most m of them (m: the drafts that fit max_new and the context); the round emits
// head 0's ids at rows 0 .. n_ok (the last only if it fits), caches z and the kept drafts, and sets up the
// next round: [head 0's id at row n_ok, heads 1 .. there]. spec = [produced, drafted, accepted, max_new,
// done, position]; a done round changes nothing (a graph may replay a few past the end). start > 0: the
// prompt's last row (am row 0) at position `start` begins a generation of max_new ids.
extern "C" __global__ void spec_round(const int* __restrict__ am, int K, int* __restrict__ state,
                                      int* __restrict__ tokens, int* __restrict__ spec, int ctx, int start,
                                      int max_new) {
    dep_wait();                                           // (one thread)
    if (start > 0) { spec[0] = spec[1] = spec[2] = spec[4] = 0; spec[3] = max_new; }
    if (spec[4]) return;
    const int produced = spec[0], len = start > 0 ? start : state[0] + 1;     // len: the ids, z included
    int n_ok = 0, m = 0, emit = 1;
    if (start == 0) {
        max_new = spec[3];
        m = min(K - 1, min(max_new - produced, ctx - len));
        while (n_ok < m && state[3 + n_ok] == am[n_ok * K]) n_ok++;
        emit = n_ok + (n_ok < m || (produced + m < max_new && len + m < ctx));
    }
    for (int i = 0; i < emit; i++) tokens[produced + i] = am[i * K];
    for (int k = 0; k < K; k++) state[2 + k] = am[n_ok * K + k];
    const int pos = start > 0 ? start : state[0] + 1 + n_ok;
    state[0] = spec[5] = pos;
    spec[0] = produced + emit;
    spec[1] += m;
    spec[2] += n_ok;
    spec[4] = produced + emit >= max_new || pos + 1 >= ctx;
}
""")


def argmax_heads(logits, V, out):
    """out[r * heads + k] = the first argmax of head k's logits at row r; logits (R, heads * V)."""
    launch(_k("argmax_heads"), (logits.size // V,), (256,), (logits, I32(V), out))


def spec_round(am, K, state, tokens, spec, ctx, start=0, max_new=0):
    """A greedy speculative round decided on the device (or, start > 0, a generation's beginning); see
    SPEC_SRC."""
    launch(_k("spec_round"), (1,), (1,), (am, I32(K), state, tokens, spec, I32(ctx), I32(start), I32(max_new)))


GEN_CHUNK = 8       # decode steps (speculative: rounds) replayed between two reads of the new ids by the host
MAX_GRAPHS = 64     # a sampler's captured graphs at most


class Sampler:
    """Generation from fp32 weights: P is DeviceParams (shared, not copied: a training run samples its live
    weights) or host Params (uploaded). Caches for `streams` sequences: generate() uses one, generate_batch()
    up to `streams`. graphs=False launches every kernel from Python instead of replaying graphs. bf16=False:
    no bf16 copy of the weights for batches of many streams (a Decoder makes its own)."""

    def __init__(self, P, streams=1, graphs=True, bf16=True):
        gpu()
        if isinstance(P, pl.Params):
            dp = DeviceParams(P.cfg)
            dp.upload(P)
            P = dp
        cfg = self.cfg = P.cfg
        if cfg.head_dim not in ATTN_CACHED_HD:
            raise UserError(f"GPU generation takes head dims {', '.join(map(str, ATTN_CACHED_HD))}; this model has "
                            f"{cfg.head_dim}: generate with nanoeuler.py")
        check_width(cfg)
        self.P, self.streams, self.graphs = P, streams, graphs
        ctx, D, F, L, V, K = cfg.ctx, cfg.dim, cfg.ffn, cfg.n_layers, cfg.vocab, cfg.n_mtp
        hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        R = max(ctx, streams, K)                 # rows: a prompt, a step of every stream, a verify step
        e = lambda *s: cp.empty(s, np.float32)
        self.x, self.h = e(R, D), e(R, D)                # the residual stream; RMSNorm's output (cuBLAS path)
        self.qkv, self.att = e(R, (Hq + 2 * Hkv) * hd), e(R, Hq * hd)
        self.gu, self.act, self.r = e(R, 2 * F), e(R, F), e(R)
        self.lse = e(Hq * ctx)
        self.logits = e(max(streams, K) * K * V)
        # K positions past the context: a speculative round verifies K rows wherever it starts (the rows past
        # what it keeps are rewritten before they are read), and its graph may replay after the end. One array
        # (keys and values, layers, streams, ...): a prompt is copied to every stream in one launch
        self.kv = cp.zeros((2, L, streams, Hkv, ctx + K, hd), np.float32)
        self.kc, self.vc = list(self.kv[0]), list(self.kv[1])           # each layer's, (streams, Hkv, ctx + K, hd)
        # device state [pos, step, the step's input ids] and its pinned host staging; what graphs read
        # must keep its address, so every buffer is made here once
        self.state, self._state_h = cp.zeros(2 + R, np.int32), _pinned(2 + R)
        self.seen = cp.zeros((streams, V), np.int32)                     # ids in each stream's text
        self.uni = cp.zeros(ctx * streams, np.float32)                   # uniform numbers, (step, stream)
        self.tokens, self._tokens_h = cp.zeros(ctx * streams, np.int32), _pinned(ctx * streams)
        self.argmax = cp.zeros(K * K, np.int32)                             # a round's heads' argmaxes
        self._logits_h = _pinned(K * K * V, np.float32)
        self.spec, self._spec_h = cp.zeros(6, np.int32), _pinned(2 * 6)        # spec_round's; a host slot a chunk
        cos, sin = pl.rope_tables(ctx + K, hd, np.float64)
        self.cos, self.sin = cp.asarray(cos.astype(np.float32)), cp.asarray(sin.astype(np.float32))
        # a decode step of more than MATVEC_ROWS streams: bf16 weights and GEMM inputs, fp32 accumulation and
        # outputs (half the bytes of fp32 weights: 64 streams of big, 77K -> 94-100K tokens/s); the copy is
        # refreshed from P before each batch (a training run's sampler reads live weights)
        self.Pb = DeviceParams(cfg, dtype=BF) if streams > MATVEC_ROWS and bf16 and PROFILE.bf16 else None
        if self.Pb is not None:                  # the products' bf16 inputs: RMSNorm's output, attention's, SwiGLU's
            self.hb, self.attb, self.actb = (cp.empty((streams, n), BF) for n in (D, Hq * hd, F))
        self.stream = cp.cuda.Stream()           # blocking: ordered with the default stream that training uses
        self._graphs = {}
        self.pos = 0                             # the cache holds positions 0 .. pos-1 (host's copy)

    # --- the passes ---
    def _linear(self, out, x, names, epi, norm=None, layer=None, rows=1, bf=False, rec=None):
        """out = epi(x' @ W.T), W the matrices names (first, last) stacked, x' = RMSNorm(x) * norm or x
        (matvec's epilogues; layer, rows: the caches and rows per stream of 'rope'): one matvec kernel for a
        decode step (exact whatever its row count; rec: a Decoder's, any row count); for more rows, RMSNorm,
        cuBLAS and the epilogue's own kernel: fp32 products, or (bf) bf16 weights and inputs with fp32
        accumulation and output."""
        R, cfg = x.shape[0], self.cfg
        rope = None if epi != "rope" else (self.kc[layer], self.vc[layer], self.cos, self.sin, self.state, rows,
                                           cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        if (R <= MATVEC_ROWS or rec is not None) and matvec_fits(self.P.rows(*names)):
            return matvec(out, x, self.P.rows(*names), epi, norm, rope, rec)
        assert rec is None or epi != "rope", "a Decoder's qkv product takes matvec (its rows' slots and positions)"
        if norm is not None:
            h = self.hb[:R] if bf else self.h[:R]
            rmsnorm_fwd(x, norm, h, self.r[:R])
            x = h
        C, beta = self.gu[:R] if epi == "glu" else out, 1.0 if epi == "add" else 0.0
        if bf:
            mm(C, x, self.Pb.rows(*names), tb=True, beta=beta)
        else:
            sgemm_nt(C, x, self.P.rows(*names), beta=beta)
        if epi == "glu":
            swiglu_fwd(self.gu[:R], out)
        elif epi == "rope":
            rope_store(out, *rope)

    def _lg(self, rows, heads):
        """The logits buffer as (rows, heads * V)."""
        n = heads * self.cfg.vocab
        return self.logits[:rows * n].reshape(rows, n)

    def _forward(self, rows, streams, heads, prefill=False, rec=None):
        """The model over `rows` new ids per stream (state[2:], row = stream * rows + t) at positions
        state[0] + t, appended to the caches; -> heads' logits of each row in _lg (prefill: the last row).
        Up to MATVEC_ROWS rows take matvec, each row's result the same for any row count; more take cuBLAS:
        a prompt in fp32, a decode step of many streams from bf16 weights (ids may differ from fp32's where
        two logits nearly tie). rec (a Decoder's step, rows = 1): each stream's cache slot and position from
        its record, every product by matvec and every row's attention as a lone row's."""
        cfg, P, R = self.cfg, self.P, rows * streams
        bf = not prefill and R > MATVEC_ROWS and rec is None and self.Pb is not None
        hd, Hq, Hkv, L = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers
        x, qkv = self.x[:R], self.qkv[:R]
        att, act = (self.attb[:R], self.actb[:R]) if bf else (self.att[:R], self.act[:R])
        embed_fwd(P["tok_emb"], self.state[2:2 + R], x)
        fold = bf and rows == 1 and attn_warps(R, Hq, Hkv, hd)      # the attention rotates and appends
        for l in range(L):
            p = f"layers.{l}."
            self._linear(qkv, x, (p + "wq", p + "wv"), "out" if fold else "rope", P[p + "attn_norm"], l, rows, bf,
                         rec)
            if prefill and hd in (32, 64) and flash_fits(hd, train=False):  # the prompt starts at 0
                flash_fwd(qkv, att, self.lse[:Hq * rows].reshape(1, Hq, rows), 1, rows, Hq, Hkv, hd)
            else:
                attn_cached(qkv, self.kc[l], self.vc[l], att, self.state, rows, Hq, Hkv, hd,
                            (self.cos, self.sin) if fold else None, rec)
            self._linear(x, att, (p + "wo",) * 2, "add", bf=bf, rec=rec)                 # x += attention
            self._linear(act, x, (p + "w1", p + "w3"), "glu", P[p + "ffn_norm"], bf=bf, rec=rec)
            self._linear(x, act, (p + "w2",) * 2, "add", bf=bf, rec=rec)                 # x += ffn
        last = x[R - 1:R] if prefill else x
        self._linear(self._lg(len(last), heads), last, ("heads.0", f"heads.{heads - 1}"), "out", P["norm"], bf=bf,
                     rec=rec)

    def _prefill(self, ids, streams, heads):
        """The prompt into stream 0's cache (copied to streams 1..), its last row's logits in _lg rows
        0..streams-1, each stream's seen ids set; state = [0, 0] after."""
        Tn, V = len(ids), self.cfg.vocab
        self._set_state(0, ids)
        self._run(("prefill", Tn, heads), lambda: self._forward(Tn, 1, heads, prefill=True))
        if streams > 1:
            lg = self._lg(streams, heads)
            lg[1:] = lg[0]
            self.kv[:, :, 1:streams, :, :Tn] = self.kv[:, :, :1, :, :Tn]
        self.seen[:streams] = cp.asarray((np.bincount(ids, minlength=V)[:V] > 0).astype(np.int32))
        self.pos = Tn

    def _set_state(self, pos, ids):
        """state = [pos, 0, ids] in one copy (the host buffer is free: every use ends in a sync)."""
        h = self._state_h
        h[0], h[1], h[2:2 + len(ids)] = pos, 0, ids
        self.state[:2 + len(ids)].set(h[:2 + len(ids)], stream=self.stream)

    def _run(self, key, fn):
        """fn's kernels: launched on first use (which also compiles them), captured as a CUDA graph, then
        replayed: one launch for a whole step. Everything fn reads is a fixed buffer or baked into key."""
        g = self._graphs.pop(key, None)
        if g is not None:
            self._graphs[key] = g                # the least recently used goes first (a server's prompt lengths)
            return g.launch(self.stream)
        fn()
        if not self.graphs:
            return
        graph = capture(self.stream, fn, f"generation ({key[0]})")
        if graph is None:
            self.graphs = False
            return
        if len(self._graphs) >= MAX_GRAPHS:      # a server's many sampling settings: the oldest goes
            del self._graphs[next(iter(self._graphs))]
        self._graphs[key] = graph

    def _on_stream(self):
        """The sampler's kernels and cuBLAS calls on its own stream (capture needs one), until closed."""
        return on_stream(self.stream)

    def _copy_back(self, *copies):
        """Queues (dev, host, n) copies of the first n items of device buffers into their pinned host copies
        on the sampler's stream; -> an event that completes once they have landed."""
        for dev, host, n in copies:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, n * dev.itemsize, 2, self.stream.ptr)
        return self.stream.record()

    def _host(self, dev, host, n):
        """The first n items of a device buffer, through its pinned copy (a sync)."""
        self._copy_back((dev, host, n)).synchronize()
        return host[:n]

    # --- plain decoding: the id drawn on the device; the host reads the ids every GEN_CHUNK steps ---
    def _plain(self, ids, max_new, sampling, rng, streams):
        """Yields (steps, streams) arrays of ids, GEN_CHUNK steps at a time, up to max_new or the context."""
        n = min(max_new, self.cfg.ctx - len(ids))
        key = ("plain", streams) + tuple(asdict(sampling).values())
        with self._on_stream():
            if self.Pb is not None:
                to_bf16(self.P.flat, self.Pb.flat)
            self._prefill(ids, streams, 1)
            if sampling.temperature > 0:         # the numbers the CPU engine draws, in its order
                self.uni[:n * streams].set(rng.random(n * streams).astype(np.float32), stream=self.stream)
            sample_tokens(self._lg(streams, 1), self.seen[:streams], self.uni, self.state, self.tokens, sampling)
            advance(self.state, len(ids), 1)
        made, queued, chunks = 1, 0, []          # steps made; steps whose copy is queued; chunks not yet read
        while True:
            with self._on_stream():              # a chunk stays queued behind the one read: the device never idles
                while len(chunks) < 2 and queued < n:
                    for _ in range(min(GEN_CHUNK, n - made)):
                        self._run(key, lambda: self._decode_step(streams, sampling))
                        made += 1
                    a = queued * streams                 # the chunk's ids to the host
                    chunks.append((self._copy_back((self.tokens[a:], self._tokens_h[a:], (made - queued) * streams)),
                                   queued, made))
                    queued = made
            if not chunks:
                break
            ev, lo, hi = chunks.pop(0)
            ev.synchronize()
            yield self._tokens_h[lo * streams:hi * streams].reshape(hi - lo, streams).copy()
        self.pos = len(ids) + n - 1

    def _decode_step(self, streams, sampling):
        self._forward(1, streams, 1)
        sample_tokens(self._lg(streams, 1), self.seen[:streams], self.uni, self.state, self.tokens, sampling)
        advance(self.state, 1, 1)

    # --- speculative decoding: greedy rounds decided on the device; any other rule through forward() ---
    def _speculative(self, ids, max_new, stats):
        """Greedy speculative decoding of one stream (spec_round): yields pl.speculative_decode's greedy ids.
        The host queues rounds (a graph each), as many as the ids still due need at the rate seen so far (a
        round past the end costs a whole forward), and reads the new ids after each chunk."""
        K, V, ctx = self.cfg.n_mtp, self.cfg.vocab, self.cfg.ctx
        n = min(max_new, ctx - len(ids))                    # the ids it yields
        spec_h, chunks, slot = self._spec_h.reshape(2, 6), [], 0

        def read_back(rounds):       # after `rounds` more: spec (a slot a chunk; two in flight) and the ids
            nonlocal slot
            chunks.append((self._copy_back((self.spec, spec_h[slot], 6), (self.tokens, self._tokens_h, n)), rounds,
                           slot))
            slot ^= 1

        def round_():
            self._forward(K, 1, K)
            argmax_heads(self._lg(K, K), V, self.argmax)
            spec_round(self.argmax, K, self.state, self.tokens, self.spec, ctx)
        with self._on_stream():
            self._prefill(ids, 1, K)
            argmax_heads(self._lg(1, K), V, self.argmax)
            spec_round(self.argmax, K, self.state, self.tokens, self.spec, ctx, len(ids), n)
            read_back(0)
        spec, got, rounds, queued = [1, 0, 0, n, 0, 0], 0, 0, 0  # spec as last read; ids and rounds read; rounds queued
        while True:
            with self._on_stream():
                while len(chunks) < 2 and not spec[4]:
                    rate = max((spec[0] - 1) / rounds if rounds else K, 1)  # ids a round (at first the most possible)
                    g = min(GEN_CHUNK, math.ceil((n - spec[0]) / rate) - queued)
                    if g <= 0:
                        break
                    for _ in range(g):
                        self._run(("spec",), round_)
                    queued += g
                    read_back(g)
            if not chunks:
                break
            ev, g, done = chunks.pop(0)
            ev.synchronize()
            spec, rounds, queued = spec_h[done].copy(), rounds + g, queued - g
            yield from (int(t) for t in self._tokens_h[got:spec[0]])
            got = spec[0]
            if spec[4]:                  # done: a chunk still queued only replays rounds that change nothing
                break
        if stats is not None and spec[1]:          # (pl.speculative_decode counts rounds, and there were some)
            stats["drafted"] = stats.get("drafted", 0) + int(spec[1])
            stats["accepted"] = stats.get("accepted", 0) + int(spec[2])
        self.pos = int(spec[5])

    def forward(self, ids):
        """ids appended to the cache at positions pos.. (the prompt, prefilled, when the cache is empty)
        -> every head's logits at each, (rows, n_mtp, V) on the host (the prompt: its last row). The forward
        of pl.speculative_decode's rounds that sample, and of the tests."""
        K, V = self.cfg.n_mtp, self.cfg.vocab
        with self._on_stream():
            if self.pos == 0:
                self._prefill(ids, 1, K)
                rows = 1
            else:
                rows = len(ids)
                self._set_state(self.pos, ids)
                self._run(("verify", rows), lambda: self._forward(rows, 1, K))
                self.pos += rows
            return self._host(self.logits, self._logits_h, rows * K * V).reshape(rows, K, V).copy()

    # --- the interface of both engines ---
    def generate(self, prompt_ids, max_new, sampling=None, rng=None, speculative=False, stats=None):
        """Yields up to max_new ids after the prompt (stops at the context), like nanoeuler.generate: the
        same rule, and with the same seed the same random numbers in the same order."""
        sampling = sampling or pl.Sampling()
        rng = rng if rng is not None else np.random.default_rng(0)
        pl.check_prompt(len(prompt_ids), self.cfg.ctx)
        self.pos = 0
        if speculative and self.cfg.n_mtp > 1:
            if sampling.temperature <= 0 and sampling.repetition_penalty == 1.0:
                yield from self._speculative(list(prompt_ids), max_new, stats)
                return
            yield from pl.speculative_decode(self.forward, lambda n: setattr(self, "pos", n), prompt_ids, max_new,
                                             sampling, rng, stats, self.cfg.n_mtp, self.cfg.ctx)
            return
        for chunk in self._plain(list(prompt_ids), max_new, sampling, rng, 1):
            yield from (int(t) for t in chunk[:, 0])

    def generate_batch(self, prompt_ids, n, max_new, sampling, rng, arrivals=None):
        """n continuations of one prompt in one batch (plain decoding); -> n lists of ids. arrivals (a list)
        gets (ids so far in all streams, time.perf_counter()) as each chunk comes (sample's speed line)."""
        if n > self.streams:
            raise UserError(f"--samples {n}: this sampler holds {self.streams} streams")
        pl.check_prompt(len(prompt_ids), self.cfg.ctx)
        chunks = []
        for chunk in self._plain(list(prompt_ids), max_new, sampling, rng, n):
            chunks.append(chunk)
            if arrivals is not None:
                arrivals.append((n * sum(map(len, chunks)), time.perf_counter()))
        out = np.concatenate(chunks)
        return [out[:, r].tolist() for r in range(n)]


# --- a Decoder step's residual products on tensor cores: x += a W^T for wo and w2 (dec_add). cuBLAS covers
#     big's w2 (768 x 2048) with a few long tiles, 5.9-6.2 us a launch at any row count, and starts only once
#     the kernel ahead has ended; dec_add splits K over the warps of 48 blocks (big) and loads its weights
#     before dep_wait, while attention or SwiGLU still run (they let it start: dep_trigger). A step of big at
#     1 / 64 rows: 0.472-0.506 / 0.582-0.616 -> 0.446 / 0.586 ms (H200, one process) ---

DEC_ADD_SRC = cuda_source("dec_add", ["dec_add"], MMA_SRC + r"""
// x (rows, N) bf16 += a (rows, K) bf16 W^T, W (N, K) bf16, fp32 sums (as cuBLAS: x = bf16(sum + x)). A block: 16
// rows of W (the mma's A operand) by a tile of 16 rows of a (two n8 B operands; blockIdx.y), K in pairs of
// k-steps (32 k) split over its 8 warps in fixed slices, each warp's partial sums added in warp order: a row's
// sums are the same whatever the rows of the launch. In a pair each lane takes 8 consecutive k of its rows of W
// and of a (16-byte loads): the first 4 as k-step one's k = 2t, 2t+1, 2t+8, 2t+9 (t = lane % 4), the rest as k-step
// two's, the same order on both sides of the sum. A warp holds its first DA_PAIRS pairs of W in registers,
// loaded before dep_wait (the weights stream in while the kernel ahead runs). Needs N % 16 == 0, K % 32 == 0.
#define DA_WARPS 8
#define DA_PAIRS 8
extern "C" __global__ void __launch_bounds__(32 * DA_WARPS) dec_add(const bf16* __restrict__ W,
                                                                   const bf16* __restrict__ a, bf16* __restrict__ x,
                                                                   int N, int K) {
    __shared__ float part[DA_WARPS][16][17];              // each warp's sums: 16 of W's rows x 16 rows of a
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, r0 = blockIdx.y * 16, KP = K / 32, per = (KP + DA_WARPS - 1) / DA_WARPS;
    const int p0 = min(warp * per, KP), p1 = min(p0 + per, KP);
    const uint4* w0 = reinterpret_cast<const uint4*>(W + (i64)(n0 + g) * K + 8 * t);       // row g; + 8 K: g + 8
    const uint4* x0 = reinterpret_cast<const uint4*>(a + (i64)(r0 + g) * K + 8 * t);       // row g; + 8 K: g + 8
    const int K8 = K / 8;                                 // uint4s a row
    uint4 wa[DA_PAIRS], wb[DA_PAIRS];
#pragma unroll
    for (int i = 0; i < DA_PAIRS; i++)
        if (p0 + i < p1) { wa[i] = w0[(p0 + i) * 4]; wb[i] = w0[8 * K8 + (p0 + i) * 4]; }
    dep_wait();
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};    // rows r0 + 0..7, r0 + 8..15
    for (int q = p0; q < p1; q += DA_PAIRS) {
#pragma unroll
        for (int i = 0; i < DA_PAIRS; i++) {
            if (q + i >= p1) break;
            if (q > p0) { wa[i] = w0[(q + i) * 4]; wb[i] = w0[8 * K8 + (q + i) * 4]; }
            const uint4 xa = x0[(q + i) * 4], xb = x0[8 * K8 + (q + i) * 4];
            const unsigned s1[4] = {wa[i].x, wb[i].x, wa[i].y, wb[i].y}, s2[4] = {wa[i].z, wb[i].z, wa[i].w, wb[i].w};
            fb_mma(c0, s1, xa.x, xa.y);
            fb_mma(c1, s1, xb.x, xb.y);
            fb_mma(c0, s2, xa.z, xa.w);
            fb_mma(c1, s2, xb.z, xb.w);
        }
    }
    // c: lane holds W rows g (c[0], c[1]) and g + 8 (c[2], c[3]), rows of a 2t and 2t + 1 of its n8 tile
    part[warp][g][2 * t] = c0[0];     part[warp][g][2 * t + 1] = c0[1];
    part[warp][g + 8][2 * t] = c0[2]; part[warp][g + 8][2 * t + 1] = c0[3];
    part[warp][g][8 + 2 * t] = c1[0];     part[warp][g][8 + 2 * t + 1] = c1[1];
    part[warp][g + 8][8 + 2 * t] = c1[2]; part[warp][g + 8][8 + 2 * t + 1] = c1[3];
    __syncthreads();
    const int f = threadIdx.x & 15, r = threadIdx.x >> 4;  // 256 threads: one (W row, row of a) each
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < DA_WARPS; w++) sum += part[w][f][r];
    bf16* o = x + (i64)(r0 + r) * N + n0 + f;
    *o = f2bf(sum + bf2f(*o));
}
""")


def dec_add_fits(W, a):
    """Whether dec_add takes the product of a with W (N, K): its shape, and 16-byte rows."""
    return W.shape[0] % 16 == 0 and W.shape[1] % 32 == 0 and W.data.ptr % 16 == 0 and a.data.ptr % 16 == 0


def dec_add(x, a, W, rows):
    """x[:rows'] += a[:rows'] W^T (all bf16; rows' = rows rounded up to 16: x and a must hold them), a
    programmatic launch (see DEC_ADD_SRC)."""
    (N, K), tiles = W.shape, -(-rows // 16)
    assert dec_add_fits(W, a) and x.shape[1] == N and a.shape[1] == K and min(x.shape[0], a.shape[0]) >= 16 * tiles
    launch(_k("dec_add"), (N // 16, tiles), (256,), (W, a, x, I32(N), I32(K)))


DECODER_MAX = 64                              # a Decoder's rows (concurrent requests) at most
DECODER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)    # a step's rows rounded up to one of these: a CUDA graph each
DECODER_MEMORY = 0.5                          # the part of the free device memory a default Decoder's caches take
PREFILL_ROWS = 512                            # prompt rows a pass of a Decoder's starts() (at most the context)


def decoder_capacity(cfg, free=None):
    """A Decoder's rows by default: the caches (and the prefill's) that DECODER_MEMORY of the device's free
    memory holds, at most DECODER_MAX."""
    if free is None:
        pool, free = cp.get_default_memory_pool(), cp.cuda.runtime.memGetInfo()[0]
        if pool.get_limit():                            # an emulated profile caps the pool (_start_profile)
            free = min(free, pool.get_limit() - pool.used_bytes())
    per = (2 * cfg.n_layers * cfg.n_kv_heads * (cfg.ctx + cfg.n_mtp) * cfg.head_dim + cfg.vocab) * 4
    return max(1, min(DECODER_MAX, int(free * DECODER_MEMORY) // per - 1))


class Decoder(Sampler):
    """Continuous batching (serve.py's decoder: start(s), step, free; one thread uses it): `capacity` rows, each a
    request with its own prompt, position, sampling rule and random generator, decoded together a step at a time. A
    row's ids depend on its own prompt, rule and seed alone, never on the other rows or on how many there are. Row
    i's cache is stream i + 1 (stream 0: the scratch of padding rows). starts() packs the prompts' rows in passes of
    _mp rows (prefill, at most the context; a CUDA graph) and draws each prompt's first id after the pass that ends
    it. A step runs the active rows as the smallest bucket of DECODER_BUCKETS that holds them (the rows past them:
    stream 0 at position 0, greedy; what they write no live row reads), a CUDA graph each. Both take _forward_tc:
    a bf16 residual stream, every product on the tensor cores from bf16 weights (the norms' folded in), cuBLAS
    at a fixed number of rows (DECODER_MAX a step, _mp a pass; a step's wo and w2: dec_add), each row's
    attention over its own slot (a step: attn_warps, which rotates and appends the row; a pass: rope_store, then
    attn_warps), then sample_tokens per row. On a GPU without bf16 every product is matvec's,
    every attention a lone row's, and a prompt the Sampler's prefill as one stream, copied to the row's slot; a
    row's ids there equal the Sampler's for its prompt. Each row takes one uniform number a step (its first id too),
    greedy or not, the Sampler's numbers in its order: drawn at start, as many as the context leaves (rng.random(n)
    gives n calls' numbers; a call a row took ~0.2 ms a step at 64 rows; they go to the device at start too). The
    host sends the rows' records and input ids in one copy, only where the rows changed: a step moves its rows'
    records on itself, and writes their ids into page-locked memory the host reads (no copies between the steps
    of the same rows: a lone row's step of big 0.49 -> 0.475 ms). It launches the same rows' next step before it
    returns (step(): one ahead), so the device works while serve handles the ids."""
    _POS, _UNI, _UIX = DEC_FIELDS.index("POS"), DEC_FIELDS.index("UNI"), DEC_FIELDS.index("UIX")
    _SCALARS = pl.Sampling(0)            # sample_tokens' scalar rule, unused where it reads the records

    def __init__(self, P, capacity=None, graphs=True, prefill=PREFILL_ROWS):
        gpu()
        capacity = capacity or decoder_capacity(P.cfg)
        if not 1 <= capacity <= DECODER_MAX:
            raise UserError(f"a batch of {capacity} rows: the GPU engine takes 1 to {DECODER_MAX}")
        super().__init__(P, streams=capacity + 1, graphs=graphs, bf16=False)
        self.capacity, self.ctx = capacity, self.cfg.ctx
        if PROFILE.bf16:                 # _forward_tc's weights and buffers (serve's weights are fixed)
            cfg, self._mp = self.cfg, min(prefill, self.x.shape[0])
            M = max(DECODER_MAX, self._mp)
            assert self.x.shape[0] >= M
            self.Pb = DeviceParams(cfg, dtype=BF)
            to_bf16(self.P.flat, self.Pb.flat)
            for l in range(cfg.n_layers):        # each norm's weight folded into the products it feeds (so
                                                 # these are not the Sampler's Pb: generate() would undo them)
                p = f"layers.{l}."
                for norm, first, last in (("attn_norm", "wq", "wv"), ("ffn_norm", "w1", "w3")):
                    to_bf16(self.P.rows(p + first, p + last) * self.P[p + norm], self.Pb.rows(p + first, p + last))
            self.xb, self.hb, self.attb, self.actb = (cp.zeros((M, n), BF) for n in (
                cfg.dim, cfg.dim, cfg.n_heads * cfg.head_dim, cfg.ffn))
            self.lg = cp.zeros((M, cfg.vocab), np.float32)
            self._pass = cp.zeros(DEC_REC * self._mp + 2 + self._mp, np.int32)   # a prompt pass's [records | state]
            self._firsts = cp.zeros(capacity + 1, np.int32)                        # the first ids of starts()
        self.buckets = [b for b in DECODER_BUCKETS if b < capacity] + [capacity]
        nr = DEC_REC * capacity          # one device buffer [records | state], so a step's inputs go up in one
        self._dev = cp.zeros(nr + len(self.state), np.int32)      # copy (before any capture: graphs keep addresses)
        self.rec, self.state = self._dev[:nr], self._dev[nr:]
        self._up = [_pinned(nr + 2 + capacity) for _ in range(2)]   # its host side, two, one for each step in
        self._flip = 0                                                # flight: the one the next launch takes
        self._idsh = _pinned(2 * capacity, device=True)   # each step's ids, which its sampling writes: a half
                                                          # for each step in flight (a row's position's parity)
        self.unis = cp.zeros((capacity, self.ctx + 1), np.float32)  # each row's uniform numbers, as _uni
        self._rows = np.zeros((capacity, DEC_REC), np.int32)      # each row's record (its uniform: set each step)
        self._pad = self._record(0, 0, pl.Sampling(0))            # a bucket's rows past the active ones
        self._last = np.zeros(capacity, np.int32)                 # each row's last id: its next input
        self._uni = np.zeros((capacity, self.ctx + 1), np.float32)    # each row's uniform numbers,
        self._drawn = np.zeros(capacity, np.intp)                     # and how many it has taken
        self._ahead, self._valid = None, set()      # the step launched ahead: (rows, event or None once waited
                                                    # for, its ids' pinned buffer or their copy); rows still theirs
        self._chain = False                         # whether the device's input ids are the step ahead's output
        for B in self.buckets:           # every bucket's graph now (padding rows alone), not at a request's step
            with self._on_stream():
                self._upload(np.zeros(0, np.intp), B)
                self._step(B)
            self.stream.synchronize()    # (the next upload rewrites the pinned buffer)
        if self.Pb is not None:          # and the prompts' pass (padding rows alone)
            with self._on_stream():
                self._prompts()

    @staticmethod
    def _record(slot, pos, sampling):
        r = np.zeros(DEC_REC, np.int32)
        f, at = r.view(np.float32), DEC_FIELDS.index
        r[at("SLOT")], r[at("POS")], r[at("TOPK")] = slot, pos, sampling.top_k
        f[at("TEMP")], f[at("TOPP")], f[at("PEN")] = sampling.temperature, sampling.top_p, sampling.repetition_penalty
        return r

    def _upload(self, rows, B, chained=False):
        """The records of rows (an int array), each with its row's next uniform number, then self._pad up to
        B, and state = [0, 0, their last ids, 0 ..]: to the device in one copy. chained (the same rows in the
        same order as the step before): nothing, its records and input ids are as that step left them."""
        if chained:
            return
        n, nr, up = len(rows), self.rec.size, self._up[self._flip]
        recs, st = up[:nr].reshape(self.capacity, DEC_REC), up[nr:]
        recs[:n] = self._rows[rows]
        recs[:n, self._UNI] = self._uni[rows, self._drawn[rows]].view(np.int32)
        recs[:n, self._UIX] = self._drawn[rows]
        recs[n:B] = self._pad
        st[:2], st[2:2 + n], st[2 + n:2 + B] = 0, self._last[rows], 0
        cp.cuda.runtime.memcpyAsync(self._dev.data.ptr, up.ctypes.data, (nr + 2 + B) * 4, 1, self.stream.ptr)

    def _sample(self, logits, step=False):
        """Each row's id by its record (step: to _idsh too, and the records one step on)."""
        sample_tokens(logits, self.seen, self.uni, self.state, self.tokens, self._SCALARS, rec=self.rec,
                      idsh=self._idsh if step else None, unis=self.unis if step else None)

    def _step(self, B):
        """The uploaded rows' step as bucket B's graph."""
        if self.Pb is None:
            return self._run(("rows", B), lambda: (self._forward(1, B, 1, rec=self.rec), self._sample(self._lg(B, 1),
                                                                                                     True)))
        self._run(("rows", B), lambda: (self._forward_tc(B, DECODER_MAX, self.rec, self.state),
                                         self._sample(self.lg[:B], True)))

    def _forward_tc(self, B, M, rec, state, step=True):
        """The model over B rows (their records in rec, their ids in state[2:]), the products from bf16
        weights and inputs with fp32 accumulation: each at M rows whatever B (DECODER_MAX for a step, _mp for a
        pass of prompts), so cuBLAS runs one kernel a product for every pass of its kind and a row's sums never
        depend on the other rows (the rows past B: inputs left by earlier passes, outputs never read). The
        residual stream is bf16 (as vLLM keeps it), so the products read it as it is: each norm before a
        product is its weight, folded into the product's matrix (Pb), and the row's 1/rms, applied by the
        kernel after it (qkv: the attention, or rope_store; w1|w3: swiglu_norm), so a layer is 4 products and 2
        kernels of the B rows, each row alone (big: 32 kernels fewer; a step of 1 / 64 rows 0.56 / 0.67 -> 0.49 /
        0.60 ms). Its roundings add little: a float64 emulation over tiny's and small's requests gives the logits
        within 9.0e-3 / 1.8e-2 of fp32's, against 7.3e-3 / 1.7e-2 with an fp32 residual. In a step
        attn_warps rotates and appends each row itself (where warps_fit: 16 launches fewer); in a pass (step=False,
        see attn_cached) rope_store first. A step's wo and w2 take dec_add (B rows; its sums, too, the same
        for a row whatever the rows), a pass's cuBLAS; -> the logits of the M rows in lg."""
        cfg, P, Pb = self.cfg, self.P, self.Pb
        hd, Hq, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        xb, hb, qkv, r = self.xb[:B], self.hb[:B], self.qkv[:B], self.r[:B]
        fold = step and warps_fit(Hq, Hkv, hd)    # (a pass of prompts reads keys its own rows append)
        embed_fwd(P["tok_emb"], state[2:2 + B], xb)
        for l in range(cfg.n_layers):
            p = f"layers.{l}."
            mm(self.qkv[:M], self.xb[:M], Pb.rows(p + "wq", p + "wv"), tb=True)
            if fold:                     # a step: attn_warps rotates each row and appends it (a block a kv head)
                attn_cached(qkv, self.kc[l], self.vc[l], self.attb[:B], state, 1, Hq, Hkv, hd, (self.cos, self.sin),
                            rec, xn=xb)
            else:
                rmsnorm_fwd(xb, None, None, r, pdl=step)                                # the rows' 1/rms alone
                rope_store(qkv, self.kc[l], self.vc[l], self.cos, self.sin, state, 1, Hq, Hkv, hd, rec, rs=r)
                attn_cached(qkv, self.kc[l], self.vc[l], self.attb[:B], state, 1, Hq, Hkv, hd, rec=rec, pdl=step)
            self._add(self.xb, self.attb, Pb[p + "wo"], B, M, step)                # x += attention
            mm(self.gu[:M], self.xb[:M], Pb.rows(p + "w1", p + "w3"), tb=True)
            swiglu_norm(self.gu[:B], xb, self.actb[:B])
            self._add(self.xb, self.actb, Pb[p + "w2"], B, M, step)                # x += ffn
        rmsnorm_fwd(xb, P["norm"], hb, r, pdl=True)
        mm(self.lg[:M], self.hb[:M], Pb.rows("heads.0", "heads.0"), tb=True)

    def _add(self, x, a, W, B, M, step):
        """x += a W^T: a step's by dec_add (its B rows, whatever B: each row's sums the same), a pass's and
        any dec_add does not fit by cuBLAS (M rows)."""
        if step and dec_add_fits(W, a):
            return dec_add(x, a, W, B)
        mm(x[:M], a[:M], W, tb=True, beta=1.0)

    def _prompts(self):
        """The pass of prompt rows uploaded to _pass, as one graph."""
        nr = DEC_REC * self._mp
        self._run(("prompts",), lambda: self._forward_tc(self._mp, self._mp, self._pass[:nr], self._pass[nr:],
                                                         step=False))

    def starts(self, items):
        """start() for each (row, ids, sampling, seed) of items -> their first ids; with bf16 products, every
        prompt's rows packed in passes of _mp rows (a graph), each pass followed by the first ids of the
        prompts it ends, and one read of the ids at the end (32 prompts of 65 ids: 5 passes)."""
        if self.Pb is None:
            return [self.start(*it) for it in items]
        self._settle()
        V, MP, nr = self.cfg.vocab, self._mp, DEC_REC * self._mp
        ids = [np.asarray(it[1], np.int64) for it in items]
        seen = np.zeros((len(items), V), np.int32)
        for k, (row, _, sampling, seed) in enumerate(items):
            self._begin(row, len(ids[k]), sampling, seed)
            seen[k, ids[k]] = 1
        lens = np.array([len(i) for i in ids])
        slots = np.array([it[0] + 1 for it in items])
        self.unis[cp.asarray(slots - 1)] = cp.asarray(self._uni[slots - 1])    # (one copy for all)
        rows = np.stack([np.repeat(slots, lens), np.concatenate([np.arange(n) for n in lens]),   # (slot, pos, id)
                         np.concatenate(ids)], 1).astype(np.int32)
        last = np.cumsum(lens) - 1
        ends = list(zip(last // MP, last % MP, range(len(items))))   # (pass, index in it, item): prompts' last rows
        with self._on_stream():
            self.seen[cp.asarray(slots)] = cp.asarray(seen)
            for a in range(0, len(rows), MP):
                up = np.zeros(nr + 2 + MP, np.int32)
                rec = up[:nr].reshape(MP, DEC_REC)
                chunk = rows[a:a + MP]
                rec[:len(chunk), DEC_FIELDS.index("SLOT")], rec[:len(chunk), self._POS] = chunk[:, 0], chunk[:, 1]
                up[nr + 2:nr + 2 + len(chunk)] = chunk[:, 2]
                self._pass.set(up)
                self._prompts()
                done = [(i, k) for p, i, k in ends if p == a // MP]
                if not done:                     # (the middle of a prompt longer than a pass)
                    continue
                recs = np.stack([self._rows[items[k][0]] for _, k in done])
                recs[:, self._UNI] = self._uni[[items[k][0] for _, k in done], 0].view(np.int32)
                self.rec[:recs.size] = cp.asarray(recs.ravel())
                sample_tokens(self.lg[cp.asarray(np.array([i for i, _ in done]))], self.seen, self.uni, self.state,
                              self.tokens, self._SCALARS, rec=self.rec[:recs.size])
                self._firsts[[k for _, k in done]] = self.tokens[:len(done)]
            first = self._host(self._firsts, self._tokens_h, len(items)).copy()
        for (row, *_), t in zip(items, first):
            self._last[row] = max(int(t), 0)
        return [int(t) for t in first]

    def _begin(self, row, Tn, sampling, seed):
        """A free row's host state for a prompt of Tn ids: its record, its uniform numbers (one each id the
        context leaves), the first of them taken by the first id, and no result of the step ahead."""
        pl.check_prompt(Tn, self.ctx)
        assert 0 <= row < self.capacity, row
        self._uni[row, :self.ctx - Tn + 1] = np.random.default_rng(seed).random(self.ctx - Tn + 1)
        self._drawn[row], self._rows[row] = 1, self._record(row + 1, Tn, sampling)
        self._valid.discard(row)
        self._chain = False              # (a start writes the device's records and input ids)

    def start(self, row, ids, sampling, seed):
        """Prefills row `row` (free) with the prompt ids, resets its seen ids to them and its generator to
        default_rng(seed); -> its first id (-1: the prompt's last logits are not all finite)."""
        if self.Pb is not None:
            return self.starts([(row, ids, sampling, seed)])[0]
        ids = [int(i) for i in ids]
        Tn, s = len(ids), row + 1
        self._settle()                   # (the pinned buffers are free once the step ahead has landed)
        self._begin(row, Tn, sampling, seed)
        self.unis[row] = cp.asarray(self._uni[row])
        self._drawn[row] = 0             # (the first id's number, drawn here)
        with self._on_stream():
            self._prefill(ids, 1, 1)                             # stream 0, as one stream alone
            self.kv[:, :, s, :, :Tn] = self.kv[:, :, 0, :, :Tn]
            self.seen[s] = self.seen[0]
            self._upload(np.array([row]), 1)
            self._sample(self._lg(1, 1))
            tok = int(self._host(self.tokens, self._tokens_h, 1)[0])
        self._drawn[row], self._last[row] = 1, max(tok, 0)
        return tok

    def step(self, rows):
        """One decode step of the active rows (ascending ints), each fed the id it gave last -> their next
        ids (an int array; -1 for a row whose logits are not all finite). The ids of the rows that the step
        launched ahead holds are that step's (waited for), the other rows' a step of their own; then the
        next step of these rows is launched ahead, and runs while the caller handles their ids. Where the
        rows are the step ahead's and none started or ended since (most steps), that next step is queued
        before the step ahead is waited for, fed the ids it leaves on the device: the device never waits
        for the host between them."""
        rows = np.asarray(rows, np.intp)
        n = len(rows)
        assert 0 < n and self._rows[rows, self._POS].max() < self.ctx, "a row past the context"
        ahead = self._ahead
        same = ahead is not None and len(ahead[0]) == n and (ahead[0] == rows).all() and len(self._valid) == n
        if same and self._chain:
            self._next(rows, chained=True)
            ids = self._wait(ahead)[2]
            self._last[rows] = np.maximum(ids, 0)
            return ids
        ids, have = np.zeros(n, np.int32), np.zeros(n, bool)
        if ahead is not None:
            got = self._settle()
            if same:
                ids[:], have[:] = got, True
            else:
                at = {int(r): i for i, r in enumerate(ahead[0]) if int(r) in self._valid}
                for k, r in enumerate(rows.tolist()):
                    if r in at:
                        ids[k], have[k] = got[at[r]], True
        if not have.all():
            need = rows[~have]
            ids[~have] = self._wait(self._launch(need))[2]
        self._last[rows] = np.maximum(ids, 0)
        self._next(rows)
        return ids

    def _next(self, rows, chained=False):
        """The rows' host state one step on, and their next step launched ahead (while within the context)."""
        self._rows[rows, self._POS] += 1
        self._drawn[rows] += 1
        self._ahead, self._valid, self._chain = None, set(), False
        if self._rows[rows, self._POS].max() < self.ctx:
            self._ahead, self._valid, self._chain = self._launch(rows, chained), set(rows.tolist()), True

    def _launch(self, rows, chained=False):
        """Queues a step of rows from their host state (chained: their input ids and records the last step's
        on the device) -> (rows, an event that completes once the step has ended, where in _idsh its ids are)."""
        B = next(b for b in self.buckets if b >= len(rows))
        with self._on_stream():
            self._upload(rows, B, chained)
            self._step(B)
            self._flip ^= 1
            at = (self._rows[rows, self._POS] & 1) * self.capacity + np.arange(len(rows))
            return rows.copy(), self.stream.record(), at

    def _wait(self, launched):
        """Waits for a launched step -> (rows, None, a copy of its ids)."""
        rows, ev, ids = launched
        if ev is not None:
            ev.synchronize()
            ids = self._idsh[ids]
        return rows, None, ids

    def _settle(self):
        """Waits for the step launched ahead, if any -> its rows' ids (kept: start() reuses the buffers)."""
        if self._ahead is None:
            return None
        self._ahead = self._wait(self._ahead)
        return self._ahead[2]

    def free(self, row):
        """Forgets row `row`; its cache is reusable at once (start overwrites all a row reads)."""
        self._valid.discard(row)


def bench_generation(P, prompt, n=200, streams=64, reps=3):
    """Greedy generation of n tokens after the prompt: plain and speculative (one stream; the same ids) and
    `streams` continuations in one batch; each run once untimed (compiles, captures the graphs), then the
    best of reps; and the batch's rate after SUSTAIN_S seconds more of batches."""
    greedy, one, many = pl.Sampling(0), Sampler(P), Sampler(P, streams=streams)

    def timed(fn):
        out, best = fn(), float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t0)
        return best, out
    stats = {}
    t_plain, plain = timed(lambda: list(one.generate(prompt, n, greedy)))
    t_spec, spec = timed(lambda: list(one.generate(prompt, n, greedy, speculative=True, stats=stats)))
    assert spec == plain, "speculative decoding changed the greedy ids"
    batch = lambda: many.generate_batch(prompt, streams, n, greedy, np.random.default_rng(0))
    t_batch, outs = timed(batch)
    t0 = time.perf_counter()      # sustained, the last of SUSTAIN_S more: one H200 ran 64 streams of big at 99K
    while time.perf_counter() - t0 < SUSTAIN_S:      # tokens/s for a second or two, then at 92K; others hold
        t1 = time.perf_counter()
        batch()
        t_last = time.perf_counter() - t1
    return dict(tokens=len(plain), plain=len(plain) / t_plain, speculative=len(spec) / t_spec,
                speedup=t_plain / t_spec, accepted=stats["accepted"] / max(stats["drafted"], 1), streams=streams,
                batch=sum(map(len, outs)) / t_batch, sustained=sum(map(len, outs)) / t_last)


SUSTAIN_S = 5.0     # seconds of batches before bench_generation's sustained figure


def gpu_generate(sampler, a, stats=None):
    """generate_fn(ids, n, rng) for the pipeline's sample and chat loops, with a's sampling flags."""
    sampling = pl.sampling_of(a)
    spec = pl.speculative_for(a.speculative, sampling, sampler.cfg.n_mtp)
    return lambda ids, n, rng: sampler.generate(ids, n, sampling, rng, speculative=spec, stats=stats)


def cmd_infer(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py sample", description="generate text from a checkpoint")
    pl.add_prompt_arg(p)
    p.add_argument("--samples", type=int, default=1, help="continuations drawn in one batch (default 1)")
    pl.add_sample_flags(p, ckpt=pl.run_ckpt("train"), temperature=0.8)
    a = p.parse_args(argv)
    prompt = pl.prompt_arg(a)
    pl.check_sampling(a)
    gpu()
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    sampler = Sampler(P, streams=a.samples)
    if a.samples > 1:
        sampling = pl.sampling_of(a)
        arrivals = pl.samples_to_stdout(tok, lambda ids, k, m, rng, arrivals: sampler.generate_batch(
            ids, k, m, sampling, rng, arrivals), prompt, a, P.cfg.ctx)
        print(pl.speed_line(arrivals, False, {}, a.samples, warmup=GPU_WARMUP), file=sys.stderr)
        return
    stats = {}
    arrivals = pl.sample_to_stdout(tok, gpu_generate(sampler, a, stats), prompt, a, P.cfg.ctx)
    print(pl.speed_line(arrivals, pl.speculative_for(a.speculative, pl.sampling_of(a), P.cfg.n_mtp), stats,
                        warmup=GPU_WARMUP),
          file=sys.stderr)


GPU_WARMUP = "compilation, CUDA graph capture, prefill"    # what the time to sample's first ids holds


# ----------------------------------------------------------------------------------------------------
# 7. fine-tuning and evaluation: SFT, chat and serve; DPO; HellaSwag and bits per byte; loss curves

# --- SFT and chat: nanoeuler's Alpaca template, data and REPL; batches padded to the model's fixed T

def cmd_sft(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py sft", description="fine-tune a base checkpoint on instructions")
    pl.add_sft_flags(p, ckpt=pl.run_ckpt("train"), out=pl.RUN_DIRS["sft"], **pl.SFT_DEFAULTS["gpu"])
    add_model_flags(p)
    a = p.parse_args(argv)
    pl.check_positive(a, "steps", "batch", "seq")
    gpu()
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    precision = precision_of(a, P.cfg)
    trainer = make_trainer(P, a.batch, min(a.seq, P.cfg.ctx), a.attn, precision=precision)
    print(f"{PRECISION_WORDS[precision]}", flush=True)
    pl.run_sft(a, P, tok, lambda: trainer, trainer.model.batch_loss, fixed_shape=True)


def cmd_chat(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py chat", description="talk to a checkpoint (the conversation is kept within "
                  "the context; a chat checkpoint wraps each line in the SFT template)")
    pl.add_sample_flags(p, ckpt=pl.run_ckpt("sft"), temperature=0.7)
    a = p.parse_args(argv)
    pl.check_sampling(a)
    gpu()
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    rng = np.random.default_rng(a.seed)
    gen = gpu_generate(Sampler(P), a)
    pl.chat_repl(tok, lambda ids, n: gen(ids, n, rng), extra.get("kind") == "chat", a.tokens, P.cfg.ctx)


def cmd_serve(argv):
    import serve
    p = pl.Parser(prog="nanoeuler_cuda.py serve", description=serve.DESCRIPTION)
    serve.add_serve_flags(p, ckpt=pl.run_ckpt("sft"), max_batch_help=f"default: the caches that {DECODER_MEMORY * 100:.0f}%% "
                          f"of the GPU's free memory holds, at most {DECODER_MAX}")
    a = p.parse_args(argv)
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)

    def decoder(rows):                   # (in serve's engine process: the GPU is first touched there)
        gpu()
        try:
            return Decoder(P, rows)
        except cp.cuda.memory.OutOfMemoryError:
            raise UserError(f"--max-batch {rows}: the rows' caches do not fit the GPU's memory; give fewer") from None
    serve.run(a, tok, P.cfg, extra.get("kind") == "chat", decoder, "GPU")


# --- DPO and evaluation: head 0 alone on the Model's final normed rows hf (forward(want_loss=False) stops
# there). Its log-prob of each row's targets scores HellaSwag and bits per byte (evaluate.py) and gives
# DPO's sequence log-probs (CONTRACT.md "DPO"). DPO's gradient with respect to the logits of row b is
# c_b (softmax - onehot) on head 0 at its counted targets, c_b = -d loss / d logp_b (pl.dpo_loss): the
# cross-entropy gradient that xent and xent_chunk write, with c_b as the head's scale, a sequence at a
# time; Model.backward goes on from there. The MTP heads take no part (zero gradient).

class Head0:
    """Head 0 on a Model's rows after model.forward(want_loss=False): token_logp() -> the log-probs of the
    uploaded targets; dpo_backward(c) (a training Model) -> the whole gradient in model.G."""

    def __init__(self, model):
        m, V = model, model.cfg.vocab
        self.m = m
        self.rows = min(m.N, max(1, 4096 // m.T) * m.T)          # a chunk of whole sequences, <= 4096 rows
        self.lg = cp.empty((self.rows, V), np.float32)           # head 0's logits of a chunk
        self.one = cp.ones(1, np.float32)
        if m.train and m.bf:
            self.dl = cp.empty((self.rows, V), BF)                # d loss / d logits of a chunk
            self.scale = cp.empty(m.B, np.float32)                # c_b
        elif m.train:
            self.scale = cp.empty((m.B, m.cfg.n_mtp), np.float32)     # xent's head scales of each row (c_b, 0, ..)

    def _loss(self):
        """model.rowloss[0] = -log p(target) under head 0 at every position, 0 where the target is -1. Per
        chunk one GEMM makes head 0's logits and xent its loss, lse - logit, no gradient."""
        m = self.m
        W = (m.Pb if m.bf else m.P)["heads.0"]
        for n0 in range(0, m.N, self.rows):
            n1 = min(m.N, n0 + self.rows)
            mm(self.lg[:n1 - n0], m.hf[n0:n1], W, tb=True)
            xent(self.lg[:n1 - n0], m.tgt[n0:n1], self.one, m.rowloss[0, n0:n1], m.T, 1, False)
        return m.rowloss[0].reshape(m.B, m.T)

    def token_logp(self):
        """-> (B, T) float64 on the host: log p(target) under head 0 at every position, 0 where the target is
        -1 (a sync)."""
        return -cp.asnumpy(self._loss()).astype(np.float64)

    def seq_logp(self):
        """-> (B,) float64 on the device: head 0's log-probs summed over each row's counted targets (no sync)."""
        return -self._loss().astype(np.float64).sum(1)

    def dpo_backward(self, c):
        """c (B,) on the device: backward from d loss / d logits of row b = c_b (softmax - onehot) on head 0 at
        its counted targets, 0 on the MTP heads; the gradient of every tensor goes to model.G."""
        m, T, K = self.m, self.m.T, self.m.cfg.n_mtp
        if m.bf:                                                  # the fused loss head's work, head 0 alone
            self.scale[...] = c
            W, G0 = m.Pb["heads.0"], m.G["heads.0"]
            for n0 in range(0, m.N, self.rows):                   # chunks of whole sequences, as _loss
                n1 = min(m.N, n0 + self.rows)
                lg, dl = self.lg[:n1 - n0], self.dl[:n1 - n0]
                mm(lg, m.hf[n0:n1], W, tb=True)
                xent_chunk(lg, dl, m.tgt, self.scale, m.rowloss, n0, T, 1, True, per_seq=True)
                mm(G0, dl, m.hf[n0:n1], ta=True, beta=1.0 if n0 else 0.0)   # dHead0 (+)= dl^T hf
                mm(m.dh[n0:n1], dl, W)                                      # its rows of dhf
            if K > 1:
                m.G.rows("heads.1", f"heads.{K - 1}").fill(0)
        else:                                                     # dlogits of every head in place, as forward
            self.scale.fill(0)
            self.scale[:, 0] = c
            mm(m.logits, m.hf, m.P.rows("heads.0", f"heads.{K - 1}"), tb=True)
            xent(m.logits, m.tgt, self.scale, m.rowloss, T, K, True, per_seq=True)
        m.backward()


class DPOTrainer:
    """pl.run_dpo's trainer over make_trainer's model and AdamW: step(x, (y, ref), lr) on x, y (2B, T), the
    chosen answers in rows [:B], the rejected in [B:]. No host sync in a step: pl.dpo_loss turns the rows'
    log-probs into d loss / d logp in float64 on the device, and Head0's backward follows it; losses and
    gradient norms wait on the device until results(), as in pretraining."""
    sync_every_step = False

    def __init__(self, trainer, beta):
        self.model, self.opt, self.beta, self.host_state = trainer.model, trainer.opt, beta, trainer.host_state
        self.head = Head0(self.model)
        self.n, self.hist = 0, cp.zeros((64, 2), np.float64)     # per step: loss, gradient norm

    def seq_logps(self, x, y):
        """(rows,) float64: head 0's log-probs summed over each row's counted targets, no gradient."""
        self.model.set_batch(x, y)
        self.model.forward(want_loss=False)
        return cp.asnumpy(self.head.seq_logp())

    def loss_and_grad(self, x, y, ref):
        """The DPO loss of a batch of pairs (a float64 device scalar) and its gradient in model.G."""
        self.model.set_batch(x, y, want_grad=True)
        self.model.forward(want_loss=False)
        loss, dlogp = pl.dpo_loss(self.head.seq_logp(), cp.asarray(ref, np.float64), self.beta, xp=cp)
        self.head.dpo_backward(-dlogp)
        return loss

    def step(self, x, y_ref, lr):
        """A NaN loss is seen in results(), and train_loop stops before it writes a checkpoint."""
        loss = self.loss_and_grad(x, *y_ref)
        self.opt.step(lr)
        if self.n == len(self.hist):
            self.hist = cp.concatenate([self.hist, cp.zeros_like(self.hist)])
        self.hist[self.n, 0] = loss
        self.hist[self.n, 1] = self.opt.norm[0]
        self.n += 1

    def results(self):
        rows, self.n = cp.asnumpy(self.hist[:self.n]), 0
        return [(float(loss), [float(loss)], float(norm)) for loss, norm in rows]


def cmd_dpo(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py dpo", description="direct preference optimisation (CONTRACT.md \"DPO\") of "
                  "a chat checkpoint on pairs of a chosen and a rejected answer, against itself frozen; writes a chat "
                  "checkpoint")
    pl.add_dpo_flags(p, ckpt=pl.run_ckpt("sft"), out=pl.RUN_DIRS["dpo"])
    add_model_flags(p)
    a = p.parse_args(argv)
    pl.check_positive(a, "steps", "batch")
    gpu()
    P, tok, _, extra = pl.load_checkpoint(a.ckpt)
    precision = precision_of(a, P.cfg)
    trainer = DPOTrainer(make_trainer(P, 2 * a.batch, P.cfg.ctx, a.attn, precision=precision), a.beta)
    print(f"{2 * a.batch} rows x {P.cfg.ctx} a step, {PRECISION_WORDS[precision]}", flush=True)
    pl.run_dpo(a, P, tok, extra, lambda: trainer, trainer.seq_logps, fixed_shape=True)


# The DPO loss through the whole model on the GPU against nanoeuler.dpo_loss_and_grads in float64 on the same
# weights and pairs, tensor by tensor, with the tolerances of the gradient check (gradcheck --dpo).
GRADCHECK_DPO = [  # (tag, config, pairs, T, attention): tiny's head dim 8 has the naive attention alone
    ("tiny", pl.CONFIGS["tiny"], 2, 64, "naive"),
    ("small", pl.CONFIGS["small"], 2, 128, "flash"),
]


def gradcheck_dpo(precision, seed, beta=0.5):
    ne = cpu_reference()
    rng = np.random.default_rng(seed)
    bf, rows, tol = precision == "bf16", [], GRADCHECK_TOL[precision]
    for tag, cfg, B, T, attn in GRADCHECK_DPO:
        if bf and attn != "flash":
            continue
        P = gradcheck_params(cfg, rng, scale=0.05 if bf else 0.1, bf16=bf)
        x = rng.integers(0, cfg.vocab, (2 * B, T)).astype(np.int32)
        y = rng.integers(0, cfg.vocab, (2 * B, T)).astype(np.int32)
        y[:, :T // 4] = -1                                       # the prompt
        y[rng.random(y.shape) < 0.1] = -1
        P64 = P.astype(np.float64)
        ref = ne.seq_logps(P64, x, y) + rng.normal(0.0, 3.0, 2 * B)     # pairs away from z = 0
        loss_r, G_r = ne.dpo_loss_and_grads(P64, x, y, ref, beta)
        t = DPOTrainer(make_trainer(P, 2 * B, T, attn, precision=precision), beta)
        t.model.G.flat.fill(np.nan)                              # every gradient must be written
        loss = float(t.loss_and_grad(x, y, ref))
        G = t.model.G.download()
        head = f"[{tag}: D={cfg.dim} L={cfg.n_layers} MTP={cfg.n_mtp} {B} pairs T={T} {attn} beta={beta}]"
        rows.append((f"{head} DPO loss", abs(loss - loss_r) / abs(loss_r), tol))
        rows += [(f"{tag} {name}", rel_err(G[name], G_r[name]), tol) for name in G.names]
    return gradcheck_verdict(rows, "DPO gradient check", f"GPU {precision} vs nanoeuler.dpo_loss_and_grads float64 on "
                             "the same weights and pairs", precision)


EVAL_TOKENS = 16384     # rows x T of one scoring forward


def gpu_logprobs(P, B, T, precision, attn):
    """evaluate.py's logprobs_fn on the device: sequences of at most T ids, B rows a forward (each padded at
    its end: causal attention keeps it exact) -> head 0's log-prob of each next id (float64 arrays)."""
    model = Model(P.cfg, B, T, attn=attn, train=False, precision=precision)
    model.load(P)
    set_tf32(precision == "tf32")
    head = Head0(model)

    def fn(seqs):
        out = []
        for i in range(0, len(seqs), B):
            part = seqs[i:i + B]
            x, y = np.zeros((B, T), np.int32), np.full((B, T), -1, np.int32)
            for r, s in enumerate(part):
                x[r, :len(s)], y[r, :len(s) - 1] = s, s[1:]
            model.set_batch(x, y)
            model.forward(want_loss=False)
            logp = head.token_logp()
            out += [logp[r, :len(s) - 1] for r, s in enumerate(part)]
        return out
    return fn


def gpu_hellaswag_logprobs(P, precision, attn):
    """logprobs_fn for evaluate.hellaswag's every (context, ending) in one call: batches of (B, T), T the
    longest sequence rounded up to 64 (at most the context), B = EVAL_TOKENS // T."""
    def fn(seqs):
        T = min(P.cfg.ctx, -(-max(map(len, seqs)) // 64) * 64)
        return gpu_logprobs(P, min(len(seqs), max(1, EVAL_TOKENS // T)), T, precision, attn)(seqs)
    return fn


def cmd_eval(argv):
    evaluate = _evaluate()
    p = pl.Parser(prog="nanoeuler_cuda.py eval", description=evaluate.EVAL_HELP + "; batched on the GPU")
    evaluate.add_eval_flags(p, pl.run_ckpt("train"))
    add_model_flags(p)
    a = p.parse_args(argv)
    evaluate.check_eval_args(a)
    gpu()
    P, tok, _, _ = pl.load_checkpoint(a.ckpt)
    precision = precision_of(a, P.cfg)
    t0 = time.time()
    print(PRECISION_WORDS[precision], flush=True)
    evaluate.run_eval(a, tok, P.cfg.ctx, gpu_logprobs(P, 8, P.cfg.ctx, precision, a.attn) if a.task == "bpb" else
                      gpu_hellaswag_logprobs(P, precision, a.attn), batch_items=None)
    print(f"[{time.time() - t0:.1f} s]", file=sys.stderr)


def cmd_plot(argv):
    evaluate = _evaluate()
    p = pl.Parser(prog="nanoeuler_cuda.py plot", description=evaluate.PLOT_HELP)
    evaluate.add_plot_flags(p)
    a = p.parse_args(argv)
    print(f"wrote {evaluate.plot(a.runs, evaluate.plot_out(a.out))}")


def cmd_export(argv):
    import export                                    # numpy alone; its packages (safetensors, gguf) serve it alone
    export.cmd_export(argv, "nanoeuler_cuda.py")


def cmd_import(argv):
    import export
    export.cmd_import(argv, "nanoeuler_cuda.py")


# ----------------------------------------------------------------------------------------------------
# 8. verification: the NVRTC compile check, the self-test of every kernel, the gradient check of the model

# --- NVRTC compile check: every source compiled to PTX (or, with arch sm_90, to machine code with the
# register and spill report) through libnvrtc loaded by ctypes, so it runs without a GPU or CuPy
# (CI installs the nvidia-cuda-nvrtc-cu12 wheel).

def _find_nvrtc():
    import ctypes
    import ctypes.util
    import glob
    cands = []
    for mod in ("nvidia.cuda_nvrtc", "nvidia.cu13", "nvidia"):
        try:
            m = __import__(mod, fromlist=["_"])
            for p in getattr(m, "__path__", []):
                cands += sorted(glob.glob(os.path.join(p, "lib", "libnvrtc.so*")), reverse=True)
                cands += sorted(glob.glob(os.path.join(p, "*", "lib", "libnvrtc.so*")), reverse=True)
        except Exception:
            pass
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            cands += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
    cands += [ctypes.util.find_library("nvrtc"), "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    for c in cands:
        if c and "builtins" not in c:
            try:
                return ctypes.CDLL(c), c
            except OSError:
                continue
    return None, None


ARCHS = ("75", "80", "86", "89", "90")     # the chips CI compiles for: T4 / RTX 20, A100, RTX 30, RTX 40 / L4, H100
BF16_MODULES = ("flash_bf16", "dec_add")   # the tensor-core kernels (mma.sync bf16): sm_80 on, bf16 only
# wgmma kernels: sm_90 only, compiled for sm_90a (_k adds -arch=sm_90a to the -arch=sm_90 CuPy passes; NVRTC
# 12 and 13 compile for sm_90a given both)
WG_MODULES = ("flash_bf16_wg",)


def sources_for(arch):
    """The modules the engine compiles on a chip of arch ("75", "sm_80", "compute_90"): every one from sm_80
    (the wgmma ones on sm_90 alone); before it, all but the bf16 tensor-core kernels (the engine runs fp32 there)."""
    cc = int(re.sub(r"\D", "", arch))
    return {n: src for n, src in SOURCES.items()
            if (cc >= 80 or n not in BF16_MODULES) and (cc == 90 or n not in WG_MODULES)}


def compile_check(arch="compute_90", verbose=False, options=(), jobs=1):
    """-> (library path, [(module, ok, log)]) or (None, []) when no libnvrtc is found: sources_for(arch)
    compiled for arch (compute_XX: PTX; sm_XX: machine code, where ptxas also checks each inline-PTX instruction
    against the chip), with NVRTC_OPTIONS + options, on `jobs` threads (NVRTC runs outside the GIL)."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor
    lib, path = _find_nvrtc()
    if lib is None:
        return None, []

    def one(item):
        name, src = item
        prog = ctypes.c_void_p()
        code = (COMMON + src).encode()
        rc = lib.nvrtcCreateProgram(ctypes.byref(prog), code, f"{name}.cu".encode(), 0, None, None)
        if rc:
            return name, False, f"nvrtcCreateProgram error {rc}"
        target = arch + "a" if name in WG_MODULES else arch
        opts = [f"--gpu-architecture={target}", *NVRTC_OPTIONS, *options] + (["--ptxas-options=-v"] if verbose else [])
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, buf)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return name, rc == 0, buf.value.decode(errors="replace").strip()
    items = sorted(sources_for(arch).items(), key=lambda kv: -len(kv[1]))     # the longest first, for the threads
    with ThreadPoolExecutor(max(1, jobs)) as ex:
        return path, list(ex.map(one, items))


# --- self-test: every kernel, forward and backward, against a float64 reference (nanoeuler's CPU layers
# where it has them, numpy otherwise) on fresh random inputs, with the outputs poisoned (NaN) first.
# Error: max |gpu - ref| / max |ref| per output (NaN anywhere fails).

def cpu_reference():
    """The CPU engine: the float64 reference of the self-test and the gradient check (it needs Numba; the
    other modes of this engine run on numpy and CuPy alone)."""
    import nanoeuler
    return nanoeuler


def rel_err(a, ref):
    a = cp.asnumpy(a) if cp is not None and not isinstance(a, np.ndarray) else np.asarray(a)
    a, ref = np.asarray(bf16_float(a) if a.dtype == BF else a, np.float64), np.asarray(ref, np.float64)
    if a.shape != ref.shape:
        a = a.reshape(ref.shape)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.max(np.abs(a - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def _d(a):
    return cp.asarray(np.ascontiguousarray(a, np.float32))


def _nan(*shape):
    a = cp.empty(shape, np.float32)
    a.fill(np.nan)
    return a


def _attn_ref(q, k, v, B, T, dout):
    """float64 reference of causal GQA attention: out, dq, dk, dv from nanoeuler's layers; the log2-sum-exp
    of the scaled scores per (b, h, t) directly in numpy."""
    ne = cpu_reference()
    N, Hq, hd = q.shape
    G = Hq // k.shape[1]
    out, cache = ne.attention_forward(q, k, v, B, T)
    dq, dk, dv = ne.attention_backward(dout, cache, B, T)
    qb = q.reshape(B, T, Hq, hd).transpose(0, 2, 1, 3)                           # (B, Hq, T, hd)
    kb = np.repeat(k.reshape(B, T, -1, hd).transpose(0, 2, 1, 3), G, axis=1)   # kv head h // G
    s = qb @ kb.transpose(0, 1, 3, 2) / math.sqrt(hd)                           # (B, Hq, T, T)
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
    mx = s.max(-1)
    lse = (mx + np.log(np.exp(s - mx[..., None]).sum(-1))) * math.log2(math.e)
    return out, lse, dq, dk, dv


def selftest_checks(rng):
    """-> list of (kernel, error, tolerance)."""
    ne = cpu_reference()
    R = []
    tol = 1e-5
    randn = lambda *s: rng.standard_normal(s)
    # embedding
    V, D, N = 50, 72, 300                                   # ~6 positions per token: the unrolled sum runs
    emb, idx = randn(V, D), rng.integers(0, V, N).astype(np.int32)
    x = _nan(N, D)
    embed_fwd(_d(emb), cp.asarray(idx), x)
    R.append(("embed fwd", rel_err(x, emb[idx]), tol))
    dx = randn(N, D)
    order, starts = sort_tokens(idx, V)
    demb = _nan(V, D)
    embed_bwd(_d(dx), cp.asarray(order), cp.asarray(starts), demb)
    ref = np.zeros((V, D))
    ne.embedding_backward(dx, idx, ref)
    R.append(("embed bwd (sorted scatter-add)", rel_err(demb, ref), tol))
    # RMSNorm (600 rows, so the weight gradient runs over many blocks)
    N, D = 600, 72
    x0, add, w = randn(N, D) * 2, randn(N, D), 1 + 0.3 * randn(D)
    y, rstd = ne.rmsnorm_forward(x0, w)
    h, r = _nan(N, D), _nan(N)
    rmsnorm_fwd(_d(x0), _d(w), h, r)
    R.append(("rmsnorm fwd", max(rel_err(h, y), rel_err(r, rstd)), tol))
    y2, rstd2 = ne.rmsnorm_forward(x0 + add, w)
    xo, h, r = _nan(N, D), _nan(N, D), _nan(N)
    rmsnorm_fwd(_d(x0), _d(w), h, r, add=_d(add), xout=xo)
    R.append(("rmsnorm fwd + residual add", max(rel_err(xo, x0 + add), rel_err(h, y2), rel_err(r, rstd2)), tol))
    dy, dres = randn(N, D), randn(N, D)
    dx_ref, dw_ref = dres.copy(), np.zeros(D)
    ne.rmsnorm_backward(dy, x0, w, rstd, dx_ref, dw_ref)
    dxg, dwg = _d(dres), _nan(D)
    rmsnorm_bwd(_d(dy), _d(x0), _d(w), _d(rstd), dxg, dwg, _nan(rms_part_rows(N), D), accumulate=True)
    R.append(("rmsnorm bwd dx (+= residual)", rel_err(dxg, dx_ref), tol))
    R.append(("rmsnorm bwd dw (per-block sums + col_sum)", rel_err(dwg, dw_ref), tol))
    N, D = 70, 1024                                         # the widest row the kernel keeps in registers
    x0, dy, w = randn(N, D), randn(N, D), 1 + 0.3 * randn(D)
    y, rstd = ne.rmsnorm_forward(x0, w)
    dx_ref, dw_ref = np.zeros((N, D)), np.zeros(D)
    ne.rmsnorm_backward(dy, x0, w, rstd, dx_ref, dw_ref)
    dxg, dwg = _nan(N, D), _nan(D)
    rmsnorm_bwd(_d(dy), _d(x0), _d(w), _d(rstd), dxg, dwg, _nan(rms_part_rows(N), D), accumulate=False)
    R.append(("rmsnorm bwd D=1024, dx (no accumulate) and dw", max(rel_err(dxg, dx_ref), rel_err(dwg, dw_ref)), tol))
    # RoPE on the q and k heads of a fused q|k|v buffer (v untouched), then back
    B, T, Hq, Hkv, hd = 2, 19, 4, 2, 32
    N, S = B * T, (Hq + 2 * Hkv) * hd
    cos, sin = pl.rope_tables(64, hd, np.float64)
    u = randn(N, S)
    pos = np.tile(np.arange(T, dtype=np.int32), B)
    ref = u.copy()
    ref[:, :(Hq + Hkv) * hd] = ne.rope_forward(u[:, :(Hq + Hkv) * hd].reshape(N, Hq + Hkv, hd), pos, cos, sin).reshape(N, -1)
    g = _d(u)
    rope(g, _d(cos), _d(sin), T, Hq + Hkv, hd)
    R.append(("rope fwd", rel_err(g, ref), tol))
    rope(g, _d(cos), _d(sin), T, Hq + Hkv, hd, sign=-1.0)
    R.append(("rope bwd (inverse rotation)", rel_err(g, u), tol))
    ref = ne.rope_forward(u[:, :hd].reshape(N, 1, hd), np.arange(5, 5 + N, dtype=np.int32), cos, sin).reshape(N, hd)
    g = _d(u[:, :hd])
    rope(g, _d(cos), _d(sin), N, 1, hd, pos0=5)
    R.append(("rope fwd at positions pos0..", rel_err(g, ref), tol))
    # SwiGLU
    N, F = 37, 50
    gu, dact = randn(N, 2 * F) * 2, randn(N, F)
    act = _nan(N, F)
    swiglu_fwd(_d(gu), act)
    R.append(("swiglu fwd", rel_err(act, ne.swiglu_forward(gu)), tol))
    gg = _d(gu)
    swiglu_bwd(_d(dact), gg)
    R.append(("swiglu bwd", rel_err(gg, ne.swiglu_backward(dact, gu)), tol))
    # cross-entropy of 3 MTP heads with ignored targets; gradient in place
    B, T, V, K = 3, 23, 97, 3
    N = B * T
    logits, y = randn(N, K * V) * 3, rng.integers(0, V, (B, T)).astype(np.int32)
    y[rng.random((B, T)) < 0.2] = -1
    ref = logits.copy()
    obj_ref, ces_ref = ne.mtp_loss(ref, y, K, 0.3)
    sc, inv = loss_weights(y, K, 0.3)
    lg, rl, ce = _d(logits), _nan(K, N), _nan(K)
    xent(lg, cp.asarray(y.reshape(-1)), _d(sc), rl, T, K, want_grad=True)
    loss_reduce(rl, _d(inv), ce)
    R.append(("cross-entropy loss (3 heads, -1 ignored)", rel_err(ce, ces_ref), tol))
    R.append(("cross-entropy grad (fused softmax)", rel_err(lg, ref), tol))
    # attention: flash and naive, head dims 32 and 64, partial tiles
    for hd, Hq, Hkv, B, T in ((32, 4, 2, 2, 100), (64, 6, 2, 2, 130)):
        N, Cq, Ck = B * T, Hq * hd, Hkv * hd
        qkv, dout = randn(N, Cq + 2 * Ck) * 1.5, randn(N, Cq)
        q, k, v = (qkv[:, :Cq].reshape(N, Hq, hd), qkv[:, Cq:Cq + Ck].reshape(N, Hkv, hd),
                   qkv[:, Cq + Ck:].reshape(N, Hkv, hd))
        out_r, lse_r, dq_r, dk_r, dv_r = _attn_ref(q, k, v, B, T, dout.reshape(N, Hq, hd))
        dqkv_r = np.concatenate([dq_r.reshape(N, Cq), dk_r.reshape(N, Ck), dv_r.reshape(N, Ck)], 1)
        for kind in ("flash", "naive") if flash_fits(hd) else ("naive",):     # as Model falls back
            g_qkv, out, dqkv = _d(qkv), _nan(N, Cq), _nan(N, Cq + 2 * Ck)
            if kind == "flash":
                lse = _nan(B, Hq, T)
                flash_fwd(g_qkv, out, lse, B, T, Hq, Hkv, hd)
                flash_bwd(g_qkv, out, _d(dout), lse, dqkv, _nan(B, Hq, T), _nan((T + 63) // 64, N, Cq),
                          B, T, Hq, Hkv, hd)
                R.append((f"flash attention lse hd={hd}", rel_err(lse, lse_r), tol))
            else:
                Pm, ws = _nan(B, Hq, T, T), naive_scratch(B, T, Hq, Hkv, hd)
                naive_fwd(g_qkv, out, Pm, ws, B, T, Hq, Hkv, hd)
                naive_bwd(g_qkv, _d(dout), Pm, dqkv, ws, B, T, Hq, Hkv, hd)
            tag = f"{kind} attention hd={hd} Hq/Hkv={Hq}/{Hkv} T={T}"
            R.append((f"{tag} fwd", rel_err(out, out_r.reshape(N, Cq)), tol))
            d = cp.asnumpy(dqkv)
            R.append((f"{tag} bwd dq", rel_err(d[:, :Cq], dqkv_r[:, :Cq]), tol))
            R.append((f"{tag} bwd dk", rel_err(d[:, Cq:Cq + Ck], dqkv_r[:, Cq:Cq + Ck]), tol))
            R.append((f"{tag} bwd dv", rel_err(d[:, Cq + Ck:], dqkv_r[:, Cq + Ck:]), tol))
    R += selftest_generation(rng, randn, tol)
    R += selftest_decoder(rng)
    R += selftest_adamw(rng, randn, tol)
    # Muon's strided-batched products (bmm_ex): A B^T with alpha, A B, and A^T B (a tall matrix's Gram), three
    # matrices each
    A3, B3, C3, D3 = randn(3, 24, 40), randn(3, 16, 40), randn(3, 40, 16), randn(3, 40, 24)
    out, out2, out3 = _nan(3, 24, 16), _nan(3, 24, 16), _nan(3, 24, 16)
    bmm_ex(out, _d(A3), _d(B3), tb=True, alpha=0.5)
    bmm_ex(out2, _d(A3), _d(C3))
    bmm_ex(out3, _d(D3), _d(C3), ta=True)
    R.append(("bmm_ex (batched A B^T x 0.5, A B, A^T B)", max(rel_err(out, 0.5 * A3 @ B3.transpose(0, 2, 1)),
                                                               rel_err(out2, A3 @ C3),
                                                               rel_err(out3, D3.transpose(0, 2, 1) @ C3)), tol))
    R += selftest_muon(rng, randn)
    # cuBLAS GEMM wrapper: all transposes, TF32 off (float32 accuracy) and on (must differ: TF32 engaged)
    M, Nn, Kk = 96, 80, 1000
    errs = {}
    for tf32 in (False, True):
        set_tf32(tf32)
        e = 0.0
        for ta in (False, True):
            for tb in (False, True):
                A, Bm = randn(M, Kk), randn(Nn, Kk)
                A_ = A.T.copy() if ta else A
                B_ = Bm if tb else Bm.T.copy()
                C0 = randn(M, Nn)
                C = _d(C0)
                mm(C, _d(A_), _d(B_), ta=ta, tb=tb, alpha=0.5, beta=1.0)
                e = max(e, rel_err(C, 0.5 * A @ Bm.T + C0))
        A, Bm = randn(3, 40, Kk), randn(3, 30, Kk)
        C = _nan(3, 40, 30)
        bmm(C, _d(A), _d(Bm), tb=True)
        errs[tf32] = max(e, rel_err(C, A @ Bm.transpose(0, 2, 1)))
    set_tf32(False)
    R.append(("gemm fp32 (cuBLAS, 4 transposes + batched)", errs[False], tol))
    if PROFILE.bf16:                                     # no TF32 before sm_80
        R.append(("gemm TF32 (must be > 1e-4: TF32 engaged)", errs[True], 1e-2 if errs[True] > 1e-4 else -1))
    return R


def selftest_generation(rng, randn, tol):
    """The generation kernels: RoPE and KV-cache attention of 3 streams (a 7-token prefill, then a 3-row
    step, the position on the device), matvec with each epilogue (each row exact whatever the row count), the
    decode step as a whole (tiny, small), the device sampler against pipeline.Sampling with the same uniform
    numbers, and argmax_heads."""
    ne, R = cpu_reference(), []
    hd, Hq, Hkv, T, ctx, ns = 32, 4, 2, 10, 40, 3
    Cq, Ck = Hq * hd, Hkv * hd
    qkv = randn(ns, T, Cq + 2 * Ck) * 1.5
    cos, sin = pl.rope_tables(ctx, hd, np.float64)
    kc, vc, out = _nan(ns, Hkv, ctx, hd), _nan(ns, Hkv, ctx, hd), _nan(ns, T, Cq)
    for a, b in ((0, 7), (7, 10)):
        state = cp.asarray(np.array([a, 0], np.int32))
        g, o = _d(qkv[:, a:b].reshape(-1, Cq + 2 * Ck)), _nan(ns * (b - a), Cq)
        rope_store(g, kc, vc, _d(cos), _d(sin), state, b - a, Hq, Hkv, hd)
        attn_cached(g, kc, vc, o, state, b - a, Hq, Hkv, hd)
        out[:, a:b] = o.reshape(ns, b - a, Cq)
    pos = np.arange(T, dtype=np.int32)
    rot = lambda u, H: ne.rope_forward(u.reshape(T, H, hd), pos, cos, sin)
    out_r = np.stack([ne.attention_forward(rot(q[:, :Cq], Hq), rot(q[:, Cq:Cq + Ck], Hkv),
                                           q[:, Cq + Ck:].reshape(T, Hkv, hd), 1, T)[0].reshape(T, Cq) for q in qkv])
    R.append(("RoPE + KV-cache attention, 3 streams (prefill + 3-row step)", rel_err(out, out_r), tol))
    ob = cp.full((ns * 3, Cq), 0x7fc0, BF)                # bf16 out (the batched decode step's), NaNs first
    attn_cached(g, kc, vc, ob, state, 3, Hq, Hkv, hd)
    R.append(("  the 3-row step, bf16 out", rel_err(bf16_float(cp.asnumpy(ob)).reshape(ns, 3, Cq), out_r[:, 7:]), 1e-2))
    S, p0, st0, e, er, ec = MATVEC_ROWS + 1, 70, cp.asarray(np.array([70, 0], np.int32)), 0.0, 0.0, 0.0
    for d in ATTN_CACHED_HD:                       # a step of many streams: every head dim, 1-4 q heads a kv head
        for Hq3 in (2, 4, 6, 8):
            Hkv3, C3 = 2, (Hq3 + 4) * d
            kc3, vc3, q3, o3 = randn(S, Hkv3, 80, d), randn(S, Hkv3, 80, d), randn(S, C3), _nan(S, Hq3 * d)
            fold = attn_warps(S, Hq3, Hkv3, d) and Hq3 == 6    # also: RoPE and the append done by the attention
            if fold:
                c64, kd, vd = pl.rope_tables(80, d, np.float64), _d(kc3), _d(vc3)
                attn_cached(_d(q3), kd, vd, o3, st0, 1, Hq3, Hkv3, d, tuple(_d(a.astype(np.float32)) for a in c64))
                for c0, H in ((0, Hq3), (Hq3 * d, Hkv3)):
                    q3[:, c0:c0 + H * d] = ne.rope_forward(q3[:, c0:c0 + H * d].reshape(S, H, d), np.full(S, p0),
                                                           *c64).reshape(S, H * d)
                kc3[:, :, p0], vc3[:, :, p0] = (q3[:, c0:c0 + Hkv3 * d].reshape(S, Hkv3, d) for c0 in
                                                (Hq3 * d, (Hq3 + Hkv3) * d))
                ec = max(ec, rel_err(kd[:, :, p0], kc3[:, :, p0]), rel_err(vd[:, :, p0], vc3[:, :, p0]))
            else:
                attn_cached(_d(q3), _d(kc3), _d(vc3), o3, st0, 1, Hq3, Hkv3, d)
            k, v = (np.repeat(c[:, :, :p0 + 1], Hq3 // Hkv3, axis=1) for c in (kc3, vc3))     # (S, Hq, keys, d)
            sc = q3[:, :Hq3 * d].reshape(S, Hq3, 1, d) @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            err = rel_err(o3, (p / p.sum(-1, keepdims=True) @ v).reshape(S, Hq3 * d))
            e, er = (e, max(er, err)) if fold else (max(e, err), er)
    R.append((f"  a step of {S} streams at {p0}, head dims {ATTN_CACHED_HD}, 1-4 q heads a kv head", e, tol))
    R.append((f"  the same, RoPE and the append in the attention (head dims {ATTN_WARPS_HD})", er, tol))
    R.append(("    its k and v appended to the caches", ec, tol))
    # a Decoder's step (records): each row at its own slot and position, its q|k|v scaled by its 1/rms of its
    # residual row (bf16), RoPE and the append by attn_warps
    d, Hq3, Hkv3, S, n = 64, 6, 2, 5, 81
    slots, at = np.array([3, 0, 4, 1, 2]), np.array([10, 0, 79, 33, 5])
    kc3, vc3, q3, o3 = randn(S, Hkv3, n, d), randn(S, Hkv3, n, d), randn(S, (Hq3 + 2 * Hkv3) * d), _nan(S, Hq3 * d)
    xr = _rb(randn(S, 96) * 3)
    recs = np.zeros((S, DEC_REC), np.int32)
    recs[:, DEC_FIELDS.index("SLOT")], recs[:, DEC_FIELDS.index("POS")] = slots, at
    c64, kd, vd = pl.rope_tables(n, d, np.float64), _d(kc3), _d(vc3)
    attn_cached(_d(q3), kd, vd, o3, st0, 1, Hq3, Hkv3, d, tuple(_d(a.astype(np.float32)) for a in c64),
                cp.asarray(recs.ravel()), xn=_db(xr))
    q3 = q3 / np.sqrt((xr * xr).mean(1, keepdims=True) + pl.RMS_EPS)
    want, ea = np.zeros((S, Hq3 * d)), 0.0
    for i, (sl, p) in enumerate(zip(slots, at)):
        rot = lambda u, H: ne.rope_forward(u.reshape(1, H, d), np.array([p]), *c64).reshape(H, d)
        qr, kr = rot(q3[i, :Hq3 * d], Hq3), rot(q3[i, Hq3 * d:(Hq3 + Hkv3) * d], Hkv3)
        vr = q3[i, (Hq3 + Hkv3) * d:].reshape(Hkv3, d)
        k, v = kc3[sl, :, :p + 1].copy(), vc3[sl, :, :p + 1].copy()
        k[:, p], v[:, p] = kr, vr
        ea = max(ea, rel_err(kd[sl, :, p], kr), rel_err(vd[sl, :, p], vr))
        for h in range(Hq3):
            sc = k[h // (Hq3 // Hkv3)] @ qr[h] / math.sqrt(d)
            w = np.exp(sc - sc.max())
            want[i, h * d:(h + 1) * d] = w / w.sum() @ v[h // (Hq3 // Hkv3)]
    R.append(("  a Decoder's step: rows at their own slots and positions, scaled by their 1/rms, RoPE and the "
              "append in attn_warps", rel_err(o3, want), tol))
    R.append(("    their k and v appended at their slots and positions", ea, tol))
    gu = randn(5, 140)
    act = cp.full((5, 70), 0x7fc0, BF)
    swiglu_fwd(_d(gu), act)
    R.append(("SwiGLU fp32 -> bf16 (the batched decode step's)", rel_err(bf16_float(cp.asnumpy(act)),
                                                                          ne.swiglu_forward(gu)), 1e-2))
    x, nw, W = randn(ns * 3, 96), randn(96) * 0.5 + 1, randn(Cq + 2 * Ck, 96)       # RMSNorm-qkv-RoPE-append
    kc2, vc2, g = _nan(ns, Hkv, ctx, hd), _nan(ns, Hkv, ctx, hd), _nan(ns * 3, Cq + 2 * Ck)
    matvec(g, _d(x), _d(W), "rope", _d(nw), (kc2, vc2, _d(cos), _d(sin), cp.asarray(np.array([7, 0], np.int32)), 3,
                                             Hq, Hkv, hd))
    ref = ne.rmsnorm_forward(x, nw)[0] @ W.T
    for c0, H in ((0, Hq), (Cq, Hkv)):
        ref[:, c0:c0 + H * hd] = ne.rope_forward(ref[:, c0:c0 + H * hd].reshape(ns * 3, H, hd), np.tile(np.arange(7, 10), ns),
                                                 cos, sin).reshape(ns * 3, H * hd)
    R.append(("matvec RMSNorm-qkv-RoPE, 3 streams x 3 rows at 7..9", rel_err(g, ref), tol))
    cached = np.concatenate([cp.asnumpy(kc2[:, :, 7:10]).transpose(0, 2, 1, 3).reshape(ns * 3, Ck),
                             cp.asnumpy(vc2[:, :, 7:10]).transpose(0, 2, 1, 3).reshape(ns * 3, Ck)], 1)
    R.append(("  its k and v appended to the caches (bitwise)", float(np.abs(cached - cp.asnumpy(g[:, Cq:])).max()), 0.0))
    for K in (200, 2048 if matvec_plan(35, 2048) else 1024):     # one warp a unit; 8 warps splitting K
        x, W, nw, x0 = randn(MATVEC_ROWS, K), randn(70, K), randn(K) * 0.5 + 1, randn(MATVEC_ROWS, 70)
        h = ne.rmsnorm_forward(x, nw)[0]
        tag = f"matvec K={K} ({matvec_plan(35, K)[1]} warps a unit)"
        for epi, norm, want, shape in (("out", nw, h @ W.T, 70), ("add", None, x0 + x @ W.T, 70),
                                       ("glu", nw, ne.swiglu_forward(h @ W.T), 35)):
            big, one = (_d(x0), _d(x0[11:12])) if epi == "add" else (_nan(MATVEC_ROWS, shape), _nan(1, shape))
            nd = None if norm is None else _d(norm)
            matvec(big, _d(x), _d(W), epi, nd)
            matvec(one, _d(x[11:12]), _d(W), epi, nd)
            R.append((f"{tag} '{epi}', {MATVEC_ROWS} rows", rel_err(big, want), tol))
            R.append((f"{tag} '{epi}': row 11 of {MATVEC_ROWS} == row alone (bitwise)",
                      float(cp.abs(big[11] - one[0]).max()), 0.0))
    for name in ("tiny", "small"):                       # the whole decode step against float64
        P = gradcheck_params(pl.CONFIGS[name], rng, scale=0.3)
        P64, smp = P.astype(np.float64), Sampler(P)
        cache = ne.KVCache(P.cfg, 1, np.float64)
        for ids, what in (([5, 9, 2, 7, 1], "a 5-token prompt's last row"), ([3, 8, 4], "a 3-row step")):
            got = smp.forward(ids)                       # (rows, n_mtp, V)
            want = ne.forward_cached(P64, ids, cache, heads=P.cfg.n_mtp)[-len(got):]
            R.append((f"decode step, {name}: every head's logits, {what}", rel_err(got, want), tol))
    V, ns, steps = 300, 4, 6
    logits = (randn(steps, ns, V) * 3).astype(np.float32)
    logits[..., 7] = logits[..., 9]                                     # a tie: the smaller id first
    logits[:, 0] = np.round(logits[:, 0])             # stream 0: ~19 values, ties at every k-th (kth_largest)
    uni = rng.random(steps * ns)
    hist = [list(rng.integers(0, V, 5)) for _ in range(ns)]
    bad = 0
    rules = (pl.Sampling(0), pl.Sampling(0.8, 40), pl.Sampling(1.3, 0, 0.9), pl.Sampling(0.7, 20, 0.8, 1.3),
             pl.Sampling(0, 0, 1.0, 1.5), pl.Sampling(1.0, 7), pl.Sampling(0.9, 0, 1.0, 1.2))
    for sampling in rules:
        seen = cp.zeros((ns, V), np.int32)
        for r, h in enumerate(hist):
            seen[r, cp.asarray(np.array(h))] = 1
        state, tokens = cp.zeros(2 + ns, np.int32), cp.zeros(steps * ns, np.int32)
        ref = []
        for t in range(steps):
            lg = _d(logits[t])
            sample_tokens(lg, seen, _d(uni).astype(np.float32), state, tokens, sampling)
            advance(state, 1, 1)
            for r in range(ns):
                u = iter([float(np.float32(uni[t * ns + r]))])
                tk = sampling.sample(logits[t, r], hist[r], type("U", (), {"random": lambda self: next(u)})())
                hist[r].append(tk)
                ref.append(tk)
        bad += int((cp.asnumpy(tokens) != np.array(ref)).sum())
    R.append((f"device sampler == pipeline.Sampling ({len(rules)} rules, ids differing)", float(bad), 0.0))
    lg = randn(3, 2 * V)
    am = cp.zeros(6, np.int32)
    argmax_heads(_d(lg), V, am)
    R.append(("argmax_heads (ids differing)", float((cp.asnumpy(am) != lg.reshape(6, V).argmax(1)).sum()), 0.0))
    return R


def decoder_requests(rng, V, n):
    """n random requests for pl.decode_requests: arrivals over 6 steps, prompts of 1-19 ids, 2-24 ids wanted,
    greedy and sampled rules (top-k, top-p, a repetition penalty)."""
    rules = [pl.Sampling(0), pl.Sampling(0.9, 40, 0.9), pl.Sampling(0.8, 0, 1.0, 1.3), pl.Sampling(1.2, 5)]
    return [(int(rng.integers(0, 6)), [int(i) for i in rng.integers(1, V, int(rng.integers(1, 20)))],
             int(rng.integers(2, 25)), rules[i % len(rules)], int(rng.integers(0, 2 ** 63))) for i in range(n)]


DEC_LOGITS_TOL = 5e-2     # a Decoder row's logits (bf16 products) against the fp32 Sampler's, weights of std 0.1:
                          # a float64 emulation of bf16 roundings (x', W, the attention's and SwiGLU's outputs)
                          # over 20 requests each of tiny and small gives at most 2.4e-2 (at std 0.3: 0.2)


def selftest_decoder(rng):
    """The Decoder (continuous batching): requests interleaved in a batch of more than MATVEC_ROWS rows
    (arrivals, rows freed and taken again, waiting for a row) give each request's ids alone; a row with NaN
    in its cache gets -1 while the others go on. Against the Sampler with the same seed: with bf16 products
    (sm_80 on) a request's first id (the prefill is the Sampler's) and each row's step logits within
    DEC_LOGITS_TOL; with matvec (before sm_80) its ids, and its step logits bit for bit at DECODER_CH's
    default."""
    R = []
    for name in ("tiny", "small"):
        bf = PROFILE.bf16                       # peaked weights where ids must agree exactly (no near-ties)
        P = gradcheck_params(pl.CONFIGS[name], rng, scale=0.1 if bf else 0.3)
        V, cap = P.cfg.vocab, MATVEC_ROWS + 4                    # buckets up to 20 rows: two of matvec's chunks
        dec, smp = Decoder(P, cap, prefill=PREFILL_ROWS // 4), Sampler(P)    # (small: a prompt over two passes)
        assert (dec.Pb is not None) == bf
        reqs = decoder_requests(rng, V, cap + 8)
        if bf and P.cfg.ctx > dec._mp + 50:      # a prompt over two passes, the first ending none
            reqs[3] = (reqs[3][0], [int(i) for i in rng.integers(1, V, dec._mp + 40)], *reqs[3][2:])
        alone = [pl.decode_requests(dec, [(0, *q[1:])])[0] for q in reqs]
        mixed = pl.decode_requests(dec, reqs)
        R.append((f"decoder {name}: {len(reqs)} requests interleaved in {cap} rows == each alone (ids differing)",
                  float(sum(a != b for x, y in zip(alone, mixed) for a, b in zip(x, y))
                        + sum(len(x) != len(y) for x, y in zip(alone, mixed))), 0.0))
        if bf:              # the prompts' pass: a prompt's last logits against the Sampler's fp32 prefill
            err = 0.0
            for _, ids, n, sampling, seed in reqs[:8]:
                dec.start(0, ids, sampling, seed)
                smp.pos = 0
                err = max(err, rel_err(dec.lg[(len(ids) - 1) % dec._mp], smp.forward(ids)[-1, 0]))
                dec.free(0)
            R.append((f"decoder {name}: a prompt's last logits (a pass of bf16 products) == the Sampler's", err,
                      DEC_LOGITS_TOL))
        else:
            bad = 0
            for (_, ids, n, sampling, seed), want in zip(reqs, alone):
                got = list(smp.generate(ids, n, sampling, np.random.default_rng(seed)))
                bad += sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
            R.append((f"decoder {name}: a request alone == Sampler.generate, its seed (ids differing)", float(bad),
                      0.0))
        # three rows at once, the middle one's cache poisoned: it gets -1, rows 0 and 2 their ids alone, and
        # the logits of their step ahead (rows 0 and 2 of a bucket of 4) are the Sampler's
        m = min(len(alone[0]), len(alone[2]))
        first = dec.starts([(r, *reqs[r][1:2], *reqs[r][3:]) for r in range(3)])
        dec.kv[:, :, 2, :, 0] = np.nan
        got = [[t] for t in first]
        for _ in range(m - 1):
            for r, t in enumerate(dec.step([0, 1, 2])):
                got[r].append(int(t))
        R.append((f"decoder {name}: the row with NaN in its cache gets -1, the others their ids (ids differing)",
                  float((got[0] != alone[0][:m]) + (got[2] != alone[2][:m]) + (got[1][1:] != [-1] * (m - 1))), 0.0))
        err, lg = 0.0, dec.logits if dec.Pb is None else dec.lg
        assert dec._settle() is not None                 # the logits are the step ahead's, fed each row's m-th id
        for r in (0, 2):
            if bf:           # the Sampler's fp32 forward along the row's ids (with bf16 products they may be others)
                smp.pos, K = 0, P.cfg.n_mtp
                smp.forward(reqs[r][1])
                for i in range(0, m, K):                 # (forward takes up to n_mtp ids at once)
                    want = smp.forward(got[r][i:min(i + K, m)])[-1, 0]
            else:
                list(smp.generate(reqs[r][1], m + 1, reqs[r][3], np.random.default_rng(reqs[r][4])))
                want = cp.asnumpy(smp.logits[:V])
            err = max(err, rel_err(lg.ravel()[r * V:(r + 1) * V], want))
        exact = DECODER_CH is None and not bf       # else bf16 products, or the attention's keys in other chunks
        R.append((f"decoder {name}: a row's step logits == the Sampler's{' (bitwise)' if exact else ''}", err,
                  DEC_LOGITS_TOL if bf else 0.0 if exact else 1e-5))
        for r in range(3):
            dec.free(r)
    return R


def _db(a):
    """host floats -> a device bf16 array (rounded to nearest even)"""
    return cp.asarray(bf16_bits(a))


def _rb(a):
    """host floats rounded to bf16, as float64: the inputs the bf16 references see"""
    return bf16_float(bf16_bits(a)).astype(np.float64)


def _nanb(*shape):
    return cp.full(shape, 0x7FC0, BF)                       # bf16 NaN


def selftest_checks_bf16(rng):
    """The bf16 path's kernels -> list of (kernel, error, tolerance). References are float64 on the
    bf16-rounded inputs, so an fp32 output is held to fp32 accuracy (1e-5) and a bf16 output to its own
    rounding (2^-9 ~ 2e-3 of the largest value: tolerance 4e-3); the attention's bf16 intermediates (P, dS
    as tensor-core operands) get 1e-2 and 2e-2. Integers (bit mismatches) must be 0."""
    ne = cpu_reference()
    R = []
    T32, TB = 1e-5, 4e-3
    randn = lambda *s: rng.standard_normal(s)
    # fp32 -> bf16 conversion: the device's cvt.rn against the host's round-to-nearest-even
    x = randn(5000) * 10.0 ** rng.integers(-6, 6, 5000)
    x[:3] = (0.0, -0.0, 3.0)
    y = _nanb(x.size)
    to_bf16(_d(x), y)
    R.append(("to_bf16 (bits vs round-to-nearest-even)", float(np.count_nonzero(cp.asnumpy(y) != bf16_bits(x))), 0))
    # GEMM: bf16 inputs, fp32 accumulation, fp32 or bf16 output, all transposes, alpha and beta
    M, Nn, Kk = 96, 80, 1000
    e32 = eb = 0.0
    for ta in (False, True):
        for tb in (False, True):
            A, Bm, C0 = _rb(randn(M, Kk)), _rb(randn(Nn, Kk)), randn(M, Nn)
            A_ = A.T.copy() if ta else A
            B_ = Bm if tb else Bm.T.copy()
            C = _d(C0)
            mm(C, _db(A_), _db(B_), ta=ta, tb=tb, alpha=0.5, beta=1.0)
            e32 = max(e32, rel_err(C, 0.5 * A @ Bm.T + C0))
            Cb = _nanb(M, Nn)
            mm(Cb, _db(A_), _db(B_), ta=ta, tb=tb)
            eb = max(eb, rel_err(Cb, A @ Bm.T))
    R.append(("gemm bf16 -> fp32 (gemmEx, 4 transposes, beta=1)", e32, 1e-4))
    R.append(("gemm bf16 -> bf16 (gemmEx, 4 transposes)", eb, TB))
    # dec_add: x += a W^T on tensor cores, K = 65 pairs (warps of 9 pairs, more than a warp's registers hold,
    # and one of 2); row 0's bits in a launch of one tile of rows and of three
    N, Kk, rows = 48, 2080, 40
    W, a, x0 = _rb(randn(N, Kk)), _rb(randn(48, Kk)), _rb(randn(48, N) * 4)
    x, x1 = _db(x0), _db(x0)
    dec_add(x, _db(a), _db(W), rows)
    dec_add(x1, _db(a), _db(W), 1)
    R.append(("dec_add: a step's x += a W^T (bf16 x, tensor cores, K over 8 warps)",
              rel_err(x[:rows], x0[:rows] + a[:rows] @ W.T), TB))
    R.append(("  its row 0 in a launch of 1 row == of 40 (bits differing)", float(cp.count_nonzero(x1[0] != x[0])), 0))
    # RMSNorm: fp32 residual plus a bf16 branch in, bf16 h out; backward from a bf16 dy, with and without the
    # bf16 copy of dx
    for N, D in ((600, 72), (130, 1024)):
        x0, add, w = randn(N, D) * 2, _rb(randn(N, D)), 1 + 0.3 * randn(D)
        y2, rstd2 = ne.rmsnorm_forward(x0 + add, w)
        xo, h, r = _nan(N, D), _nanb(N, D), _nan(N)
        rmsnorm_fwd(_d(x0), _d(w), h, r, add=_db(add), xout=xo)
        R.append((f"rmsnorm fwd + bf16 branch add, bf16 h (D={D})", max(rel_err(xo, x0 + add), rel_err(r, rstd2)), T32))
        R.append((f"  its bf16 h (D={D})", rel_err(h, y2), TB))
        dy, dres = _rb(randn(N, D)), randn(N, D)                        # bf16 dy: a GEMM's output
        dx_ref, dw_ref = dres.copy(), np.zeros(D)
        ne.rmsnorm_backward(dy, x0 + add, w, rstd2, dx_ref, dw_ref)
        for copy in (False, True):
            dxg, dxb, dwg = _d(dres), _nanb(N, D), _nan(D)
            rmsnorm_bwd(_db(dy), _d(x0 + add), _d(w), _d(rstd2), dxg, dwg, _nan(rms_part_rows(N), D),
                        dxb=dxb if copy else None)
            R.append((f"rmsnorm bwd, bf16 dy{' + bf16 copy' if copy else ''}: dx, dw (D={D})",
                      max(rel_err(dxg, dx_ref), rel_err(dwg, dw_ref)), T32))
        R.append((f"  its bf16 dx (D={D})", rel_err(dxb, dx_ref), TB))
    # a Decoder's bf16 residual stream: the embedding rounded into it; RMSNorm from its rows (h, or the
    # statistics alone); the kernels that scale a product's rows by their 1/rms (the norm's weight folded
    # into the product): rope_store and SwiGLU (attn_warps: selftest_generation)
    V, N, D, F, hd, Hq, Hkv = 50, 7, 96, 80, 32, 4, 2
    emb, idx = randn(V, D), rng.integers(0, V, N).astype(np.int32)
    xb = _nanb(N, D)
    embed_fwd(_d(emb), cp.asarray(idx), xb)
    R.append(("embed fwd -> bf16 (bits vs round-to-nearest-even)",
              float(np.count_nonzero(cp.asnumpy(xb) != bf16_bits(emb[idx]))), 0))
    x, w = _rb(randn(N, D) * 2), 1 + 0.3 * randn(D)
    y, rs = ne.rmsnorm_forward(x, w)
    h, r, r2 = _nanb(N, D), _nan(N), _nan(N)
    rmsnorm_fwd(_db(x), _d(w), h, r)
    rmsnorm_fwd(_db(x), None, None, r2)
    R.append(("rmsnorm fwd of bf16 rows: rstd, and rstd alone", max(rel_err(r, rs), rel_err(r2, rs)), T32))
    R.append(("  its bf16 h", rel_err(h, y), TB))
    gu, act = randn(N, 2 * F), _nanb(N, F)
    swiglu_norm(_d(gu), _db(x), act)
    R.append(("SwiGLU of rows scaled by their 1/rms of bf16 rows, bf16 out", rel_err(act, ne.swiglu_forward(
        gu * rs[:, None])), TB))
    C, nq = (Hq + 2 * Hkv) * hd, (Hq + Hkv) * hd
    q, (cos, sin) = randn(N, C), pl.rope_tables(16, hd, np.float64)
    g, kc, vc = _d(q), _nan(1, Hkv, 16, hd), _nan(1, Hkv, 16, hd)
    rope_store(g, kc, vc, _d(cos), _d(sin), cp.asarray(np.zeros(2, np.int32)), N, Hq, Hkv, hd, rs=_d(rs))
    ref = q * rs[:, None]
    ref[:, :nq] = ne.rope_forward(ref[:, :nq].reshape(N, Hq + Hkv, hd), np.arange(N), cos, sin).reshape(N, nq)
    cached = np.concatenate([cp.asnumpy(c[0, :, :N]).transpose(1, 0, 2).reshape(N, Hkv * hd) for c in (kc, vc)], 1)
    R.append(("rope_store of rows scaled by their 1/rms: q|k|v, and k|v cached",
              max(rel_err(g, ref), rel_err(cached, ref[:, Hq * hd:])), T32))
    # RoPE on bf16 q|k heads of a fused q|k|v buffer (v untouched), and at positions pos0..
    B, T, Hq, Hkv, hd = 2, 19, 4, 2, 32
    N, S = B * T, (Hq + 2 * Hkv) * hd
    cos, sin = pl.rope_tables(64, hd, np.float64)
    u = _rb(randn(N, S))
    pos = np.tile(np.arange(T, dtype=np.int32), B)
    ref = u.copy()
    ref[:, :(Hq + Hkv) * hd] = ne.rope_forward(u[:, :(Hq + Hkv) * hd].reshape(N, Hq + Hkv, hd), pos, cos, sin).reshape(N, -1)
    g = _db(u)
    rope(g, _d(cos), _d(sin), T, Hq + Hkv, hd)
    R.append(("rope bf16 fwd", rel_err(g, ref), TB))
    ref = ne.rope_forward(u[:, :hd].reshape(N, 1, hd), np.arange(5, 5 + N, dtype=np.int32), cos, sin).reshape(N, hd)
    g = _db(u[:, :hd])
    rope(g, _d(cos), _d(sin), N, 1, hd, pos0=5)
    R.append(("rope bf16 fwd at positions pos0..", rel_err(g, ref), TB))
    # SwiGLU: 2 (F % 8 != 0) and 8 columns per thread
    for N, F in ((37, 50), (29, 96)):
        gu, dact = _rb(randn(N, 2 * F) * 2), _rb(randn(N, F))
        act = _nanb(N, F)
        swiglu_fwd(_db(gu), act)
        R.append((f"swiglu bf16 fwd (F={F})", rel_err(act, ne.swiglu_forward(gu)), TB))
        gg = _db(gu)
        swiglu_bwd(_db(dact), gg)
        R.append((f"swiglu bf16 bwd [dg | du] (F={F})", rel_err(gg, ne.swiglu_backward(dact, gu)), TB))
    # chunked cross-entropy of 3 MTP heads with ignored targets, in two chunks (the second ragged), from fp32 and
    # bf16 logits (the gradient over them, as the trainer has it): rows in registers (V <= 4096, V a multiple of
    # 16 bytes of logits), rows read from memory
    for B, T, V, K, lb in ((3, 23, 96, 3, 0), (3, 23, 97, 3, 0), (2, 9, 4500, 2, 0), (3, 23, 97, 3, 1),
                           (3, 23, 1000, 3, 1), (2, 9, 4096, 2, 1)):
        N = B * T
        logits, y = randn(N, K * V) * 3, rng.integers(0, V, (B, T)).astype(np.int32)
        logits = _rb(logits) if lb else logits
        y[rng.random((B, T)) < 0.2] = -1
        ref = logits.copy()
        obj_ref, ces_ref = ne.mtp_loss(ref, y, K, 0.3)
        sc, inv = loss_weights(y, K, 0.3)
        lg, rl, ce = (_db if lb else _d)(logits), _nan(K, N), _nan(K)
        dl = lg if lb else _nanb(N, K * V)
        tg, scd = cp.asarray(y.reshape(-1)), _d(sc)
        for n0, n1 in ((0, N // 2 + 3), (N // 2 + 3, N)):
            xent_chunk(lg[n0:n1], dl[n0:n1], tg, scd, rl, n0, T, K, want_grad=True)
        loss_reduce(rl, _d(inv), ce)
        R.append((f"cross-entropy, 2 row chunks (V={V}, {'bf16' if lb else 'fp32'} logits): loss",
                  rel_err(ce, ces_ref), T32))
        R.append(("  its bf16 gradient", rel_err(dl, ref), TB))
    # tensor-core flash attention (its backward with the RoPE backward): head dims 32, 64, 128, GQA, T not a tile
    # multiple; determinism; at head dim 64 on sm_90, the wgmma kernels and the mma.sync ones
    for hd, Hq, Hkv, B, T, wg in ((32, 4, 2, 2, 100, False), (64, 6, 2, 2, 130, False), (64, 6, 2, 2, 130, True),
                                  (128, 4, 1, 1, 200, False)):
        if not flash_fits(hd, True) or (wg and not flash_wg(hd)):     # hd 128's dK/dV tile on 99 KB: check_precision
            continue                                                  # refuses bf16 there
        N, Cq, Ck = B * T, Hq * hd, Hkv * hd
        qkv, dout = _rb(randn(N, Cq + 2 * Ck) * 1.5), _rb(randn(N, Cq))
        q, k, v = (qkv[:, :Cq].reshape(N, Hq, hd), qkv[:, Cq:Cq + Ck].reshape(N, Hkv, hd),
                   qkv[:, Cq + Ck:].reshape(N, Hkv, hd))
        out_r, lse_r, dq_r, dk_r, dv_r = _attn_ref(q, k, v, B, T, dout.reshape(N, Hq, hd))
        cos, sin = pl.rope_tables(256, hd, np.float64)
        pos = np.tile(np.arange(T, dtype=np.int32), B)
        dq_r, dk_r = ne.rope_backward(dq_r, pos, cos, sin), ne.rope_backward(dk_r, pos, cos, sin)
        g_qkv, g_do, g_cos, g_sin = _db(qkv), _db(dout), _d(cos), _d(sin)
        runs = []
        for _ in range(2):
            out, lse, dqkv, ws = _nanb(N, Cq), _nan(B, Hq, T), _nanb(N, Cq + 2 * Ck), flash_bf16_scratch(B, T, Hq)
            ws["D"].fill(np.nan)
            ws["dS"].fill(0x7FC07FC0)                                  # bf16 NaNs: a tile read unwritten shows
            flash_bf16_fwd(g_qkv, out, lse, B, T, Hq, Hkv, hd, wg=wg)
            flash_bf16_bwd(g_qkv, out, g_do, lse, dqkv, ws, g_cos, g_sin, B, T, Hq, Hkv, hd, wg=wg)
            runs.append((cp.asnumpy(out), cp.asnumpy(lse), cp.asnumpy(dqkv)))
        tag = f"flash bf16{' wgmma' if wg else ''} hd={hd} Hq/Hkv={Hq}/{Hkv} T={T}"
        out, lse, d = runs[0]
        R.append((f"{tag} lse", rel_err(lse, lse_r), T32))
        R.append((f"{tag} fwd", rel_err(out, out_r.reshape(N, Cq)), 1e-2))
        R.append((f"{tag} bwd dq (rotated back)", rel_err(d[:, :Cq], dq_r.reshape(N, Cq)), 2e-2))
        R.append((f"{tag} bwd dk (rotated back)", rel_err(d[:, Cq:Cq + Ck], dk_r.reshape(N, Ck)), 2e-2))
        R.append((f"{tag} bwd dv", rel_err(d[:, Cq + Ck:], dv_r.reshape(N, Ck)), 2e-2))
        R.append((f"{tag} rerun bit mismatches", float(sum(np.count_nonzero(a.view(np.uint16) != b.view(np.uint16))
                                                           for a, b in zip(runs[0], runs[1]))), 0))
    R += selftest_adamw(rng, randn, T32, bf16=True)
    R += selftest_muon(rng, randn, bf16=True)
    return R


def selftest_adamw(rng, randn, tol, bf16=False):
    """The gradient norm, clipping and one AdamW step on the tiny config's layout (decay only on matrices and
    the embedding) from random moments, against the CPU engine's; bf16: with the bf16 copy of the weights that
    the same pass writes."""
    cfg = pl.CONFIGS["tiny"]
    n = pl.num_params(cfg)
    p, gr, m, v = randn(n), randn(n) * 0.05, randn(n) * 0.01, rng.random(n) * 1e-3
    Pd, Gd, Pbd = DeviceParams(cfg, _d(p)), DeviceParams(cfg, _d(gr)), DeviceParams(cfg, _nanb(n)) if bf16 else None
    opt = AdamW(Pd, Gd, Pb=Pbd)
    opt.m.flat[...], opt.v.flat[...] = _d(m), _d(v)
    opt.step_count = 2
    opt.step(3e-3)
    norm = float(np.sqrt(np.dot(gr, gr)))
    pr, mr, vr = p.copy(), m.copy(), v.copy()
    cpu_reference().adamw_step(pr, gr, mr, vr, pl.decay_mask(cfg, np.float64), 3e-3, 0.9, 0.95, 1e-8, 0.1, 3,
                               min(1.0, 1.0 / (norm + 1e-6)))
    if bf16:
        return [("adamw + bf16 copy: params", rel_err(Pd.flat - _d(p), pr - p), 1e-4),
                ("  its bf16 copy (bits vs rounding the fp32 result)",
                 float(np.count_nonzero(cp.asnumpy(Pbd.flat) != bf16_bits(cp.asnumpy(Pd.flat)))), 0)]
    return [("grad norm (float64 partials)", rel_err(opt.norm, [norm]), tol),
            ("adamw (clip, decay mask) params", rel_err(Pd.flat - _d(p), pr - p), 1e-4),
            ("adamw moments m, v", max(rel_err(opt.m.flat, mr), rel_err(opt.v.flat, vr)), tol)]


def selftest_muon(rng, randn, bf16=False):
    """One --optim muon step on the tiny config's layout (clipped, from random momenta) against the CPU engine's
    nanoeuler.Muon in float64 on the same float32 inputs. The momentum is elementwise: 1e-6. The Newton-Schulz
    output is not: five quintic steps amplify each step's rounding (the slope at 0 is 3.4445), so fp32 lands at
    1-3e-6 of float64 (numpy float32 on tiny's shapes, 200 seeds: at most 3.0e-6): 1e-5; bf16 operands, as
    training runs them, at up to 5.4e-2 (a float64 emulation of this path's roundings, same seeds): 1e-1."""
    cfg, f32 = pl.CONFIGS["tiny"], lambda a: a.astype(np.float32).astype(np.float64)
    n = pl.num_params(cfg)
    # weights of the init's size, so the float32 rounding of p - step stays far below the step
    p, gr, m, v = f32(randn(n) * 0.02), f32(randn(n) * 0.05), f32(randn(n) * 0.01), f32(rng.random(n) * 1e-3)
    Pd, Gd, Pbd = DeviceParams(cfg, _d(p)), DeviceParams(cfg, _d(gr)), DeviceParams(cfg, _nanb(n)) if bf16 else None
    opt = Muon(Pd, Gd, 10.0, Pb=Pbd)
    opt.m.flat[...], opt.v.flat[...] = _d(m), _d(v)
    opt.step_count = 2
    opt.step(1e-3)
    ne = cpu_reference()
    Pr = pl.Params(cfg, np.float64, p.copy())
    ref = ne.Muon(Pr, 10.0)
    ref.m.flat[:], ref.v.flat[:], ref.step_count = m, v, 2
    ref.step(Pr, pl.Params(cfg, np.float64, gr), 1e-3)
    mat = np.zeros(n, bool)
    for name in pl.muon_matrices(cfg):
        mat[slice(*Pr.offsets[name])] = True
    step, ref_step = cp.asnumpy(Pd.flat - _d(p)), Pr.flat - p
    rows = [("muon + bf16 copy: matrices (bf16 Newton-Schulz)" if bf16 else "muon: matrices (fp32 Newton-Schulz)",
             rel_err(step[mat], ref_step[mat]), 1e-1 if bf16 else 1e-5),
            ("muon: adamw on embedding, norms, heads", rel_err(step[~mat], ref_step[~mat]), 1e-4)]
    if bf16:
        return rows + [("  its bf16 copy (bits vs rounding the fp32 result)",
                        float(np.count_nonzero(cp.asnumpy(Pbd.flat) != bf16_bits(cp.asnumpy(Pd.flat)))), 0)]
    return rows + [("muon momentum (matrices), adam m, v (the rest)",
                    max(rel_err(cp.asnumpy(opt.m.flat)[mat], ref.m.flat[mat]),
                        rel_err(cp.asnumpy(opt.m.flat)[~mat], ref.m.flat[~mat]),
                        rel_err(opt.v.flat, ref.v.flat)), 1e-6)]


def print_table(rows, head=("check", "max rel err", "tol", "")):
    w = max(len(r[0]) for r in rows) + 2
    print(f"{head[0]:<{w}}{head[1]:>12}  {head[2]:>8}  result")
    ok_all = True
    for name, err, tol in rows:
        ok = err <= tol and np.isfinite(err)
        ok_all &= bool(ok)
        print(f"{name:<{w}}{err:12.2e}  {tol:8.0e}  {'pass' if ok else 'FAIL'}")
    return ok_all


def cmd_selftest(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py selftest", description="every kernel against a float64 reference")
    p.add_argument("--seed", type=pl.seed_arg, default=None, help="input seed (default: a fresh one, printed)")
    a = p.parse_args(argv)
    path, comp = compile_check()
    if path is None:
        print("nvrtc compile check: no libnvrtc found via ctypes (CuPy compiles the kernels below)")
    else:
        bad = [(n, log) for n, ok, log in comp if not ok]
        print(f"nvrtc compile check ({path}): {len(comp) - len(bad)}/{len(comp)} modules compile for compute_90")
        for n, log in bad:
            print(f"--- {n}:\n{log}")
    gpu()
    set_tf32(False)
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"self-test on {PROFILE.name}, fresh inputs (seed {seed}), "
          f"outputs poisoned with NaN; error = max|gpu - ref| / max|ref| vs float64")
    rng = np.random.default_rng(seed)
    rows = selftest_checks(rng) + (selftest_checks_bf16(rng) if PROFILE.bf16 else [])
    ok = print_table(rows) and (path is None or all(ok for _, ok, _ in comp))
    print("self-test:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


# --- gradient check: the whole model on the GPU against nanoeuler.loss_and_grads in float64 on the same
# float32 weights; several layers, Hq/Hkv > 1, >= 3 MTP heads, -1 targets. fp32 (TF32 off, the default)
# to 1e-5; bf16 (mixed precision: bf16 weights copy, activations and tensor-core attention) to 2e-2.
# The bf16 check runs on matrices of std 0.05 that are bf16 numbers (so the fp32 master weights equal
# their bf16 copy, and "the same weights" holds exactly). At the fp32 check's std 0.1, chosen for peaky
# attention, the network amplifies bf16's 2^-9 rounding of the activations to 2-5e-2 in the gradients:
# a float64 emulation of the bf16 path's roundings (scratch_gpu/bf16_emulate.py) gives the same errors
# there (hd64: 2.2e-2 emulated and measured), and 6e-3 to 7e-3 at std 0.05.

GRADCHECK = [  # (tag, config, B, T, attention)
    ("hd32", pl.Config(dim=128, n_heads=4, n_kv_heads=2, n_layers=3, ctx=128, vocab=256, ffn=384, n_mtp=3), 2, 100, "flash"),
    ("hd64", pl.Config(dim=128, n_heads=2, n_kv_heads=1, n_layers=2, ctx=160, vocab=200, ffn=384, n_mtp=4), 2, 150, "flash"),
    ("naive", pl.Config(dim=128, n_heads=4, n_kv_heads=2, n_layers=3, ctx=128, vocab=256, ffn=384, n_mtp=3), 2, 100, "naive"),
]
GRADCHECK_BF16 = [  # the bf16 path runs flash attention only; head dims 32, 64 and 128; T not a tile multiple
    GRADCHECK[0], GRADCHECK[1],
    ("hd128", pl.Config(dim=256, n_heads=2, n_kv_heads=1, n_layers=2, ctx=160, vocab=200, ffn=512, n_mtp=3), 2, 130, "flash"),
]
GRADCHECK_TOL = {"fp32": 1e-5, "bf16": 2e-2}


def gradcheck_params(cfg, rng, scale=0.1, bf16=False):
    """Weights that make every path matter: peaky attention (matrices of std `scale`), non-trivial norm
    weights; with bf16, the matrices the GEMMs read are rounded to bf16 numbers."""
    P = pl.Params(cfg)
    for name, view in P.items():
        view[:] = 1 + 0.2 * rng.standard_normal(view.shape) if view.ndim == 1 else \
            rng.standard_normal(view.shape) * (0.5 if name == "tok_emb" else scale)
        if bf16 and view.ndim == 2 and name != "tok_emb":
            view[:] = bf16_float(bf16_bits(view))
    return P


def cmd_gradcheck(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py gradcheck",
                  description="whole-model gradients on the GPU against nanoeuler.py in float64")
    p.add_argument("--seed", type=pl.seed_arg, default=0, help="weights and batch (default 0)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (TF32 off; the reference, tolerance 1e-5) or bf16 (mixed precision, 2e-2); default fp32")
    p.add_argument("--dpo", action="store_true", help="the DPO loss's gradient instead (tiny and small configs)")
    a = p.parse_args(argv)
    gpu()
    set_tf32(False)
    if a.dpo:
        return gradcheck_dpo(a.precision, a.seed)
    rng = np.random.default_rng(a.seed)
    rows, tol = [], GRADCHECK_TOL[a.precision]
    for tag, cfg, B, T, attn in (GRADCHECK_BF16 if a.precision == "bf16" else GRADCHECK):
        bf = a.precision == "bf16"
        if bf and not flash_fits(cfg.head_dim, True):          # hd 128's dK/dV tile on 99 KB (check_precision)
            print(f"{tag}: skipped, bf16 flash attention at head dim {cfg.head_dim} does not fit {PROFILE.name}")
            continue
        P = gradcheck_params(cfg, rng, scale=0.05 if bf else 0.1, bf16=bf)
        x = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
        y = rng.integers(0, cfg.vocab, (B, T)).astype(np.int32)
        y[rng.random((B, T)) < 0.15] = -1
        obj_r, ces_r, G_r = cpu_reference().loss_and_grads(P.astype(np.float64), x, y)
        model = Model(cfg, B, T, attn=attn, precision=a.precision)
        model.load(P)
        model.set_batch(x, y, want_grad=True)
        model.G.flat.fill(np.nan)                              # every gradient must be written
        model.forward(want_loss=True, want_grad=True)
        model.backward()
        obj, ces = model.losses()
        G = model.G.download()
        head = f"[{tag}: D={cfg.dim} Hq/Hkv={cfg.n_heads}/{cfg.n_kv_heads} L={cfg.n_layers} MTP={cfg.n_mtp} B={B} T={T} {attn}]"
        rows.append((f"{head} objective", abs(obj - obj_r) / abs(obj_r), tol))
        for name in G.names:
            rows.append((f"{tag} {name}", rel_err(G[name], G_r[name]), tol))
    what = "float32 (TF32 off)" if a.precision == "fp32" else \
        "bf16 mixed precision (matrices of std 0.05, bf16 numbers)"
    return gradcheck_verdict(rows, "gradient check", f"GPU {what} vs nanoeuler.loss_and_grads float64 on the same "
                             "weights", a.precision)


def gradcheck_verdict(rows, name, what, precision):
    """Prints the table of (tensor, error, tolerance) and the verdict line; -> the exit code."""
    print(f"{name}: {what}; error = max|g - g_ref| / max|g_ref| per tensor")
    ok = print_table(rows, ("tensor", "max rel err", "tol", ""))
    worst = max(rows, key=lambda r: r[1])
    print(f"{name}: {'PASS' if ok else 'FAIL'} ({precision}; worst {worst[1]:.2e}: {worst[0]})")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------------
# 9. bench: training speed of `big` (tokens/s, ms/step, MFU, peak memory) per precision and batch size, and
# attention forward + backward alone (flash bf16, flash fp32, naive). A step time is CUDA events around
# --steps steps run back to back after 3 warm-up steps, as the training loop runs them (the host queues
# ahead of the device); "host ms" is the time the host takes to queue one step on an idle device (the
# launch overhead: a step would be launch-bound if it came near ms/step). MFU = model FLOPs / time / the
# device's dense bf16 peak (PROFILE.peak_tflops: 989 TFLOP/s on an H100/H200 SXM), for every precision; model
# FLOPs per token are pipeline.model_flops_per_token: 6 per matrix weight (all matrices, heads included,
# no embedding or norms) + 12 * L * T * D for the attention products counted over the full T x T (the
# PaLM convention: the causal half that is skipped still counts), so MFU is comparable across engines.
# Peak memory is what the run took from CuPy's pool (everything is preallocated, so it is the peak).
# Generation (bench_generation, section 6) and serve's batch without HTTP (bench_decoder) have tables of
# their own.

def _time(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(times))


def bench_step(cfg, B, T, attn, steps, precision, P=None, group=None):
    """-> (ms per step, peak pool bytes, host ms to queue a step, objective). The training step of make_trainer
    on weights P (default the contract's init); group: data parallel over its ranks (ZeRO-1), B rows per GPU."""
    import time
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    used0 = pool.total_bytes()
    trainer = make_trainer(pl.Params.init(cfg) if P is None else P, B, T, attn, precision=precision, group=group)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab, (B, T)).astype(np.int32) for _ in range(2))
    step = lambda: trainer.step(x, y, 1e-4)

    for _ in range(3):
        step()
    host = []
    for _ in range(3):                                  # queueing time of one step on an idle device
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    cp.cuda.Device().synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(steps):
        step()
    b.record()
    b.synchronize()
    ms = cp.cuda.get_elapsed_time(a, b) / steps
    peak = pool.total_bytes() - used0
    obj = trainer.model.losses()[0]
    trainer = None                                      # free the run's buffers before the next one
    pool.free_all_blocks()
    return ms, peak, 1e3 * float(np.median(host)), obj


def bench_attention(B=16, Hq=12, Hkv=4, T=512, hd=64, reps=20):
    """Attention forward and forward + backward alone, ms: flash bf16, flash fp32, naive (fp32 products;
    and with TF32 products, not the contract's precision, for reference)."""
    N, Cq, Ck = B * T, Hq * hd, Hkv * hd
    rng = np.random.default_rng(0)
    qkv_h, dout_h = rng.standard_normal((N, Cq + 2 * Ck)), rng.standard_normal((N, Cq))
    res = {}
    qkv, dout = cp.asarray(bf16_bits(qkv_h)), cp.asarray(bf16_bits(dout_h))
    out, dqkv = cp.empty((N, Cq), BF), cp.empty((N, Cq + 2 * Ck), BF)
    lse, Dv, ws = _nan(B, Hq, T), _nan(B, Hq, T), flash_bf16_scratch(B, T, Hq)
    cos, sin = (_d(t) for t in pl.rope_tables(T, hd, np.float64))      # the bf16 backward rotates dq, dk back
    for tag, wg in (("flash-bf16", None),) + ((("flash-bf16-mma", False),) if flash_wg(hd) else ()):
        res[tag] = (_time(lambda: flash_bf16_fwd(qkv, out, lse, B, T, Hq, Hkv, hd, wg=wg), reps),
                    _time(lambda: (flash_bf16_fwd(qkv, out, lse, B, T, Hq, Hkv, hd, wg=wg),
                                   flash_bf16_bwd(qkv, out, dout, lse, dqkv, ws, cos, sin, B, T, Hq, Hkv, hd, wg=wg)),
                          reps))
    qkv, dout = _d(qkv_h), _d(dout_h)
    out, dqkv, dqp = _nan(N, Cq), _nan(N, Cq + 2 * Ck), _nan((T + 63) // 64, N, Cq)
    if not flash_fits(hd):                     # fp32 flash's backward tile at hd 64 is over 99 KB (sm_86, sm_89)
        res["flash-fp32"] = (math.nan, math.nan)
    else:
        res["flash-fp32"] = (_time(lambda: flash_fwd(qkv, out, lse, B, T, Hq, Hkv, hd), reps),
                             _time(lambda: (flash_fwd(qkv, out, lse, B, T, Hq, Hkv, hd),
                                            flash_bwd(qkv, out, dout, lse, dqkv, Dv, dqp, B, T, Hq, Hkv, hd)), reps))
    dqp = None
    Pm, ws = _nan(B, Hq, T, T), naive_scratch(B, T, Hq, Hkv, hd)
    global NAIVE_TF32
    for tf, tag in ((False, "naive"), (True, "naive-tf32")):
        NAIVE_TF32 = tf
        res[tag] = (_time(lambda: naive_fwd(qkv, out, Pm, ws, B, T, Hq, Hkv, hd), reps),
                    _time(lambda: (naive_fwd(qkv, out, Pm, ws, B, T, Hq, Hkv, hd),
                                   naive_bwd(qkv, dout, Pm, dqkv, ws, B, T, Hq, Hkv, hd)), reps))
    NAIVE_TF32 = False
    return res


def bench_scaling(a, cfg, batches, T, precisions, group):
    """bench --gpus N, on each rank: per batch size, the training step on one GPU (every rank alone on its own GPU,
    at the same time), then on all N (ZeRO-1, B rows per GPU). Rank 0 prints tokens/s of all GPUs, the speed-up,
    and MFU and peak pool memory per GPU."""
    gpu()
    W, P = group.world, pl.Params.init(cfg)
    name = PROFILE.name
    fpt = pl.model_flops_per_token(cfg, T)
    print(f"bench --gpus {W} on {name}: {a.config} {cfg}, {pl.num_params(cfg):,} parameters, T={T}; {a.steps} steps "
          f"after 3 warm-up steps; tokens/s of all GPUs, MFU (vs {PROFILE.peak_tflops:.0f} TFLOP/s) and peak memory per GPU",
          flush=True)
    rows = []
    for prec in precisions:
        for B in batches:
            runs = []
            for g in (None, group):
                ms, peak, host, obj = bench_step(cfg, B, T, "flash", a.steps, prec, P, g)
                n = 1 if g is None else W
                runs.append(dict(gpus=n, ms=ms, tok_s=n * B * T / ms * 1e3, peak_gib=peak / 2 ** 30, host_ms=host,
                                 mfu=fpt * B * T / (ms / 1e3) / 1e12 / PROFILE.peak_tflops))
                group.barrier()                     # every GPU alone first, then all together
            rows.append(dict(precision=prec, B=B, T=T, one=runs[0], all=runs[1],
                             speedup=runs[1]["tok_s"] / runs[0]["tok_s"]))
            print(f"  {prec} B={B}: 1 GPU {runs[0]['tok_s']:,.0f} tokens/s, {W} GPUs {runs[1]['tok_s']:,.0f} tokens/s "
                  f"({rows[-1]['speedup']:.2f}x)", flush=True)
    print(f"\ntraining step, {a.config}, T={T}, B per GPU:")
    head = "ms/step  tokens/s   MFU  peak GiB"
    print(f"{'run':<14}| 1 GPU: {head} | {W} GPUs: {head} | speed-up")
    for r in rows:
        cols = [f"{x['ms']:7.2f}{x['tok_s']:10,.0f}{100 * x['mfu']:6.1f}%{x['peak_gib']:9.2f}" for x in (r["one"], r["all"])]
        print(f"{r['precision'] + ' B=' + str(r['B']):<14}|        {cols[0]} |{' ' * (len(str(W)) + 8)}{cols[1]} | "
              f"{r['speedup']:.2f}x")
    for prec in precisions:
        best = max((r for r in rows if r["precision"] == prec), key=lambda r: r["one"]["tok_s"])
        print(f"{prec}: at the best single-GPU batch, B={best['B']}, {W} GPUs give {best['speedup']:.2f}x the tokens/s "
              f"of one ({best['all']['tok_s']:,.0f} against {best['one']['tok_s']:,.0f})")
    bench_json(a.json if group.rank == 0 else None, device=name, gpus=W, config=a.config, T=T, peak_tflops=PROFILE.peak_tflops,
               rows=rows)


def bench_json(path, **results):
    """bench --json PATH: the results as JSON (nothing without a path)."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def cmd_bench(argv):
    p = pl.Parser(prog="nanoeuler_cuda.py bench", description="training speed per precision: tokens/s, ms/step, "
                  "MFU, peak memory; attention forward + backward alone")
    pl.add_config_arg(p, "big")
    p.add_argument("--batches", default="16,64", help="batch sizes, comma-separated (default 16,64)")
    p.add_argument("--precision", help=f"precisions, comma-separated, of {', '.join(PRECISIONS)} (default all three; "
                   "bf16 left out where the config's head dim has no bf16 kernel)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 512, or the context if shorter)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--no-naive", dest="naive", action="store_false", help="skip the naive-attention runs")
    p.add_argument("--json", help="also write the results to this file (default: none)")
    p.add_argument("--ckpt", help="weights for the generation benchmark (default random weights of the config, "
                   "with which the MTP heads' drafts are right by chance only)")
    p.add_argument("--only", choices=["train", "generation", "decoder"], help="run one part (default all: "
                   "decoder is serve's batch, step() alone)")
    distributed = _distributed()
    p.add_argument("--gpus", type=int, metavar="N", help="the training step on one GPU and on N (data parallel, "
                   "ZeRO-1; B per GPU): tokens/s of each, the speed-up, MFU and memory per GPU (default: one GPU, "
                   "the usual tables); bf16 only unless --precision says otherwise")
    a = p.parse_args(argv)
    if a.json:
        pl.writable(a.json, "--json", force=True)    # before the minutes of timing; a file there is replaced
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        raise UserError(f"--batches wants integers separated by commas, got {a.batches!r}") from None
    precisions = [w.strip() for w in (a.precision or ",".join(PRECISIONS)).split(",") if w.strip()]
    for w in precisions:
        if w not in PRECISIONS:
            raise UserError(f"unknown precision {w!r} in --precision; use {', '.join(PRECISIONS)}")
    a.config = pl.config_arg(a) or "big"
    cfg = pl.get_config(a.config)
    T = a.seq or min(512, cfg.ctx)
    if not 1 <= T <= cfg.ctx or min(batches) < 1 or a.steps < 1:
        raise UserError(f"--seq must lie in 1..{cfg.ctx}, every batch size and --steps be at least 1")
    # asked for, a precision the config cannot run is an error; by default bf16 is left out (with a note)
    precisions = list(dict.fromkeys(check_precision(w, cfg, "flash", explicit=a.precision is not None)
                                    for w in precisions))
    if distributed.launching(a.gpus):
        return distributed.launch(a.gpus, [sys.executable, os.path.abspath(__file__), "bench", *argv])
    group = distributed.join(a.gpus)
    if group is not None:                           # one rank of bench --gpus N
        group.run(lambda: bench_scaling(a, cfg, batches, T, precisions if a.precision else precisions[:1], group))
    name = device().name
    precisions = list(dict.fromkeys(check_precision(w, cfg, "flash", explicit=a.precision is not None)
                                    for w in precisions))    # again, with the device's profile (sm_75: fp32)
    if a.only == "generation":                      # a mode returns None on success (an int is an exit status)
        bench_json(a.json, device=name, config=a.config, generation=print_bench_generation(a, cfg))
        return
    if a.only == "decoder":
        bench_json(a.json, device=name, config=a.config, decoder=print_bench_decoder(a, cfg))
        return
    print(f"bench on {name}: {a.config} {cfg}, {pl.num_params(cfg):,} parameters, T={T}, flash attention; "
          f"{a.steps} steps back to back after 3 warm-up steps; MFU against {PROFILE.peak_tflops:g} TFLOP/s (its dense bf16 "
          f"peak) for every precision")
    fpt = pl.model_flops_per_token(cfg, T)
    rows = []
    for prec in precisions:
        for B in batches:
            need = memory_estimate(cfg, B, T, prec, "flash")
            if need > PROFILE.free:
                print(f"  {prec} B={B}: skipped, needs about {need / GiB:.1f} GiB of the {PROFILE.free / GiB:.1f} free")
                continue
            ms, peak, host, obj = bench_step(cfg, B, T, "flash", a.steps, prec)
            rows.append(dict(run=f"{prec} B={B}", precision=prec, attn="flash", B=B, T=T, ms=ms, tok_s=B * T / ms * 1e3,
                             mfu=fpt * B * T / (ms / 1e3) / 1e12 / PROFILE.peak_tflops, peak_gib=peak / 2 ** 30, host_ms=host))
            print(f"  {prec} B={B}: {ms:.2f} ms/step, {B * T / ms * 1e3:,.0f} tokens/s, loss {obj:.3f}", flush=True)
    if a.naive and "tf32" in precisions and cfg.head_dim in (32, 64) and \
            memory_estimate(cfg, batches[0], T, "tf32", "naive") <= PROFILE.free:
        B = batches[0]
        ms, peak, host, obj = bench_step(cfg, B, T, "naive", a.steps, "tf32")
        rows.append(dict(run=f"tf32 B={B} naive attention", precision="tf32", attn="naive", B=B, T=T, ms=ms,
                         tok_s=B * T / ms * 1e3, mfu=fpt * B * T / (ms / 1e3) / 1e12 / PROFILE.peak_tflops,
                         peak_gib=peak / 2 ** 30, host_ms=host))
    set_tf32(False)
    att = bench_attention()
    print(f"\ntraining step, {a.config}, T={T} (MFU vs {PROFILE.peak_tflops:.0f} TFLOP/s; peak = CuPy pool bytes):")
    print(f"{'run':<30}{'ms/step':>9}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}{'host ms':>9}")
    for r in rows:
        print(f"{r['run']:<30}{r['ms']:9.2f}{r['tok_s']:11,.0f}{100 * r['mfu']:6.1f}%{r['peak_gib']:10.2f}"
              f"{r['host_ms']:9.2f}")
    print("\nattention alone, B=16 Hq=12 Hkv=4 T=512 hd=64 (median of 20, ms):")
    print(f"{'kernel':<34}{'fwd':>8}{'fwd+bwd':>9}")
    words = {"flash-bf16": f"flash bf16 ({'wgmma' if 'flash-bf16-mma' in att else 'tensor cores'})",
             "flash-bf16-mma": "flash bf16 on mma.sync", "flash-fp32": "flash fp32",
             "naive": "naive fp32 (T x T in memory)", "naive-tf32": "naive, TF32 products"}
    for k, (f, fb) in att.items():
        print(f"{words[k]:<34}{f:8.3f}{fb:9.3f}")
    print(f"flash bf16 vs flash fp32: {att['flash-fp32'][1] / att['flash-bf16'][1]:.1f}x, vs naive: "
          f"{att['naive'][1] / att['flash-bf16'][1]:.1f}x (fwd+bwd)")
    gen = print_bench_generation(a, cfg) if a.only != "train" else None
    dec = print_bench_decoder(a, cfg) if a.only != "train" else None
    bench_json(a.json, device=name, config=a.config, T=T, peak_tflops=PROFILE.peak_tflops, rows=rows, attention=att,
               generation=gen, decoder=dec)


def print_bench_generation(a, cfg):
    """bench's generation part: big's targets are stated for 200 tokens after a 16-token prompt."""
    if a.ckpt:
        P, tok, _, _ = pl.load_checkpoint(a.ckpt)
        prompt, what = tok.encode(pl.default_corpus()[0][20_000:21_000])[:16], f"checkpoint {a.ckpt}"
    else:
        P = pl.Params.init(cfg, seed=0)
        prompt, what = list(range(1, 17)), "random weights"
    set_tf32(False)
    g = bench_generation(P, prompt)
    print(f"\ngeneration, {P.cfg.n_layers}-layer {what}, greedy, {g['tokens']} tokens after a 16-token prompt (best of 3):")
    print(f"  plain (CUDA graphs, ids drawn on the device)  {g['plain']:10,.0f} tokens/s")
    print(f"  speculative (MTP heads draft, head 0 checks)  {g['speculative']:10,.0f} tokens/s  ({g['speedup']:.2f}x; "
          f"{g['accepted']:.0%} of drafts accepted; the same ids)")
    print(f"  {g['streams']} streams in one batch                  {g['batch']:10,.0f} tokens/s in all; after "
          f"{SUSTAIN_S:.0f} s more of them {g['sustained']:,.0f}")
    return g


def bench_decoder(P, prompt_len=70, rows=(1, 8, 32, 64), steps=100, reps=3, ch=None):
    """serve's batch without HTTP: Decoder.step() alone for each count of rows, every row a prompt of
    prompt_len ids sampled at temperature 0.8 (top-k 40) with its own seed; a warm-up run, then the best
    of reps runs of `steps` -> (prompt_len, {rows: (ms a step, tokens/s)}). ch: DECODER_CH
    for this run."""
    global DECODER_CH
    keep, DECODER_CH = DECODER_CH, ch
    try:
        rows, prompt_len = [n for n in rows if n <= DECODER_MAX], min(prompt_len, P.cfg.ctx // 4)
        dec, rng, out = Decoder(P, max(rows)), np.random.default_rng(0), {}
        steps = min(steps, (P.cfg.ctx - prompt_len) // (reps + 1) - 1)     # every row stays within the context
        for n in rows:
            for r in range(n):
                dec.start(r, [int(i) for i in rng.integers(1, P.cfg.vocab, prompt_len)], pl.Sampling(0.8, 40), r)
            best = float("inf")
            for rep in range(reps + 1):                 # the first: warm-up
                t0 = time.perf_counter()
                for _ in range(steps):
                    dec.step(list(range(n)))
                best = min(best, time.perf_counter() - t0) if rep else best
            out[n] = (best / steps * 1e3, n * steps / best)
            for r in range(n):
                dec.free(r)
        return prompt_len, out
    finally:
        DECODER_CH = keep


BENCH_CH = None     # bench's other DECODER_CH without bf16 (a lone row's chunk); bf16 steps take attn_warps


def print_bench_decoder(a, cfg):
    P = pl.load_checkpoint(a.ckpt)[0] if a.ckpt else pl.Params.init(cfg, seed=0)
    set_tf32(False)
    prompt_len, d = bench_decoder(P, ch=DECODER_CH)
    head = (f"\nserve's batch (Decoder.step alone, no HTTP), {P.cfg.n_layers} layers, {prompt_len}-token prompts, "
            "temperature 0.8 (best of 3)")
    if PROFILE.bf16:                 # (steps and passes attend by attn_warps: DECODER_CH changes nothing)
        print(head + ":")
        print(f"{'rows':>6}{'ms/step':>10}{'tokens/s':>12}")
        for n, (ms, tps) in d.items():
            print(f"{n:>6}{ms:10.3f}{tps:12,.0f}")
        return {str(n): dict(ms=ms, tok_s=tps) for n, (ms, tps) in d.items()}
    _, d2 = bench_decoder(P, ch=BENCH_CH)
    print(head + f"; attention's keys a chunk {DECODER_CH}, and {BENCH_CH or 'as one row alone'}:")
    print(f"{'rows':>6}{'ms/step':>10}{'tokens/s':>12}{'ms/step':>10}{'tokens/s':>12}")
    for n, (ms, tps) in d.items():
        print(f"{n:>6}{ms:10.3f}{tps:12,.0f}{d2[n][0]:10.3f}{d2[n][1]:12,.0f}")
    return {str(n): dict(ms=ms, tok_s=tps, ms_ch=d2[n][0], tok_s_ch=d2[n][1]) for n, (ms, tps) in d.items()}


# ----------------------------------------------------------------------------------------------------
# 10. command line: the modes, their letters and main

MODES = {   # name: (one line of the mode list, fn(argv)); each mode's --help gives its flags
    "selftest": ("every kernel against a float64 reference (the mode run without one)", cmd_selftest),
    "gradcheck": ("gradients of the whole model against nanoeuler.py", cmd_gradcheck),
    "train": ("pretrain (default big)", lambda argv: cmd_train(argv, False)),
    "resume": ("continue the run in --out from its checkpoint", lambda argv: cmd_train(argv, True)),
    "sample": ("generate text from a checkpoint, with a KV cache", cmd_infer),
    "sft": ("supervised fine-tuning of a base checkpoint", cmd_sft),
    "chat": ("chat with a checkpoint", cmd_chat),
    "serve": ("an OpenAI-compatible API and a chat page in the browser (serve.py)", cmd_serve),
    "dpo": ("DPO of a chat checkpoint on preference pairs", cmd_dpo),
    "eval": ("HellaSwag (acc, acc_norm) or bits per byte of a text, batched", cmd_eval),
    "plot": ("train and validation loss curves of runs, a PNG", cmd_plot),
    "bench": ("speed per precision: tokens/s, ms/step, MFU, memory; attention; generation", cmd_bench),
    "export": ("write a checkpoint for transformers (hf) or llama.cpp (gguf); numpy alone, as the CPU's",
               cmd_export),
    "import": ("a Hugging Face Llama folder -> a checkpoint (sample, chat, sft)", cmd_import),
}
LETTERS = {"": "selftest", "g": "gradcheck", "t": "train", "tr": "resume", "i": "sample", "s": "sft", "c": "chat",
           "d": "dpo"}


def out_of_memory(e):
    """CuPy's out-of-memory error as one line (run_main's error_of); None for any other exception."""
    if cp is not None and isinstance(e, cp.cuda.memory.OutOfMemoryError):
        return f"out of GPU memory ({e}); lower --batch or --seq"
    return None


def main(argv=None):
    return pl.run_main("nanoeuler_cuda.py", "NanoEuler's GPU engine: the model, loss and AdamW of CONTRACT.md in "
                       "CUDA on CuPy, in fp32, tf32 or bf16 mixed precision. The CPU engine, with the same modes: "
                       "nanoeuler.py.", MODES, LETTERS, sys.argv[1:] if argv is None else argv, error_of=out_of_memory)


if __name__ == "__main__":
    sys.exit(main())
