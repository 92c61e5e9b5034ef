"""Quantized kernels against gguf's reference dequantization, on random blocks of every format, on every
ISA path this CPU can run (generic, avx2, avx512, avx512vnni — forced one after another), and on the default model's
real tensors. The references are gguf.quants (the format authors' NumPy code), never our own code.

Error bounds (max |y - y_ref| / max |y_ref|, y_ref = x @ dequantize(w).T in float64):
- dequantization: exact (bit-identical float32), every format, every path;
- narrow (fused) and float32 wide products: 1e-5 — the kernels multiply the exact dequantized values, so
  only the float32 summation order differs. For Q4_0 / Q4_1 / Q8_0 the reference multiplies the
  activations rounded per block of 32 to 16-bit integers (TITAN_ACTIVATION_BITS=16, the default) or
  8-bit ones, in narrow (integer dot products) and wide steps alike, so the same 1e-5 holds against
  that reference;
- against the unrounded activations, the rounding itself: 16-bit 1e-4 (measured ~1e-5), 8-bit 2e-2
  (measured ~5e-3);
- bfloat16 wide products: 2e-2 — activations and weights are rounded to bf16 (8-bit mantissa) first.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from titan.kernels import SUPPORTED_TYPES, QuantizedTensor, cat_rows, fallback, native, ops
from titan.kernels.quantize import quantize_q8_0
from titan.loader.resolve import default_model_path

Q = gguf.GGMLQuantizationType
NATIVE = native()
NEEDS_NATIVE = pytest.mark.skipif(NATIVE is None, reason="native kernels could not be built")
FEATURES = set(NATIVE.cpu_features()) if NATIVE is not None else set()
# The vector ISAs and the CPU feature each needs.
VECTOR_ISA_FEATURES = {"avx2": "avx2", "avx512": "avx512bw", "avx512vnni": "avx512vnni"}
RUNNABLE_VECTOR_ISAS = [isa for isa, feature in VECTOR_ISA_FEATURES.items() if feature in FEATURES]
ISAS = [pytest.param("generic", marks=NEEDS_NATIVE)] + [
    pytest.param(isa, marks=pytest.mark.skipif(feature not in FEATURES, reason=f"CPU lacks {feature}"))
    for isa, feature in VECTOR_ISA_FEATURES.items()
]
NARROW_BOUND = 1e-5
BF16_BOUND = 2e-2
ROUNDING_BOUND = {16: 1e-4, 8: 2e-2}
INT_ACTIVATION_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
# Row counts: single decode, a few decodes, exactly one fused pass, several passes, a wide step.
ROW_COUNTS = (1, 3, 8, 13, ops.FUSED_MAX_ROWS, ops.FUSED_MAX_ROWS + 1, 40)


def random_blocks(kind: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid `kind` blocks: quantized from Gaussian weights where gguf can
    quantize the type, else random bytes with finite, small fp16 super-block scales (K-quants)."""
    rng = np.random.default_rng(seed)
    if kind == Q.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    try:
        return np.ascontiguousarray(gguf_quantize(rng.standard_normal((rows, cols), dtype=np.float32), kind)).view(
            np.uint8
        ).reshape(rows, -1)
    except NotImplementedError:
        pass
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[kind]
    for offset in offsets:
        scale = (rng.standard_normal((rows, cols // block)) * 0.01).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_dequantize(raw, kind), dtype=np.float32))


def quantized(raw: np.ndarray, kind: Q, cols: int) -> QuantizedTensor:
    return QuantizedTensor(torch.from_numpy(raw.copy()), int(kind), raw.shape[0], cols)


def laid_out(weight: QuantizedTensor, interleaved: bool, isa: str) -> QuantizedTensor:
    """The weight, or with `interleaved` its 8-row layout where the kernels have one (checked: it is made)."""
    if not interleaved:
        return weight
    made = ops.interleave(weight)
    expected = weight.ggml_type in INT_ACTIVATION_TYPES and weight.rows % 8 == 0 and isa != "generic"
    assert made.interleaved == expected
    return made


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    assert NATIVE.set_isa(request.param) == request.param
    yield request.param
    NATIVE.set_isa("auto")


LAYOUTS = pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "interleaved"])


@LAYOUTS
@pytest.mark.parametrize("kind", SUPPORTED_TYPES, ids=lambda k: k.name)
def test_dequantize_is_exact(isa: str, kind: Q, interleaved: bool) -> None:
    cols = 512
    raw = random_blocks(kind, 40, cols, seed=int(kind))
    weight, expected = laid_out(quantized(raw, kind, cols), interleaved, isa), reference(raw, kind)
    assert torch.equal(ops.dequantize(weight), expected)
    rows = torch.tensor([36, 0, 5, 5, 17, 39])
    assert torch.equal(ops.embedding(rows.view(2, 3), weight), expected[rows].view(2, 3, cols))


@pytest.fixture(params=[16, 8, 0], ids=["int16-activations", "int8-activations", "float-activations"])
def activation_bits(request: pytest.FixtureRequest, set_activation_bits: Callable[[int], None]) -> int:
    set_activation_bits(request.param)
    return request.param


def rounded_reference_input(x: torch.Tensor, kind: Q, bits: int) -> torch.Tensor:
    """What the kernels multiply: x rounded per block for the integer formats, else x itself."""
    return fallback.round_activations(x, bits) if kind in INT_ACTIVATION_TYPES else x


@LAYOUTS
@pytest.mark.parametrize("kind", SUPPORTED_TYPES, ids=lambda k: k.name)
def test_products_match_reference(isa: str, kind: Q, activation_bits: int, interleaved: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cols = 768
    raw = random_blocks(kind, 72, cols, seed=100 + int(kind))
    weight, dense = laid_out(quantized(raw, kind, cols), interleaved, isa), reference(raw, kind).double()
    generator = torch.Generator().manual_seed(int(kind))
    for bf16 in (False, True):
        monkeypatch.setattr(ops, "wide_bf16", lambda bf16=bf16: bf16)
        for rows in ROW_COUNTS:
            x = torch.randn(rows, cols, generator=generator)
            actual = ops.quantized_linear(x, weight)
            assert actual.shape == (rows, 72) and actual.dtype == torch.float32
            bound = BF16_BOUND if bf16 and rows > ops.FUSED_MAX_ROWS else NARROW_BOUND
            expected = rounded_reference_input(x, kind, activation_bits).double() @ dense.T
            assert relative_error(actual, expected) < bound, (rows, bf16)


@LAYOUTS
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", INT_ACTIVATION_TYPES, ids=lambda k: k.name)
def test_activation_rounding_is_the_only_difference(isa: str, kind: Q, bits: int, interleaved: bool,
                                                    set_activation_bits: Callable[[int], None]) -> None:
    """Against unrounded activations the error is the rounding's, within its stated bound; narrow (integer
    kernel) and wide (rounded floats into a GEMM) steps give a row the same numbers, so a row's output
    does not depend on the step it rides in."""
    cols = 768
    raw = random_blocks(kind, 72, cols, seed=200 + int(kind))
    weight, dense = laid_out(quantized(raw, kind, cols), interleaved, isa), reference(raw, kind).double()
    x = torch.randn(ops.FUSED_MAX_ROWS + 8, cols, generator=torch.Generator().manual_seed(5))
    set_activation_bits(bits)
    wide = ops.quantized_linear(x, weight)
    for rows in (1, 3, 8, 11):
        narrow = ops.quantized_linear(x[:rows], weight)
        error = relative_error(narrow, x[:rows].double() @ dense.T)
        assert error < ROUNDING_BOUND[bits], rows
        if bits == 8:
            assert error > NARROW_BOUND  # the rounding really happened
        assert relative_error(narrow, wide[:rows].double()) < NARROW_BOUND, rows


@pytest.mark.parametrize("bits", [16, 8])
def test_activation_rounding_is_bit_identical_everywhere(isa: str, bits: int,
                                                         set_activation_bits: Callable[[int], None]) -> None:
    x = torch.randn(9, 256) * torch.logspace(-3, 3, 9)[:, None]
    x[2, :32] = 0.0  # an all-zero block: scale 0, values 0
    set_activation_bits(bits)
    rounded = NATIVE.round_activations(x)
    assert torch.equal(rounded, fallback.round_activations(x, bits))  # the pure-PyTorch path rounds alike
    top = 2 ** (bits - 1) - 1
    scales = x.reshape(9, 8, 32).abs().amax(-1, keepdim=True) / top
    steps = (rounded.reshape(9, 8, 32) / torch.where(scales > 0, scales, 1)).round()
    assert steps.abs().max() <= top and torch.equal(rounded[2, :32], torch.zeros(32))
    assert not torch.equal(rounded, x)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("kind", INT_ACTIVATION_TYPES, ids=lambda k: k.name)
def test_interleaved_rows_do_not_depend_on_width_or_isa(kind: Q, bits: int,
                                                        set_activation_bits: Callable[[int], None]) -> None:
    """The interleaved kernels give a row the same bits whatever the step's width (1 to a wide step, so
    one or several packing chunks, a chunk's tail) and whichever ISA runs them: AVX-512 pairs two row
    groups per 512-bit register (here 9 groups: four pairs and a lone one, which takes the 256-bit
    kernel), AVX2 runs each group alone, and both do the same operations per output lane; 8-bit
    activations take vpdpbusd with VNNI and maddubs without, the same exact integer sums. Which steps pair
    groups (`set_wide_rows`: every step on Intel, from 16 rows elsewhere) changes nothing either: every width is
    checked with pairing from 1 row, from the CPU's default and never. A greedy output or a speculative
    verification cannot depend on what else is in the batch."""
    isas = RUNNABLE_VECTOR_ISAS
    if not isas:
        pytest.skip("no AVX2 / AVX-512 on this CPU")
    set_activation_bits(bits)
    cols = 768
    raw = random_blocks(kind, 72, cols, seed=300 + int(kind))
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(9)) * 3
    first = None
    try:
        for isa, wide_rows in itertools.product(isas, (1, 0, 1 << 30)):
            assert NATIVE.set_isa(isa) == isa
            NATIVE.set_wide_rows(wide_rows)
            weight = laid_out(quantized(raw, kind, cols), True, isa)
            whole = ops.quantized_linear(x, weight)
            first = whole if first is None else first
            assert torch.equal(whole, first), (isa, wide_rows)
            for rows in (1, 2, 3, 5, 8, 9, 13, 17):
                for start in (0, 3):
                    assert torch.equal(ops.quantized_linear(x[start:start + rows], weight),
                                       whole[start:start + rows]), (isa, wide_rows, rows, start)
    finally:
        NATIVE.set_isa("auto")
        NATIVE.set_wide_rows(0)


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":")[1].strip() for line in cpuinfo if line.startswith("vendor_id")), "")


@NEEDS_NATIVE
def test_wide_rows_default_follows_the_cpu_and_the_env_var() -> None:
    """Intel CPUs pair row groups at every width, others (Zen 4: a 512-bit op costs two 256-bit ones) from 16;
    TITAN_WIDE_ROWS overrides it, and a bad value is refused rather than silently ignored."""
    expected = 1 if _cpu_vendor() == "GenuineIntel" else 16
    assert NATIVE.set_wide_rows(0) == expected == NATIVE.get_wide_rows()
    with pytest.raises(RuntimeError, match="wide rows"):
        NATIVE.set_wide_rows(-1)
    script = "from titan.kernels import native; print(native().get_wide_rows())"

    def run(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TITAN_WIDE_ROWS": value}
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)

    assert run("7").stdout.strip() == "7"
    assert run("auto").stdout.strip() == str(expected)
    refused = run("wide")
    assert refused.returncode != 0 and "TITAN_WIDE_ROWS" in refused.stderr


@pytest.mark.parametrize("kind", SUPPORTED_TYPES, ids=lambda k: k.name)
def test_pytorch_fallback_dequantizes_exactly(kind: Q) -> None:
    cols = 256
    raw = random_blocks(kind, 9, cols, seed=7 + int(kind))
    assert torch.equal(fallback.dequantize_rows(torch.from_numpy(raw.copy()), int(kind), cols), reference(raw, kind))


def test_strided_and_batched_inputs(isa: str) -> None:
    raw = random_blocks(Q.Q4_1, 24, 64, seed=3)
    weight, dense = quantized(raw, Q.Q4_1, 64), reference(raw, Q.Q4_1)
    x = torch.randn(2, 3, 128)[..., ::2]  # non-unit inner stride, leading batch dims
    expected = (fallback.round_activations(x).double() @ dense.double().T)
    assert relative_error(ops.quantized_linear(x, weight), expected) < NARROW_BOUND


@pytest.fixture(scope="module")
def real_tensors() -> dict[str, gguf.ReaderTensor]:
    reader = gguf.GGUFReader(default_model_path())
    names = ("token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight")
    return {tensor.name: tensor for tensor in reader.tensors if tensor.name in names}


@LAYOUTS
@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.ffn_gate.weight"]
)
def test_default_model_tensors(isa: str, name: str, interleaved: bool,
                               real_tensors: dict[str, gguf.ReaderTensor]) -> None:
    tensor = real_tensors[name]
    weight = laid_out(QuantizedTensor.from_gguf(tensor), interleaved, isa)
    expected = reference(np.asarray(tensor.data), tensor.tensor_type)
    assert weight.type_name in ("Q4_1", "Q8_0")
    assert torch.equal(ops.dequantize(weight), expected)
    x = torch.randn(5, weight.cols, generator=torch.Generator().manual_seed(1))
    product = fallback.round_activations(x).double() @ expected.double().T
    assert relative_error(ops.quantized_linear(x, weight), product) < NARROW_BOUND


def _backend_in_subprocess(isa: str) -> subprocess.CompletedProcess:
    script = "from titan.kernels import backend_name; print(backend_name())"
    env = {**os.environ, "TITAN_KERNEL_ISA": isa}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


@NEEDS_NATIVE
def test_isa_env_var_forces_the_path() -> None:
    assert _backend_in_subprocess("generic").stdout.strip() == "native-generic"
    fallback_run = _backend_in_subprocess("torch")
    assert fallback_run.stdout.strip() == "torch"
    assert "pure-PyTorch path" in fallback_run.stderr  # said once, in the log
    assert _backend_in_subprocess("sse9").returncode != 0


@NEEDS_NATIVE
def test_unsupported_isa_request_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown ISA"):
        NATIVE.set_isa("neon")
    if "avx512f" not in FEATURES:
        with pytest.raises(RuntimeError, match="lacks"):
            NATIVE.set_isa("avx512")
    assert NATIVE.get_isa() in ("generic", "avx2", "avx512", "avx512vnni")


@NEEDS_NATIVE
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_native_rms_norm_matches_torch(rows: int) -> None:
    x, weight = torch.randn(rows, 576) * 3, 1 + 0.3 * torch.randn(576)
    expected = torch.nn.functional.rms_norm(x.double(), (576,), weight.double(), 1e-5)
    actual = ops.rms_norm(x, weight, 1e-5)
    assert actual is not None and actual.dtype == torch.float32
    assert relative_error(actual, expected) < NARROW_BOUND
    assert ops.rms_norm(x.bfloat16(), weight, 1e-5) is None  # only float32 CPU rows take the native path


@NEEDS_NATIVE
def test_swiglu_exp_is_float32_exact_on_every_isa(isa: str) -> None:
    """SwiGLU's exp is each ISA's own vectorized polynomial (csrc/vector_math.h): across the whole range an
    exp can take before it saturates, and past it, each element within float32 rounding of the float64
    truth, as torch's silu is; odd widths exercise the vector loops' tails."""
    gate = torch.cat([torch.linspace(-87, 87, 200_001), torch.tensor([-1e4, -100.0, -0.0, 0.0, 1e-30, 100.0, 1e4])])
    for width in (gate.numel(), 1, 13):
        g = gate[:width]
        up = torch.linspace(-3, 3, width)
        out = NATIVE.silu_and_mul(torch.cat([g, up])[None])[0].double()
        truth = g.double() * torch.sigmoid(g.double()) * up.double()
        tolerance = 4e-7 * truth.abs() + 1e-36  # where exp nears overflow, silu is ~1e-37 or less
        assert ((out - truth).abs() <= tolerance).all(), isa


@NEEDS_NATIVE
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_fused_layer_ops_match_torch(tokens: int) -> None:
    """The native rotary, SwiGLU and residual-add + RMSNorm against their PyTorch definitions (1e-5: float32
    rounding; the rotary input is a strided view, as the q/k part of a fused qkv output is)."""
    from titan.model import rope

    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 15 * 64, generator=generator)
    x = qkv[:, : 12 * 64].view(tokens, 12, 64)
    angles = torch.rand(tokens, 32, generator=generator) * 6.3
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :32].double(), x[..., 32:].double()
    c, s = cos[:, None].double(), sin[:, None].double()
    expected = torch.cat([first * c - second * s, second * c + first * s], dim=-1)
    actual = ops.rotary(x, cos[:, None], sin[:, None])
    assert actual is not None and actual.is_contiguous()
    assert relative_error(actual, expected) < NARROW_BOUND
    assert torch.equal(rope.apply_rotary(x, cos[:, None], sin[:, None]), actual)

    gate_up = torch.randn(tokens, 2 * 96, generator=generator) * 4
    gate, up = gate_up.double().chunk(2, dim=-1)
    swiglu = ops.silu_and_mul(gate_up)
    assert swiglu is not None and relative_error(swiglu, torch.nn.functional.silu(gate) * up) < NARROW_BOUND

    hidden, residual = torch.randn(tokens, 576, generator=generator), torch.randn(tokens, 576, generator=generator)
    weight = 1 + 0.3 * torch.randn(576, generator=generator)
    fused = ops.add_rms_norm(hidden, residual, weight, 1e-5)
    assert fused is not None
    total = residual.double() + hidden.double()
    assert relative_error(fused[1], total) < NARROW_BOUND
    assert relative_error(fused[0], torch.nn.functional.rms_norm(total, (576,), weight.double(), 1e-5)) < NARROW_BOUND
    assert ops.silu_and_mul(gate_up.bfloat16()) is None  # only float32 CPU tensors take the native path


@NEEDS_NATIVE
def test_interleaving_is_refused_where_it_does_not_apply() -> None:
    plain = quantized(random_blocks(Q.Q4_1, 12, 64, seed=9), Q.Q4_1, 64)
    assert ops.interleave(plain) is plain  # 12 rows: not whole groups of 8
    with pytest.raises(RuntimeError, match="multiple of 8"):
        NATIVE.interleave(plain.data, plain.ggml_type, plain.cols)
    k_quant = quantized(random_blocks(Q.Q4_K, 8, 256, seed=9), Q.Q4_K, 256)
    assert ops.interleave(k_quant) is k_quant
    made = ops.interleave(quantized(random_blocks(Q.Q8_0, 16, 64, seed=9), Q.Q8_0, 64))
    if NATIVE.get_isa() != "generic":
        assert made.interleaved
        with pytest.raises(ValueError, match="interleaved"):
            made.with_rows(made.data[:8])
        assert cat_rows([made, made]) is None


@NEEDS_NATIVE
def test_products_do_not_depend_on_the_thread_count() -> None:
    """The narrow-step products run on the chunk-claiming pool (csrc/pool.h): every output comes from one
    thread's whole computation, so 1, 2 or 4 threads (more than this machine may have) agree bit for bit,
    job after job, through the pool's sleep and wake-up cycles."""
    cols = 512
    weights = [laid_out(quantized(random_blocks(kind, rows, cols, seed=rows), kind, cols), True, NATIVE.get_isa())
               for kind, rows in ((Q.Q4_1, 4096), (Q.Q8_0, 968), (Q.Q4_0, 64))]
    inputs = [torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) for rows in (1, 3, 9)]
    before = torch.get_num_threads()
    results: dict[int, list[torch.Tensor]] = {}
    try:
        for threads in (1, 2, 4, 2):
            torch.set_num_threads(threads)
            results[threads] = [ops.quantized_linear(x, w) for _ in range(3) for w in weights for x in inputs]
    finally:
        torch.set_num_threads(before)
    for threads in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(results[1], results[threads], strict=True)), threads


@pytest.mark.parametrize("kind", INT_ACTIVATION_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "interleaved"])
def test_opt_in_bf32_wide_products(kind: Q, interleaved: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """TITAN_WIDE_BF32=1: steps of WIDE_BF32_MIN_ROWS+ rows multiply the same rounded activations in oneDNN's bf32
    mode (bfloat16 products, float32 sums and output), within bf16's rounding of the exact product; narrower
    steps keep the integer kernel's bits, and the process-wide matmul precision is left as it was."""
    if NATIVE is None:
        pytest.skip("native kernels could not be built")
    cols = 768
    raw = random_blocks(kind, 72, cols, seed=400 + int(kind))
    weight = laid_out(quantized(raw, kind, cols), interleaved, NATIVE.get_isa())
    dense = reference(raw, kind).double()
    x = torch.randn(ops.WIDE_BF32_MIN_ROWS, cols, generator=torch.Generator().manual_seed(11)) * 3
    exact = fallback.round_activations(x).double() @ dense.T
    integer = ops.quantized_linear(x, weight)
    precision = torch.backends.mkldnn.matmul.fp32_precision
    monkeypatch.setattr(ops, "wide_bf32", lambda: True)
    wide = ops.quantized_linear(x, weight)
    assert torch.backends.mkldnn.matmul.fp32_precision == precision
    assert relative_error(integer, exact) < NARROW_BOUND
    assert relative_error(wide, exact) < BF16_BOUND
    if FEATURES & {"amx-bf16", "avx512bf16"}:  # elsewhere oneDNN multiplies in float32
        assert not torch.equal(wide, integer)
    narrow = x[: ops.WIDE_BF32_MIN_ROWS - 1]
    monkeypatch.setattr(ops, "wide_bf32", lambda: False)
    before = ops.quantized_linear(narrow, weight)
    monkeypatch.setattr(ops, "wide_bf32", lambda: True)
    assert torch.equal(ops.quantized_linear(narrow, weight), before)


def test_a_block_of_tiny_activations_rounds_to_zeros(isa: str) -> None:
    """A block of 32 activations all below ~4e-34 but not zero: its scale is below the smallest normal float,
    1 / scale overflowed to inf, and the row's product came out NaN (wide steps, the fallback) or its block
    read -32768 (narrow integer steps). It now rounds to zeros on every path, as the fallback does."""
    torch.manual_seed(0)
    weight = quantize_q8_0(torch.randn(8, 64))
    x = torch.randn(1, 64)
    x[0, 32:] = torch.linspace(1e-36, 2e-36, 32)
    expected = x[:, :32] @ fallback.dequantize_rows(weight.data, weight.ggml_type, 64)[:, :32].T
    assert torch.equal(fallback.round_activations(x)[0, 32:], torch.zeros(32))
    assert torch.equal(NATIVE.round_activations(x), fallback.round_activations(x))
    narrow = NATIVE.gemv(x, weight.data, weight.ggml_type, 64, False)
    wide = NATIVE.gemm(x, weight.data, weight.ggml_type, 64, 8, False, False)
    for product in (narrow, wide):
        assert torch.allclose(product, expected, rtol=1e-2, atol=1e-2)


@NEEDS_NATIVE
def test_a_weight_the_kernels_cannot_read_is_an_error() -> None:
    """Q5_0 (no kernel) used to fall through the dispatch and return the uninitialised output; rows narrower
    than in_features were read past their end."""
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="not one the kernels compute on"):
        NATIVE.gemv(x, torch.zeros(16, 44, dtype=torch.uint8), int(Q.Q5_0), 64, False)
    with pytest.raises(RuntimeError, match="takes 68"):  # Q8_0 x 64: two blocks of 34 bytes
        NATIVE.gemv(x, torch.zeros(16, 34, dtype=torch.uint8), int(Q.Q8_0), 64, False)
    with pytest.raises(RuntimeError, match="not one the kernels compute on"):  # a K-quant needs blocks of 256
        NATIVE.dequantize(torch.zeros(4, 144, dtype=torch.uint8), int(Q.Q4_K), 128)
