"""GatedDeltaNet against a plain-PyTorch composition of the reference ops; masks, packed
sequences and incremental decoding against the full forward."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlx_torch.nn import GatedDeltaNet, RecurrentCache
from rlx_torch.ops import reference

CONFIGS = {
    # GVA (2 q/k heads, 4 value heads), wider values, per-head gate
    "gva_head": dict(hidden_size=16, num_heads=2, head_dim=4, num_v_heads=4, expand_v=1.5),
    # fla's options: beta in (0, 2), biased short convolutions
    "neg_eigval_conv_bias": dict(hidden_size=8, num_heads=2, head_dim=4, expand_v=1,
                                 allow_neg_eigval=True, conv_bias=True),
    # per-key-channel gate, no short conv, no output gate
    "channel_plain": dict(hidden_size=12, num_heads=1, head_dim=5, num_v_heads=2, expand_v=1,
                          gate="channel", use_short_conv=False, use_gate=False),
    # per-key-channel gate with convs of width 2
    "channel_conv2": dict(hidden_size=10, num_heads=2, head_dim=3, expand_v=1, gate="channel",
                          conv_size=2),
}


def make_layer(name, dtype=torch.float64, **extra):
    torch.manual_seed(1)
    layer = GatedDeltaNet(**CONFIGS[name], layer_idx=0, **extra).to(dtype)
    with torch.no_grad():  # larger than the default init so every path matters numerically
        for p in layer.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer


def l2norm(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def layer_reference(layer, x):
    """The layer's math written out with plain torch ops + the reference gated delta rule, for a
    batch of independent sequences ``x [B, T, hidden]`` (no layer code is used)."""
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim

    def short_conv(conv, t):
        W = conv.weight.shape[-1]
        y = F.conv1d(F.pad(t.transpose(1, 2), (W - 1, 0)), conv.weight, conv.bias,
                     groups=t.shape[-1])
        return F.silu(y.transpose(1, 2))

    q, k, v = (F.linear(x, m.weight) for m in (layer.q_proj, layer.k_proj, layer.v_proj))
    if layer.use_short_conv:
        q = short_conv(layer.q_conv1d, q)
        k = short_conv(layer.k_conv1d, k)
        v = short_conv(layer.v_conv1d, v)
    else:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    # grouped value attention: value head hv reads q/k head hv // (HV // H)
    q = l2norm(q.unflatten(-1, (H, K))).repeat_interleave(HV // H, dim=2)
    k = l2norm(k.unflatten(-1, (H, K))).repeat_interleave(HV // H, dim=2)
    v = v.unflatten(-1, (HV, V))
    beta = torch.sigmoid(F.linear(x, layer.b_proj.weight))
    if layer.allow_neg_eigval:
        beta = 2 * beta
    a = F.linear(x, layer.a_proj.weight) + layer.dt_bias
    if layer.gate == "channel":
        g = -layer.A_log.exp()[:, None] * F.softplus(a.unflatten(-1, (HV, K)))
    else:
        g = -layer.A_log.exp() * F.softplus(a)
    o = reference.gated_delta_rule(q, k, v, g, beta, scale=K ** -0.5)[0].to(x.dtype)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    if layer.use_gate:
        o = o * F.silu(F.linear(x, layer.g_proj.weight).unflatten(-1, (HV, V)))
    return F.linear(o.flatten(-2), layer.o_proj.weight)


def grads(fn, layer, x, weight):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = fn(x)
    (out * weight).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_reference_composition(name):
    layer = make_layer(name)
    x = torch.randn(2, 9, layer.hidden_size, dtype=torch.float64)
    weight = torch.randn(2, 9, layer.hidden_size, dtype=torch.float64)
    out, dx, dparams = grads(lambda t: layer(t)[0], layer, x, weight)
    ref_out, ref_dx, ref_dparams = grads(lambda t: layer_reference(layer, t), layer, x, weight)
    tol = dict(rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    assert dparams.keys() == ref_dparams.keys()
    for key in dparams:
        torch.testing.assert_close(dparams[key], ref_dparams[key], **tol, msg=key)
        assert dparams[key].abs().sum() > 0, f"{key} got no gradient"


def test_layer_non_contiguous_and_empty_inputs():
    layer = make_layer("gva_head")
    base = torch.randn(7, 3, 2 * layer.hidden_size, dtype=torch.float64)
    x = base.transpose(0, 1)[..., ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(layer(x)[0], layer_reference(layer, x.contiguous()),
                               rtol=1e-6, atol=1e-8)
    for shape in [(0, 5), (2, 0)]:
        out, attentions, cache = layer(torch.randn(*shape, layer.hidden_size,
                                                   dtype=torch.float64))
        assert out.shape == (*shape, layer.hidden_size) and attentions is None and cache is None


def test_layer_gradcheck_small():
    layer = GatedDeltaNet(6, num_heads=1, head_dim=3, num_v_heads=2, expand_v=1, gate="channel",
                          conv_size=2).double()
    x = torch.randn(1, 3, 6, dtype=torch.float64, requires_grad=True)
    names = ("A_log", "dt_bias", "q_conv1d.weight", "o_norm.weight")
    params = tuple(dict(layer.named_parameters())[n].detach().clone().requires_grad_(True)
                   for n in names)

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values, strict=True)), (x,))[0]

    assert torch.autograd.gradcheck(run, (x, *params))


@pytest.mark.parametrize("name", ["gva_head", "channel_plain"])
def test_padding_mask_equals_separate_sequences(name):
    layer = make_layer(name)
    T = 8
    lengths_and_offsets = [(8, 0), (5, 3), (3, 0), (1, 4)]  # left, right and middle padding
    x = torch.randn(len(lengths_and_offsets), T, layer.hidden_size, dtype=torch.float64,
                    requires_grad=True)
    mask = torch.zeros(len(lengths_and_offsets), T, dtype=torch.long)
    for b, (n, start) in enumerate(lengths_and_offsets):
        mask[b, start:start + n] = 1
    out, _, _ = layer(x, attention_mask=mask)
    out.sum().backward()
    for b, (n, start) in enumerate(lengths_and_offsets):
        alone, _, _ = layer(x[b:b + 1, start:start + n].detach())
        torch.testing.assert_close(out[b:b + 1, start:start + n], alone, rtol=1e-6, atol=1e-8)
    padded = mask == 0
    assert torch.all(out[padded] == 0)
    assert torch.all(x.grad[padded] == 0)  # padding never influences anything
    # a boolean mask means the same
    torch.testing.assert_close(layer(x, attention_mask=mask.bool())[0], out)
    # a longer mask (the whole sequence so far, as during generation): its last T columns
    longer = torch.cat([torch.zeros(len(mask), 3, dtype=mask.dtype), mask], 1)
    torch.testing.assert_close(layer(x, attention_mask=longer)[0], out)


@pytest.mark.parametrize("name", ["gva_head", "channel_conv2"])
def test_cu_seqlens_equals_separate_sequences(name):
    layer = make_layer(name)
    lengths = [4, 0, 7, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, int(cu[-1]), layer.hidden_size, dtype=torch.float64)
    out, _, _ = layer(x, cu_seqlens=cu)
    for n in range(len(lengths)):
        if lengths[n]:
            alone, _, _ = layer(x[:, cu[n]:cu[n + 1]])
            torch.testing.assert_close(out[:, cu[n]:cu[n + 1]], alone, rtol=1e-6, atol=1e-8)
    # a mask and cu_seqlens together are ambiguous: an error, not a silent choice
    with pytest.raises(ValueError, match="not both"):
        layer(x, attention_mask=torch.ones(1, int(cu[-1])), cu_seqlens=cu)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_reproduces_full_forward(name):
    layer = make_layer(name)
    x = torch.randn(2, 9, layer.hidden_size, dtype=torch.float64)
    full, _, cache = layer(x, use_cache=True)
    assert isinstance(cache, RecurrentCache) and cache.get_seq_length() == 9
    # prefill 4 tokens, then one token at a time
    steps = [layer(x[:, :4], use_cache=True)]
    for t in range(4, 9):
        steps.append(layer(x[:, t:t + 1], past_key_values=steps[-1][2], use_cache=True))
    stepped = torch.cat([o for o, _, _ in steps], dim=1)
    torch.testing.assert_close(stepped, full, rtol=1e-6, atol=1e-8)
    last = steps[-1][2].get(0)
    torch.testing.assert_close(last["recurrent_state"], cache.get(0)["recurrent_state"],
                               rtol=1e-6, atol=1e-8)
    assert last["recurrent_state"].shape == (2, layer.num_v_heads, layer.head_k_dim,
                                             layer.head_v_dim)


def test_batched_decoding_with_left_padding_and_packed_steps():
    layer = make_layer("gva_head")
    prompts = [torch.randn(n, layer.hidden_size, dtype=torch.float64) for n in (5, 2, 3)]
    new_tokens = torch.randn(3, 4, layer.hidden_size, dtype=torch.float64)
    T = 5
    x = torch.zeros(3, T, layer.hidden_size, dtype=torch.float64)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, T - len(p):] = p
        mask[b, T - len(p):] = 1
    _, _, cache_masked = layer(x, attention_mask=mask, use_cache=True)
    # the same prompts packed with cu_seqlens
    cu = torch.tensor([0, 5, 7, 10])
    _, _, cache_packed = layer(torch.cat(prompts)[None], cu_seqlens=cu, use_cache=True)
    one_each = torch.tensor([0, 1, 2, 3])
    for t in range(4):
        out_masked, _, cache_masked = layer(new_tokens[:, t:t + 1],
                                            past_key_values=cache_masked, use_cache=True)
        out_packed, _, cache_packed = layer(new_tokens[:, t][None], cu_seqlens=one_each,
                                            past_key_values=cache_packed, use_cache=True)
        torch.testing.assert_close(out_packed[0], out_masked[:, 0], rtol=1e-6, atol=1e-8)
    for b, p in enumerate(prompts):
        alone, _, _ = layer(torch.cat([p, new_tokens[b]])[None])
        torch.testing.assert_close(out_masked[b, 0], alone[0, -1], rtol=1e-6, atol=1e-8)


def test_cache_select_keeps_chosen_sequences():
    layer = make_layer("channel_conv2")
    x = torch.randn(3, 5, layer.hidden_size, dtype=torch.float64)
    _, _, cache = layer(x[:, :4], use_cache=True)
    picked = cache.select(torch.tensor([2, 0]))
    out, _, _ = layer(x[[2, 0], 4:], past_key_values=picked, use_cache=True)
    full, _, _ = layer(x[[2, 0]])
    torch.testing.assert_close(out[:, 0], full[:, -1], rtol=1e-6, atol=1e-8)


def test_initialization_follows_fla():
    layer = GatedDeltaNet(64, num_heads=4, head_dim=16, num_v_heads=8, gate="channel")
    decay_rate = layer.A_log.exp()
    assert layer.A_log.shape == (8,) and layer.dt_bias.shape == (8 * 16,)
    assert torch.all((decay_rate > 0) & (decay_rate <= 16))
    dt = F.softplus(layer.dt_bias)
    assert torch.all((dt > 1e-3 * (1 - 1e-5)) & (dt < 1e-1 * (1 + 1e-5)))
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    # log-uniform dt: the median is near the geometric mean of the range
    assert abs(dt.log().median().item() - math.log(1e-2)) < 0.7
    g, beta = layer.gates(torch.randn(2, 3, 64))
    assert g.shape == (2, 3, 8, 16) and beta.shape == (2, 3, 8)
    assert torch.all(g < 0) and torch.all((beta > 0) & (beta < 1))


def test_bfloat16_layer_tracks_float32():
    layer = make_layer("gva_head", dtype=torch.float32)
    x = torch.randn(2, 6, layer.hidden_size)
    expected = layer(x)[0]
    out = layer.to(torch.bfloat16)(x.bfloat16())[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.1, atol=0.1)


def test_layer_rejects_bad_arguments():
    small = dict(num_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=r"num_v_heads \(3\) must be a multiple of num_heads"):
        GatedDeltaNet(16, **small, num_v_heads=3)
    with pytest.raises(ValueError, match="head_dim \\* expand_v must be a positive integer"):
        GatedDeltaNet(16, **small, expand_v=0.3)
    with pytest.raises(ValueError, match="gate must be 'head' or 'channel'"):
        GatedDeltaNet(16, **small, gate="vector")
    with pytest.raises(ValueError, match="mode must be one of"):
        GatedDeltaNet(16, **small, mode="parallel")
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        GatedDeltaNet(16, num_heads=2, head_dim=0)
    # fla's positional order (hidden_size, expand_v, head_dim, num_heads) is keyword-only here
    with pytest.raises(TypeError):
        GatedDeltaNet(16, 1, 4, 2)
    with pytest.raises(TypeError):  # an fla argument we do not have is not silently dropped
        GatedDeltaNet(16, **small, use_beta=True)
    layer = GatedDeltaNet(16, **small)
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, 16\]"):
        layer(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="attention_mask must be a"):
        layer(torch.randn(2, 3, 16), attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="attention_mask must be a"):
        layer(torch.randn(2, 3, 16), attention_mask=torch.ones(2, 3, 3))
    with pytest.raises(ValueError, match="batch 1"):
        layer(torch.randn(2, 3, 16), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="past_key_values must be an rlx_torch.nn.RecurrentCache"):
        layer(torch.randn(2, 3, 16), past_key_values={}, use_cache=True)


def test_fla_defaults_and_returns():
    layer = GatedDeltaNet(layer_idx=3)  # fla's defaults: 2048 wide, 6 heads of 256, expand_v 2
    assert (layer.hidden_size, layer.num_heads, layer.head_k_dim, layer.head_v_dim) == (
        2048, 6, 256, 512)
    assert layer.mode == "chunk" and layer.use_gate and layer.use_short_conv
    assert not layer.allow_neg_eigval and layer.q_conv1d.bias is None
    small = GatedDeltaNet(8, num_heads=2, head_dim=4, conv_bias=True, allow_neg_eigval=True,
                          mode="fused_recurrent")
    assert small.q_conv1d.bias is not None and small.mode == "fused_recurrent"
    x = torch.randn(64, 8)
    _, beta = small.gates(x)
    torch.testing.assert_close(beta, 2 * torch.sigmoid(small.b_proj(x)))
    out = small(torch.randn(1, 3, 8), output_attentions=True)
    assert len(out) == 3 and out[1] is None and out[2] is None


def test_torch_compile_fullgraph_with_packed_sequences():
    layer = make_layer("channel_conv2", dtype=torch.float32)
    x = torch.randn(1, 12, layer.hidden_size)
    cu = torch.tensor([0, 5, 12])
    eager_x = x.clone().requires_grad_(True)
    layer(eager_x, cu_seqlens=cu)[0].square().sum().backward()
    eager_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    compiled = torch.compile(lambda t, c: layer(t, cu_seqlens=c)[0], fullgraph=True)
    compiled_x = x.clone().requires_grad_(True)
    out = compiled(compiled_x, cu)
    out.square().sum().backward()
    torch.testing.assert_close(out, layer(x, cu_seqlens=cu)[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad, rtol=1e-4, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", ["gva_head", "channel_conv2"])
def test_torch_compile_dynamic_shapes_with_packed_sequences(name):
    """fullgraph=True, dynamic=True with gradients over several packed lengths (the second
    shape exercises the gated delta rule's layout arithmetic on symbolic sizes)."""
    torch._dynamo.reset()
    layer = make_layer(name, dtype=torch.float32)
    compiled = torch.compile(lambda t, c: layer(t, cu_seqlens=c)[0], fullgraph=True,
                             dynamic=True)
    for cu in ([0, 5, 12], [0, 3, 9, 17], [0, 20], [0, 1, 8]):
        cu = torch.tensor(cu)
        x = torch.randn(1, int(cu[-1]), layer.hidden_size)
        grads = []
        for fn in (lambda t, c: layer(t, cu_seqlens=c)[0], compiled):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            fn(xi, cu).square().sum().backward()
            grads.append([xi.grad] + [p.grad.clone() for p in layer.parameters()])
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
