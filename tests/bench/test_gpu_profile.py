"""bench/gpu/profile.py sorts kernels into families by name: CUDA kernel names as the profiler reports them."""

from __future__ import annotations

import pytest

from bench.gpu.profile import family


@pytest.mark.parametrize("name, expected", [
    ("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_64x1_tn_align8>", "matmul"),
    ("aten::mm", "matmul"),
    ("_split_kernel", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("void at::native::tensor_kernel_scan_innermost_dim<double, std::plus<double>>", "sort/scan"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "sort/scan"),
    ("Memcpy HtoD (Pageable -> Device)", "copy/index"),
    ("void at::native::index_elementwise_kernel<128, 4>", "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>",
     "other"),
])
def test_kernels_fall_into_their_family(name, expected):
    assert family(name) == expected


def test_device_idle_splits_gaps_between_kernels_from_waits_for_the_host():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.gpu.profile import _idle

    def kernel(start, end, key="k"):
        return SimpleNamespace(device_type=DeviceType.CUDA, key=key, is_user_annotation=False,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [kernel(0, 10), kernel(12, 20, "gemm"), kernel(15, 18),  # 2 us between kernels, one inside another
              kernel(120, 130, "embed"),  # 100 us waiting for the host, after the GEMM (the kernel that ended last)
              kernel(0, 500, "Optimizer.step#AdamW.step"),  # an annotation: not a kernel
              SimpleNamespace(device_type=DeviceType.CPU, key="aten::mm", is_user_annotation=False,
                              time_range=SimpleNamespace(start=20, end=119))]
    got = _idle(SimpleNamespace(events=lambda: events), steps=2)
    assert got == {"span_ms": 0.065, "idle_short_ms": 0.001, "idle_long_ms": 0.05, "long_idles": 0.5,
                   "long_idles_between": [["gemm", "embed", 0.05, 0.5]]}
