"""Tests of the paper's baselines (baselines.py: Huginn, MoR, the ablation ladder rung1..rung4), on CPU
at tiny sizes: each checked against a computation written out here from its equations. What every
model must do (shapes, causality, caches, determinism, counted FLOPs) is in test_contract.py."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from baselines import Huginn, HuginnConfig, MoR, MoRConfig
from common import compile_regions, train_flops_per_token
from experiments import study
from model import RecurrentLM, heavy_tailed_depths
from registry import MODELS, build_model

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
    return make(f'rung{k}', **{**layout, 'n_core': 2, 'n_recur': 3, **overrides})


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


# ---------------------------------------------------------------------------------------------
# Registration and configuration


def test_registered_and_built_from_config():
    assert MODELS['huginn'] == (HuginnConfig, Huginn) and MODELS['mor'] == (MoRConfig, MoR)
    assert isinstance(huginn(), RecurrentLM) and isinstance(mor(), RecurrentLM)  # the shared depth loop


@pytest.mark.parametrize('model_type, fields, message', [
    ('rung1', dict(n_prelude=1), 'set n_prelude=0 and n_coda=0'),
    ('huginn', dict(backprop_depth=0), 'backprop_depth must be >= 1'),
    ('mor', dict(n_prelude=0), 'unique first and last layers'),
    ('mor', dict(attn_window=2), 'mor does not take attn_window'),
    # a setting a model does not have is refused, not silently ignored
    ('huginn', dict(gate_noise=0.2), "gate_noise does not apply to model_type 'huginn'"),
    ('mor', dict(state_noise=0.1), "state_noise does not apply to model_type 'mor'"),
    ('rung2', dict(state_noise=0.1), "state_noise does not apply to model_type 'rung2'"),
    ('grt', dict(router_alpha=0.1), "router_alpha does not apply to model_type 'grt'"),
])
def test_bad_configuration_raises_clear_error(model_type, fields, message):
    with pytest.raises(ValueError, match=message):
        build_model(model_type, **{**SMALL, **fields})


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


@pytest.mark.parametrize('model_type', ['huginn', 'grt'])
def test_backward_flops_do_not_grow_past_backprop_depth(model_type):
    """The r - k no-grad steps cost no backward FLOPs: backward counts equal for r = k + 1 and k + 4,
    and the training FLOPs count those steps' forward only."""
    model = make(model_type, n_prelude=1, n_core=2, n_coda=1, n_recur=3, backprop_depth=2).train()
    idx = torch.randint(0, V, (2, 16))
    counts = []
    for r in (3, 6):
        _, loss = model(idx, targets=idx, num_steps=r)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0
    assert train_flops_per_token(model, 16, 2) == 3 * model.flops_per_token(16, 2)
    assert train_flops_per_token(model, 16, 6) - train_flops_per_token(model, 16, 3) == \
        model.flops_per_token(16, 6) - model.flops_per_token(16, 3)


# ---------------------------------------------------------------------------------------------
# The ablation ladder: each rung computes its equation


def test_rung1_is_the_core_applied_r_times_to_the_embeddings():
    model = rung(1).eval()
    idx = torch.randint(0, V, (2, 12))
    h = embed(model, idx)
    for _ in range(3):
        h = run(model.transformer.core, h)
    torch.testing.assert_close(logits_all(model, idx), head(model, h))
    assert not hasattr(model, 'proj') and not hasattr(model, 'gate')


def trained_and_replayed(model, step, steps=3):
    """(the logits of model in training at num_steps=steps, the logits of h0 = e = Prelude(embeddings)
    carried by step(h, e) steps times through the coda and head), with the same noise draws."""
    idx = torch.randint(0, V, (2, 12))
    torch.manual_seed(8)
    logits = logits_all(model, idx, num_steps=steps)
    torch.manual_seed(8)
    e = h = run(model.transformer.prelude, embed(model, idx))
    for _ in range(steps):
        h = step(h, e)
    return logits, head(model, run(model.transformer.coda, h))


@pytest.mark.parametrize('k', [2, 3, 4])
def test_rungs_2_to_4_compute_their_equations_in_training(k):
    """rung 2: h = Core(h); rung 3: h = Core(h + eps_x); rung 4: h = Core(W_proj [h + eps_x ; e]),
    with h0 = e = Prelude(embeddings), replayed here with the same noise draws."""
    model = rung(k).train()

    def step(h, e):
        u = h + torch.randn_like(h) * 0.1 if k >= 3 else h
        u = model.proj(torch.cat([u, e], dim=-1)) if k == 4 else u
        return run(model.transformer.core, u)
    torch.testing.assert_close(*trained_and_replayed(model, step))


def test_grt_without_reinjection_computes_its_equations_in_training():
    """grt_no_e: u = h + eps_x, o = Core(u), g = sigmoid(f_g([LN(h) ; LN(e)]) + eps_g), h = g h + (1 - g) o,
    replayed with the same noise draws; it has GRT's parameters less W_proj, and its FLOPs less W_proj's."""
    model = make('grt_no_e', n_core=2, n_recur=3).train()
    grt = make('grt', n_core=2, n_recur=3)
    assert not hasattr(model, 'W_proj')
    assert grt.get_num_params() - model.get_num_params() == 2 * D * D + D
    assert grt.flops_per_token(S) - model.flops_per_token(S) == 3 * 4 * D * D

    def step(h, e):
        eps_x, eps_g = torch.randn_like(h) * 0.1, torch.randn_like(h) * 0.1
        o = run(model.transformer.core, h + eps_x)
        f = model.gate_out(F.silu(model.gate_in(torch.cat([model.ln_h(h), model.ln_e(e)], dim=-1))))
        g = torch.sigmoid(f + eps_g)
        return g * h + (1 - g) * o
    torch.testing.assert_close(*trained_and_replayed(model, step))


def test_ladder_flops_add_projection_then_gate():
    flops = [rung(k).flops_per_token(S) for k in range(1, 5)] + [make('grt', n_core=2, n_recur=3).flops_per_token(S)]
    assert flops[1] == flops[2]  # noise is free
    assert flops[3] - flops[2] == 3 * 4 * D * D  # W_proj: 2 * 2d * d per step
    assert flops[4] - flops[3] == 3 * 6 * D * D  # gate f_g: 2 * (2d * d + d * d) per step


# ---------------------------------------------------------------------------------------------
# Huginn (seal-rg/recurrent-pretraining, recpre/model_dynamic.py, RecurrentGPT), written out:
#   h0 ~ TruncNormal(0, 0.02^2) on [-0.06, 0.06]        initialize_state ('like-init'), eval too
#   h  = Core(adapter [h ; e])  r times                 core_block_forward (injection 'linear')
#   logits = head(ln_f(Coda(ln_f(h))))                  iterate_forward returns ln_f(x); ln_f used twice
#   r = Poisson(tau) + 1, tau ~ LogNormal(log r_mean - sigma^2 / 2, sigma), no cap ('poisson-lognormal-filling')


def huginn_eval_states(T, std=0.02, seed=0):
    """The eval initial states of positions 0..T-1: one seeded truncated-normal draw per position."""
    table = torch.empty(S, D)
    nn.init.trunc_normal_(table, std=std, a=-3 * std, b=3 * std, generator=torch.Generator().manual_seed(seed))
    return table[:T]


def test_huginn_eval_is_the_adapter_recurrence_from_a_seeded_random_state():
    model = huginn(n_recur=4).eval()
    idx = torch.randint(0, V, (2, 12))
    e = run(model.transformer.prelude, embed(model, idx))
    h = huginn_eval_states(12).expand(2, 12, D)
    assert h.abs().max() <= 0.06 and h.std() > 0.01  # random, not zeros
    for _ in range(4):  # eval depth: r_mean
        h = run(model.transformer.core, model.proj(torch.cat([h, e], dim=-1)))
    reference = head(model, run(model.transformer.coda, model.transformer.ln_f(h)))
    torch.testing.assert_close(logits_all(model, idx), reference)
    # the state is normalised before the coda: without it the logits differ
    assert not torch.allclose(logits_all(model, idx), head(model, run(model.transformer.coda, h)), atol=1e-3)


def test_huginn_eval_state_depends_on_position_only():
    """A token's h0 is its position's seeded draw, whether it comes in a prefill or decoded alone."""
    model = huginn().eval()
    states = []
    initial_state = model.initial_state
    model.initial_state = lambda e: states.append(initial_state(e)) or states[-1]
    idx = torch.randint(0, V, (2, 9))
    model(idx)
    cache = model.new_kv_cache(9)
    model(idx[:, :6], kv_cache=cache)
    for t in range(6, 9):
        model(idx[:, t:t + 1], kv_cache=cache)
    torch.testing.assert_close(states[0], huginn_eval_states(9).expand(2, 9, D), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(states[1:], dim=1), states[0], rtol=0, atol=0)
    assert 'eval_state' not in model.state_dict()  # fixed by the seed, not a weight


def test_huginn_backpropagates_through_the_last_k_steps_only():
    """Gradients equal a written-out pass whose first r - k steps are detached from the graph,
    from a truncated-normal random h0, with the state normalised before the coda."""
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
        h = run(model.transformer.core, model.proj(torch.cat([h, e], dim=-1)))
    logits = head(model, run(model.transformer.coda, model.transformer.ln_f(h)))
    F.cross_entropy(logits.view(-1, V), idx.view(-1)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)

    full = huginn(backprop_depth=5).train()  # same weights, every step backpropagated
    torch.manual_seed(9)
    full(idx, targets=idx, num_steps=5)[1].backward()
    assert not torch.allclose(full.proj.weight.grad, grads['proj.weight'])


def test_huginn_depth_distribution():
    """r = Poisson(tau) + 1, tau ~ LogNormal(log r_mean - sigma^2 / 2, sigma), unbounded: keyed by the
    caller's generator, and its mean matches an independent numpy simulation."""
    model = huginn(n_recur=8)
    draws = [model.sample_depth(torch.Generator().manual_seed(s)) for s in range(5)]
    assert draws == [model.sample_depth(torch.Generator().manual_seed(s)) for s in range(5)]
    assert all(isinstance(r, int) for r in draws)
    depths = heavy_tailed_depths(8, 40000, torch.Generator().manual_seed(1)).numpy()
    assert depths.min() >= 1 and depths.max() > 24 and (depths > 16).mean() > 0.01  # heavy tail, no 3 r_mean cap
    rng = np.random.default_rng(0)
    tau = rng.lognormal(math.log(8) - 0.125, 0.5, 200000)
    reference = rng.poisson(tau) + 1
    assert depths.mean() == pytest.approx(reference.mean(), abs=0.06)
    assert model.mean_train_steps() == pytest.approx(reference.mean(), abs=0.06)
    # the expected training FLOPs average the truncated backward over this distribution
    flops = {r: train_flops_per_token(model, S, r) for r in set(reference.tolist())}
    expected = np.mean([flops[r] for r in reference.tolist()])
    assert study.mean_train_flops(model, S) == pytest.approx(expected, rel=0.01)


def test_huginn_trains_with_random_depths_from_none():
    model = huginn().train()
    idx = torch.randint(0, V, (2, 12))
    torch.manual_seed(10)
    _, loss = model(idx, targets=idx)  # no num_steps: drawn from torch's global generator
    loss.backward()
    assert model.proj.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# MoR (raymin0223/mixture_of_recursions, model/mor_model/expert_choice_router.py,
# MoRLlamaDecoderLayer.forward), written out:
#   g   = alpha * sigmoid(w_s . h)                        router_func 'sigmoid', router_probs * alpha (0.1)
#   k_s = max(1, floor(c_s T)), c_s = (N_r - s) / N_r     capacity; c_0 = 1: every token at recursion 0
#   c_s(t) = c_s + (1 - c_s) (1 + cos(pi min(1, (t+1) / W))) / 2   during the warm-up of W iterations
#   chosen: h <- h + g * Block(h), Block(h) = h + attn + mlp     scatter_add(total_x, block_out * weights)


ALPHA = 0.1


def test_mor_training_matches_expert_choice_written_out():
    """Recursion 0 keeps all 8 tokens, recursion 1 the top 4 of each row by router weight, in causal
    order; chosen tokens get h + g Core(h), g = alpha sigmoid(w . h), with attention among themselves only."""
    model = mor(n_recur=2).train()
    idx = torch.randint(0, V, (2, 8))
    logits, loss = model(idx, targets=idx)

    h = run(model.transformer.prelude, embed(model, idx))
    g = ALPHA * torch.sigmoid(model.routers[0](h))
    h = h + g * run(model.transformer.core, h)
    g = ALPHA * torch.sigmoid(model.routers[1](h)).squeeze(-1)
    rows = []
    for b in range(2):
        keep = g[b].argsort(descending=True)[:4].sort().values
        x = h[b, keep][None]
        x = x + g[b, keep, None] * run(model.transformer.core, x)
        row = h[b].clone()
        row[keep] = x[0]
        rows.append(row)
    reference = head(model, run(model.transformer.coda, torch.stack(rows)))
    torch.testing.assert_close(logits, reference)
    # the auxiliary routers' BCE trains them but leaves the loss's value the cross-entropy
    torch.testing.assert_close(loss, F.cross_entropy(reference.view(-1, V), idx.view(-1)))
    assert model.router_loss > 0


def test_mor_update_adds_the_weighted_block_output_to_the_state():
    """One recursion at capacity 1 on a state of zeros after a block that returns its input: h' = h + g h."""
    model = mor(n_recur=2, router_alpha=0.5).train()
    h = torch.randn(2, 6, D)
    with torch.no_grad():
        for block in model.transformer.core:  # residual branches off: Block(h) = h
            block.attn.c_proj.weight.zero_(), block.attn.c_proj.bias.zero_()
            block.mlp.c_proj.weight.zero_(), block.mlp.c_proj.bias.zero_()
    g = 0.5 * torch.sigmoid(model.routers[0](h)).squeeze(-1)
    out = model.update_chosen(h, g, torch.arange(6).expand(2, 6), [None, None])
    torch.testing.assert_close(out, h * (1 + g[..., None]))


def test_mor_capacity_schedule_is_hierarchical():
    model = mor(n_recur=3).train()
    assert model.sample_depth(torch.Generator()) == 3  # every training pass runs all N_r recursions
    masks = record_routing(model)
    model(torch.randint(0, V, (4, 30)))
    assert [m.sum(dim=1).tolist() for m in masks] == [[30] * 4, [20] * 4, [10] * 4]
    for earlier, later in zip(masks, masks[1:]):
        assert not (later & ~earlier).any()  # a token dropped once stays dropped


@pytest.mark.parametrize('iteration', [0, 3, 9, 40, None])
def test_mor_capacity_warmup_follows_the_cosine(iteration):
    """capacity_warmup W: c_s(t) = c_s + (1 - c_s)(1 + cos(pi min(1, (t+1)/W)))/2, k = max(1, floor(c T));
    iteration None (never set) and eval use the targets."""
    model = mor(n_recur=3, capacity_warmup=10).train()
    model.set_iteration(iteration)
    masks = record_routing(model)
    model(torch.randint(0, V, (2, 30)))
    expected = []
    for s in range(3):
        c = (3 - s) / 3
        if iteration is not None:
            c += (1 - c) * 0.5 * (1 + math.cos(math.pi * min(1.0, (iteration + 1) / 10)))
        expected.append(max(1, math.floor(c * 30 + 1e-9)))
    assert [m.sum(dim=1).tolist() for m in masks] == [[k] * 2 for k in expected]
    if iteration in (40, None):
        assert expected == [30, 20, 10]
    if iteration == 0:
        assert expected[2] > 25  # starts near capacity 1
    model.eval()
    assert [model.capacity(s) for s in range(3)] == [1.0, 2 / 3, 1 / 3]


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
    """Recursion 0 (capacity 1) takes every token even where its auxiliary router says no; recursion 1
    takes a token where its auxiliary router says yes."""
    model = mor(n_recur=2).eval()
    idx = torch.randint(0, V, (2, 10))
    h0 = run(model.transformer.prelude, embed(model, idx))
    h = h0 + ALPHA * torch.sigmoid(model.routers[0](h0)) * run(model.transformer.core, h0)
    with torch.no_grad():
        model.aux_routers[0][-1].bias.fill_(-30.0)  # ignored: capacity 1
        model.aux_routers[1][-1].bias.fill_(-30.0)
    torch.testing.assert_close(logits_all(model, idx), head(model, run(model.transformer.coda, h)))
    assert model.last_keep_fractions == [1.0, 0.0]
    with torch.no_grad():
        model.aux_routers[1][-1].bias.fill_(30.0)
    h = h + ALPHA * torch.sigmoid(model.routers[1](h)) * run(model.transformer.core, h)
    torch.testing.assert_close(logits_all(model, idx), head(model, run(model.transformer.coda, h)))
    assert model.last_keep_fractions == [1.0, 1.0]


def test_mor_mixed_routing_differs_between_tokens_and_rows():
    """The fixture's routing is really mixed, so the causality and cache tests exercise selection."""
    model = mixed_routing(mor()).eval()
    masks = record_routing(model)
    model(torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(4)))
    kept = [m.float().mean().item() for m in masks]
    assert kept[0] == 1 and 0 < kept[1] < 1 and 0 < kept[2] < kept[1]
    assert model.last_keep_fractions == pytest.approx(kept)
    assert masks[1][0].sum() != masks[1][1].sum()  # rows keep different counts: the per-row path


def test_mor_eval_flops_from_keep_fractions():
    """eval_flops_per_token at the training fractions is flops_per_token; at the kept fractions of an
    eval pass whose rows keep equal counts it equals torch's count of that pass."""
    model = mor().eval()
    assert model.eval_flops_per_token(30, [1.0, 2 / 3, 1 / 3]) == model.flops_per_token(30)
    with torch.no_grad():
        model.aux_routers[1][-1].bias.fill_(30.0)  # all go on at recursion 1 ...
        model.aux_routers[2][-1].bias.fill_(-30.0)  # ... and none at recursion 2
    idx = torch.randint(0, V, (2, 30))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, targets=idx)
    assert model.last_keep_fractions == [1.0, 1.0, 0.0]
    counted = counter.get_total_flops() / idx.numel() - 2 * D * V
    assert counted == pytest.approx(model.eval_flops_per_token(30), rel=1e-9)
    assert model.flops_per_token(30) < model.eval_flops_per_token(30)


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
    compile_regions(model, backend='aot_eager')
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
