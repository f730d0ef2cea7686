"""bench/flex_kernels.py reads the tiles of generated flex kernels from inductor's sources."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from flex_kernels import cached_flex_kernels, kernel_tiles  # noqa: E402

SOURCE = """
import triton
@triton_heuristics.template(
    num_stages=3,
    num_warps=4,
    triton_meta={'signature': {'arg_Q': '*bf16'}},
)
@triton.jit
def triton_tem_fused_flex_attention_0(arg_Q, arg_K, out_ptr0):
    PRESCALE_QK : tl.constexpr = False
    QK_HEAD_DIM : tl.constexpr = 128
    BLOCK_M : tl.constexpr = 64
    BLOCK_N : tl.constexpr = 64
    SPARSE_Q_BLOCK_SIZE : tl.constexpr = 64
    SPARSE_KV_BLOCK_SIZE : tl.constexpr = 64
    x = BLOCK_M * 2


@triton_heuristics.pointwise(size_hints=[1024])
@triton.jit
def triton_poi_fused_add_1(in_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass


@triton_heuristics.template(
    num_stages=2,
    num_warps=8,
)
@triton.jit
def triton_tem_fused_flex_attention_backward_2(arg_Q, arg_K):
    BLOCK_M1 : tl.constexpr = 32
    BLOCK_N1 : tl.constexpr = 64
    BLOCK_M2 : tl.constexpr = 64
    BLOCK_N2 : tl.constexpr = 32
"""


def test_tiles_and_launch_settings_of_each_flex_kernel() -> None:
    forward, backward = kernel_tiles(SOURCE)
    assert forward == {
        "kernel": "triton_tem_fused_flex_attention_0",
        "role": "chosen",
        "num_stages": 3,
        "num_warps": 4,
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "SPARSE_Q_BLOCK_SIZE": 64,
        "SPARSE_KV_BLOCK_SIZE": 64,
    }
    # the pointwise kernel between them is not a flex kernel, and its decorator is not read
    assert backward == {
        "kernel": "triton_tem_fused_flex_attention_backward_2",
        "role": "chosen",
        "num_stages": 2,
        "num_warps": 8,
        "BLOCK_M1": 32,
        "BLOCK_N1": 64,
        "BLOCK_M2": 64,
        "BLOCK_N2": 32,
    }


def test_cache_folder_scan_keeps_distinct_configurations(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "one.py").write_text(SOURCE)
    (tmp_path / "cd.py").write_text(SOURCE)  # the same kernels again: listed once
    (tmp_path / "other.py").write_text("def triton_poi_fused_add_0(x):\n    pass\n")
    (tmp_path / "slow.py").write_text(
        SOURCE.replace("BLOCK_M1 : tl.constexpr = 32", "BLOCK_M1 : tl.constexpr = 64")
    )
    kernels = cached_flex_kernels(tmp_path)
    assert [k["kernel"] for k in kernels] == [
        "triton_tem_fused_flex_attention_0",
        "triton_tem_fused_flex_attention_backward_2",
        "triton_tem_fused_flex_attention_backward_2",
    ]
    assert sorted(k["BLOCK_M1"] for k in kernels[1:]) == [32, 64]


def test_embedded_kernels_end_at_their_string_and_candidates_are_named() -> None:
    """Inside inductor's output code a kernel is a string passed to async_compile.triton; a
    later template (an mm with its own BLOCK_M) must not lend it constants."""
    wrapper = (
        "triton_a = async_compile.triton('triton_flex_attention', '''\n"
        "@triton_heuristics.template(\n    num_stages=3,\n    num_warps=4,\n)\n"
        "@triton.jit\n"
        "def triton_flex_attention(arg_Q):\n    BLOCK_M : tl.constexpr = 64\n"
        "''', device_str='cuda')\n"
        "triton_b = async_compile.triton('triton_tem_fused_mm_1', '''\n"
        "@triton.jit\n"
        "def triton_tem_fused_mm_1(arg_A):\n    BLOCK_K : tl.constexpr = 128\n"
        "''', device_str='cuda')\n"
    )
    (kernel,) = kernel_tiles(wrapper)
    assert kernel == {
        "kernel": "triton_flex_attention",
        "role": "candidate",
        "num_stages": 3,
        "num_warps": 4,
        "BLOCK_M": 64,
    }
