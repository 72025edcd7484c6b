"""AQLM layers and checkpoints: CodebookLinear.from_aqlm/to_aqlm and integrations.aqlm.

The AQLM tensors here are written from AQLM's documented layout (aqlm/inference.py, aqlm/utils.py)
by this file, and the expected outputs come from a float64 dequantize-and-matmul written from the
format's math, not from the code under test. Where the aqlm package is installed (CI installs it)
its QuantizedLinear forward is a second reference.
"""

import importlib
import json
import os
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rlx_torch.integrations.aqlm import load_aqlm, read_quantization_config, save_aqlm
from rlx_torch.nn import CodebookLinear


def _optional(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# aqlm (with its numba kernels) is only the second reference: the tests that need it skip
# where it cannot be installed, except in CI, which installs it.
aqlm, numba = _optional("aqlm"), _optional("numba")


def _require_aqlm():
    if aqlm is not None and numba is not None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("aqlm and numba are required in CI (scripts/setup_env.sh installs them)")
    pytest.skip("aqlm is not installed")


def _op_takes_16bit_indices():
    x, cb = torch.randn(1, 8), torch.randn(300, 8)
    try:
        torch.ops.rlx.codebook_matmul(x, torch.full((2, 1), 299, dtype=torch.int16), cb, None, None)
    except ValueError:
        return False
    return True


OP_16BIT = _op_takes_16bit_indices()
NEEDS_16BIT = pytest.mark.xfail(
    not OP_16BIT, strict=True, raises=ValueError, reason="codebook_matmul takes uint8 indices only"
)


# ---- AQLM's format, written from its definition ----


def aqlm_pack(values, nbits):
    """AQLM's storage of codes in [0, 2**nbits): values >= 2**(nbits-1) minus 2**nbits."""
    values = values.clone()
    values[values >= 2 ** (nbits - 1)] -= 2**nbits
    return values.to(torch.int8 if nbits <= 8 else torch.int16)


def random_aqlm(out_f, in_f, *, ig, og, m, nbits, bias=True, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**nbits, (out_f // og, in_f // ig, m), generator=gen)
    values.view(-1)[:2] = torch.tensor([0, 2**nbits - 1])  # both ends of the code range
    tensors = {
        "codes": aqlm_pack(values, nbits),
        "codebooks": (torch.randn(m, 2**nbits, og, ig, generator=gen) / in_f**0.5).to(dtype),
        "scales": (torch.rand(out_f // og, 1, 1, 1, generator=gen) + 0.5).to(dtype),
    }
    if bias:
        tensors["bias"] = torch.randn(out_f, generator=gen).to(dtype)
    return tensors


def dense_weight_float64(codes, codebooks, scales, nbits):
    """W[o*og + r, i*ig + t] = scales[o] * sum_m codebooks[m, codes[o, i, m] mod 2**nbits, r, t]."""
    c = codes.long() % 2**nbits
    cb = codebooks.double()
    out_groups, in_groups, m = c.shape
    og, ig = cb.shape[2], cb.shape[3]
    blocks = sum(cb[k][c[:, :, k]] for k in range(m))  # [O, I, og, ig]
    blocks = blocks * scales.double().reshape(-1, 1, 1, 1)
    return blocks.permute(0, 2, 1, 3).reshape(out_groups * og, in_groups * ig)


def linear_float64(x, tensors, nbits):
    w = dense_weight_float64(tensors["codes"], tensors["codebooks"], tensors["scales"], nbits)
    out = x.double() @ w.T
    return out + tensors["bias"].double() if "bias" in tensors else out


SCHEMES = [  # (m, nbits, ig, og)
    pytest.param(1, 8, 8, 1, id="1x8"),
    pytest.param(2, 8, 8, 1, id="2x8"),
    pytest.param(1, 4, 4, 1, id="1x4g4"),
    pytest.param(3, 6, 2, 1, id="3x6g2"),
    pytest.param(1, 7, 8, 2, id="1x7-og2"),
    pytest.param(1, 8, 8, 2, id="1x8-og2", marks=NEEDS_16BIT),
    pytest.param(1, 16, 8, 1, id="1x16", marks=NEEDS_16BIT),
    pytest.param(2, 12, 4, 1, id="2x12g4", marks=NEEDS_16BIT),
]


@pytest.mark.parametrize("m,nbits,ig,og", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_from_aqlm_state_dict_matches_float64(m, nbits, ig, og, dtype):
    out_f, in_f = 6 * og, 5 * ig
    tensors = random_aqlm(out_f, in_f, ig=ig, og=og, m=m, nbits=nbits, dtype=dtype)
    layer = CodebookLinear.from_aqlm(tensors, in_features=in_f, out_features=out_f)
    assert layer.codebook.dtype == dtype and layer.indices.dtype == (
        torch.uint8 if og * 2**nbits <= 256 else torch.int16
    )
    assert (layer.in_features, layer.out_features) == (in_f, out_f)
    want_w = dense_weight_float64(tensors["codes"], tensors["codebooks"], tensors["scales"], nbits)
    torch.testing.assert_close(layer.dequantize().double(), want_w, rtol=2e-3, atol=1e-6)
    x = torch.randn(3, 4, in_f).to(dtype)
    want = linear_float64(x, tensors, nbits)
    got = layer(x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_from_aqlm_squeezes_one_codebook_and_keeps_bias_optional():
    tensors = random_aqlm(4, 16, ig=8, og=1, m=1, nbits=8, bias=False)
    layer = CodebookLinear.from_aqlm(tensors, in_features=16, out_features=4)
    assert layer.indices.shape == (4, 2) and layer.codebook.shape == (256, 8)
    assert layer.bias is None and layer.scales.shape == (4,)
    # The int8 -> uint8 wrap: stored -1 is entry 255.
    assert int(layer.indices.view(-1)[1]) == 255 and int(tensors["codes"].view(-1)[1]) == -1
    double = CodebookLinear.from_aqlm(tensors, in_features=16, out_features=4, dtype=torch.float64)
    assert double.codebook.dtype == torch.float64 and double.scales.dtype == torch.float64


@pytest.mark.parametrize("m,nbits,ig,og", SCHEMES)
def test_to_aqlm_writes_aqlms_tensors_back(m, nbits, ig, og):
    tensors = random_aqlm(4 * og, 3 * ig, ig=ig, og=og, m=m, nbits=nbits)
    layer = CodebookLinear.from_aqlm(tensors, in_features=3 * ig, out_features=4 * og)
    back = layer.to_aqlm(out_group_size=og)
    assert set(back) == set(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    layer(torch.randn(2, 3 * ig))  # the op takes these indices (xfail until it does)


def test_to_aqlm_rejects_what_aqlm_cannot_store():
    tensors = random_aqlm(8, 16, ig=8, og=2, m=1, nbits=7)
    layer = CodebookLinear.from_aqlm(tensors, in_features=16, out_features=8)
    with torch.no_grad():
        layer.scales[0] += 1  # rows 0 and 1 of a group no longer share a scale
    with pytest.raises(ValueError, match="share one scale"):
        layer.to_aqlm(out_group_size=2)
    with torch.no_grad():
        layer.scales[0] -= 1
        layer.indices[0, 0] = 200  # row 0 must use entries [0, 128)
    with pytest.raises(ValueError, match="share codes"):
        layer.to_aqlm(out_group_size=2)
    with pytest.raises(ValueError, match="power of two"):
        CodebookLinear(16, 4, entry_dim=8, num_entries=12).to_aqlm()


def test_from_aqlm_rejects_bad_input():
    good = random_aqlm(4, 16, ig=8, og=1, m=2, nbits=8)
    kw = {"in_features": 16, "out_features": 4}
    with pytest.raises(ValueError, match="in_features and out_features"):
        CodebookLinear.from_aqlm(good)
    with pytest.raises(ValueError, match="no scales"):
        CodebookLinear.from_aqlm({k: v for k, v in good.items() if k != "scales"}, **kw)
    with pytest.raises(ValueError, match="codebooks must be"):
        CodebookLinear.from_aqlm({**good, "codebooks": good["codebooks"][0]}, **kw)
    with pytest.raises(ValueError, match="power of two"):
        CodebookLinear.from_aqlm({**good, "codebooks": good["codebooks"][:, :100]}, **kw)
    with pytest.raises(ValueError, match="integer"):
        CodebookLinear.from_aqlm({**good, "codes": good["codes"].float()}, **kw)
    with pytest.raises(ValueError, match="codes must be"):
        CodebookLinear.from_aqlm(good, in_features=24, out_features=4)
    with pytest.raises(ValueError, match="scales must have"):
        CodebookLinear.from_aqlm({**good, "scales": good["scales"][:3]}, **kw)
    with pytest.raises(ValueError, match="codes_layout"):
        CodebookLinear.from_aqlm(good, codes_layout="rows", **kw)
    with pytest.raises(ValueError, match="aqlm.QuantizedLinear"):
        CodebookLinear.from_aqlm(torch.nn.Linear(16, 4))
    big = random_aqlm(8, 16, ig=8, og=2, m=1, nbits=16)
    with pytest.raises(ValueError, match="131072 entries"):
        CodebookLinear.from_aqlm(big, in_features=16, out_features=8)


def test_transposed_codes_state_dict():
    # AQLM's CPU kernel stores codes as [in_groups, out_groups, M] after a first forward.
    tensors = random_aqlm(6, 32, ig=8, og=1, m=1, nbits=8)
    want = CodebookLinear.from_aqlm(tensors, in_features=32, out_features=6)
    rewritten = {**tensors, "codes": tensors["codes"].permute(1, 0, 2).contiguous()}
    got = CodebookLinear.from_aqlm(rewritten, in_features=32, out_features=6)  # shapes tell
    assert torch.equal(got.indices, want.indices)
    square = random_aqlm(4, 32, ig=8, og=1, m=1, nbits=8)
    with pytest.raises(ValueError, match="codes_layout"):
        CodebookLinear.from_aqlm(square, in_features=32, out_features=4)
    flipped = {**square, "codes": square["codes"].permute(1, 0, 2).contiguous()}
    a = CodebookLinear.from_aqlm(square, in_features=32, out_features=4, codes_layout="aqlm")
    b = CodebookLinear.from_aqlm(flipped, in_features=32, out_features=4, codes_layout="transposed")
    assert torch.equal(a.indices, b.indices)


# ---- against aqlm.QuantizedLinear ----


def aqlm_module(out_f, in_f, *, ig, m, nbits, bias, seed=0):
    module = aqlm.QuantizedLinear(in_f, out_f, ig, 1, m, nbits, bias=bias)
    tensors = random_aqlm(out_f, in_f, ig=ig, og=1, m=m, nbits=nbits, bias=bias, seed=seed)
    module.load_state_dict(tensors)
    return module, tensors


@pytest.mark.parametrize(
    "out_f,in_f,m,nbits,ig",
    [(24, 64, 1, 8, 8), (16, 128, 2, 8, 8), (8, 64, 1, 8, 8), (12, 40, 1, 5, 4), (24, 64, 2, 8, 8)],
)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_aqlm_quantized_linear(out_f, in_f, m, nbits, ig, bias, one_numba_thread):
    # (8, 64, g8) has as many input as output groups: only the module's state tells whether
    # AQLM's first forward has transposed its codes.
    module, tensors = aqlm_module(out_f, in_f, ig=ig, m=m, nbits=nbits, bias=bias)
    before = CodebookLinear.from_aqlm(module)
    x = torch.randn(5, in_f)
    with torch.no_grad():
        theirs = module(x)
    if nbits == 8:
        assert module.codes.shape[:2] == (in_f // ig, out_f)  # AQLM rewrote its codes
    after = CodebookLinear.from_aqlm(module)
    assert torch.equal(before.indices, after.indices)
    want = linear_float64(x, tensors, nbits)
    with torch.no_grad():
        for layer in (before, after):
            ours = layer(x)
            torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # And back: AQLM's module loaded from to_aqlm() computes the same.
    fresh = aqlm.QuantizedLinear(in_f, out_f, ig, 1, m, nbits, bias=bias)
    fresh.load_state_dict(after.to_aqlm())
    for key, t in tensors.items():
        assert torch.equal(fresh.state_dict()[key], t), key


# ---- checkpoints ----


def tiny_llama_config(**changes):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    config.update(changes)
    return config


def write_aqlm_checkpoint(
    folder, *, m=1, nbits=8, ig=8, og=1, dtype=torch.float32, shards=1, **changes
):
    """A tiny Llama in AQLM's checkpoint format: random codes and codebooks for every linear
    of the decoder layers, float embeddings, norms and head. Returns the float64 reference
    model (dense weights from the format's math)."""
    config = tiny_llama_config(torch_dtype=str(dtype).removeprefix("torch."), **changes)
    plain = transformers.LlamaConfig(**config)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(plain).double()
    for module in reference.modules():  # norms away from 1, so a lost norm weight shows
        if "RMSNorm" in type(module).__name__:
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    state, skip = {}, []
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            seed = len(state)
            t = random_aqlm(
                module.out_features, module.in_features, ig=ig, og=og, m=m, nbits=nbits,
                bias=module.bias is not None, dtype=dtype, seed=seed,
            )
            with torch.no_grad():
                module.weight.copy_(
                    dense_weight_float64(t["codes"], t["codebooks"], t["scales"], nbits)
                )
                if module.bias is not None:
                    module.bias.copy_(t["bias"].double())
            state.update({f"{name}.{k}": v for k, v in t.items()})
    for key, value in reference.state_dict().items():
        if key.rsplit(".", 1)[0] + ".codes" in state:
            continue
        if key == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        skip.append(key)
        state[key] = value.to(dtype).contiguous()
        with torch.no_grad():
            value.copy_(state[key])  # the reference holds exactly the stored numbers
    config["quantization_config"] = {
        "quant_method": "aqlm",
        "in_group_size": ig,
        "out_group_size": og,
        "num_codebooks": m,
        "nbits_per_codebook": nbits,
        "linear_weights_not_to_quantize": skip,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:  # transformers' sharded layout: an index naming the file of every tensor
        keys = sorted(state)
        weight_map = {}
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: state[k] for k in keys[i::shards]}
            save_file(part, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return reference.eval()


@pytest.fixture
def one_numba_thread():
    # AQLM's numba kernel adds into its output from parallel loop iterations: with several
    # threads its results race.
    _require_aqlm()
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(threads)


@pytest.fixture
def no_aqlm(monkeypatch):
    monkeypatch.setitem(sys.modules, "aqlm", None)  # `import aqlm` raises ImportError


@pytest.mark.parametrize(
    "changes",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "mlp_bias": True}, {"shards": 3}],
    ids=["plain", "tied", "bias", "sharded"],
)
def test_load_aqlm_matches_float64_model(tmp_path, no_aqlm, changes):
    reference = write_aqlm_checkpoint(tmp_path, m=2, **changes)
    model = load_aqlm(tmp_path, dtype=torch.float64)
    quantized = [n for n, m in model.named_modules() if isinstance(m, CodebookLinear)]
    assert len(quantized) == 2 * 7 and not any(
        isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.startswith("model.")
    )
    if changes.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = torch.randint(0, 96, (2, 11))
    with torch.no_grad():
        want = reference(tokens).logits
        got = model(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    single = load_aqlm(tmp_path)  # the config's float32
    assert single.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(single(tokens).logits.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "scheme",
    [
        pytest.param({"m": 1, "nbits": 16}, id="1x16", marks=NEEDS_16BIT),
        pytest.param({"m": 1, "nbits": 7, "og": 2}, id="1x7-og2"),
    ],
)
def test_load_aqlm_other_schemes(tmp_path, no_aqlm, scheme):
    reference = write_aqlm_checkpoint(tmp_path, dtype=torch.float16, **scheme)
    model = load_aqlm(tmp_path, dtype=torch.float64)
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits)


def test_load_aqlm_rejects_inconsistent_checkpoints(tmp_path, no_aqlm):
    write_aqlm_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    state = load_file(str(tmp_path / "model.safetensors"))

    def rewrite(cfg=None, drop=(), **tensors):
        (tmp_path / "config.json").write_text(json.dumps(cfg or config))
        new = {k: v for k, v in {**state, **tensors}.items() if k not in drop}
        save_file(new, str(tmp_path / "model.safetensors"))

    q = config["quantization_config"]
    rewrite({**config, "quantization_config": {**q, "num_codebooks": 2}})
    with pytest.raises(ValueError, match="codebooks is"):
        load_aqlm(tmp_path)
    rewrite({**config, "quantization_config": {**q, "out_group_size": 2, "nbits_per_codebook": 16}})
    with pytest.raises(ValueError, match="out_group_size=2"):
        load_aqlm(tmp_path)
    rewrite({**config, "quantization_config": {**q, "quant_method": "gptq"}})
    with pytest.raises(ValueError, match="quant_method"):
        load_aqlm(tmp_path)
    rewrite(drop=["model.layers.0.mlp.up_proj.scales"])
    with pytest.raises(ValueError, match="no model.layers.0.mlp.up_proj.scales"):
        load_aqlm(tmp_path)
    rewrite(drop=["model.norm.weight"])
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_aqlm(tmp_path)
    rewrite(**{"model.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.extra"):
        load_aqlm(tmp_path)
    skip = [*q["linear_weights_not_to_quantize"], "model.layers.1.self_attn.o_proj.weight"]
    rewrite({**config, "quantization_config": {**q, "linear_weights_not_to_quantize": skip}})
    with pytest.raises(ValueError, match="linear_weights_not_to_quantize"):
        load_aqlm(tmp_path)
    with pytest.raises(ValueError, match="nbits_per_codebook must be an int"):
        read_quantization_config({"quantization_config": {**q, "nbits_per_codebook": 8.0}})


def test_save_aqlm_round_trip(tmp_path, no_aqlm):
    write_aqlm_checkpoint(tmp_path / "in", m=2, tie_word_embeddings=True, dtype=torch.float16)
    assert load_aqlm(tmp_path / "in").dtype == torch.float16  # the config's dtype
    model = load_aqlm(tmp_path / "in", dtype=torch.float32)
    save_aqlm(model, tmp_path / "out", dtype=torch.float16)
    original = load_file(str(tmp_path / "in" / "model.safetensors"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(saved) == set(original)
    for key, t in original.items():
        assert saved[key].dtype == t.dtype and torch.equal(saved[key], t), key
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q["num_codebooks"] == 2 and q["nbits_per_codebook"] == 8 and q["in_group_size"] == 8
    again = load_aqlm(tmp_path / "out", dtype=torch.float32)
    tokens = torch.randint(0, 96, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)


def test_transformers_with_aqlm_reads_what_save_aqlm_writes(tmp_path, one_numba_thread):
    # The other direction: the reference stack (transformers' AQLM integration + aqlm) loads
    # our output and computes the same logits.
    write_aqlm_checkpoint(tmp_path / "in", m=1, nbits=8)
    ours = load_aqlm(tmp_path / "in")
    with torch.no_grad():
        for layer in ours.modules():
            if isinstance(layer, CodebookLinear):
                layer.scales.mul_(1.5)  # something a fine-tune would change
    save_aqlm(ours, tmp_path / "out")
    auto = transformers.AutoModelForCausalLM
    theirs = auto.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert any(isinstance(m, aqlm.QuantizedLinear) for m in theirs.modules())
    tokens = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens).logits, rtol=1e-5, atol=1e-5)


def test_finetune_aqlm_example_lowers_held_out_loss(tmp_path):
    import importlib.util
    from pathlib import Path

    from safetensors.torch import load_model

    path = Path(__file__).resolve().parents[1] / "examples/finetune_aqlm.py"
    spec = importlib.util.spec_from_file_location("finetune_aqlm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--out", str(tmp_path), "--steps", "10", "--batch-size", "8", "--seq-len", "32"]
    result = example.main(args)
    assert result["after"] < result["before"] - 0.1
    assert result["codes_unchanged"]
    assert abs(result["reloaded"] - result["after"]) < 1e-5  # AQLM's format holds the result
    # Our format: the fine-tuned CodebookLinear tensors, loadable into the same architecture.
    model = load_aqlm(tmp_path / "input", dtype=torch.float32)
    load_model(model, str(result["rlx"] / "model.safetensors"))
    _, held_out = example.split_tokens(example.read_bytes())
    assert abs(example.held_out_loss(model, held_out, 32) - result["after"]) < 1e-5
