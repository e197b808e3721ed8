"""What the measuring itself costs inside the forward hooks, by way of measuring one tensor.

`overhead.py` shows `watch()` above its speed targets on a 2-core CPU, with most of the added time in the two kernels
nanwatch launches per tensor (`abs` into a reused buffer, then `aminmax` of it). This asks whether a fused single pass
would do better. Same model and batch as `overhead.py`, one `nanwatch.watch` whose per-tensor kernels are swapped
round by round (interleaved, so drifts of the machine hit every variant alike):

    nanwatch              what nanwatch ships: abs into a reused buffer + aminmax (exact)
    fused C, 1 thread     one read-only pass over the bits, |x| min and max together, in C (exact; compiled with
                          `cc` at start, called through ctypes; vectorised with AVX2 where the CPU has it)
    fused C, 2 threads    the same pass split over two threads: the caller's and a worker thread of its own (exact)
    read-only aminmax     one torch aminmax of the raw values, 2 threads (abs max exact, abs min only when all values
                          have one sign: the floor `overhead.py --floor` times, never something to ship)
    no kernels            constant results: what the hooks cost in Python alone

For each it prints the median time spent inside nanwatch's forward hooks per step, and the median step time. The C
variants are experiments that live here only (nanwatch needs no compiler); without `cc` they are left out.

    python benchmarks/kernel_variants.py                       # inference and training, about 3 minutes on 2 cores
    python benchmarks/kernel_variants.py --modes infer --rounds 40
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nanwatch

# Their `_RANGE`: the kernel every measurement launches (measure() and the cache's fast path each bind it).
from nanwatch.core.stats import cache as caching
from nanwatch.core.stats import measure as stats
from nanwatch.core.watcher import Watcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import build_model, write_results  # noqa: E402  (the same model as the overhead benchmark)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "kernel_variants.json"
Kernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# min and max of |x| for float32 (4-byte) and float16/bfloat16 (2-byte) values, read once, as integers: with the
# sign bit cleared a float's bits order as its magnitude does, and fit a signed integer. nan (above inf) is passed on
# to the min as torch's reductions do. `absrange` splits the values over `parts` threads: the caller and workers
# that spin briefly after each job, then sleep on a condition variable.
C_SOURCE = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stddef.h>

#define RANGE(NAME, UT, ST, MASK, SMAX, ATTR)                                              \
    ATTR static void NAME(const void *xv, size_t n, uint64_t *out) {                      \
        const UT *x = (const UT *)xv; ST lo = SMAX, hi = 0;                               \
        for (size_t i = 0; i < n; i++) {                                                   \
            ST m = (ST)(x[i] & MASK); lo = m < lo ? m : lo; hi = m > hi ? m : hi;         \
        }                                                                                  \
        out[0] = (uint64_t)lo; out[1] = (uint64_t)hi;                                      \
    }
#if defined(__x86_64__)
RANGE(r32_avx2, uint32_t, int32_t, 0x7fffffffu, INT32_MAX, __attribute__((target("avx2"))))
RANGE(r16_avx2, uint16_t, int16_t, 0x7fffu, INT16_MAX, __attribute__((target("avx2"))))
#endif
RANGE(r32_base, uint32_t, int32_t, 0x7fffffffu, INT32_MAX, )
RANGE(r16_base, uint16_t, int16_t, 0x7fffu, INT16_MAX, )
typedef void (*range_fn)(const void *, size_t, uint64_t *);

static range_fn pick(int elem) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return elem == 4 ? r32_avx2 : r16_avx2;
#endif
    return elem == 4 ? r32_base : r16_base;
}

#define MAXP 16
static range_fn job_fn; static const char *job_x; static size_t job_n, job_elem; static int job_parts;
static uint64_t partial[MAXP][2];
static _Atomic unsigned long generation = 0;
static _Atomic int remaining = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER, call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int sleeping = 0, nworkers = 0;

static void run_part(int part) {
    size_t per = job_n / job_parts, start = per * part;
    job_fn(job_x + start * job_elem, part == job_parts - 1 ? job_n - start : per, partial[part]);
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    unsigned long seen = 0, g;
    for (;;) {
        long spins = 0;
        while ((g = atomic_load(&generation)) == seen) {
            if (++spins > 20000) {
                pthread_mutex_lock(&mu);
                sleeping++;
                while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&cv, &mu);
                sleeping--;
                pthread_mutex_unlock(&mu);
                break;
            }
        }
        seen = g;
        if (id < job_parts) run_part(id);
        atomic_fetch_sub(&remaining, 1);
    }
    return NULL;
}

/* elem: 4 for float32, 2 for float16, 3 for bfloat16 (two bytes too, with another inf) */
void absrange(const void *x, size_t n, int elem, int parts, void *out) {
    uint64_t lo, hi, inf = elem == 4 ? 0x7f800000u : elem == 3 ? 0x7f80u : 0x7c00u;
    if (elem == 3) elem = 2;
    if (parts > MAXP) parts = MAXP;
    if (parts > 1 && n >= (size_t)parts * 4096 && pthread_mutex_trylock(&call_mu) == 0) {
        while (nworkers < parts - 1) {
            pthread_t thread;
            if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)(nworkers + 1)) != 0) break;
            pthread_detach(thread);
            nworkers++;
        }
        job_fn = pick(elem); job_x = (const char *)x; job_n = n; job_elem = (size_t)elem;
        job_parts = parts <= nworkers + 1 ? parts : nworkers + 1;
        atomic_store(&remaining, nworkers);
        atomic_fetch_add(&generation, 1);
        pthread_mutex_lock(&mu);
        if (sleeping) pthread_cond_broadcast(&cv);
        pthread_mutex_unlock(&mu);
        run_part(0);
        while (atomic_load(&remaining) > 0) {}
        lo = partial[0][0]; hi = partial[0][1];
        for (int p = 1; p < job_parts; p++) {
            if (partial[p][0] < lo) lo = partial[p][0];
            if (partial[p][1] > hi) hi = partial[p][1];
        }
        pthread_mutex_unlock(&call_mu);
    } else {
        uint64_t result[2];
        pick(elem)(x, n, result);
        lo = result[0]; hi = result[1];
    }
    if (hi > inf) lo = hi;  /* a nan: torch's min is nan too */
    if (elem == 4) { ((uint32_t *)out)[0] = (uint32_t)lo; ((uint32_t *)out)[1] = (uint32_t)hi; }
    else { ((uint16_t *)out)[0] = (uint16_t)lo; ((uint16_t *)out)[1] = (uint16_t)hi; }
}
"""

# The C function's `elem` argument per dtype.
_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 3}


def compile_fused() -> Any | None:
    """Build the C kernel with `cc`; None (and a note) when there is no compiler or it fails."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        print("no C compiler (cc): the fused C variants are left out")
        return None
    folder = Path(tempfile.mkdtemp(prefix="nanwatch-kernels-"))
    source, library = folder / "absrange.c", folder / "absrange.so"
    source.write_text(C_SOURCE)
    built = subprocess.run(
        [compiler, "-O3", "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        print(f"compiling the C kernel failed, the fused C variants are left out:\n{built.stderr}")
        return None
    lib = ctypes.CDLL(str(library))
    lib.absrange.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.absrange.restype = None
    return lib


def fused_kernel(lib: Any, parts: int, fallback: Kernel) -> Kernel:
    def kernel(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        elem = _ELEM.get(data.dtype)
        if elem is None or not data.is_cpu or type(data) is not torch.Tensor or not data.is_contiguous():
            return fallback(data)  # integers and odd layouts: tiny here, and not what is compared
        out = torch.empty(2, dtype=data.dtype)
        lib.absrange(data.data_ptr(), data.numel(), elem, parts, out.data_ptr())
        low, high = out.unbind()
        return low, high

    return kernel


def read_only_aminmax(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = torch.aminmax(data)
    return low.abs(), torch.maximum(low.neg(), high)


def check_exact(name: str, kernel: Kernel, reference: Kernel) -> None:
    """The exact variants must give nanwatch's numbers (signed zeros, inf, nan, every float dtype)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in _ELEM:
        for size in (1, 1000, 300_000):
            values = torch.randn(size, generator=generator).to(dtype)
            for special in (None, -0.0, float("-inf"), float("nan")):
                if special is not None:
                    values[size // 2] = special
                got, want = torch.stack(kernel(values)), torch.stack(reference(values))
                if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.nan_to_num(), want.nan_to_num()):
                    raise SystemExit(f"{name} differs from nanwatch on {dtype} x {size}: {got} vs {want}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=("infer", "train"), default=["infer", "train"])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per mode (each times every variant once)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shipped: Kernel = stats._RANGE
    zero, one = torch.zeros(()), torch.ones(())
    variants: dict[str, Kernel] = {"nanwatch": shipped}
    lib = compile_fused()
    if lib is not None:
        variants["fused C, 1 thread"] = fused_kernel(lib, 1, shipped)
        variants["fused C, 2 threads"] = fused_kernel(lib, 2, shipped)
        for name in ("fused C, 1 thread", "fused C, 2 threads"):
            check_exact(name, variants[name], shipped)
    variants["read-only aminmax"] = read_only_aminmax
    variants["no kernels"] = lambda data: (zero, one)

    model = build_model(8192, 128, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    input_ids = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))
    handle = nanwatch.watch(model, nanwatch.WatchConfig(watch_eval=True), optimizer=optimizer)
    in_hooks = [0.0]
    record = Watcher._record

    def timed_record(self: Watcher, *record_args: Any) -> None:
        start = time.perf_counter()
        record(self, *record_args)
        in_hooks[0] += time.perf_counter() - start

    def step(mode: str) -> None:
        if mode == "train":
            model.train()
            optimizer.zero_grad(set_to_none=True)
            model(input_ids, labels=input_ids).loss.backward()
            optimizer.step()
            handle.step()
        else:
            model.eval()
            with torch.no_grad():
                model(input_ids)

    results: dict[str, dict[str, dict[str, float]]] = {}
    Watcher._record = timed_record  # type: ignore[method-assign,assignment]
    try:
        for mode in args.modes:
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            for round_index in range(args.warmup + args.rounds):
                names = list(variants)
                shift = round_index % len(names)  # a rotating order: no variant always runs first
                for name in names[shift:] + names[:shift]:
                    stats._RANGE = caching._RANGE = variants[name]  # type: ignore[assignment]
                    in_hooks[0] = 0.0
                    start = time.perf_counter()
                    step(mode)
                    if round_index >= args.warmup:
                        times[name].append((in_hooks[0], time.perf_counter() - start))
            results[mode] = {
                name: {
                    "in_hooks_ms": statistics.median(hooks for hooks, _ in pairs) * 1e3,
                    "step_ms": statistics.median(seconds for _, seconds in pairs) * 1e3,
                }
                for name, pairs in times.items()
            }
    finally:
        Watcher._record = record  # type: ignore[method-assign]
        stats._RANGE = caching._RANGE = shipped  # type: ignore[assignment]
        handle.close()

    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds per mode; medians per step")
    for mode, by_variant in results.items():
        print(f"\n{mode}: {'variant':<20} {'in hooks ms':>12} {'step ms':>9}")
        for name, figures in by_variant.items():
            print(f"{'':<{len(mode) + 2}}{name:<20} {figures['in_hooks_ms']:>12.2f} {figures['step_ms']:>9.1f}")
    payload = {
        "torch": torch.__version__,
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "results": results,
    }
    print()
    write_results(payload, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
