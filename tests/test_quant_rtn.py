"""RTN quantization: error bounds, code ranges, exact pack/unpack round-trips, byte counts, QuantLinear."""
import pytest
import torch

from llmso_lab.quant import QuantLinear, dequantize, fake_quantize, pack_bits, quantize, quantize_linears, unpack_bits


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", [{}, {"group_size": 32}, {"per_tensor": True}])
def test_rtn_error_within_half_step_and_codes_in_range(bits, symmetric, gran):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(bits))
    qt = quantize(w, bits, symmetric=symmetric, **gran)
    q = qt.codes()
    lo, hi = ((-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if symmetric else (0, (1 << bits) - 1))
    assert lo <= int(q.min()) and int(q.max()) <= hi
    assert qt.scale.numel() == (1 if "per_tensor" in gran else 48 * 3 if "group_size" in gran else 48)
    err = (dequantize(qt) - w).abs().reshape(qt.scale.shape[0], qt.scale.shape[1], -1)
    step = qt.scale[..., None]
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all())   # round to nearest: at most half a step
    assert qt.packed.dtype == torch.uint8 and qt.packed.shape == (48, 96 * bits // 8)


def test_asymmetric_rtn_is_idempotent_on_its_own_grid():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    once = fake_quantize(w, 4, group_size=32, symmetric=False)
    twice = quantize(once, 4, group_size=32, symmetric=False)
    assert torch.equal(twice.codes(), quantize(w, 4, group_size=32, symmetric=False).codes())
    torch.testing.assert_close(dequantize(twice), once, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_bits(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 64), codes)


def test_int4_packing_is_two_nibbles_low_first():
    codes = torch.tensor([[0x3, 0xA, 0xF, 0x1]], dtype=torch.uint8)
    assert pack_bits(codes, 4).tolist() == [[0xA3, 0x1F]]


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="group_size=128 does not divide the 576"):
        quantize(torch.randn(4, 576), 4, group_size=128)
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        quantize(torch.randn(4, 8), 1)
    with pytest.raises(ValueError, match="whole bytes"):
        pack_bits(torch.zeros(1, 3, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="fit in 4 bits"):
        pack_bits(torch.full((1, 2), 16, dtype=torch.uint8), 4)


def test_bytes_int4_group32_is_about_a_quarter_of_fp16_plus_scales():
    qt = quantize(torch.randn(64, 128), 4, group_size=32, symmetric=False)
    assert qt.nbytes == 64 * 128 // 2 + 64 * 4 * 2 * 2   # codes + fp16 scale and minimum per group


def test_quantize_linears_replaces_and_matches_fake_quant():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(3, 64)
    expected = model[2](torch.relu(torch.nn.functional.linear(x, fake_quantize(model[0].weight, 4, group_size=32), model[0].bias)))
    done = quantize_linears(model, 4, group_size=32, skip=("2",))
    assert list(done) == ["0"] and isinstance(model[0], QuantLinear) and isinstance(model[2], torch.nn.Linear)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_bits_is_the_little_endian_bit_stream(bits):
    codes = torch.randint(0, 1 << bits, (3, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    for row, packed in zip(codes.tolist(), pack_bits(codes, bits).tolist()):
        stream = sum(c << (i * bits) for i, c in enumerate(row))   # code i at bits [i*b, (i+1)*b)
        assert packed == [(stream >> (8 * j)) & 0xFF for j in range(len(packed))]


def test_int4_matmul_unpacks_pack_int4s_layout_and_equals_the_dequantized_matmul():
    """Lab 06's W4A16 by unpacking: the same numbers as multiplying by the dequantized weight, and by the fused CPU
    kernel the engine uses up to its bf16 activations."""
    from llmso_lab.quant.rtn import int4_matmul
    from llmso_lab.quant.weight_only import WeightOnlyInt4

    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 128, generator=g) * 0.1, torch.randn(6, 128, generator=g)
    for group in (16, 32, 128):
        qt = quantize(w, 4, group_size=group, symmetric=False)
        torch.testing.assert_close(int4_matmul(x, qt.packed, qt.scale, qt.minimum, group), x @ dequantize(qt).T,
                                   atol=1e-5, rtol=1e-5)
    qt = quantize(w, 4, group_size=32, symmetric=False)
    fused = WeightOnlyInt4(w, group_size=32, qt=qt)(x.bfloat16()).float()
    torch.testing.assert_close(fused, int4_matmul(x, qt.packed, qt.scale, qt.minimum, 32), atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="packed uint8"):
        int4_matmul(x, qt.packed.to(torch.int16), qt.scale, qt.minimum, 32)
    with pytest.raises(ValueError, match="divisible by group_size"):
        int4_matmul(x, qt.packed, qt.scale, qt.minimum, 48)
