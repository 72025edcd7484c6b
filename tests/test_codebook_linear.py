"""CodebookLinear: construction, from_linear quantization, state_dict, to_linear, TorchScript,
training. (rlx_torch.quant: tests/test_quant.py; AQLM loading: tests/test_aqlm.py.)"""

import importlib.util
import io
import pathlib

import pytest
import torch

import rlx_torch
from rlx_torch.nn import CodebookLinear

ROOT = pathlib.Path(__file__).resolve().parents[1]


def structured_linear(in_features=64, out_features=48, seed=0):
    """Low rank plus noise, like a trained layer; rows of different magnitude."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        weight = torch.randn(out_features, 4, generator=gen) @ torch.randn(
            4, in_features, generator=gen
        )
        weight += 0.2 * torch.randn(out_features, in_features, generator=gen)
        weight *= torch.rand(out_features, 1, generator=gen) + 0.5
        linear.weight.copy_(weight / in_features**0.5)
    return linear


def relative_error(w, approx):
    return float((w - approx).norm() / w.norm())


def random_codebook_errors(linear, layer):
    """Baselines with the same scales: a random codebook with random codes, and the same
    random codebook with the best (nearest-entry) codes."""
    w = linear.weight.detach()
    scales = layer.scales.detach()[:, None]
    vectors = (w / scales).reshape(-1, layer.entry_dim)
    gen = torch.Generator().manual_seed(1)
    random_codes = torch.zeros_like(vectors)
    nearest_codes = torch.zeros_like(vectors)
    residual = vectors.clone()
    for _ in range(layer.num_codebooks):
        cb = torch.randn(layer.num_entries, layer.entry_dim, generator=gen) * vectors.std()
        cb /= layer.num_codebooks**0.5
        random_codes += cb[torch.randint(layer.num_entries, (len(vectors),), generator=gen)]
        nearest = cb[torch.cdist(residual, cb).argmin(1)]
        nearest_codes += nearest
        residual -= nearest
    return tuple(
        relative_error(w, a.reshape(w.shape) * scales) for a in (random_codes, nearest_codes)
    )


def test_shapes_and_parameters():
    layer = CodebookLinear(32, 20, entry_dim=4, num_entries=16, num_codebooks=2)
    assert layer.indices.dtype == torch.uint8 and layer.indices.shape == (20, 8, 2)
    assert layer.codebook.shape == (2, 16, 4)
    assert {n for n, _ in layer.named_parameters()} == {"codebook", "scales", "bias"}
    assert "indices" in layer.state_dict()
    assert int(layer.indices.max()) < 16
    single = CodebookLinear(32, 20, bias=False, scales=False)
    assert single.indices.shape == (20, 4) and single.codebook.shape == (256, 8)
    assert single.bias is None and single.scales is None
    assert single(torch.randn(3, 32)).shape == (3, 20)


def test_default_init_has_linear_output_scale():
    torch.manual_seed(0)
    x = torch.randn(256, 512)
    got = CodebookLinear(512, 256, bias=False)(x).std()
    want = torch.nn.Linear(512, 256, bias=False)(x).std()
    assert 0.7 < float(got.detach() / want.detach()) < 1.4


def test_extra_repr_reports_shapes_and_bits():
    text = repr(CodebookLinear(64, 32, entry_dim=8, num_entries=256, num_codebooks=2))
    assert "indices=(32, 8, 2)" in text and "codebook=(2, 256, 8)" in text
    assert "bits_per_weight=2" in text


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"in_features": 30, "entry_dim": 8}, "multiple of entry_dim"),
        ({"num_entries": 70000}, "num_entries"),
        ({"num_entries": 0}, "num_entries"),
        ({"num_codebooks": 0}, "num_codebooks"),
        ({"entry_dim": 0}, "entry_dim"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, match):
    args = {"in_features": 32, "out_features": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        CodebookLinear(**args)


@pytest.mark.parametrize("num_codebooks", [1, 2])
def test_from_linear_quantizes_well(num_codebooks):
    linear = structured_linear()
    layer = CodebookLinear.from_linear(
        linear, entry_dim=4, num_entries=32, num_codebooks=num_codebooks, iters=15
    )
    random_codes, nearest_codes = random_codebook_errors(linear, layer)
    assert layer.quantization_error < 0.4 * random_codes
    assert layer.quantization_error < 0.85 * nearest_codes
    assert layer.quantization_error < (0.5 if num_codebooks == 1 else 0.25)
    w = linear.weight.detach()
    assert abs(relative_error(w, layer.dequantize().detach()) - layer.quantization_error) < 1e-5
    x = torch.randn(16, 64)
    with torch.no_grad():
        want = linear(x)
        rel = float((layer(x) - want).norm() / want.norm())
        dense = layer.to_linear()
        torch.testing.assert_close(dense(x), layer(x), atol=1e-5, rtol=1e-5)
    assert rel < 2 * layer.quantization_error + 0.02


def test_from_linear_errors_shrink_with_more_codebooks_and_more_entries():
    linear = structured_linear(seed=3)
    small = CodebookLinear.from_linear(linear, entry_dim=4, num_entries=8, iters=10)
    more = CodebookLinear.from_linear(linear, entry_dim=4, num_entries=64, iters=10)
    two = CodebookLinear.from_linear(linear, entry_dim=4, num_entries=8, num_codebooks=2, iters=10)
    assert more.quantization_error < small.quantization_error
    assert two.quantization_error < small.quantization_error


def test_from_linear_keeps_device_dtype_and_bias():
    linear = structured_linear().double()
    layer = CodebookLinear.from_linear(linear, entry_dim=8, num_entries=16, iters=5)
    assert layer.codebook.dtype == torch.float64 and layer.bias.dtype == torch.float64
    torch.testing.assert_close(layer.bias, linear.bias)
    no_bias = torch.nn.Linear(16, 4, bias=False)
    assert CodebookLinear.from_linear(no_bias, entry_dim=4, num_entries=4, iters=2).bias is None


def test_state_dict_round_trip_gives_identical_outputs():
    layer = CodebookLinear.from_linear(structured_linear(), entry_dim=4, num_entries=16, iters=5)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    fresh = CodebookLinear(64, 48, entry_dim=4, num_entries=16)
    fresh.load_state_dict(torch.load(buffer))
    x = torch.randn(5, 64)
    assert torch.equal(fresh(x), layer(x))


def test_constructor_is_like_nn_linear():
    layer = CodebookLinear(32, 20, False)  # bias is the third argument, as in nn.Linear
    assert layer.bias is None
    with pytest.raises(TypeError):
        CodebookLinear(32, 20, True, 4)  # the codebook arguments are keyword-only
    wide = CodebookLinear(16, 4, entry_dim=8, num_entries=4096)
    assert wide.indices.dtype == torch.int16 and int((wide.indices.long() % 65536).max()) < 4096


def test_from_linear_on_meta_raises():
    with torch.device("meta"):
        linear = torch.nn.Linear(16, 8)
    with pytest.raises(ValueError, match="meta device"):
        CodebookLinear.from_linear(linear, entry_dim=4, num_entries=4)


@pytest.mark.parametrize("bias,scales", [(True, True), (False, False)])
def test_torchscript_runs_inference_and_refuses_training(bias, scales):
    kw = {"entry_dim": 4, "num_entries": 16, "scales": scales}
    layer = CodebookLinear(32, 12, bias, num_codebooks=2, **kw)
    scripted = torch.jit.script(layer)
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        assert torch.equal(scripted(x), layer(x))
    frozen = torch.jit.script(CodebookLinear(32, 12, bias, **kw).requires_grad_(False))
    assert frozen(x).shape == (3, 5, 12)
    with pytest.raises(torch.jit.Error, match="has no backward"):
        scripted(x)


def test_fine_tuning_reduces_loss():
    torch.manual_seed(0)
    teacher = structured_linear()
    layer = CodebookLinear.from_linear(teacher, entry_dim=4, num_entries=16, iters=5)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    x = torch.randn(64, 64) * torch.logspace(0, -1.5, 64)
    target = teacher(x).detach()
    losses = []
    for _ in range(40):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert layer.indices.grad is None
    assert losses[-1] < 0.9 * losses[0]


def test_quantize_linear_example_runs():
    spec = importlib.util.spec_from_file_location(
        "quantize_linear", ROOT / "examples/quantize_linear.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    before, after = example.main(
        [
            "--in-features",
            "64",
            "--out-features",
            "32",
            "--num-entries",
            "16",
            "--steps",
            "30",
            "--kmeans-iters",
            "5",
        ]
    )
    assert 0 < after <= before < 1


def test_public_exports():
    assert rlx_torch.codebook_matmul is rlx_torch.ops.codebook_matmul
    assert "codebook_matmul" in rlx_torch.__all__
    assert rlx_torch.nn.CodebookLinear is CodebookLinear
