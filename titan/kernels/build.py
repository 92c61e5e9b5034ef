"""Build (once per machine, cached) and load the native kernels; report why when they cannot load.

The extension is compiled just in time with `torch.utils.cpp_extension.load` into the Titan cache folder,
so `pip install` never has to build against torch (build isolation would pull a CUDA torch). The ISA
variants are separate translation units compiled with `#pragma GCC target`; the binding picks one at
runtime, so one build serves AVX2-only and AVX-512 machines alike.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("titan.kernels")

_SOURCES = ("binding.cpp", "fused.cpp", "isa_generic.cpp", "isa_avx2.cpp", "isa_avx512.cpp", "isa_avx512vnni.cpp",
            "attention_binding.cpp",
            "decoder.cpp", "interleave.cpp", "pool.cpp",
            "attention_generic.cpp", "attention_avx2.cpp", "attention_avx512.cpp")
_HEADERS = ("kernels.h", "kernels_impl.inc", "kernels_int.inc", "fused.h", "attention.h", "attention_ops.h",
            "attention_impl.inc", "decoder.h", "linear_ops.h", "interleave.h", "kernels_x8.inc",
            "pool.h", "vector_math.h")
_CSRC = Path(__file__).parent / "csrc"
ISA_ENV = "TITAN_KERNEL_ISA"  # auto | generic | avx2 | avx512 | avx512vnni | torch (the pure-PyTorch fallback)
ISA_CHOICES = ("auto", "generic", "avx2", "avx512", "avx512vnni", "torch")
# Q4_0/Q4_1/Q8_0 weights multiply activations rounded per block of 32 to integers of this many bits, in
# every step (integer dot products in narrow steps): 16 (default; teacher-forced top-1 agreement with the
# float32 model 100%), 8 (llama.cpp's scheme, ~10% faster decode kernels, 96.9%: this model's normed
# activations have outlier channels), 0 (float32 activations, the numbers of `--quantization none`).
ACTIVATION_BITS_ENV = "TITAN_ACTIVATION_BITS"
ACTIVATION_BITS_CHOICES = (16, 8, 0)


def activation_bits() -> int:
    value = os.environ.get(ACTIVATION_BITS_ENV, "16").strip()
    if value not in {str(choice) for choice in ACTIVATION_BITS_CHOICES}:
        raise ValueError(f"{ACTIVATION_BITS_ENV} must be one of 16, 8, 0, not {value!r}")
    return int(value)


# Interleaved products of at least this many rows take the 512-bit kernel that pairs row groups (AVX-512
# only): "auto" (default) is this CPU's measured best (csrc/binding.cpp: default_wide_rows), a number
# overrides it (benchmarks/wide_rows.py measures both kernels on this CPU). Only speed depends on it.
WIDE_ROWS_ENV = "TITAN_WIDE_ROWS"


def wide_rows() -> int:
    """TITAN_WIDE_ROWS as set_wide_rows takes it: 0 for auto, else the positive row count."""
    value = os.environ.get(WIDE_ROWS_ENV, "auto").strip().lower() or "auto"
    if value == "auto":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WIDE_ROWS_ENV} must be auto or a positive row count, not {value!r}")
    return int(value)


_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


KERNEL_CACHE_ENV = "TITAN_KERNEL_CACHE"
# -fopenmp: ATen's parallel_for is a template that runs in parallel only where the calling unit is compiled
# with OpenMP (without it every kernel ran on one thread whatever --threads said).
# -fno-trapping-math: no code here reads floating-point exception flags, and without it GCC keeps loops with
# a division or a select scalar (SwiGLU's exp).
_CFLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def _build_dir() -> Path:
    """Keyed by the sources and torch version; deliberately not under TITAN_CACHE_DIR (which tests point at
    fresh folders), so a machine compiles each kernel version once."""
    configured = os.environ.get(KERNEL_CACHE_ENV)
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "titan" / "kernels"
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    import torch

    digest.update(torch.__version__.encode())
    folder = root / f"titan_qkernels_{digest.hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv that is not activated has the pinned PyPI ninja off PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _load_built(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("titan_qkernels", library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile() -> ModuleType:
    folder = _build_dir()
    # The folder is keyed by the sources, flags and torch version, so a library in it is this build:
    # load it directly (~1 ms) instead of through cpp_extension.load (~0.2 s of every cold start for
    # importing setuptools and asking ninja, which also rebuilds when another checkout's paths differ).
    library = folder / "titan_qkernels.so"
    if library.exists():
        try:
            return _load_built(library)
        except ImportError:
            pass  # a build interrupted mid-link: build it again below
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    return cpp_extension.load(
        name="titan_qkernels",
        sources=[str(_CSRC / name) for name in _SOURCES],
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(folder),
        verbose=False,
    )


def native() -> ModuleType | None:
    """The compiled kernel module, or None (with the reason in `native_error()`) if it cannot be built."""
    global _module, _error, _tried
    if _tried:  # hot path (every layer of every step): no lock once decided
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        requested = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
        if requested not in ISA_CHOICES:
            raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_CHOICES)}, not {requested!r}")
        bits, rows = activation_bits(), wide_rows()  # a bad setting is an error, not a silent fallback
        if requested == "torch":
            _error = f"{ISA_ENV}=torch"
        else:
            try:
                module = _compile()
                module.set_isa(requested)
                module.set_activation_bits(bits)
                module.set_wide_rows(rows)
                _module = module
            except Exception as exc:  # any build failure means: fall back, say why
                _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        if _module is None:
            logger.warning("native quantized kernels unavailable (%s); using the pure-PyTorch path (slower)", _error)
        else:
            logger.info("native quantized kernels loaded: %s", _module.get_isa())
        return _module


def native_error() -> str | None:
    native()
    return _error


def backend_name() -> str:
    """What runs quantized layers: 'native-avx512vnni', 'native-avx512', 'native-avx2', 'native-generic' or 'torch'."""
    module = native()
    return f"native-{module.get_isa()}" if module is not None else "torch"


def status() -> str:
    """For /version: the backend if quantized layers have run in this process, else 'unused'."""
    return backend_name() if _tried else "unused"
