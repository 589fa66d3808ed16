"""Per-token early exit at inference (early_exit.py: EarlyExit, ExitingModel): threshold 0 and
None are the fixed depth, a huge threshold runs exactly min_steps, the cache (with its fill rule)
equals a written-out uncached forward under the same exit decisions, causality holds, and both
criteria match their written-out definitions. Tiny fp32 models on CPU, no timing."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import CHARS, scramble, tiny_model
from common import compile_regions
from early_exit import EarlyExit, ExitingModel
from registry import build_model

V = len(CHARS)


@pytest.fixture(scope='module', autouse=True)
def inference_without_autograd():
    """Every forward here is inference (one thread for every test: conftest.py)."""
    with torch.no_grad():
        yield


@pytest.fixture(scope='module')
def grt():
    """1 + 1x4 + 1, d 64, gate_bias 0: the state moves at every step, so depths vary with the threshold."""
    return tiny_model('grt')


@pytest.fixture(scope='module')
def grt2():
    """1 + 2x4 + 1 with larger weights: two core layers, so the fill is per layer."""
    return scramble(tiny_model('grt', n_core=2), std=0.2)


def tokens(B, T, seed=0):
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(seed))


# thresholds that give a mix of depths 1..4 on these models (checked in mixed_depths)
MIXED = {'state': 0.5, 'kl': 3e-3}
MIXED2 = {'state': 1.0, 'kl': 1.0}


def exiting(model, threshold, min_steps=1, exit='state'):
    return ExitingModel(model, EarlyExit(threshold, min_steps, exit))


def mixed_depths(depth):
    assert len(set(depth.flatten().tolist())) >= 2, f"the threshold no longer mixes depths: {depth.tolist()}"


# -----------------------------------------------------------------------------
# The fixed depth as limits


@pytest.mark.parametrize('exit, kv_mode', [('state', 'per_step'), ('kl', 'per_step'), ('state', 'mean')])
def test_threshold_zero_and_none_equal_full_depth(grt, exit, kv_mode):
    idx = tokens(2, 5)
    full = grt.generate(idx, 24, temperature=0, kv_mode=kv_mode)
    never = exiting(grt, 0, exit=exit)
    assert torch.equal(never.generate(idx, 24, temperature=0, kv_mode=kv_mode), full)
    assert (never.exit_steps == grt.config.n_recur).all()


def test_threshold_zero_equals_full_depth_logits(grt):
    """Bit for bit where the exit path runs the same passes ('state'; 'kl' decoding one token);
    'kl' runs a chunk one token at a time (body_token_by_token), equal up to rounding."""
    state, kl = exiting(grt, 0.0, exit='state'), exiting(grt, 0.0, exit='kl')
    idx = tokens(2, 20)
    full = grt(idx, targets=idx)[0]
    for cached in (False, True):
        cache = lambda: grt.new_kv_cache(20) if cached else None
        assert torch.equal(state(idx, targets=idx, kv_cache=cache())[0], full)
        logits = kl(idx, targets=idx, kv_cache=cache())[0]
        torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    cache, exit_cache = grt.new_kv_cache(21), grt.new_kv_cache(21)
    grt(idx, kv_cache=cache)
    grt(idx, kv_cache=exit_cache)  # the same prompt, then one token decoded with and without 'kl'
    assert torch.equal(kl(idx[:, :1], kv_cache=exit_cache)[0], grt(idx[:, :1], kv_cache=cache)[0])
    assert torch.equal(state.generate(idx[:, :3], 10, temperature=0, use_cache=False),
                       grt.generate(idx[:, :3], 10, temperature=0, use_cache=False))


@pytest.mark.parametrize('exit', ['state', 'kl'])
@pytest.mark.parametrize('min_steps', [1, 2, 3])
def test_huge_threshold_runs_exactly_min_steps(grt, exit, min_steps):
    """Every token stops after min_steps, so nothing reads the filled later steps: the same tokens
    as the fixed depth min_steps."""
    idx = tokens(2, 4)
    always = exiting(grt, 1e30, min_steps, exit)
    out = always.generate(idx, 10, temperature=0)
    assert (always.exit_steps == min_steps).all() and always.exit_stats['steps_run'] == min_steps
    assert torch.equal(out, grt.generate(idx, 10, temperature=0, num_steps=min_steps))


# -----------------------------------------------------------------------------
# Cached == uncached under the same exit decisions, with the fill rule written out


def attention(q, k, v):
    """Causal softmax(q k^T / sqrt(head_size)) v over (B, n_head, T, head_size)."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
    return F.softmax(att, dim=-1) @ v


def block_forward(block, x, fill=None):
    """A Block written out. fill(k, v) -> (k, v) may replace keys and values before attention.
    Returns the output and the (k, v) attention used."""
    B, T, C = x.shape
    H = block.attn.n_head
    q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
    if fill is not None:
        k, v = fill(k, v)
    y = attention(q, k, v).transpose(1, 2).reshape(B, T, C)
    x = x + block.attn.c_proj(y)
    return x + block.mlp(block.ln_2(x)), (k, v)


def reference_grt_with_exits(model, idx, depth):
    """Every position's logits when token (b, t) runs depth[b, t] recurrence steps of Eq. 2-5 and
    keeps h after, and a token that stopped after step d < s attends, and is attended to, at step s
    with the keys and values it computed at step d at the same core layer (the fill rule)."""
    c = model.config
    B, T = idx.shape
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T))
    for block in model.transformer.prelude:
        x = block_forward(block, x)[0]
    e = h = x
    computed = [[] for _ in model.transformer.core]  # computed[j][s - 1]: (k, v) of core layer j at step s
    for s in range(1, c.n_recur + 1):
        stopped = depth < s  # (B, T): tokens that stopped before step s

        def fill(k, v, j):
            k, v = k.clone(), v.clone()
            for b, t in stopped.nonzero().tolist():
                d = int(depth[b, t])
                k[b, :, t], v[b, :, t] = computed[j][d - 1][0][b, :, t], computed[j][d - 1][1][b, :, t]
            computed[j].append((k, v))
            return k, v

        o = model.W_proj(torch.cat([h, e], dim=-1))
        for j, block in enumerate(model.transformer.core):
            o = block_forward(block, o, lambda k, v, j=j: fill(k, v, j))[0]
        g = torch.sigmoid(model.f_g(torch.cat([model.ln_h(h), model.ln_e(e)], dim=-1)) / c.gate_tau)
        h = torch.where(stopped.unsqueeze(-1), h, g * h + (1 - g) * o)
    for block in model.transformer.coda:
        h = block_forward(block, h)[0]
    return model.lm_head(model.transformer.ln_f(h))


def decode_teacher_forced(model, idx, prompt_len, rule, kv_mode='per_step'):
    """Prefill idx[:, :prompt_len], then feed the rest one token at a time through the cache, as
    generation runs: (every position's logits, every token's depth)."""
    cache = model.new_kv_cache(idx.size(1), kv_mode=kv_mode)
    exiting_model = ExitingModel(model, rule)
    logits, depths = [], []
    for start, end in [(0, prompt_len)] + [(i, i + 1) for i in range(prompt_len, idx.size(1))]:
        logits.append(exiting_model(idx[:, start:end], targets=idx[:, start:end], kv_cache=cache)[0])
        depths.append(exiting_model.exit_steps)
    return torch.cat(logits, dim=1), torch.cat(depths, dim=1)


@pytest.mark.parametrize('exit', ['state', 'kl'])
@pytest.mark.parametrize('which', ['grt', 'grt2'])
def test_cached_equals_uncached_reference_under_same_exits(request, which, exit):
    model = request.getfixturevalue(which)
    idx = tokens(3, 20, seed=1)
    threshold = (MIXED if which == 'grt' else MIXED2)[exit]
    logits, depth = decode_teacher_forced(model, idx, 7, EarlyExit(threshold, 1, exit))
    mixed_depths(depth)
    with torch.no_grad():
        expected = reference_grt_with_exits(model, idx, depth)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # the model's own uncached forward takes the same decisions and gives the same logits
    uncached_model = exiting(model, threshold, 1, exit)
    uncached = uncached_model(idx, targets=idx)[0]
    assert torch.equal(uncached_model.exit_steps, depth)
    torch.testing.assert_close(uncached, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('in_order', [False, True])
def test_generation_cached_equals_uncached_with_exits(grt2, in_order):
    """Also past the block (64), where the cache is rebuilt on the last 64 tokens."""
    for exit, threshold in MIXED2.items():
        for idx in (tokens(2, 3, seed=2), tokens(2, 60, seed=2)):
            rule = EarlyExit(threshold, 1, exit, in_order)
            cached = ExitingModel(grt2, rule).generate(idx, 10, temperature=0)
            assert torch.equal(ExitingModel(grt2, rule).generate(idx, 10, temperature=0, use_cache=False), cached)


def test_batch_rows_exit_independently(grt2):
    """A row of a batch gets the depths and logits it gets alone (its own exits, its own fills)."""
    idx = tokens(3, 16, seed=3)
    rule = EarlyExit(MIXED2['state'], 1, 'state')
    logits, depth = decode_teacher_forced(grt2, idx, 5, rule)
    mixed_depths(depth)
    assert len({tuple(row) for row in depth.tolist()}) == 3  # rows stop at different steps
    for b in range(3):
        row_logits, row_depth = decode_teacher_forced(grt2, idx[b:b + 1], 5, rule)
        assert torch.equal(row_depth, depth[b:b + 1])
        torch.testing.assert_close(row_logits, logits[b:b + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('exit', ['state', 'kl'])
def test_causal_with_exits(grt2, exit):
    """Changing token t changes no earlier position's depth or logits, uncached and cached."""
    idx = tokens(2, 30, seed=4)
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % V
    rule = EarlyExit(MIXED2[exit], 1, exit)
    model = ExitingModel(grt2, rule)
    a, depth_a = model(idx, targets=idx)[0], model.exit_steps
    b, depth_b = model(changed, targets=changed)[0], model.exit_steps
    mixed_depths(depth_a)
    assert torch.equal(depth_a[:, :20], depth_b[:, :20])
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    c, depth_c = decode_teacher_forced(grt2, changed, 5, rule)
    assert torch.equal(depth_c[:, :20], depth_a[:, :20])
    torch.testing.assert_close(c[:, :20], a[:, :20], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('exit', ['state', 'kl'])
@pytest.mark.parametrize('min_steps', [1, 2])
def test_in_order_stops_a_token_first_where_its_criterion_allows_after_the_token_before(grt2, exit, min_steps):
    """in_order: depths never fall along a row. Token t stops where the plain rule with min_steps =
    max(min_steps, the depth of token t - 1) stops it, given the same earlier tokens; a prefilled chunk
    (held back within the chunk) equals the tokens decoded (held back across calls), and the
    written-out forward."""
    idx = tokens(2, 12, seed=5)
    rule = EarlyExit(MIXED2[exit], min_steps, exit, in_order=True)
    model = ExitingModel(grt2, rule)
    logits, depth = model(idx, targets=idx)[0], model.exit_steps
    mixed_depths(depth)
    assert (depth[:, 1:] >= depth[:, :-1]).all()
    plain = exiting(grt2, MIXED2[exit], min_steps, exit)
    plain(idx, targets=idx)
    assert not torch.equal(plain.exit_steps, depth)  # the plain rule stops some tokens before the one before
    for b in range(2):
        for t in range(1, 12):
            cache = grt2.new_kv_cache(12)
            ExitingModel(grt2, rule)(idx[b:b + 1, :t], kv_cache=cache)
            after = exiting(grt2, MIXED2[exit], max(min_steps, int(depth[b, t - 1])), exit)
            after(idx[b:b + 1, t:t + 1], kv_cache=cache)
            assert after.exit_steps.item() == depth[b, t]
    decoded, decoded_depth = decode_teacher_forced(grt2, idx, 5, rule)
    assert torch.equal(decoded_depth, depth)
    torch.testing.assert_close(decoded, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference_grt_with_exits(grt2, idx, depth), rtol=1e-4, atol=1e-4)


# -----------------------------------------------------------------------------
# The two criteria, written out (single-token sequences, so a token's exits touch no other token)


def threshold_in_gap(values):
    """A threshold halfway across the widest gap among the middle half of the sorted values, so
    rounding cannot move a value across it."""
    v = sorted(values)
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = max(range(lo, hi), key=lambda i: v[i + 1] - v[i])
    return (v[i] + v[i + 1]) / 2


def expected_depths(signals, threshold, min_steps, R):
    """The first s >= min_steps with c_s < threshold, else R. signals[s - 1]: c_s per token."""
    depth = []
    for b in range(signals[0].numel()):
        d = next((s for s in range(min_steps, R) if signals[s - 1][b] < threshold), R)
        depth.append(d)
    return torch.tensor(depth)


@pytest.mark.parametrize('min_steps', [1, 2])
def test_kl_criterion_written_out(grt2, min_steps):
    R = grt2.config.n_recur
    x = torch.arange(V).view(V, 1)  # every token, each a sequence of one
    with torch.no_grad():
        e = grt2.transformer.wte(x) + grt2.transformer.wpe(torch.zeros(1, dtype=torch.long))
        for block in grt2.transformer.prelude:
            e = block_forward(block, e)[0]
        h0 = e
        for block in grt2.transformer.coda:
            h0 = block_forward(block, h0)[0]
        log_p = [F.log_softmax(grt2.lm_head(grt2.transformer.ln_f(h0)), dim=-1)]  # p_0: exit before step 1
        log_p += [F.log_softmax(grt2(x, num_steps=s)[0], dim=-1) for s in range(1, R + 1)]
    # c_s = KL(p_(s-1) || p_s) = sum_v p_(s-1)(v) (log p_(s-1)(v) - log p_s(v))
    kl = [(log_p[s - 1].exp() * (log_p[s - 1] - log_p[s])).sum(dim=-1).flatten() for s in range(1, R + 1)]
    threshold = threshold_in_gap(torch.cat(kl[min_steps - 1:R - 1]).tolist())
    expected = expected_depths(kl, threshold, min_steps, R)
    mixed_depths(expected)
    model = exiting(grt2, threshold, min_steps, 'kl')
    logits = model(x)[0]
    assert torch.equal(model.exit_steps.flatten(), expected)
    for d in set(expected.tolist()):  # a token that stops after d steps predicts as the fixed depth d
        rows = expected == d
        torch.testing.assert_close(logits[rows], grt2(x[rows], num_steps=d)[0], rtol=1e-5, atol=1e-5)
    # probes: p_0 (min_steps 1 only), then p_s after each step s < R that ran (up to the deepest token's)
    assert model.exit_stats['probes'] == (min_steps == 1) + min(int(expected.max()), R - 1)


def test_state_criterion_written_out(grt2):
    R, c = grt2.config.n_recur, grt2.config
    x = torch.arange(V).view(V, 1)
    with torch.no_grad():
        e = grt2.transformer.wte(x) + grt2.transformer.wpe(torch.zeros(1, dtype=torch.long))
        for block in grt2.transformer.prelude:
            e = block_forward(block, e)[0]
        states = [e]  # h_0 = e
        for s in range(R):  # Eq. 2-5; one token attends only to itself
            h = states[-1]
            o = grt2.W_proj(torch.cat([h, e], dim=-1))
            for block in grt2.transformer.core:
                o = block_forward(block, o)[0]
            g = torch.sigmoid(grt2.f_g(torch.cat([grt2.ln_h(h), grt2.ln_e(e)], dim=-1)) / c.gate_tau)
            states.append(g * h + (1 - g) * o)
    # c_s = ||h_s - h_(s-1)|| / ||h_(s-1)||
    change = [((states[s] - states[s - 1]).norm(dim=-1) / states[s - 1].norm(dim=-1)).flatten() for s in range(1, R + 1)]
    threshold = threshold_in_gap(torch.cat(change[:R - 1]).tolist())
    expected = expected_depths(change, threshold, 1, R)
    mixed_depths(expected)
    model = exiting(grt2, threshold)
    model(x)
    assert torch.equal(model.exit_steps.flatten(), expected)


# -----------------------------------------------------------------------------
# Which models, which settings


def test_recurrent_baselines_exit_and_zero_threshold_is_full_depth():
    for model_type, fields in [('huginn', dict(n_recur=3)), ('rung1', dict(n_prelude=0, n_coda=0, n_recur=3)),
                               ('rung4', dict(n_recur=3))]:
        torch.manual_seed(0)
        model = build_model(model_type, vocab_size=V, block_size=32, n_embd=32, n_head=4, **fields).eval()
        idx = tokens(2, 4)
        full = model.generate(idx, 8, temperature=0)
        for exit in ('state', 'kl'):
            assert torch.equal(exiting(model, 0, exit=exit).generate(idx, 8, temperature=0), full)
            always = exiting(model, 1e30, 2, exit)
            always.generate(idx, 8, temperature=0)
            assert (always.exit_steps == 2).all()


@pytest.mark.parametrize('model_type', ['grt', 'rung4'])
def test_compiled_decoding_with_exits_equals_eager(model_type):
    """compile_regions as bench.py decodes (dynamic shapes; Dynamo alone, no code generation, so it is
    fast): the same tokens as eager with early exit by either criterion, the one-block core traced into
    the compiled step together with the KV caches. The GRT, and rung 4, whose step takes e beside h:
    these settings crashed torch 2.13's guard code for it while its h0 was e itself."""
    ends = dict(n_prelude=0, n_coda=0) if model_type == 'rung1' else {}
    torch.manual_seed(0)
    eager = build_model(model_type, vocab_size=V, block_size=32, n_embd=32, n_head=2, n_core=1, n_recur=3,
                        **ends).eval()
    compiled = build_model(model_type, vocab_size=V, block_size=32, n_embd=32, n_head=2, n_core=1, n_recur=3,
                           **ends).eval()
    compiled.load_state_dict(eager.state_dict())
    torch.compiler.reset()
    compile_regions(compiled, dynamic=True, backend='eager')
    idx = tokens(2, 5, seed=1)
    for exit, threshold in (('state', 1.0), ('kl', 0.01)):
        assert torch.equal(exiting(compiled, threshold, exit=exit).generate(idx, 8, temperature=0),
                           exiting(eager, threshold, exit=exit).generate(idx, 8, temperature=0))


def test_exit_refused_where_it_does_not_apply(grt):
    idx = tokens(1, 4)
    with pytest.raises(ValueError, match="mor's routers"):
        exiting(build_model('mor', vocab_size=V, block_size=32, n_embd=32, n_head=4).eval(), 0.1).generate(idx, 2)
    with pytest.raises(ValueError, match='dense GPT has no loop'):
        exiting(tiny_model('gpt'), 0.1).generate(idx, 2)
    with pytest.raises(ValueError, match='min_steps=5 exceeds'):
        exiting(grt, 0.1, min_steps=5).generate(idx, 2)
    with pytest.raises(ValueError, match='exit must be one of'):
        exiting(grt, 0.1, exit='entropy')
    with pytest.raises(ValueError, match='exit_threshold must be a number'):
        exiting(grt, -1)
    with pytest.raises(ValueError, match="use kv_mode='per_step' or exit='state'"):
        exiting(grt, 0.1, exit='kl').generate(idx, 2, kv_mode='mean')
    with pytest.raises(ValueError, match='min_steps must be an integer'):
        exiting(grt, 0.1, min_steps=0)
    with pytest.raises(ValueError, match='in_order must be True or False'):
        EarlyExit(0.1, in_order=1)
    cache = grt.new_kv_cache(8)
    exiting(grt, 0.1)(idx, kv_cache=cache)
    with pytest.raises(ValueError, match='continue only the cache this ExitingModel filled last'):
        ExitingModel(grt, EarlyExit(0.1, in_order=True))(idx[:, :1], kv_cache=cache)
    in_order, cache = ExitingModel(grt, EarlyExit(0.1, in_order=True)), grt.new_kv_cache(8)
    in_order(idx[:, :2], kv_cache=cache)
    grt(idx[:, 2:3], kv_cache=cache)  # another forward moves the cache on: the depth before is unknown
    with pytest.raises(ValueError, match='as it left it'):
        in_order(idx[:, 3:], kv_cache=cache)
    grt.train()
    try:
        with pytest.raises(ValueError, match='early exit is for inference'):
            exiting(grt, 0.1)(idx)
    finally:
        grt.eval()

