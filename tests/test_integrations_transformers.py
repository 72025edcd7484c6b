"""rlx_torch.integrations.transformers: tiny random transformers models of every gated-delta /
KDA family this transformers version has, built from configs (no download), on our kernels
against transformers' own fallback and against a float64 run whose recurrence is the
token-by-token reference (rlx_torch.ops.reference)."""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING, AutoModelForCausalLM  # noqa: E402

import rlx_torch.integrations.transformers as rlx_hf  # noqa: E402
from rlx_torch.ops import reference  # noqa: E402

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16,
              shared_expert_intermediate_size=16, num_experts_per_tok=4, num_experts=4,
              layer_types=["linear_attention", "full_attention"], pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
# Every expert routed (top-k = all) so that rounding cannot flip a routing decision.
_MLA = dict(num_experts_per_token=4, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
            v_head_dim=8, num_key_value_heads=2)
FAMILIES = {
    "qwen3_next": {},
    "qwen3_5_text": {},
    "qwen3_5_moe_text": {},
    "olmo_hybrid": {},
    "lara_mini": {},
    "kimi_linear": dict(_MLA, mlp_layer_types=["dense", "sparse"], linear_attn_config={
        "kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8,
        "short_conv_kernel_size": 4}),
    "bailing_hybrid": dict(_MLA, first_k_dense_replace=1, num_expert_group=1, topk_group=1,
                           layer_group_size=2, num_nextn_predict_layers=0),
    # Its indexed-attention layer needs more configuration: GDN layers only.
    "qwen4_exp_text": dict(layer_types=["linear_attention", "linear_attention"]),
}
FAMILY_IDS = [f for f in FAMILIES if f in CONFIG_MAPPING]
# transformers' cache needs an attention layer to report its length.
DECODING_IDS = [f for f in FAMILY_IDS if "full_attention" in
                FAMILIES[f].get("layer_types", COMMON["layer_types"])]


@pytest.fixture(autouse=True)
def _restore():
    yield
    rlx_hf.disable()


def build(family, seed=0):
    torch.manual_seed(seed)
    config = CONFIG_MAPPING[family](**{**COMMON, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():  # non-trivial gates: A_log spread, dt_bias away from zero
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


def uses_linear_attention(model):
    return any("Delta" in type(m).__name__ or "LinearAttention" in type(m).__name__
               for m in model.modules())


def run(model, ids, targets=None, **kwargs):
    """Logits and every parameter's gradient of the LM loss (summed, so packed and separate
    runs add up alike; targets of -100 are left out)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, use_cache=False, **kwargs)
    logits = out.logits
    targets = ids[:, 1:] if targets is None else targets
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), targets.flatten(),
                           reduction="sum", ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach(), grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture
def reference_kernels(monkeypatch):
    """Our integration with the token-by-token reference recurrence in place of the op."""
    def use():
        rlx_hf.enable()
        monkeypatch.setattr(rlx_hf, "gated_delta_rule", reference.gated_delta_rule)
    return use


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_logits_and_every_gradient(family, reference_kernels):
    model = build(family)
    assert uses_linear_attention(model)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(3, VOCAB, (2, 37), generator=torch.Generator().manual_seed(1))

    rlx_hf.disable()
    fb_logits, fb_grads = run(model, ids)
    rlx_hf.enable()
    our_logits, our_grads = run(model, ids)
    our64_logits, our64_grads = run(model64, ids)
    reference_kernels()
    ref_logits, ref_grads = run(model64, ids)

    assert set(our_grads) == set(ref_grads) == set(fb_grads) == {
        n for n, p in model.named_parameters() if p.requires_grad}
    assert rel(our64_logits, ref_logits) < 1e-12
    assert rel(our_logits, ref_logits) < 2e-6
    torch.testing.assert_close(our_logits, fb_logits, atol=2e-5, rtol=2e-5)
    for name, ref in ref_grads.items():
        assert rel(our64_grads[name], ref) < 1e-10, name
        # float32 against float64. A_log / dt_bias gradients are sums over every token of the
        # per-token gate gradient with much cancellation; the kernels' per-head dg (a recursion
        # inside each chunk) lands within ~3e-5 of float64 there, the fallback within ~7e-6.
        assert rel(our_grads[name], ref) < 1e-4, name
        assert rel(fb_grads[name], ref) < 1e-4, name


@pytest.mark.parametrize("family", DECODING_IDS)
def test_cached_decoding(family, reference_kernels):
    model = build(family)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    prompt = 12

    # transformers renamed the forward's `past_key_values` to `cache` (5.2x); a name the model
    # does not take would be swallowed by its **kwargs and decode without the cache.
    takes_past = "past_key_values" in inspect.signature(model.forward).parameters
    cache_arg = "past_key_values" if takes_past else "cache"

    def decode(m):
        with torch.no_grad():
            out = m(ids[:, :prompt], use_cache=True)
            logits, cache = [out.logits], out.past_key_values
            for t in range(prompt, ids.shape[1]):
                out = m(ids[:, t:t + 1], **{cache_arg: cache}, use_cache=True)
                logits.append(out.logits)
                cache = out.past_key_values
        return torch.cat(logits, 1)

    rlx_hf.disable()
    fallback = decode(model)
    rlx_hf.enable()
    ours = decode(model)
    reference_kernels()
    with torch.no_grad():
        full = model64(ids).logits
    assert rel(ours, full) < 2e-6
    torch.testing.assert_close(ours, fallback, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_packed_sequences_keep_their_boundaries(family):
    model = build(family)
    lengths = (13, 5, 27)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, VOCAB, (1, n), generator=gen) for n in lengths]
    cu = torch.tensor([0, 13, 18, 45], dtype=torch.int32)  # int32, as HF's collator builds
    packed = torch.cat(seqs, 1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    targets = packed[:, 1:].clone()
    targets[0, cu[1:-1].long() - 1] = -100  # a sequence's last token predicts nothing
    rlx_hf.enable()
    logits, grads = run(model, packed, targets, position_ids=position_ids, cu_seq_lens_q=cu,
                        cu_seq_lens_k=cu, max_length_q=27, max_length_k=27)
    separate = [run(model, s) for s in seqs]
    torch.testing.assert_close(logits, torch.cat([s[0] for s in separate], 1),
                               atol=2e-5, rtol=2e-5)
    for name, g in grads.items():
        total = sum(s[1][name] for s in separate)
        assert rel(g, total) < 1e-5, name


@pytest.mark.parametrize("family", [f for f in ("qwen3_next", "kimi_linear") if f in FAMILY_IDS])
def test_packed_sequences_by_seq_idx(family):
    model = build(family)
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(3, VOCAB, (1, n), generator=gen) for n in (9, 16)]
    seq_idx = torch.tensor([[0] * 9 + [1] * 16], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(9), torch.arange(16)]).unsqueeze(0)
    rlx_hf.enable()
    with torch.no_grad():
        packed = model(torch.cat(seqs, 1), position_ids=position_ids, seq_idx=seq_idx,
                       use_cache=False).logits
        alone = torch.cat([model(s, use_cache=False).logits for s in seqs], 1)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_padding(family):
    model = build(family)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, VOCAB, (1, 30), generator=gen), torch.randint(3, VOCAB, (1, 19),
                                                                          generator=gen)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 11, dtype=torch.long), b], 1)])  # left pad
    mask = (torch.arange(30) >= torch.tensor([[0], [11]])).long()
    position_ids = (mask.cumsum(1) - 1).clamp_min(0)
    rlx_hf.enable()
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=position_ids,
                      use_cache=False).logits
        alone = [model(a, use_cache=False).logits, model(b, use_cache=False).logits]
    torch.testing.assert_close(batch[0], alone[0][0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(batch[1, 11:], alone[1][0], atol=2e-5, rtol=2e-5)


def _outcome(call):
    try:
        return call()
    except Exception as e:  # noqa: BLE001 (the outcome itself is what is compared)
        return e


def test_enable_before_construction_disable_and_idempotence():
    import transformers.models.qwen3_next.modeling_qwen3_next as mod
    original = mod.torch_chunk_gated_delta_rule
    names = rlx_hf.enable()
    assert rlx_hf.is_enabled() and rlx_hf.enable() == names  # a second call changes nothing
    assert mod.torch_chunk_gated_delta_rule.rlx_replaces is original
    assert {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn"} \
        <= {rlx_hf._hub_name(getattr(mod, n.rsplit(".", 1)[1]).rlx_replaces) for n in names
            if n.startswith(mod.__name__)}
    model = build("qwen3_next")  # built after enable(): uses our kernels all the same
    ids = torch.randint(3, VOCAB, (1, 9))
    with torch.no_grad():
        ours = model(ids).logits
    rlx_hf.disable()
    assert mod.torch_chunk_gated_delta_rule is original and not rlx_hf.is_enabled()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ours, atol=2e-5, rtol=2e-5)
    # Packed sequences after disable(): whatever this transformers version does with them (a
    # ValueError in some, a result in others), the same as a model that never saw enable().
    packed = {"cu_seq_lens_q": torch.tensor([0, 4, 9], dtype=torch.int32)}
    with torch.no_grad():
        after = _outcome(lambda: model(ids, **packed).logits)
        never = _outcome(lambda: build("qwen3_next")(ids, **packed).logits)
    assert type(after) is type(never)
    if isinstance(after, torch.Tensor):
        torch.testing.assert_close(after, never)
    else:
        assert str(after) == str(never)


def test_kernel_adapters_take_transformers_arguments():
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen
    rlx_hf.enable()
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 11, 2, 8, generator=gen), torch.randn(1, 11, 2, 8, generator=gen)
    v, beta = torch.randn(1, 11, 4, 6, generator=gen), torch.rand(1, 11, 4, generator=gen)
    g = F.logsigmoid(torch.randn(1, 11, 4, generator=gen))
    cu = torch.tensor([0, 3, 11], dtype=torch.int32)
    o, s = qwen.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, output_router_logits=False, use_cache=True,
        position_ids=None, max_length_q=8)
    ro, rs = reference.gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                        cu_seqlens=cu.long(), use_qk_l2norm=True)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, rs, atol=1e-5, rtol=1e-5)
    # Kimi passes no cu_seqlens: the collator's cu_seq_lens_q is used.
    gk = F.logsigmoid(torch.randn(1, 11, 2, 8, generator=gen))
    o, _ = kimi.chunk_kimi_delta_attention(q, k, v[:, :, :2], g=gk, beta=beta[:, :, :2],
                                           cu_seq_lens_q=cu, use_qk_l2norm_in_kernel=True)
    ro, _ = reference.gated_delta_rule(q, k, v[:, :, :2], gk, beta[:, :, :2],
                                       cu_seqlens=cu.long(), use_qk_l2norm=True)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="batch size 1"):
        qwen.torch_chunk_gated_delta_rule(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                          v.expand(2, -1, -1, -1), g.expand(2, -1, -1),
                                          beta.expand(2, -1, -1), cu_seqlens=cu)


@pytest.mark.parametrize("packing", ["cu_seq_lens_q", "seq_idx"])
def test_packed_causal_conv1d(packing):
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen
    rlx_hf.enable()
    gen = torch.Generator().manual_seed(6)
    x, w, bias = torch.randn(1, 7, 20, generator=gen), torch.randn(7, 4, generator=gen), \
        torch.randn(7, generator=gen)
    bounds = [(0, 2), (2, 9), (9, 9), (9, 20)]
    if packing == "cu_seq_lens_q":
        kw = {"cu_seq_lens_q": torch.tensor([0, 2, 9, 9, 20], dtype=torch.int32)}
    else:
        kw = {"seq_idx": torch.tensor([[0] * 2 + [1] * 7 + [3] * 11])}
    y = qwen.causal_conv1d_fn(x, w, bias, activation="silu", **kw)
    expected = torch.cat([F.silu(F.conv1d(x[..., a:b], w[:, None], bias, padding=3,
                                          groups=7)[..., :b - a]) for a, b in bounds if b > a],
                         -1)
    torch.testing.assert_close(y, expected)
    for T in (2, 20):  # unpacked, also shorter than the kernel: transformers' own result
        xs = x[..., :T].clone().requires_grad_()
        y = qwen.causal_conv1d_fn(xs, w, bias, activation="silu")
        y_fb = qwen.causal_conv1d_fn.rlx_replaces.__wrapped__(xs, w, bias, activation="silu")
        torch.testing.assert_close(y, y_fb)
        torch.testing.assert_close(torch.autograd.grad(y.square().sum(), xs),
                                   torch.autograd.grad(y_fb.square().sum(), xs))
    with pytest.raises(ValueError, match="packed input"):
        qwen.causal_conv1d_fn(x[..., :15], w, bias, activation="silu",
                              cu_seq_lens_q=torch.tensor([0, 20]))


def test_finetune_example_runs():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "finetune_qwen3_next.py"
    spec = importlib.util.spec_from_file_location("finetune_qwen3_next", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--steps", "4", "--batch-size", "2", "--seq-len", "32",
                           "--hidden-size", "64", "--no-progress"])
    assert any(n.endswith("qwen3_next.torch_chunk_gated_delta_rule") for n in result["patched"])
    assert not rlx_hf.is_enabled()  # the example undoes enable()
    assert result["last_loss"] < result["first_loss"]  # random bytes -> learning the text


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs MPS")
@pytest.mark.parametrize("family", ["qwen3_next", "kimi_linear"])
def test_mps_matches_cpu(family):
    model = build(family)
    ids = torch.randint(3, VOCAB, (2, 37), generator=torch.Generator().manual_seed(7))
    rlx_hf.enable()
    cpu_logits, cpu_grads = run(model, ids)
    mps_logits, mps_grads = run(model.to("mps"), ids.to("mps"))
    torch.testing.assert_close(mps_logits.cpu(), cpu_logits, atol=1e-4, rtol=1e-4)
    for name, g in cpu_grads.items():
        assert rel(mps_grads[name].cpu(), g) < 1e-4, name


def test_hub_wrapper_without_its_name_is_recognised():
    """transformers 5.15's wrapper keeps only `implementation` and `applicable_params`."""
    import functools

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        return None

    def make(implementation, applicable_params):
        @functools.wraps(implementation)
        def wrapped(*args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k in applicable_params}
            return implementation(*args, **kwargs)
        return wrapped

    assert rlx_hf._hub_name(make(torch_chunk_gated_delta_rule, ())) == "chunk_gated_delta_rule"
    assert rlx_hf._hub_name(torch_chunk_gated_delta_rule) is None
    assert rlx_hf._hub_name(functools.wraps(torch_chunk_gated_delta_rule)(lambda: 0)) is None


def test_tensors_go_to_transformers_where_the_build_has_no_kernel(monkeypatch):
    """The replacements take a device exactly when the build registered rlx::gated_delta_fwd
    for its dispatch key (CUDA in a CUDA build); others go to transformers' implementation."""
    asked = []

    def registered(op, key):
        asked.append((op, key))
        return key in ("CPU", "CUDA")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", registered)
    assert rlx_hf._has_kernel(torch.device("cuda"))
    assert rlx_hf._has_kernel(torch.device("cpu"))
    assert not rlx_hf._has_kernel(torch.device("mps"))
    assert not rlx_hf._has_kernel(torch.device("meta"))
    assert ("rlx::gated_delta_fwd", "CUDA") in asked
