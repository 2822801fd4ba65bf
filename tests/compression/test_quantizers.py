"""Quantizers (``model.compression.quantize``) against their naive references and their papers.

KIVI and per-token codes round-trip bit for bit as the naive group loops of
``naive/quantization.py``, packed two int4 / four int2 per byte; TurboQuant's MSE distortion at
1-4 bits stays under Theorem 1's bound and its inner-product estimator is unbiased (Theorem 2),
where the MSE quantizer alone is not.
"""

import math

import pytest
import torch
from naive.quantization import naive_group_round_trip, naive_pack

from kvlab.cache.packed import PackedPrompt, body_lengths
from kvlab.compression.quantizers import KIVI, QUANTIZERS, GroupCodes, PerToken, pack_codes, unpack_codes
from kvlab.compression.turboquant import TurboQuant, lloyd_max_codebook, turbo_quantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group", "along"), [(2, 4, "tokens"), (4, 8, "channels"), (8, 16, "channels"), (2, 8, "tokens")]
)
def test_group_codes_round_trip_equals_the_naive_loops_bit_for_bit(bits, group, along, dtype):
    x = (torch.randn(16, 16, generator=torch.Generator().manual_seed(bits + group)) * 3).to(dtype)
    x[4:8] = x[4, 0]  # a constant group (scale 0) along either axis
    codes = GroupCodes.quantize(x, bits, group, along)
    naive_codes, naive_out = naive_group_round_trip(x.float().tolist(), bits, group, along, dtype)
    assert unpack_codes(codes.packed, bits, 16).tolist() == naive_codes
    assert codes.packed.tolist() == naive_pack(naive_codes, bits)
    got = codes.dequantize_rows(torch.arange(16))
    assert got.dtype == dtype
    assert torch.equal(got, torch.tensor(naive_out, dtype=dtype))
    # a subset of rows dequantizes to the same rows (what decode attention reads, chunk by chunk)
    rows = torch.tensor([15, 3, 8])
    assert torch.equal(codes.dequantize_rows(rows), got[rows])


def test_codes_are_packed_two_int4_and_four_int2_per_byte():
    codes = torch.tensor([[1, 2, 3, 0, 3, 1, 0, 2]])
    assert pack_codes(codes, 4).tolist() == [[1 | 2 << 4, 3, 3 | 1 << 4, 2 << 4]]
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 1 << 2 | 2 << 6]]
    for bits in range(1, 9):
        random = torch.randint(0, 1 << bits, (5, 32), generator=torch.Generator().manual_seed(bits))
        packed = pack_codes(random, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (5, 32 * bits // 8)
        assert torch.equal(unpack_codes(packed, bits, 32), random.to(torch.uint8))


def test_bodies_are_whole_groups_and_leave_at_least_the_residual():
    lengths = torch.tensor([[0, 5, 40], [17, 33, 100]])
    body = body_lengths(lengths, group=8, residual=16)
    assert body.tolist() == [[0, 0, 24], [0, 16, 80]]
    assert bool(((lengths - body) >= torch.clamp(lengths, max=16)).all()) and bool((body % 8 == 0).all())


def test_kivi_keys_per_channel_values_per_token_and_the_residual_kept_exactly():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([[40, 9], [23, 64]])
    N, D = int(lengths.sum()), 16
    keys, values = torch.randn(N, D, generator=g), torch.randn(N, D, generator=g)
    starts = torch.cumsum(lengths.flatten(), 0).view_as(lengths) - lengths
    packed = KIVI(bits=2, group=8, residual=8).pack(keys, values, starts, lengths)
    assert packed.keys.along == "tokens" and packed.values.along == "channels"
    assert packed.keys.scale.shape == (int(packed.body_lengths.sum()) // 8, D)
    assert packed.values.scale.shape == (int(packed.body_lengths.sum()), D // 8)
    dense_keys, dense_values = packed.dense()
    for b in range(2):
        for h in range(2):
            s, n, q = int(starts[b, h]), int(lengths[b, h]), int(packed.body_lengths[b, h])
            assert torch.equal(dense_keys[s + q : s + n], keys[s + q : s + n])  # the residual: exact
            assert torch.equal(dense_values[s + q : s + n], values[s + q : s + n])
            body = slice(s, s + q)
            if q:  # 2-bit codes: within half a step of each group's range
                step = (keys[body].view(-1, 8, D).amax(1) - keys[body].view(-1, 8, D).amin(1)) / 3
                err = (dense_keys[body] - keys[body]).abs().view(-1, 8, D)
                assert bool((err <= step[:, None] / 2 + 1e-6).all())


def test_every_quantizer_is_registered_and_refuses_bad_bits():
    assert {"kivi", "per_token", "turboquant"} <= set(QUANTIZERS.names())
    for cls, bad in ((KIVI, 3), (PerToken, 1), (TurboQuant, 5)):
        with pytest.raises(ValueError, match="bits"):
            cls(bits=bad)


def test_lloyd_max_codebook_matches_the_gaussian_limit():
    d = 256
    one = lloyd_max_codebook(1, d)  # N(0, 1/d): +-sqrt(2/pi)/sqrt(d)
    assert torch.allclose(one.abs(), torch.full((2,), math.sqrt(2 / math.pi / d), dtype=one.dtype), rtol=1e-2)
    two = lloyd_max_codebook(2, d) * math.sqrt(d)  # Gaussian Lloyd-Max: +-0.4528, +-1.510
    assert torch.allclose(two, torch.tensor([-1.510, -0.4528, 0.4528, 1.510], dtype=two.dtype), atol=1e-2)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turboquant_mse_distortion_is_under_theorem_1s_bound(bits):
    d = 128
    x = torch.randn(2000, d, generator=torch.Generator().manual_seed(bits))
    x = x / x.norm(dim=1, keepdim=True)  # unit vectors
    codes = turbo_quantize(x, bits, seed=7, sketch=False)
    x_hat = codes.dequantize_rows(torch.arange(x.shape[0]))
    distortion = float(((x - x_hat) ** 2).sum(1).mean())
    bound = math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert distortion <= bound, (distortion, bound)
    # the paper's measured values (Sec. 3.1): ~0.36, 0.117, 0.03, 0.009: well inside the bound
    assert distortion >= bound / 20
    assert codes.packed.shape == (2000, d * bits // 8)  # codes, not dequantized tensors, are stored


def test_turboquant_inner_products_are_unbiased_where_the_mse_codes_are_not():
    d, seeds = 32, 400
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, d, generator=g)
    y = x[0] + 0.5 * torch.randn(d, generator=g)  # a query aligned with the key: a large <y, x>
    truth = float(x[0] @ y)
    row = torch.tensor([0])
    prod = torch.tensor(
        [float(turbo_quantize(x, 2, s, sketch=True).dequantize_rows(row)[0] @ y) for s in range(seeds)]
    )
    mse = torch.tensor(
        [float(turbo_quantize(x, 1, s, sketch=False).dequantize_rows(row)[0] @ y) for s in range(seeds)]
    )
    stderr = float(prod.std()) / math.sqrt(seeds)
    assert abs(float(prod.mean()) - truth) < 4 * stderr  # Theorem 2: E <y, Q(x)> = <y, x>
    # 1-bit MSE codes shrink inner products by ~2/pi (Sec. 3.2): biased far beyond their noise
    mse_stderr = float(mse.std()) / math.sqrt(seeds)
    assert truth - float(mse.mean()) > 8 * mse_stderr
    assert abs(float(mse.mean()) / truth - 2 / math.pi) < 0.1


def test_packed_prompt_counts_codes_parameters_and_residual():
    lengths = torch.tensor([[70, 50]])
    N, D = 120, 32
    keys = torch.randn(N, D, generator=torch.Generator().manual_seed(2))
    starts = torch.tensor([[0, 70]])
    packed: PackedPrompt = PerToken(bits=4, group=32, residual=10).pack(keys, keys, starts, lengths)
    body = 60 + 40
    # codes, scale + zero point (fp32, one group per row), residual, offsets
    expected = 2 * (body * D // 2 + 2 * body * 4) + 2 * 20 * D * 4 + 4 * 2 * 8
    assert packed.nbytes() == expected
    assert packed.sample_bytes().tolist() == [expected - 4 * 2 * 8]


def test_turboquant_keys_prod_or_mse():
    """``keys: prod`` spends a bit on the QJL sketch (unbiased, test above), ``keys: mse`` codes keys
    as values: every bit to the codebook, no sketch. At the same bits the MSE keys' inner products
    with random queries err far less (measured at D = 64, 3 bits: 5.3e-4 against 2.8e-3 of
    ``||x||^2 ||y||^2``): unbiasedness costs variance, which the softmax then sees."""
    d, rows = 64, 2000
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    prod, mse = TurboQuant(bits=3).quantize_keys(x), TurboQuant(bits=3, keys="mse").quantize_keys(x)
    assert (prod.mse_bits, prod.signs is not None) == (2, True)
    assert (mse.mse_bits, mse.signs is None) == (3, True)
    assert torch.equal(mse.packed, turbo_quantize(x, 3, 0, sketch=False).packed)  # the values' code
    scale = float((x.norm(dim=1) ** 2 * y.norm(dim=1) ** 2).mean())

    def error(codes):
        return float((((codes.dequantize_rows(slice(0, rows)) - x) * y).sum(1) ** 2).mean()) / scale

    assert error(prod) > 3 * error(mse)
    assert mse.row_bytes() < prod.row_bytes()  # no sketch bits, no γ
