"""GDNLanguageModel: structure, decoding, codebook MLPs, torch.compile."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlx_torch.models import GDNConfig, GDNLanguageModel
from rlx_torch.nn import GatedDeltaNet

TINY = GDNConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, head_dim=16,
                 intermediate_size=64)


def tiny_model(**overrides):
    torch.manual_seed(0)
    return GDNLanguageModel(TINY, **overrides)


def test_structure_and_shapes():
    model = tiny_model(num_v_heads=4, gate="channel")
    assert len(model.blocks) == 2
    assert [b.mixer.layer_idx for b in model.blocks] == [0, 1]
    assert all(isinstance(b.mixer, GatedDeltaNet) and b.mixer.gate == "channel"
               for b in model.blocks)
    ids = torch.randint(0, 256, (3, 11))
    out = model(ids)
    assert out.logits.shape == (3, 11, 256) and out.cache is None
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    # fresh init: close to uniform predictions
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert model(ids[:0]).logits.shape == (0, 11, 256)


def test_config_round_trip_and_tied_embeddings():
    model = tiny_model(tie_embeddings=True)
    assert model.head.weight is model.embed.weight
    again = GDNLanguageModel(GDNConfig(**vars(model.config)))
    assert again.config == model.config
    assert TINY.mlp_width() == 64 and GDNConfig(hidden_size=100).mlp_width() == 288


def test_decoding_matches_full_forward_and_greedy_generation():
    model = tiny_model().double()
    ids = torch.randint(0, 256, (2, 9))
    full = model(ids).logits
    logits, cache = model(ids[:, :3], use_cache=True)
    steps = [logits]
    for t in range(3, 9):
        logits, cache = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-6, atol=1e-8)
    assert cache.get_seq_length() == 9 and len(cache) == 2
    generated = model.generate(ids[:, :4], 6, temperature=0)
    seq = torch.cat([ids[:, :4], generated], 1)
    expected_next = model(seq).logits[:, 3:-1].argmax(-1)
    assert torch.equal(generated, expected_next)


def test_generate_sampling_options():
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 3))
    gen = torch.Generator().manual_seed(3)
    a = model.generate(prompt, 8, temperature=0.7, top_k=5, generator=gen)
    b = model.generate(prompt, 8, temperature=0.7, top_k=5,
                       generator=torch.Generator().manual_seed(3))
    assert a.shape == (1, 8) and torch.equal(a, b)
    assert model.generate(prompt, 0).shape == (1, 0)
    with pytest.raises(ValueError, match="prompt_ids must be"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, -1)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        model(torch.zeros(3, dtype=torch.long))


def test_padding_mask_and_packed_sequences_through_the_model():
    model = tiny_model().double()
    a, b = torch.randint(0, 256, (1, 6)), torch.randint(0, 256, (1, 4))
    packed = model(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 6, 10])).logits
    torch.testing.assert_close(packed[:, :6], model(a).logits)
    torch.testing.assert_close(packed[:, 6:], model(b).logits)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 2, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    masked = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(masked[1:, 2:], model(b).logits)


def test_torch_compile_fullgraph_forward_and_backward():
    model = tiny_model(num_layers=1)
    ids = torch.randint(0, 256, (2, 7))
    targets = torch.randint(0, 256, (2, 7))

    def loss_fn(m):
        return F.cross_entropy(m(ids).logits.flatten(0, 1), targets.flatten())

    eager_loss = loss_fn(model)
    eager_loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    loss = loss_fn(compiled)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_quantize_mlp_swaps_linears_for_codebooks():
    from rlx_torch.nn import CodebookLinear

    model = tiny_model()
    ids = torch.randint(0, 256, (2, 8))
    before = model(ids).logits
    linears = [getattr(parent, name) for parent, name in model.mlp_linears()]
    assert all(type(m) is nn.Linear for m in linears)
    model.quantize_mlp()
    swapped = [getattr(parent, name) for parent, name in model.mlp_linears()]
    assert all(isinstance(m, CodebookLinear) for m in swapped)
    assert all(type(b.mixer.q_proj) is nn.Linear for b in model.blocks)  # mixers untouched
    after = model(ids).logits
    assert torch.isfinite(after).all()
    # a faithful quantization: the logits move far less than their own spread
    assert (after - before).std() < 0.5 * before.std()
    loss = F.cross_entropy(after.flatten(0, 1), ids.flatten())
    loss.backward()
    for m in swapped:
        grads = [p.grad for p in m.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    # the decoding path runs on the quantized model too
    assert model.generate(ids[:, :2], 3, temperature=0).shape == (2, 3)


def test_torch_compile_dynamic_shapes_forward_and_backward():
    """fullgraph=True, dynamic=True with gradients over several sequence lengths and batch
    sizes (the second shape exercises the gated delta rule's layout arithmetic on symbolic
    sizes)."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=1)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for batch, seqlen in ((2, 7), (3, 12), (1, 21), (2, 5)):
        ids = torch.randint(0, 256, (batch, seqlen))
        targets = torch.randint(0, 256, (batch, seqlen))
        grads = []
        for m in (model, compiled):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(m(ids).logits.flatten(0, 1), targets.flatten()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for name in grads[0]:
            torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-5,
                                       msg=f"{name} at {(batch, seqlen)}")
