"""Build and load the engine's C kernels (`model/csrc/*.c`), once per machine.

Contract: `load(name)` returns a `ctypes.CDLL` of `csrc/<name>.c` compiled for this CPU, or None
where no C compiler works. The build is `cc -O3 -march=<march> -ffast-math -fPIC`, with
`-fopenmp` where the compiler has it (the kernels' `#pragma omp` loops then run on the process's
one GNU OpenMP runtime: the shared object names libgomp.so.1, which resolves to the copy torch
already loaded, so the kernels run on torch's own worker threads), else without (the pragmas are
ignored and each call runs on one thread). The shared object is cached under
~/.cache/pdserve/ (or $PDSERVE_CACHE_DIR), keyed by source, flags and the CPU's model and
features, so a machine of another kind (AVX2-only vs AVX-512) builds its own: `-march=native`
selects the instruction set at build time on the machine that runs it. `load(name, march=...)`
builds for another target, as does $PDSERVE_MARCH for a whole process (tests build `x86-64-v3`,
AVX2 and FMA without AVX-512, to check that path on an AVX-512 machine; the kernel modules ask
`default_march()` at each call, so a test may swap it). `Binding(name, signatures)` is how a
kernel module holds its library: the build for the current target with its C signatures declared.
-ffast-math is a compile-time flag only: linking a shared object with it would switch the whole
process to flush-to-zero; `SOURCE_FLAGS` turns it off for sources that must round as written.
Two rules every kernel call follows live here too: `openmp_usable()` (no OpenMP region in a
forked child) and `named(label, fn, *args)` (a call named in torch.profiler traces only while a
profiler runs).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
import torch.profiler

from pdserve.model.cpu import cpu_report

_LOADED_PID = os.getpid()  # GNU OpenMP's thread pool does not survive fork()


def openmp_usable() -> bool:
    """Whether a kernel may open an OpenMP parallel region in this process: not in a forked
    child, where the runtime's inherited pool has no threads behind it and a region hangs
    (torch's own parallel ops hang there too), unless the child was declared fresh
    (`openmp_fresh`)."""
    return os.getpid() == _LOADED_PID


def openmp_fresh() -> None:
    """Declare this process's OpenMP runtime fresh: it is a fork of a process that never opened a
    parallel region (the warm template of workers/process/warm_start.py only imports modules), so
    no pool was inherited and its kernels may open regions as torch's own products do. Without
    this, every worker forked from the template ran the kernels (attention, glue, few-row and
    AVX2 products) on one thread whatever its `--threads-per-worker`."""
    global _LOADED_PID
    _LOADED_PID = os.getpid()


def region_threads(openmp_built) -> int:
    """The threads a kernel call may use here: torch's thread count where the build has OpenMP
    (`openmp_built()`) and a region may open in this process, else 1."""
    return torch.get_num_threads() if openmp_built() and openmp_usable() else 1


def threads_for(work: int, threshold: int, openmp_built) -> int:
    """torch's thread count for a kernel call of `work` units, at or above `threshold` (below it a
    parallel region costs more than it saves) where the build has OpenMP (`openmp_built()`) and a
    region may open in this process; else 1."""
    return 1 if work < threshold else region_threads(openmp_built)


def named(label: str, fn, *args):
    """fn(*args), shown as `label` in torch.profiler traces while a profiler runs (a
    record_function costs ~6 us a call otherwise, so it is skipped then)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        with torch.profiler.record_function(label):
            return fn(*args)
    return fn(*args)

CSRC = Path(__file__).parent / "csrc"
BASE_FLAGS = ("-O3", "-ffast-math", "-fPIC", "-std=gnu11")
BUILD_VERSION = ("openmp-or-not",)  # part of the cache key: how _build links
# glue.c must round every operation as written, as eager torch does: no fast-math, no fused multiply-add
# paged_prefill and paged_decode sum their scores in one order on every path (bf16 dot products or fp32): no
# reassociation; bf16_matched adds its block sums in the order oneDNN does
SOURCE_FLAGS = {"glue": ("-fno-fast-math", "-ffp-contract=off"), "paged_prefill": ("-fno-associative-math",),
                "paged_decode": ("-fno-associative-math",), "bf16_matched": ("-fno-fast-math", "-ffp-contract=off")}


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def flags(march: str, name: str = "") -> tuple[str, ...]:
    return (BASE_FLAGS[0], f"-march={march}", *BASE_FLAGS[1:], *SOURCE_FLAGS.get(name, ()))


def _build(cc: str, source: Path, march: str, out: Path) -> None:
    """Compile with OpenMP where the compiler has it, else without (the pragmas are then ignored)."""
    with tempfile.TemporaryDirectory() as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for omp in (["-fopenmp"], []):
            try:
                subprocess.run([cc, *flags(march, source.stem), *omp, "-c", str(source), "-o", str(obj)], check=True,
                               capture_output=True)
                subprocess.run([cc, "-shared", *omp, str(obj), "-o", str(lib), "-lm"], check=True,
                               capture_output=True)
                break
            except subprocess.CalledProcessError:
                if not omp:
                    raise
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(lib, staged)
        os.replace(staged, out)  # atomic: concurrent builders leave one complete file


@lru_cache(maxsize=1)
def default_march() -> str:
    """`-march=` of the engine's builds: native, or $PDSERVE_MARCH as the process found it."""
    return os.environ.get("PDSERVE_MARCH", "native")


def load(name: str, march: str | None = None) -> ctypes.CDLL | None:
    """csrc/<name>.c built for `march` (default: default_march(); cached), or None without a working C compiler."""
    return _load(name, march or default_march())


def library_path(name: str, march: str) -> Path:
    """Where the shared object of csrc/<name>.c for `march` is cached on this machine."""
    source = CSRC / f"{name}.c"
    report = cpu_report()
    key = hashlib.sha256(source.read_bytes() + " ".join(flags(march, name) + BUILD_VERSION).encode()
                         + f"{report['model']}|{sorted(report['features'].items())}".encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{key}.so"


@lru_cache(maxsize=None)
def _load(name: str, march: str) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        return None
    path = library_path(name, march)
    try:
        if not path.exists():
            _build(cc, CSRC / f"{name}.c", march, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError):
        return None


Signatures = dict  # C function name -> (restype, argtypes; None leaves the arguments unchecked)


class Binding:
    """csrc/<name>.c's library with its functions' C signatures declared, once per `-march`
    target: `binding()` is the build for `default_march()` (None without a compiler),
    `binding.bound(march)` the build for another target (cached)."""

    def __init__(self, name: str, signatures: Signatures) -> None:
        self.name, self.signatures = name, signatures
        self.bound = lru_cache(maxsize=None)(self._bind)

    def __call__(self) -> ctypes.CDLL | None:
        return self.bound(default_march())

    def _bind(self, march: str) -> ctypes.CDLL | None:
        lib = load(self.name, march)
        if lib is None:
            return None
        for function, (restype, argtypes) in self.signatures.items():
            fn = getattr(lib, function)
            fn.restype = restype
            if argtypes is not None:
                fn.argtypes = argtypes
        return lib
