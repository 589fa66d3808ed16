"""The contract every registered model keeps (registry.MODELS: the dense GPT, the GRT, the baselines
and the ablation ladder), at tiny sizes on CPU: shapes, causality, cached == uncached, eval
determinism, and forward FLOPs counted by torch against the model's own flops_per_token."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from registry import MODELS, build_model

V, S, D = 50, 32, 32
LAYOUT = dict(n_prelude=1, n_core=2, n_coda=1, n_recur=3)
FIELDS = {  # a small model of each type; every recurrent one runs 3 steps at eval
    'gpt': dict(n_layer=3),
    'grt': LAYOUT,
    'huginn': dict(LAYOUT, backprop_depth=2),
    'mor': dict(LAYOUT, router_hidden=16),
    'rung1': dict(n_prelude=0, n_core=2, n_coda=0, n_recur=3),
    'rung2': LAYOUT,
    'rung3': LAYOUT,
    'rung4': LAYOUT,
    'grt_no_e': LAYOUT,
}


def make(model_type):
    torch.manual_seed(0)
    model = build_model(model_type, vocab_size=V, block_size=S, n_embd=D, n_head=4, **FIELDS[model_type])
    torch.manual_seed(1)
    with torch.no_grad():  # weights large enough that greedy decoding does not just repeat one token
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.startswith('aux_routers'):
                p.normal_(0.0, 0.5)
        if model_type == 'mor':  # auxiliary routers that keep some tokens and drop others
            for aux in model.aux_routers:
                aux[-1].weight.normal_(0.0, 2.0)
    return model.eval()


def logits_all(model, idx, **kwargs):
    return model(idx, targets=torch.zeros_like(idx), **kwargs)[0]


def test_every_model_type_is_covered():
    assert set(FIELDS) == set(MODELS)


@pytest.fixture(params=list(MODELS))
def model(request):
    return make(request.param)


def test_output_shapes(model):
    idx = torch.randint(0, V, (3, 17))
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (3, 17, V) and loss.dim() == 0
    logits, loss = model(idx)
    assert logits.shape == (3, 1, V) and loss is None


def test_causality(model):
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % V
    a, b = logits_all(model, idx), logits_all(model, changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-3)


@pytest.mark.parametrize('prompt_len', [1, 7])
def test_cached_logits_equal_uncached(model, prompt_len):
    """Prefill a prompt, then decode one token at a time: every position's logits equal the full forward's."""
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(4))
    full = logits_all(model, idx)
    cache = model.new_kv_cache(16)
    steps = [logits_all(model, idx[:, :prompt_len], kv_cache=cache)]
    for t in range(prompt_len, 16):
        steps.append(model(idx[:, t:t + 1], kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_greedy_generation_cached_equals_uncached(model):
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(5))
    cached = model.generate(prompt, 40, temperature=0)  # past block_size: the window slides
    uncached = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, 5:].flatten().tolist())) > 2  # not one repeated token


def test_eval_is_deterministic(model):
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(6))
    first = logits_all(model, idx)
    model.train()
    logits_all(model, idx)  # a training pass in between (noise, depth draws) changes nothing after
    model.eval()
    torch.testing.assert_close(logits_all(model, idx), first, rtol=0, atol=0)


def counted_forward_flops(model, idx):
    """FLOPs torch counts in one forward pass, per token, less the LM head (at every position). The
    math attention kernel is plain matmuls (4 T^2 d per layer: Q K^T and A V), which the counter sees."""
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, targets=idx)
    return counter.get_total_flops() / idx.numel() - 2 * D * V


def test_flops_per_token_matches_counted_matmuls(model):
    if type(model).__name__ == 'MoR':
        model.train()  # expert choice keeps exactly the capacity schedule (T divisible by N_r)
    idx = torch.randint(0, V, (2, 30))
    expected = model.flops_per_token(30)
    assert counted_forward_flops(model, idx) == pytest.approx(expected, rel=1e-9)


def test_under_autocast_every_block_keeps_the_residual_stream_in_fp32(model):
    """bf16 autocast computes the matmuls in bf16 but leaves the residual stream in the embeddings'
    fp32, as for the dense GPT: a block whose input is a Linear's output (the GRT's W_proj, Huginn's
    adapter) would otherwise add its residuals in bf16, over every core block at every step."""
    from model import Block
    dtypes = set()
    for block in (m for m in model.modules() if isinstance(m, Block)):
        block.register_forward_hook(lambda block, args, out: dtypes.update({args[0].dtype, out.dtype}))
    idx = torch.randint(0, V, (2, S))
    model.train()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        model(idx, targets=idx)
    assert dtypes == {torch.float32}


# -----------------------------------------------------------------------------
# The attention's masks: a window (local attention) and ALiBi's relative bias


@pytest.mark.parametrize('window, position', [(0, 'learned'), (2, 'none'), (5, 'learned'), (0, 'alibi'), (3, 'alibi')])
def test_attention_equals_an_explicit_softmax(window, position):
    """CausalSelfAttention against scores written out: q.k / sqrt(hs), minus slope_h * (i - j) under ALiBi
    (slopes 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads), over the keys j <= i with i - j < window."""
    from model import CausalSelfAttention, GPTConfig
    torch.manual_seed(0)
    attention = CausalSelfAttention(GPTConfig(n_embd=D, n_head=4, attn_window=window, position=position)).eval()
    x = torch.randn(2, 9, D)
    q, k, v = (t.view(2, 9, 4, D // 4).transpose(1, 2) for t in attention.c_attn(x).split(D, dim=2))
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    scores = q @ k.transpose(-1, -2) / (D // 4) ** 0.5
    if position == 'alibi':
        scores = scores - torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]).view(4, 1, 1) * (i - j)
    seen = (j <= i) & ((i - j < window) if window else True)
    y = (scores.masked_fill(~seen, float('-inf')).softmax(-1) @ v).transpose(1, 2).reshape(2, 9, D)
    torch.testing.assert_close(attention(x), attention.c_proj(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('fields', [dict(attn_window=2), dict(position='alibi'), dict(attn_window=3, position='alibi')])
@pytest.mark.parametrize('model_type', ['gpt', 'grt'])
def test_local_and_alibi_attention_cached_equal_uncached(model_type, fields):
    """With a window or ALiBi, decoding from the cache gives the full forward's logits, and greedy
    generation past block_size (the cache rebuilt as the context slides) the uncached tokens."""
    torch.manual_seed(0)
    model = build_model(model_type, vocab_size=V, block_size=S, n_embd=D, n_head=4, **FIELDS[model_type], **fields)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    model.eval()
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(4))
    cache = model.new_kv_cache(16)
    steps = [logits_all(model, idx[:, :5], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache)[0]
                                                             for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), logits_all(model, idx), rtol=1e-4, atol=1e-4)
    cached = model.generate(idx[:, :5], 40, temperature=0)
    assert torch.equal(cached, model.generate(idx[:, :5], 40, temperature=0, use_cache=False))
    if fields.get('position') == 'alibi':
        assert model.transformer.wpe is None and not any('alibi' in k for k in model.state_dict())
