"""Tests of model.py: the GPT-2 baseline and the GRT, on CPU at tiny sizes (paper sizes on `meta`)."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from common import compile_regions, estimate_mfu, from_pretrained
from model import GPT, MLP, GPTConfig, GRTConfig, heavy_tailed_depths
from registry import MODELS, PRESETS, build_model, preset

VOCAB = 256


def tiny(name, **overrides):
    torch.manual_seed(0)
    model_type, config = preset(name, **overrides)
    return MODELS[model_type][1](config)


def scramble(model, std=0.5):
    """Weights large enough that greedy decoding does not just repeat one token."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def logits_all(model, idx, **kwargs):
    """Logits at every position (forward returns all positions when targets are given)."""
    return model(idx, targets=torch.zeros_like(idx), **kwargs)[0]


@pytest.fixture(params=['tiny-gpt', 'tiny-grt'])
def model(request):
    return tiny(request.param).eval()


# ---------------------------------------------------------------------------------------------
# Loss (shapes and causality of every model: test_contract.py)


def test_initial_loss_is_near_uniform(model):
    torch.manual_seed(2)
    data = torch.randint(0, VOCAB, (8, 33))
    _, loss = model(data[:, :-1], targets=data[:, 1:])
    assert abs(loss.item() - math.log(VOCAB)) < 0.1


def test_loss_ignores_index_minus_one(model):
    idx = torch.randint(0, VOCAB, (2, 10))
    targets = idx.clone()
    targets[:, 5:] = -1
    logits, loss = model(idx, targets=targets)
    expected = F.cross_entropy(logits[:, :5].reshape(-1, VOCAB), idx[:, :5].reshape(-1))
    torch.testing.assert_close(loss, expected)


# ---------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize('prompt_len', [1, 7, 30])
def test_cached_logits_equal_uncached(model, prompt_len):
    scramble(model, std=0.2)
    torch.manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        full = logits_all(model, idx)
        cache = model.new_kv_cache(max_len=40)
        logits, _ = model(idx[:, :prompt_len], kv_cache=cache)  # prefill
        torch.testing.assert_close(logits[:, -1], full[:, prompt_len - 1], atol=1e-5, rtol=1e-5)
        for t in range(prompt_len, 40):  # one token at a time
            logits, _ = model(idx[:, t:t + 1], kv_cache=cache)
            torch.testing.assert_close(logits[:, -1], full[:, t], atol=1e-5, rtol=1e-5)


def test_cached_chunk_after_prefix(model):
    """Several new tokens after a cached prefix need the offset causal mask."""
    scramble(model, std=0.2)
    idx = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        full = logits_all(model, idx)
        cache = model.new_kv_cache(max_len=24)
        model(idx[:, :10], kv_cache=cache)
        logits = model(idx[:, 10:], targets=idx[:, 10:], kv_cache=cache)[0]
    torch.testing.assert_close(logits, full[:, 10:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('name', ['tiny-gpt', 'tiny-grt'])
def test_local_attention_reaches_back_one_token_a_block_pass(name):
    """attn_window = 2: each block pass sees one token further back, so a change at position p moves the
    logits at p .. p + passes and nowhere else (the GRT's passes: prelude, R core steps, coda)."""
    gate = {} if name == 'tiny-gpt' else dict(gate_bias=0.0)  # a gate near 1 would pass little of each step
    model = scramble(tiny(name, attn_window=2, **gate), std=0.2).eval()
    passes = model.config.n_layer if name == 'tiny-gpt' else model.num_block_passes(model.config.n_recur)
    idx = torch.randint(0, VOCAB, (1, 30))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % VOCAB
    with torch.no_grad():
        moved = (logits_all(model, idx) - logits_all(model, changed)).abs().amax(-1)[0] > 1e-6
    assert moved.nonzero().flatten().tolist() == list(range(10, 11 + passes))


@pytest.mark.parametrize('name', ['tiny-gpt', 'tiny-grt'])
def test_local_attention_cached_equals_uncached(name):
    """The window applies to cached keys too (a prefill, a chunk, then a token at a time), and a
    window as long as the block is full attention."""
    model = scramble(tiny(name, attn_window=3), std=0.2).eval()
    idx = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        full = logits_all(model, idx)
        cache = model.new_kv_cache(max_len=30)
        model(idx[:, :7], kv_cache=cache)
        chunk = model(idx[:, 7:12], targets=idx[:, 7:12], kv_cache=cache)[0]
        torch.testing.assert_close(chunk, full[:, 7:12], atol=1e-5, rtol=1e-5)
        for t in range(12, 30):
            logits, _ = model(idx[:, t:t + 1], kv_cache=cache)
            torch.testing.assert_close(logits[:, -1], full[:, t], atol=1e-5, rtol=1e-5)
        wide, everything = scramble(tiny(name, attn_window=64), std=0.2).eval(), scramble(tiny(name), std=0.2).eval()
        torch.testing.assert_close(logits_all(wide, idx), logits_all(everything, idx))
        assert not torch.allclose(full, logits_all(everything, idx))


@pytest.mark.parametrize('name', ['tiny-gpt', 'tiny-grt'])
@pytest.mark.parametrize('prompt_len,new_tokens', [(1, 10), (5, 12), (12, 20), (16, 6)])
def test_greedy_generation_cached_equals_uncached(name, prompt_len, new_tokens):
    """block_size 16: the longer runs slide the window past block_size, where the cache is rebuilt."""
    model = scramble(tiny(name, block_size=16)).eval()
    torch.manual_seed(4)
    prompt = torch.randint(0, VOCAB, (2, prompt_len))
    cached = model.generate(prompt, new_tokens, temperature=0)
    uncached = model.generate(prompt, new_tokens, temperature=0, use_cache=False)
    # an independent reference: nanoGPT's loop, cropping the context and recomputing everything
    reference = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            logits, _ = model(reference[:, -16:])
            reference = torch.cat([reference, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, reference) and torch.equal(uncached, reference)
    assert len(set(cached[0, prompt_len:].tolist())) > 2  # a real test: not one repeated token


def test_sampling_is_seeded(model):
    prompt = torch.zeros(1, 1, dtype=torch.long)
    torch.manual_seed(5)
    a = model.generate(prompt, 12, temperature=1.0, top_k=10)
    torch.manual_seed(5)
    b = model.generate(prompt, 12, temperature=1.0, top_k=10)
    assert torch.equal(a, b)


def test_forward_rejects_too_long_sequence(model):
    with pytest.raises(ValueError, match='exceeds block_size'):
        model(torch.zeros(1, 65, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# The GRT recurrence


def reference_grt_logits(model, idx, r, noise=None, h0=None, detach_steps=None):
    """Eq. 2-5 written out again from the model's parts, independently of GRT.body. noise(h) gives
    (eps_x, eps_g) for one step (None: eval, no noise); h0 (None: e) the initial state; with
    detach_steps, the state after that many steps is detached (no gradient through them)."""
    c, tr = model.config, model.transformer
    x = tr.wte(idx) + tr.wpe(torch.arange(idx.size(1)))
    for block in tr.prelude:
        x = block(x)
    e, h = x, (x if h0 is None else h0)
    for step in range(r):
        if step == detach_steps:
            h = h.detach()
        eps_x, eps_g = noise(h) if noise else (0.0, 0.0)
        u = model.W_proj(torch.cat([h + eps_x, e], -1))
        o = u
        for block in tr.core:
            o = block(o)
        a = model.gate_out(F.silu(model.gate_in(torch.cat([model.ln_h(h), model.ln_e(e)], -1))))
        g = torch.sigmoid(a / c.gate_tau + eps_g)
        h = g * h + (1 - g) * o
    for block in tr.coda:
        h = block(h)
    return model.lm_head(tr.ln_f(h))


@pytest.mark.parametrize('r', [1, 3, 7])
def test_grt_matches_equations_in_eval(r):
    model = scramble(tiny('tiny-grt', n_prelude=2, n_core=2, n_coda=1), std=0.1).eval()
    idx = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(logits_all(model, idx, num_steps=r), reference_grt_logits(model, idx, r),
                                   atol=1e-5, rtol=1e-5)


def test_grt_training_noise_is_where_the_equations_put_it():
    model = scramble(tiny('tiny-grt', state_noise=0.3, gate_noise=0.7), std=0.1).train()
    idx = torch.randint(0, VOCAB, (2, 12))
    torch.manual_seed(6)
    got = logits_all(model, idx, num_steps=3)
    torch.manual_seed(6)
    expected = reference_grt_logits(model, idx, 3, noise=lambda h: (torch.randn_like(h) * 0.3,
                                                                      torch.randn_like(h) * 0.7))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_grt_training_gradients_equal_the_written_out_equations():
    """The gradients of every weight equal those of Eq. 2-5 written out again, noise included."""
    model = scramble(tiny('tiny-grt', n_core=2), std=0.1).train()
    idx = torch.randint(0, VOCAB, (2, 12))
    grads = []
    for forward in (lambda: logits_all(model, idx, num_steps=3),
                    lambda: reference_grt_logits(model, idx, 3, noise=lambda h: (torch.randn_like(h) * 0.1,
                                                                                 torch.randn_like(h) * 0.1))):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        forward().square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_training_depth_rules():
    g = lambda: torch.Generator().manual_seed(3)
    fixed = tiny('tiny-grt', n_recur=5, train_depth='fixed')
    assert [fixed.sample_depth(g()) for _ in range(3)] == [5, 5, 5] and fixed.mean_train_steps() == 5
    heavy = tiny('tiny-grt', n_recur=5, train_depth='heavy')
    gen, reference = g(), g()
    assert [heavy.sample_depth(gen) for _ in range(20)] == [heavy_tailed_depths(5, 1, reference).item()
                                                             for _ in range(20)]
    draws = heavy_tailed_depths(5, 20000, g()).float()
    assert draws.min() >= 1 and abs(draws.mean() - 6) < 0.1  # Poisson(tau) + 1, E[tau] = 5
    assert heavy.mean_train_steps() == pytest.approx(6, abs=0.1)
    with pytest.raises(ValueError, match="train_depth must be"):
        tiny('tiny-grt', train_depth='normal')


def test_truncated_backprop_equals_detaching_the_first_steps():
    """backprop_depth k: the gradients of r = 4 steps equal those of Eq. 2-5 with h detached after r - k."""
    model = scramble(tiny('tiny-grt', backprop_depth=1, state_noise=0.0, gate_noise=0.0), std=0.1).train()
    idx = torch.randint(0, VOCAB, (2, 12))
    grads = []
    for forward in (lambda: logits_all(model, idx, num_steps=4),
                    lambda: reference_grt_logits(model, idx, 4, detach_steps=3)):
        model.zero_grad(set_to_none=True)
        forward().square().mean().backward()
        grads.append(model.W_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    model.zero_grad(set_to_none=True)
    reference_grt_logits(model, idx, 4).square().mean().backward()  # every step: other gradients
    assert not torch.allclose(grads[0], model.W_proj.weight.grad, atol=1e-6, rtol=1e-4)


def test_random_initial_state():
    """init_state='random': h0 is 0 in eval, and TruncNormal(0, 0.02^2) drawn fresh in training."""
    model = scramble(tiny('tiny-grt', init_state='random'), std=0.1).eval()
    idx = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(logits_all(model, idx, num_steps=3),
                                   reference_grt_logits(model, idx, 3, h0=torch.zeros(2, 12, 64)), atol=1e-5, rtol=1e-5)
    model.train()
    e = torch.randn(2, 12, 64)
    h0 = model.initial_state(e)
    assert h0.abs().max() <= 0.06 and 0.01 < h0.std() < 0.02 and not torch.equal(h0, model.initial_state(e))


def test_grt_train_mode_is_noisy_and_eval_deterministic():
    model = tiny('tiny-grt')
    idx = torch.randint(0, VOCAB, (2, 12))
    model.train()
    assert not torch.allclose(logits_all(model, idx, num_steps=2), logits_all(model, idx, num_steps=2))
    model.eval()
    assert torch.equal(logits_all(model, idx), logits_all(model, idx))


def test_grt_num_steps_changes_the_result_and_may_exceed_R():
    model = scramble(tiny('tiny-grt'), std=0.1).eval()
    idx = torch.randint(0, VOCAB, (1, 12))
    outs = [logits_all(model, idx, num_steps=r) for r in (1, 4, 8)]  # R = 4
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[1], outs[2])
    torch.testing.assert_close(logits_all(model, idx), outs[1])  # eval default is R


def test_grt_training_draws_r_uniformly_from_torch_generator():
    model = tiny('tiny-grt', n_recur=5)
    g = torch.Generator().manual_seed(0)
    draws = [model.sample_depth(g) for _ in range(500)]
    assert set(draws) == {1, 2, 3, 4, 5}
    assert abs(sum(draws) / len(draws) - model.mean_train_steps()) < 0.25
    model.train()
    idx = torch.randint(0, VOCAB, (2, 12))
    torch.manual_seed(7)
    a = model(idx, idx)[1]
    torch.manual_seed(7)
    b = model(idx, idx)[1]
    assert torch.equal(a, b)  # a seeded run repeats, depth draw included


def test_gate_starts_near_sigmoid_4():
    model = tiny('tiny-grt').eval()
    gates = []
    model.gate_out.register_forward_hook(lambda mod, inp, out: gates.append(torch.sigmoid(out)))  # f_g's output
    model(torch.randint(0, VOCAB, (2, 16)))
    assert len(gates) == model.config.n_recur
    for g in gates:
        assert (g - torch.sigmoid(torch.tensor(4.0))).abs().max() < 0.02


# ---------------------------------------------------------------------------------------------
# Parameter counts and FLOPs, against independent formulas


def block_params(d):
    ln = 2 * d  # weight and bias
    return 2 * ln + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)


def expected_params(spec, non_embedding):
    d, vocab, block = spec['n_embd'], spec['vocab_size'], spec['block_size']
    if spec['model_type'] == 'gpt':
        layers, extra = spec['n_layer'], 0
    else:
        layers = spec['n_prelude'] + spec['n_core'] + spec['n_coda']
        projection = 2 * d * d + d
        gate = (2 * d * d + d) + (d * d + d) + 2 * (2 * d)  # f_g, plus the two LayerNorms of Eq. 5
        extra = projection + gate
    n = layers * block_params(d) + extra + 2 * d  # + ln_f; the LM head is tied to wte
    return n if non_embedding else n + vocab * d + block * d


@pytest.mark.parametrize('name', list(PRESETS))
def test_preset_parameter_counts(name):
    with torch.device('meta'):
        model_type, config = preset(name)
        model = MODELS[model_type][1](config)
    spec = PRESETS[name]
    assert model.get_num_params(non_embedding=True) == expected_params(spec, True)
    assert model.get_num_params(non_embedding=False) == expected_params(spec, False)


def test_medium_isoflop_gate_and_projection_sizes():
    d = 1024
    with torch.device('meta'):
        model = build_model('grt', **{k: v for k, v in PRESETS['grt-medium-isoflop'].items() if k != 'model_type'})
    gate_linears = sum(p.numel() for p in [*model.gate_in.parameters(), *model.gate_out.parameters()])
    assert gate_linears == 3 * d * d + 2 * d
    assert sum(p.numel() for p in model.W_proj.parameters()) == 2 * d * d + d


def test_large_isoflop_has_63_percent_fewer_parameters():
    with torch.device('meta'):
        dense = build_model(**PRESETS['gpt2-large'])
        grt = build_model(**PRESETS['grt-large-isoflop'])
    fewer = 1 - grt.get_num_params(False) / dense.get_num_params(False)
    assert round(fewer, 2) in (0.62, 0.63)  # the paper's headline, embeddings counted


@pytest.mark.parametrize('name', list(PRESETS))
def test_flops_per_token_formula(name):
    with torch.device('meta'):
        model = build_model(**PRESETS[name])
    s = PRESETS[name]
    d, S = s['n_embd'], 512
    if s['model_type'] == 'gpt':
        assert model.flops_per_token(S) == s['n_layer'] * (24 * d ** 2 + 4 * S * d)
    else:
        for r in (1, s['n_recur'], 2 * s['n_recur']):
            passes = s['n_prelude'] + s['n_core'] * r + s['n_coda']
            assert model.flops_per_token(S, num_steps=r) == passes * (24 * d ** 2 + 4 * S * d) + 10 * r * d ** 2
        assert model.flops_per_token(S) == model.flops_per_token(S, num_steps=s['n_recur'])


def test_isoflop_presets_unroll_to_the_dense_depth():
    """1+1x10+1 = 12, 2+5x4+2 = 24, 1+5x6+5 = 36 block passes; only projection and gate add FLOPs."""
    for scale, depth in (('small', 12), ('medium', 24), ('large', 36)):
        with torch.device('meta'):
            dense = build_model(**PRESETS[f'gpt2-{scale}'])
            grt = build_model(**PRESETS[f'grt-{scale}-isoflop'])
        R, d = grt.config.n_recur, grt.config.n_embd
        assert grt.num_block_passes(R) == dense.config.n_layer == depth
        assert grt.flops_per_token(1024) - dense.flops_per_token(1024) == 10 * R * d * d


def test_estimate_mfu():
    model = tiny('tiny-gpt')
    flops = 3 * model.flops_per_token(64) * 1000
    assert estimate_mfu(model, tokens_per_iter=1000, dt=2.0, peak_flops=flops, seq_len=64) == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------
# Optimizer, configuration errors, compilation, Hugging Face equivalence


def test_configure_optimizers_covers_every_parameter_once(model):
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    seen = [id(p) for group in opt.param_groups for p in group['params']]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    decay, no_decay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and all(p.dim() >= 2 for p in decay['params'])
    assert no_decay['weight_decay'] == 0.0 and all(p.dim() < 2 for p in no_decay['params'])


@pytest.mark.parametrize('make,message', [
    (lambda: GPTConfig(n_embd=100, n_head=3), 'divisible by n_head'),
    (lambda: GRTConfig(n_recur=0), 'n_recur'),
    (lambda: GRTConfig(n_core=0), 'n_core'),
    (lambda: GRTConfig(n_prelude=1, n_core=2, n_coda=1, n_layer=12), 'leave it out'),
    (lambda: preset('gpt2-huge'), 'known presets: gpt2-small'),
    (lambda: build_model('rnn'), 'known: gpt'),
    (lambda: tiny('tiny-grt').eval()(torch.zeros(1, 4, dtype=torch.long), num_steps=0), 'num_steps'),
])
def test_bad_configuration_raises_clear_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_grt_n_layer_is_derived():
    assert GRTConfig(n_prelude=2, n_core=5, n_coda=2).n_layer == 9
    assert GRTConfig(n_prelude=2, n_core=5, n_coda=2, n_layer=9).n_layer == 9


def test_compiled_grt_by_regions_never_recompiles_across_r():
    import torch._dynamo
    torch._dynamo.reset()
    model = tiny('tiny-grt', block_size=32)
    eager = tiny('tiny-grt', block_size=32)
    eager.load_state_dict(model.state_dict())
    compile_regions(model)  # every block, and the step's W_proj, gate and update around its core
    idx = torch.randint(0, VOCAB, (2, 32))
    model.train()
    model(idx, idx, num_steps=2)[1].backward()  # first call compiles every region once
    with torch._dynamo.config.patch(error_on_recompile=True):
        for r in (1, 4, 3, 7):
            _, loss = model(idx, idx, num_steps=r)
            loss.backward()
    for m in (model, eager):  # training noise too: the compiled step draws it with torch's own randn
        m.zero_grad()
        torch.manual_seed(7)
        m(idx, idx, num_steps=3)[1].backward()
    torch.testing.assert_close(model.gate_out.weight.grad, eager.gate_out.weight.grad, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(model.W_proj.weight.grad, eager.W_proj.weight.grad, atol=1e-4, rtol=1e-3)
    model.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx, idx)[1], eager(idx, idx)[1], atol=1e-4, rtol=1e-4)


def test_gpt_matches_hugging_face_gpt2():
    transformers = pytest.importorskip('transformers')  # installed by .ci/run; optional for users
    torch.manual_seed(8)
    hf_config = transformers.GPT2Config(vocab_size=97, n_positions=24, n_embd=48, n_layer=3, n_head=4,
                                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    assert hf_config.activation_function == 'gelu_new'  # GPT-2's own tanh GELU
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)  # random everywhere, biases and LayerNorms included
    ours = from_pretrained(hf).eval()
    idx = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(logits_all(ours, idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
        ours.transformer.h[0].mlp.gelu.approximate = 'none'  # the exact GELU, our default, is another function
        assert not torch.allclose(logits_all(ours, idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_the_mlp_computes_the_gelu_its_config_names():
    x = torch.linspace(-4, 4, 101)
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))  # GPT-2's gelu_new
    for approximate, expected in (('none', exact), ('tanh', tanh)):
        mlp = MLP(GPTConfig(n_embd=1, n_head=1, gelu_approximate=approximate))
        torch.testing.assert_close(mlp.gelu(x), expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="gelu_approximate must be 'none'"):
        GPTConfig(gelu_approximate='fast')
