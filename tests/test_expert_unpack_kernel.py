"""The Triton decode of the CPU kernel's quantized expert tiles (tandem/kernels/expert_unpack.py)
against streaming.py's torch path, which tests/test_expert_streaming.py checks against the C
kernel's own unpack: bit-equal in float32, and the same bf16 roundings. Without CUDA the kernel
runs in Triton's interpreter on tiny shapes; with CUDA (`-m gpu`) on V4-Flash's expert shape."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpret_without_cuda, interpreted_module, kernel_test_setup  # noqa: F401 (autouse)

interpret_without_cuda()  # before anything imports Triton

cpu_experts = pytest.importorskip("tandem.offload.cpu_experts")
from tandem.offload import streaming  # noqa: E402
from tandem.offload.cpu_experts import CpuExpertLayer  # noqa: E402


@pytest.fixture(scope="module")
def unpack():
    yield from interpreted_module("tandem.kernels.expert_unpack", "_unpack_kernel", language=True)


def packed_layer(fmt: str, num_experts: int, hidden: int, inter: int) -> CpuExpertLayer:
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=g) * 0.1 for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.1
    return CpuExpertLayer.from_dense(gate, up, down, fmt)


def check(unpack, fmt: str, hidden: int, inter: int, device: str) -> None:
    layer = packed_layer(fmt, 3, hidden, inter)
    want = streaming._unpack(layer.data, fmt, hidden, inter)  # float32
    packed = layer.data.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        w13, w2 = unpack.unpack_quantized(packed, fmt, hidden, inter, dtype)
        assert w13.dtype == w2.dtype == dtype
        for got, ref in ((w13, want[0]), (w2, want[1])):
            if dtype == torch.bfloat16 and device == "cpu":  # Triton 3.6's interpreter truncates to bf16
                torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=0)
            else:
                assert torch.equal(got.cpu(), ref.to(dtype))


@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4"])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (96, 40), (40, 12)])  # partial tiles and blocks
def test_kernel_equals_the_torch_decode(unpack, fmt, hidden, inter) -> None:
    if fmt == "mxfp4" and (hidden % 32 or inter % 32):
        pytest.skip("mxfp4 layers have sizes in multiples of 32")
    check(unpack, fmt, hidden, inter, "cpu")


def test_bad_input_is_refused(unpack) -> None:
    with pytest.raises(ValueError, match="decodes int8"):
        unpack.unpack_quantized(torch.zeros(1, 64, dtype=torch.uint8), "bf16", 32, 32, torch.float32)
    with pytest.raises(ValueError, match="contiguous uint8"):
        unpack.unpack_quantized(torch.zeros(1, 64), "int8", 32, 32, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4"])
def test_on_cuda_v4_flash_expert_shape(unpack, fmt) -> None:
    check(unpack, fmt, 4096, 2048, "cuda")
