"""lnstrain's Triton kernels compile for the GPUs training runs on, without one: Triton's compiler and
ptxas (shipped in Triton's wheel) build each kernel for sm_80 (A100) and sm_90 (H100, H200) here, and
the PTX shows what the kernel was written for:

* 16-byte global loads and stores (``v4.b32``) when pointers, strides and sizes are multiples of 16,
  as Triton specialises them at launch: one pass over memory, vectorised;
* SwiGLU's division correctly rounded (``div.rn.f32``) and its exp CUDA's ``expf`` (libdevice, whose
  ``ex2`` is the ``.ftz`` one) rather than Triton's faster ``ex2.approx.f32`` of x·log2(e): what torch's
  own kernels compute, so that the once-per-process bitwise check can pass on the GPU.

The interpreter tests (``TRITON_INTERPRET=1``) check the numbers; these check that the code the GPU
would run exists. Skipped without Triton (CPU builds of torch).
"""

import inspect

import pytest

from lnstrain.model import rotary_kernel, swiglu_kernel
from lnstrain.model.triton_common import triton

pytestmark = pytest.mark.skipif(triton is None, reason="needs Triton (it comes with CUDA builds of torch)")

DIVISIBLE_BY_16 = [["tt.divisibility", 16]]


def _compile(kernel, dtype: str, pointers: tuple[str, ...], constants: dict, arch: int, not_divisible=()):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: ("constexpr" if name in constants else f"*{dtype}" if name in pointers else "i32")
                 for name in names}
    attrs = {(index,): DIVISIBLE_BY_16 for index, name in enumerate(names)
             if name not in constants and name not in not_divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["ptx"]


def _instructions(ptx: str) -> set[str]:
    found = set()
    for line in ptx.splitlines():
        words = line.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words and words[0][0].isalpha():
            found.add(words[0])
    return found


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("backward", [False, True])
def test_the_rotary_kernel_compiles_vectorised(arch, dtype, backward):
    ptx = _compile(rotary_kernel._rotate_kernel, dtype, ("source", "target", "cos", "sin"),
                   {"HALF": 64, "BLOCK_HALF": 64, "BLOCK_HEADS": 32, "BACKWARD": backward, "BF16": dtype == "bf16"},
                   arch, not_divisible=("seq", "heads", "rotated_heads"))
    ops = _instructions(ptx)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= ops, sorted(o for o in ops if "global" in o)
    assert not {"ld.global.b16", "st.global.b16"} & ops


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_swiglu_kernels_compile_vectorised_with_torchs_exp_and_division(arch, dtype, direction):
    kernel = {"forward": swiglu_kernel._swiglu_forward_kernel, "backward": swiglu_kernel._swiglu_backward_kernel}
    pointers = ("grad_out", "gate", "up", "out", "grad_gate", "grad_up")
    # the element count too is a multiple of 16 in training (micro-batch x sequence x FFN width)
    ptx = _compile(kernel[direction], dtype, pointers, {"BLOCK": swiglu_kernel._BLOCK, "BF16": dtype == "bf16"}, arch)
    ops = _instructions(ptx)
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= ops, sorted(o for o in ops if "global" in o)
    assert "div.rn.f32" in ops and not {"div.full.f32", "div.approx.f32"} & ops
    assert "ex2.approx.ftz.f32" in ops and "ex2.approx.f32" not in ops


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("aligned", [True, False])
def test_the_gradient_add_compiles_vectorised_where_its_chunks_are_aligned(arch, dtype, aligned):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lnstrain.training import accumulation_kernel

    kernel = accumulation_kernel._add_into_fp32_kernel
    constants = {"CHUNK": accumulation_kernel.CHUNK, "BLOCK": accumulation_kernel._BLOCK, "ALIGNED": aligned}
    signature = {"table": "*i64", "target": "*fp32", "source": f"*{dtype}", **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants,
                       attrs={(index,): DIVISIBLE_BY_16 for index in range(3)})
    ops = _instructions(triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8}).asm["ptx"])
    vectorised = {"ld.global.v4.b32", "st.global.v4.b32"}
    assert (vectorised <= ops) == aligned, sorted(o for o in ops if "global" in o)
    assert ("ld.global.b16" in ops) != aligned
