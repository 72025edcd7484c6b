"""ShortConvolution and RMSNormGated against plain-PyTorch definitions."""

import pytest
import torch
import torch.nn.functional as F

from rlx_torch.nn import RMSNormGated, ShortConvolution


def conv_reference(conv, x, history=None):
    """Causal depthwise conv of one batch ``x [B, T, D]``, left context ``history [B, D, W]``."""
    W = conv.weight.shape[-1]
    xt = x.transpose(1, 2)
    left = xt.new_zeros(x.shape[0], x.shape[2], W - 1) if history is None else history[..., 1:]
    y = F.conv1d(torch.cat([left, xt], 2), conv.weight, conv.bias, groups=x.shape[2])
    y = y.transpose(1, 2)
    return F.silu(y) if conv.activation else y


def split_points(total, n, gen):
    cuts = torch.randint(0, total + 1, (n - 1,), generator=gen).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])


@pytest.mark.parametrize("B,T,D,W", [(2, 7, 5, 4), (1, 1, 3, 4), (3, 10, 6, 1), (0, 4, 3, 3)])
@pytest.mark.parametrize("bias,activation", [(False, "silu"), (True, None)])
def test_short_conv_matches_reference(B, T, D, W, bias, activation):
    conv = ShortConvolution(D, W, bias=bias, activation=activation).double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    y, final = conv(x, output_final_state=True)
    torch.testing.assert_close(y, conv_reference(conv, x))
    padded = torch.cat([x.new_zeros(B, W, D), x], 1)
    torch.testing.assert_close(final, padded[:, -W:].transpose(1, 2))


def test_short_conv_non_contiguous_input_and_mask():
    conv = ShortConvolution(6, 4).double()
    base = torch.randn(9, 3, 12, dtype=torch.float64)
    x = base.transpose(0, 1)[..., ::2]  # [3, 9, 6], non-contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(conv(x)[0], conv_reference(conv, x.contiguous()))
    mask = torch.rand(3, 9) > 0.3
    torch.testing.assert_close(conv(x, mask=mask)[0], conv_reference(conv, x * mask[..., None]))


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [9], [2, 2]])
def test_short_conv_packed_equals_separate(lengths):
    conv = ShortConvolution(4, 3).double()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, int(cu[-1]), 4, dtype=torch.float64)
    history = torch.randn(len(lengths), 4, 3, dtype=torch.float64)
    y, final = conv(x, cu_seqlens=cu, cache=history, output_final_state=True)
    for n in range(len(lengths)):
        seg = x[:, cu[n]:cu[n + 1]]
        y_n, final_n = conv(seg, cache=history[n:n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, cu[n]:cu[n + 1]], y_n)
        torch.testing.assert_close(final[n], final_n[0])
        if seg.shape[1]:
            torch.testing.assert_close(y_n, conv_reference(conv, seg, history[n:n + 1]))
        else:
            torch.testing.assert_close(final_n, history[n:n + 1])  # nothing consumed


def test_short_conv_cache_continuation_dense_and_packed():
    gen = torch.Generator().manual_seed(1)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    full, full_final = conv(x, output_final_state=True)
    pieces, cache = [], None
    cuts = split_points(11, 4, gen)
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        y, cache = conv(x[:, a:b], cache=cache, output_final_state=True)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full)
    torch.testing.assert_close(cache, full_final)
    # the same two sequences packed, fed token by token with cu_seqlens
    cache = None
    for t in range(11):
        step = x[:, t:t + 1].reshape(1, 2, 5)
        y, cache = conv(step, cu_seqlens=torch.tensor([0, 1, 2]), cache=cache,
                        output_final_state=True)
        torch.testing.assert_close(y[0], full[:, t])
    torch.testing.assert_close(cache, full_final)


@pytest.mark.parametrize("D,W", [(6, 2), (5, 4), (3, 1)])
def test_short_conv_packed_compiled_gradients(D, W):
    """The packed path compiled with gradients, channel counts that are not a multiple of the
    vector width included: torch 2.11's inductor wrote past the weight gradient's buffer for
    the former einsum form (heap corruption, then an abort in free()); with the shifted-sum
    form every torch gives the eager gradients, which match a per-sequence float64 conv1d."""
    torch._dynamo.reset()
    conv = ShortConvolution(D, W, bias=True)
    cu = torch.tensor([0, 5, 5, 12])
    x = torch.randn(1, 12, D)
    history = torch.randn(3, D, W)

    def loss(module, inp):
        y, final = module(inp, cu_seqlens=cu, cache=history, output_final_state=True)
        return y.square().sum() + final.sum()

    ref = ShortConvolution(D, W, bias=True).double()
    ref.load_state_dict(conv.state_dict())
    x64 = x.double().requires_grad_(True)
    total = x64.new_zeros(())
    for n in range(3):
        seg = x64[:, cu[n]:cu[n + 1]]
        if seg.shape[1] == 0:
            continue
        total = total + conv_reference(ref, seg, history[n:n + 1].double()).square().sum()
    total.backward()
    compiled = torch.compile(loss, fullgraph=True)
    for _ in range(2):
        conv.zero_grad(set_to_none=True)
        xc = x.clone().requires_grad_(True)
        compiled(conv, xc).backward()
        # final.sum() adds 1 per consumed row to x's gradient: the rows that end in the state
        final_rows = torch.zeros_like(x)
        for n in range(3):
            end = int(cu[n + 1])
            final_rows[0, max(int(cu[n]), end - W):end] = 1
        torch.testing.assert_close(xc.grad, (x64.grad + final_rows).float(), rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(conv.weight.grad, ref.weight.grad.float(), rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(conv.bias.grad, ref.bias.grad.float(), rtol=1e-4, atol=1e-5)


def test_short_conv_gradcheck():
    conv = ShortConvolution(3, 3, bias=True).double()
    x = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    history = torch.randn(3, 3, 3, dtype=torch.float64, requires_grad=True)
    weight = conv.weight.detach().clone().requires_grad_(True)
    bias = conv.bias.detach().clone().requires_grad_(True)
    cu = torch.tensor([0, 2, 2, 5])

    def run(x, history, weight, bias, cu_seqlens):
        params = {"weight": weight, "bias": bias}
        cache = history if cu_seqlens is not None else history[:1]
        return torch.func.functional_call(
            conv, params, (x,), {"cache": cache, "output_final_state": True,
                                 "cu_seqlens": cu_seqlens})

    assert torch.autograd.gradcheck(lambda *a: run(*a, None), (x, history, weight, bias))
    assert torch.autograd.gradcheck(lambda *a: run(*a, cu), (x, history, weight, bias))


def test_short_conv_rejects_bad_input():
    conv = ShortConvolution(4, 3)
    with pytest.raises(ValueError, match=r"x must be \[B, T, 4\]"):
        conv(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="cache must be"):
        conv(torch.randn(2, 5, 4), cache=torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="mask must be"):
        conv(torch.randn(2, 5, 4), mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="batch 1"):
        conv(torch.randn(2, 5, 4), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="end at the packed length 5"):
        conv(torch.randn(1, 5, 4), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="non-decreasing"):
        conv(torch.randn(1, 5, 4), cu_seqlens=torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="int32 or int64"):
        conv(torch.randn(1, 5, 4), cu_seqlens=torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 3, activation="relu")


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 0, 5), (4, 2, 3, 9)])
def test_rms_norm_gated_matches_formula(activation, shape):
    norm = RMSNormGated(shape[-1], eps=1e-5, activation=activation).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(shape, dtype=torch.float64)
    gate = torch.randn(shape, dtype=torch.float64)
    act = F.silu if activation == "silu" else torch.sigmoid
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight * act(gate)
    torch.testing.assert_close(norm(x, gate), expected)
    torch.testing.assert_close(norm(x), expected / act(gate))


def test_rms_norm_gated_gradcheck_and_half_dtype():
    norm = RMSNormGated(5).double()
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x, gate))
    half = RMSNormGated(5, dtype=torch.bfloat16)
    xb, gb = x.detach().bfloat16(), gate.detach().bfloat16()
    out = half(xb, gb)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), norm(xb.double(), gb.double()).float(),
                               atol=2e-2, rtol=2e-2)


def test_rms_norm_gated_rejects_bad_input():
    norm = RMSNormGated(4)
    with pytest.raises(ValueError, match="last dimension must be 4"):
        norm(torch.randn(2, 3))
    with pytest.raises(ValueError, match="gate must have x's shape"):
        norm(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="activation"):
        RMSNormGated(4, activation="relu")
