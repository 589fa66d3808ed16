"""Tests of the paper's baselines (baselines.py: Huginn, MoR) and GRT's ablation ladder (GRTConfig.rung),
on CPU at tiny sizes: each checked against a computation written out here from its equations."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from baselines import Huginn, HuginnConfig, MoR, MoRConfig
from model import GRT, MODELS, build_model

V, S, D = 50, 32, 32
SMALL = dict(vocab_size=V, block_size=S, n_embd=D, n_head=4, dropout=0.0)


def make(model_type, seed=0, **overrides):
    torch.manual_seed(seed)
    return build_model(model_type, **{**SMALL, **overrides})


def huginn(**overrides):
    return make('huginn', **{**dict(n_prelude=1, n_core=2, n_coda=1, n_recur=3, backprop_depth=2), **overrides})


def mor(**overrides):
    return make('mor', **{**dict(n_prelude=1, n_core=2, n_coda=1, n_recur=3, router_hidden=16), **overrides})


def rung(k, **overrides):
    layout = dict(n_prelude=0, n_coda=0) if k == 1 else dict(n_prelude=1, n_coda=1)
    return make('grt', **{**layout, 'n_core': 2, 'n_recur': 3, 'rung': k, **overrides})


def mixed_routing(model, std=2.0):
    """Auxiliary routers large enough that inference keeps some tokens and drops others."""
    torch.manual_seed(2)
    with torch.no_grad():
        for aux in model.aux_routers:
            aux[-1].weight.normal_(0.0, std)
    return model


def record_routing(model):
    """Record the (B, T) mask of the tokens chosen at every recursion (expert choice in training,
    the auxiliary router otherwise), by wrapping the model's methods."""
    chosen_masks = []
    expert_choice, update_rows = model.expert_choice, model.update_rows

    def recording_expert_choice(weight, active, step):
        idx = expert_choice(weight, active, step)
        chosen_masks.append(torch.zeros_like(active).scatter(1, idx, True))
        return idx

    def recording_update_rows(h, weight, chosen, caches):
        chosen_masks.append(chosen.clone())
        return update_rows(h, weight, chosen, caches)
    model.expert_choice, model.update_rows = recording_expert_choice, recording_update_rows
    return chosen_masks


def logits_all(model, idx, **kwargs):
    return model(idx, targets=torch.zeros_like(idx), **kwargs)[0]


def head(model, h):
    return model.lm_head(model.transformer.ln_f(h))


def embed(model, idx):
    pos = torch.arange(idx.size(1))
    return model.transformer.drop(model.transformer.wte(idx) + model.transformer.wpe(pos))


def run(blocks, x):
    for block in blocks:
        x = block(x)
    return x


VARIANTS = {
    'huginn': huginn,
    'mor': lambda: mixed_routing(mor()),
    **{f'rung{k}': (lambda k=k: rung(k)) for k in range(1, 5)},
}


@pytest.fixture(params=list(VARIANTS))
def variant(request):
    return VARIANTS[request.param]().eval()


# ---------------------------------------------------------------------------------------------
# What every variant must do: shapes, causality, cache == no cache, eval determinism


def test_registered_and_built_from_config():
    assert MODELS['huginn'] == (HuginnConfig, Huginn) and MODELS['mor'] == (MoRConfig, MoR)
    assert isinstance(huginn(), GRT) and isinstance(mor(), GRT)  # they reuse GRT's prelude, coda, loop


@pytest.mark.parametrize('model_type, fields, message', [
    ('grt', dict(rung=6), 'rung must be 1..5'),
    ('grt', dict(rung=1, n_prelude=1), 'set n_prelude=0 and n_coda=0'),
    ('huginn', dict(rung=5), "huginn's step is rung 4"),
    ('huginn', dict(backprop_depth=0), 'backprop_depth >= 1'),
    ('mor', dict(n_prelude=0), 'unique first and last layers'),
    ('mor', dict(rung=5), 'leave rung out'),
])
def test_bad_configuration_raises_clear_error(model_type, fields, message):
    with pytest.raises(ValueError, match=message):
        build_model(model_type, **{**SMALL, **fields})


def test_output_shapes(variant):
    idx = torch.randint(0, V, (3, 17))
    logits, loss = variant(idx, targets=idx)
    assert logits.shape == (3, 17, V) and loss.dim() == 0
    logits, loss = variant(idx)
    assert logits.shape == (3, 1, V) and loss is None


def test_causality_at_inference(variant):
    torch.manual_seed(3)
    idx = torch.randint(0, V, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % V
    a, b = logits_all(variant, idx), logits_all(variant, changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_cached_logits_equal_uncached(variant):
    """Prefill 7 tokens, then decode one at a time: every position's logits equal the full forward's."""
    torch.manual_seed(4)
    idx = torch.randint(0, V, (2, 16))
    full = logits_all(variant, idx)
    cache = variant.new_kv_cache(16)
    steps = [variant(idx[:, :7], kv_cache=cache, targets=torch.zeros_like(idx[:, :7]))[0]]
    for t in range(7, 16):
        steps.append(variant(idx[:, t:t + 1], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_cached_equals_uncached(variant):
    torch.manual_seed(1)
    with torch.no_grad():  # weights large enough that greedy decoding does not repeat one token
        for name, p in variant.named_parameters():
            if p.dim() >= 2 and not name.startswith('aux_routers'):
                p.normal_(0.0, 0.5)
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(5))
    cached = variant.generate(prompt, 40, temperature=0)  # past block_size: the window slides
    uncached = variant.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, 5:].flatten().tolist())) > 2


def test_eval_is_deterministic_and_training_is_not(variant):
    idx = torch.randint(0, V, (2, 16))
    first = logits_all(variant, idx)
    variant.train()
    torch.manual_seed(6)
    train_a = logits_all(variant, idx, num_steps=3)
    torch.manual_seed(7)
    train_b = logits_all(variant, idx, num_steps=3)
    variant.eval()
    torch.testing.assert_close(logits_all(variant, idx), first, rtol=0, atol=0)
    if not isinstance(variant, MoR) and variant.config.rung >= 3:  # noise or random h0 in training
        assert not torch.allclose(train_a, train_b)


# ---------------------------------------------------------------------------------------------
# Parameter counts and FLOPs against independent formulas and counters


def block_params(d):
    return 12 * d * d + 13 * d  # LN 2d, c_attn 3d^2+3d, c_proj d^2+d, LN 2d, c_fc 4d^2+4d, c_proj 4d^2+d


@pytest.mark.parametrize('name', list(VARIANTS))
def test_parameter_counts(name):
    model, d = VARIANTS[name](), D
    c = model.config
    n = (c.n_prelude + c.n_core + c.n_coda) * block_params(d) + 2 * d  # blocks + ln_f
    if name == 'mor':
        n += c.n_recur * (d + d * 16 + 16 + 16 + 1)  # router d -> 1; aux router d -> 16 -> 1
    elif name in ('huginn', 'rung4'):
        n += 2 * d * d + d  # the adapter / W_proj, Linear(2d, d)
    assert model.get_num_params() == n
    assert model.get_num_params(non_embedding=False) == n + V * d + S * d


def counted_forward_flops(model, idx):
    """FLOPs torch counts in a forward pass, per token, less the LM head (at every position). The
    math attention kernel is plain matmuls (4 T^2 d per layer: Q K^T and A V), which the counter sees."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, targets=idx)
    return counter.get_total_flops() / idx.numel() - 2 * D * V


@pytest.mark.parametrize('name', list(VARIANTS))
def test_flops_per_token_matches_counted_matmuls(name):
    model = VARIANTS[name]()
    if name == 'mor':
        model.train()  # expert choice keeps exactly the capacity schedule (T divisible by N_r)
    else:
        model.eval()
    idx = torch.randint(0, V, (2, 30))
    assert counted_forward_flops(model, idx) == pytest.approx(model.flops_per_token(30), rel=1e-9)
    assert model.flops_per_token(30, float(model.mean_train_steps())) > 0  # train.py passes a float mean


def test_huginn_backward_flops_do_not_grow_past_backprop_depth():
    """The r - k no-grad steps cost no backward FLOPs: backward counts equal for r = k + 1 and k + 4."""
    model = huginn(backprop_depth=2).train()
    idx = torch.randint(0, V, (2, 16))
    counts = []
    for r in (3, 6):
        _, loss = model(idx, targets=idx, num_steps=r)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0
    assert model.train_flops_per_token(16, 6) < 3 * model.flops_per_token(16, 6)
    assert model.train_flops_per_token(16, 2) == 3 * model.flops_per_token(16, 2)


# ---------------------------------------------------------------------------------------------
# The ablation ladder: each rung computes its equation


def test_rung1_is_the_core_applied_r_times_to_the_embeddings():
    model = rung(1).eval()
    idx = torch.randint(0, V, (2, 12))
    h = embed(model, idx)
    for _ in range(3):
        h = run(model.transformer.core, h)
    torch.testing.assert_close(logits_all(model, idx), head(model, h))
    assert model.proj is None and not hasattr(model, 'gate')


@pytest.mark.parametrize('k', [2, 3, 4])
def test_rungs_2_to_4_compute_their_equations_in_training(k):
    """rung 2: h = Core(h); rung 3: h = Core(h + eps_x); rung 4: h = Core(W_proj [h + eps_x ; e]),
    with h0 = e = Prelude(embeddings), replayed here with the same noise draws."""
    model = rung(k).train()
    idx = torch.randint(0, V, (2, 12))
    torch.manual_seed(8)
    logits = logits_all(model, idx, num_steps=3)
    torch.manual_seed(8)
    e = h = run(model.transformer.prelude, embed(model, idx))
    for _ in range(3):
        u = h + torch.randn_like(h) * 0.1 if k >= 3 else h
        u = model.proj(torch.cat([u, e], dim=-1)) if k == 4 else u
        h = run(model.transformer.core, u)
    torch.testing.assert_close(logits, head(model, run(model.transformer.coda, h)))


def test_ladder_flops_add_projection_then_gate():
    flops = [rung(k).flops_per_token(S) for k in range(1, 5)] + [make('grt', n_core=2, n_recur=3).flops_per_token(S)]
    assert flops[1] == flops[2]  # noise is free
    assert flops[3] - flops[2] == 3 * 4 * D * D  # W_proj: 2 * 2d * d per step
    assert flops[4] - flops[3] == 3 * 6 * D * D  # gate f_g: 2 * (2d * d + d * d) per step


# ---------------------------------------------------------------------------------------------
# Huginn


def test_huginn_eval_is_the_adapter_recurrence_from_zeros():
    model = huginn(n_recur=4).eval()
    idx = torch.randint(0, V, (2, 12))
    e = run(model.transformer.prelude, embed(model, idx))
    h = torch.zeros_like(e)
    for _ in range(4):  # eval depth: r_mean
        h = run(model.transformer.core, model.proj(torch.cat([h, e], dim=-1)))
    torch.testing.assert_close(logits_all(model, idx), head(model, run(model.transformer.coda, h)))


def test_huginn_backpropagates_through_the_last_k_steps_only():
    """Gradients equal a written-out pass whose first r - k steps are detached from the graph,
    from a truncated-normal random h0."""
    model = huginn(backprop_depth=2).train()
    idx = torch.randint(0, V, (2, 12))
    torch.manual_seed(9)
    model(idx, targets=idx, num_steps=5)[1].backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    torch.manual_seed(9)
    e = run(model.transformer.prelude, embed(model, idx))
    h = nn.init.trunc_normal_(torch.empty_like(e), std=0.02, a=-0.06, b=0.06)
    assert h.abs().max() <= 0.06 and h.std() > 0.01
    for step in range(5):
        if step == 3:
            h = h.detach()  # the first 5 - 2 steps carry no gradient
        u = h + torch.randn_like(h) * 0.0  # rung 4 draws eps_x; Huginn's std is 0
        h = run(model.transformer.core, model.proj(torch.cat([u, e], dim=-1)))
    logits = head(model, run(model.transformer.coda, h))
    F.cross_entropy(logits.view(-1, V), idx.view(-1)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)

    full = huginn(backprop_depth=5).train()  # same weights, every step backpropagated
    torch.manual_seed(9)
    full(idx, targets=idx, num_steps=5)[1].backward()
    assert not torch.allclose(full.proj.weight.grad, grads['proj.weight'])


def test_huginn_depth_distribution():
    """r = min(Poisson(tau) + 1, 3 r_mean), tau ~ LogNormal(log r_mean - sigma^2 / 2, sigma): keyed by the
    caller's generator, and its mean matches an independent numpy simulation."""
    model = huginn(n_recur=8)
    draws = [model.sample_depth(torch.Generator().manual_seed(s)) for s in range(5)]
    assert draws == [model.sample_depth(torch.Generator().manual_seed(s)) for s in range(5)]
    assert all(isinstance(r, int) for r in draws)
    depths = model.draw_depths(40000, torch.Generator().manual_seed(1)).numpy()
    assert depths.min() >= 1 and depths.max() == 24 and (depths > 16).mean() > 0.01  # heavy tail, capped
    rng = np.random.default_rng(0)
    tau = rng.lognormal(math.log(8) - 0.125, 0.5, 200000)
    reference = np.minimum(rng.poisson(tau) + 1, 24)
    assert depths.mean() == pytest.approx(reference.mean(), abs=0.06)
    assert model.mean_train_steps() == pytest.approx(reference.mean(), abs=0.06)
    # the expected training FLOPs average the truncated backward over this distribution
    expected = np.mean([model.train_flops_per_token(S, int(r)) for r in reference[:5000]])
    assert model.expected_train_flops_per_token(S) == pytest.approx(expected, rel=0.01)


def test_huginn_trains_with_random_depths_from_none():
    model = huginn().train()
    idx = torch.randint(0, V, (2, 12))
    torch.manual_seed(10)
    _, loss = model(idx, targets=idx)  # no num_steps: drawn from torch's global generator
    loss.backward()
    assert model.proj.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# MoR


def test_mor_training_matches_expert_choice_written_out():
    """Recursion 0 keeps all 8 tokens, recursion 1 the top 4 of each row by router weight, in causal
    order; chosen tokens get h + g (Core(h) - h) with attention among themselves only."""
    model = mor(n_recur=2).train()
    idx = torch.randint(0, V, (2, 8))
    logits, loss = model(idx, targets=idx)

    h = run(model.transformer.prelude, embed(model, idx))
    g = torch.sigmoid(model.routers[0](h))
    h = h + g * (run(model.transformer.core, h) - h)
    g = torch.sigmoid(model.routers[1](h)).squeeze(-1)
    rows = []
    for b in range(2):
        keep = g[b].argsort(descending=True)[:4].sort().values
        x = h[b, keep][None]
        x = x + g[b, keep, None] * (run(model.transformer.core, x) - x)
        row = h[b].clone()
        row[keep] = x[0]
        rows.append(row)
    reference = head(model, run(model.transformer.coda, torch.stack(rows)))
    torch.testing.assert_close(logits, reference)
    # the auxiliary routers' BCE trains them but leaves the loss's value the cross-entropy
    torch.testing.assert_close(loss, F.cross_entropy(reference.view(-1, V), idx.view(-1)))
    assert model.router_loss > 0


def test_mor_capacity_schedule_is_hierarchical():
    model = mor(n_recur=3).train()
    assert model.sample_depth(torch.Generator()) == 3  # every training pass runs all N_r recursions
    masks = record_routing(model)
    model(torch.randint(0, V, (4, 30)))
    assert [m.sum(dim=1).tolist() for m in masks] == [[30] * 4, [20] * 4, [10] * 4]
    for earlier, later in zip(masks, masks[1:]):
        assert not (later & ~earlier).any()  # a token dropped once stays dropped


def test_mor_aux_router_learns_from_detached_states_only():
    """The BCE reaches the auxiliary routers, and nothing else: every other gradient equals the
    gradient of the cross-entropy alone."""
    model = mor().train()
    idx = torch.randint(0, V, (2, 12))
    model(idx, targets=idx)[1].backward()
    assert all(p.grad.abs().sum() > 0 for p in model.aux_routers.parameters())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if not n.startswith('aux_routers')}
    model.zero_grad()
    logits, _ = model(idx, targets=idx)
    F.cross_entropy(logits.view(-1, V), idx.view(-1)).backward()
    for name, grad in grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, msg=name)


def test_mor_inference_routes_by_the_auxiliary_router():
    """Aux router says no at recursion 1: eval runs recursion 0 (all tokens) and nothing else; says yes
    everywhere: every token passes both recursions."""
    model = mor(n_recur=2).eval()
    idx = torch.randint(0, V, (2, 10))
    h0 = run(model.transformer.prelude, embed(model, idx))
    h = h0 + torch.sigmoid(model.routers[0](h0)) * (run(model.transformer.core, h0) - h0)
    with torch.no_grad():
        model.aux_routers[0][-1].bias.fill_(30.0)
        model.aux_routers[1][-1].bias.fill_(-30.0)
    torch.testing.assert_close(logits_all(model, idx), head(model, run(model.transformer.coda, h)))
    with torch.no_grad():
        model.aux_routers[1][-1].bias.fill_(30.0)
    h = h + torch.sigmoid(model.routers[1](h)) * (run(model.transformer.core, h) - h)
    torch.testing.assert_close(logits_all(model, idx), head(model, run(model.transformer.coda, h)))


def test_mor_mixed_routing_differs_between_tokens_and_rows():
    """The fixture's routing is really mixed, so the causality and cache tests exercise selection."""
    model = mixed_routing(mor()).eval()
    masks = record_routing(model)
    model(torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(4)))
    kept = [m.float().mean().item() for m in masks]
    assert 0 < kept[1] < 1 and 0 < kept[2] < kept[1]
    assert masks[1][0].sum() != masks[1][1].sum()  # rows keep different counts: the per-row path


def test_mor_cache_holds_only_routed_tokens():
    model = mixed_routing(mor()).eval()
    masks = record_routing(model)
    idx = torch.randint(0, V, (2, 12))
    cache = model.new_kv_cache(12)
    model(idx, kv_cache=cache)
    for step, mask in enumerate(masks):
        layer = cache[1 + step * 2]  # the first core layer at this recursion
        assert [row.length for row in layer.rows] == mask.sum(dim=1).tolist()
    with pytest.raises(ValueError, match="mor has its own"):
        model.new_kv_cache(12, kv_mode='shared')
    with pytest.raises(ValueError, match='num_steps must be <= 3'):
        model(idx, num_steps=4)


# ---------------------------------------------------------------------------------------------
# torch.compile by regions: no recompile as the depth (or MoR's routed length) changes


@pytest.mark.parametrize('name', ['huginn', 'mor'])
def test_compile_regions_never_recompile_across_depths(name):
    import torch._dynamo
    torch._dynamo.reset()
    model, eager = VARIANTS[name](), VARIANTS[name]()
    model.compile_regions(backend='aot_eager')
    idx = torch.randint(0, V, (2, 30))
    model.train()
    for r in (3, 2):  # warm-up: compiles each region (and the no-grad step, and MoR's dynamic length)
        model(idx, targets=idx, num_steps=r)[1].backward()
    model.eval()
    with torch.no_grad():
        for T in (30, 17):  # a second length makes the sequence dimension dynamic
            model(idx[:, :T], targets=idx[:, :T])
    with torch._dynamo.config.patch(error_on_recompile=True):
        model.train()
        for r in (1, 3, 2, 3):
            model(idx, targets=idx, num_steps=r)[1].backward()
        model.eval()
        eager.eval()
        with torch.no_grad():
            for T in (30, 23):
                torch.testing.assert_close(model(idx[:, :T], targets=idx[:, :T])[1],
                                           eager(idx[:, :T], targets=idx[:, :T])[1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The isoFLOP configs: each variant's training FLOPs per token match the GRT config of its scale


def config_model(path):
    """The model train.py builds from a config file (on the meta device: no memory, no time)."""
    import train
    from config import parse_config
    model_type, args = train.requested_model(parse_config(train.DEFAULTS, [path]), {'vocab_size': 50304})
    with torch.device('meta'):
        return build_model(model_type or 'gpt', **args)


def train_flops(model, seq_len, draws=2000):
    """Training FLOPs per token averaged over the depths training draws (estimate_mfu at 1 token/s
    against a 1 FLOP/s peak is the FLOPs of one trained token)."""
    gen = torch.Generator().manual_seed(0)
    return sum(model.estimate_mfu(1, 1.0, 1.0, seq_len, model.sample_depth(gen)) for _ in range(draws)) / draws


SHAKESPEARE = ['huginn', 'mor', 'rung1', 'rung2', 'rung3', 'rung4']


@pytest.mark.parametrize('path, reference, tolerance', [
    ('config/huginn_small.py', 'config/grt_small.py', 0.01),
    ('config/mor_small.py', 'config/grt_small.py', 0.03),
    *[(f'config/shakespeare_char_{name}.py', f'config/shakespeare_char_{ref}.py', 0.03)
      for name in SHAKESPEARE for ref in ('gpt', 'grt')],
])
def test_isoflop_configs_match_in_training_flops(path, reference, tolerance):
    model, grt = config_model(path), config_model(reference)
    seq_len = grt.config.block_size
    assert model.config.block_size == seq_len and model.config.n_embd == grt.config.n_embd
    assert train_flops(model, seq_len) == pytest.approx(train_flops(grt, seq_len), rel=tolerance)
