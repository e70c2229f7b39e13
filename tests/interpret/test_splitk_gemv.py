"""The split-K GEMV candidate of ``benchmarks/bench_gemv.py`` (``benchmarks/splitk_gemv.py``),
run on CPU tensors under ``TRITON_INTERPRET=1``: every split and tile gives the float64 product
within the input dtype's rounding, the same bits on every call, and malformed calls a
``ValueError``."""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from splitk_gemv import splitk_gemv, splitk_gemv_ref  # noqa: E402

from tests.helpers import rel_err, same_bits  # noqa: E402

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 set before import"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("block_n,block_k,splits", [(32, 64, 1), (32, 64, 3), (64, 32, 16)])
def test_every_split_gives_the_product(dtype, tol, rows, block_n, block_k, splits):
    """N = 40 and K = 300 (neither a multiple of a tile), the input a view with a row stride of its
    own; 16 splits of 300 inputs in 32-wide tiles leave fewer programs than asked (no empty one)."""
    gen = torch.Generator().manual_seed(rows * 7 + splits)
    x = torch.randn(rows, 320, generator=gen).to(dtype)[:, :300]
    w = torch.randn(40, 300, generator=gen).to(dtype)
    y = splitk_gemv(x, w, block_n=block_n, block_k=block_k, splits=splits)
    assert y.shape == (rows, 40) and y.dtype == dtype
    assert rel_err(y, splitk_gemv_ref(x, w)) < tol
    assert same_bits(y, splitk_gemv(x, w, block_n=block_n, block_k=block_k, splits=splits))


@pytest.mark.parametrize("args,words", [
    (((2, 8), (4, 9)), "expected \\[M, K\\] and \\[N, K\\]"),
    (((17, 8), (4, 8)), "17 rows"),
    (((2, 8), (4, 8), torch.float64), "one float dtype"),
    (((2, 8), (8, 4), None, True), "unit stride"),
])
def test_malformed_calls_are_refused(args, words):
    x_shape, w_shape, *rest = args
    dtype = rest[0] if rest and rest[0] is not None else torch.float32
    x = torch.randn(*x_shape, dtype=dtype)
    w = torch.randn(*w_shape, dtype=torch.float32 if dtype == torch.float64 else dtype)
    if len(rest) > 1:  # a transposed weight: stride along K is not 1
        w = w.T
    with pytest.raises(ValueError, match=words):
        splitk_gemv(x, w)
    with pytest.raises(ValueError, match="block_k=24"):
        splitk_gemv(torch.randn(2, 8), torch.randn(4, 8), block_k=24)


@pytest.mark.parametrize("K,block_k", [(9216, 128), (4096, 256), (300, 32), (2560, 128)])
def test_the_split_plan_launches_programs_that_cover_k_and_none_empty(K, block_k):
    """What a tuned config records as ``splits`` is what runs: ``split_plan`` gives programs of
    whole tiles that cover ``K`` with none left without inputs, asking its own answer again gives
    the same plan, and asking more programs than tiles gives one per tile."""
    from splitk_gemv import split_plan

    for asked in (1, 2, 3, 4, 8, 16, 64):
        k_split, splits = split_plan(K, asked, block_k)
        assert k_split % block_k == 0 and 1 <= splits <= asked
        assert (splits - 1) * k_split < K <= splits * k_split
        assert split_plan(K, splits, block_k) == (k_split, splits)
    assert split_plan(9216, 16, 128) == (640, 15)
    assert split_plan(K, 10 ** 6, block_k) == (block_k, -(-K // block_k))
