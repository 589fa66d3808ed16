"""
The GPT-2 baseline and the Gated Recurrent Transformer (GRT), side by side.

Both are built from one pre-LN Block. GPT stacks n_layer unique blocks. GRT runs a prelude of unique
blocks, then one shared core of blocks R times under a gated update, then a coda of unique blocks:

    e = Prelude(wte(x) + wpe(pos));  h = e
    repeat r times:  u = W_proj [h + eps_x ; e]                         (Eq. 2)
                     o = Core(u)                                         (Eq. 3)
                     g = sigmoid(f_g([LN(h) ; LN(e)]) / tau + eps_g)     (Eq. 5)
                     h = g * h + (1 - g) * o                             (Eq. 4)
    logits = lm_head(ln_f(Coda(h)))

Read top to bottom: the configs, the Block, LanguageModel (embeddings, tied head, loss, generation),
RecurrentLM (prelude -> core loop -> coda), GRT (Eq. 2-5 in GRT.recurrence_step) and GPT. After
nanoGPT (Karpathy) for the GPT-2 side, and the GRT paper for the recurrence.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import KV_MODES, KVCache, recurrent_kv_cache

# -----------------------------------------------------------------------------
# Configurations

@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2 has them
    gelu_approximate: str = 'none'  # exact GELU, as nanoGPT; 'tanh': GPT-2's own (from_pretrained)
    attn_window: int = 0  # w > 0: a token attends to itself and the w - 1 tokens before it (local); 0: to all
    position: str = 'learned'  # 'learned': GPT-2's position embedding wpe; 'none': no positions; 'alibi': relative

    def __post_init__(self):
        check(min(self.block_size, self.vocab_size, self.n_head, self.n_embd) >= 1,
              "block_size, vocab_size, n_head and n_embd must be >= 1")
        check(self.n_embd % self.n_head == 0,
              f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): pick one of its divisors")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.attn_window >= 0, f"attn_window must be >= 0 (0: every earlier token), got {self.attn_window}")
        check(self.position in ('learned', 'none', 'alibi'),
              f"position must be 'learned', 'none' or 'alibi', got {self.position!r}")
        check(self.gelu_approximate in ('none', 'tanh'),
              f"gelu_approximate must be 'none' (exact GELU) or 'tanh', got {self.gelu_approximate!r}")


@dataclass
class RecurrentConfig(GPTConfig):
    """A recurrent-depth layout, written n_prelude + n_core x n_recur + n_coda."""
    n_layer: int = None  # derived: n_prelude + n_core + n_coda unique blocks
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    n_recur: int = 10  # R: recurrence steps at eval
    # the training choices (docs/analysis.md, docs/depth.md); the defaults are the paper's
    train_depth: str = 'uniform'  # r in training: 'uniform' on 1..R, 'fixed' at R, 'heavy' (Huginn's, mean R + 1)
    backprop_depth: int = None  # k: gradients through only the last k steps (truncated backprop); None: all
    init_state: str = 'e'  # h0: 'e' (the prelude output) or 'random' (training: TruncNormal(0, 0.02^2); eval: 0)

    def __post_init__(self):
        super().__post_init__()
        check(self.n_core >= 1 and self.n_recur >= 1, "n_core and n_recur (R) must be >= 1")
        check(self.train_depth in ('uniform', 'fixed', 'heavy'), "train_depth must be 'uniform', 'fixed' or 'heavy'")
        check(self.backprop_depth is None or self.backprop_depth >= 1, "backprop_depth must be >= 1 (None: all)")
        check(self.init_state in ('e', 'random'), "init_state must be 'e' or 'random'")
        check(self.n_prelude >= 0 and self.n_coda >= 0, "n_prelude and n_coda must be >= 0")
        unique = self.n_prelude + self.n_core + self.n_coda
        check(self.n_layer in (None, unique),
              f"n_layer={self.n_layer} is not n_prelude + n_core + n_coda = {unique}; leave it out (derived)")
        self.n_layer = unique


@dataclass
class GRTConfig(RecurrentConfig):
    state_noise: float = 0.1  # std of eps_x, Eq. 2
    gate_noise: float = 0.1  # std of eps_g, Eq. 5
    gate_bias: float = 4.0  # initial bias of f_g's last Linear: g ~ sigmoid(4) = 0.98 keeps h at first
    gate_tau: float = 1.0  # temperature tau of Eq. 5

    def __post_init__(self):
        super().__post_init__()
        check(self.gate_tau > 0, f"gate_tau must be > 0, got {self.gate_tau}")
        check(min(self.state_noise, self.gate_noise) >= 0, "state_noise and gate_noise are std's, >= 0")


def check(condition, message):
    if not condition:
        raise ValueError(message)


# -----------------------------------------------------------------------------
# The building blocks every model shares

class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v of all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)  # output projection
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.window = config.attn_window
        # ALiBi (Press et al., 2022): head h's scores fall by slope_h per token of distance, slopes 2^(-8h/n_head)
        slopes = 2.0 ** (-8.0 * torch.arange(1, config.n_head + 1) / config.n_head)
        self.register_buffer('alibi_slopes', slopes if config.position == 'alibi' else None, persistent=False)

    def forward(self, x, cache=None):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        past = 0 if cache is None else cache.length  # earlier tokens, whose keys and values are cached
        if cache is not None:
            k, v = cache.update(k, v)  # (B, nh, past + T, hs)
        dropout_p = self.dropout if self.training else 0.0
        # causal self-attention; (B, nh, T, hs) x (B, nh, hs, past + T) -> (B, nh, T, past + T)
        if past == 0 and not self.window and self.alibi_slopes is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:  # new token t, at position past + t, sees the keys up to itself: all, or the last `window`
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            if self.window:  # and none before position past + t - window + 1
                mask = mask.triu(diagonal=past - self.window + 1)
            if self.alibi_slopes is not None:  # the mask becomes a bias: -slope_h * (query's - key's position)
                distance = torch.arange(past, past + T, device=x.device)[:, None] - torch.arange(past + T, device=x.device)
                bias = -self.alibi_slopes.view(-1, 1, 1) * distance
                mask = bias.to(q.dtype).masked_fill(~mask, float('-inf'))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        x = x + self.mlp(self.ln_2(x))
        return x


def run_blocks(blocks, x, caches):
    for block, cache in zip(blocks, caches):
        x = block(x, cache)
    return x


# -----------------------------------------------------------------------------
# What every language model here shares: embeddings, tied head, loss, init, generation

class LanguageModel(nn.Module):
    """Token and position embeddings -> body (the subclass's) -> ln_f -> tied LM head."""

    kv_modes = ('per_step',)  # the KV-cache modes generate() accepts (a recurrent model has more)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.position == 'learned' else None,
            drop=nn.Dropout(config.dropout),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def _finish_init(self, residual_depth):
        """Tie the head, then GPT-2's init: N(0, 0.02), and the residual projections scaled by
        1/sqrt(2 * depth), so the residual stream's variance stays bounded over depth blocks."""
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * residual_depth))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding=True):
        """Unique parameters (the tied head once); non_embedding leaves out both embedding tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for table in (self.transformer.wte, self.transformer.wpe) if table is not None
                     for p in table.parameters())
        return n

    def forward(self, idx, targets=None, num_steps=None, kv_cache=None):
        """idx (B, T) -> (logits, loss): with targets, every position's logits and the loss (target -1 is
        ignored); without, the last position's. kv_cache holds earlier tokens, idx the tokens after them;
        num_steps is a recurrent model's depth r."""
        x = self.embed(idx, kv_cache)
        x = self.body(x, num_steps, kv_cache)
        return self.head(x, targets)

    def embed(self, idx, kv_cache=None):
        start = kv_cache[0].length if kv_cache else 0  # the cached tokens come first
        end = start + idx.size(1)
        check(end <= self.config.block_size, f"sequence of {end} tokens exceeds block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.transformer.wpe is not None:  # 'none', 'alibi': no wpe, order from the mask
            x = x + self.transformer.wpe(torch.arange(start, end, dtype=torch.long, device=idx.device))
        return self.transformer.drop(x)

    def head(self, x, targets=None):
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: only the last position's logits, the list [-1] keeps the time dim
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None, use_cache=True,
                 kv_mode='per_step'):
        """Append max_new_tokens sampled tokens to idx (B, T); temperature 0 is greedy."""
        new = self.generate_tokens(idx, max_new_tokens, temperature, top_k, num_steps, use_cache, kv_mode)
        return torch.cat([idx, *new], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None,
                        use_cache=True, kv_mode='per_step', forward=None):
        """Yield max_new_tokens sampled tokens after idx (B, T), each (B, 1). With the cache the prompt is
        prefilled in one pass, then each token costs one position's pass; a context past block_size is
        cropped to its last block_size tokens and the cache rebuilt. forward: what runs the model (self;
        early_exit.ExitingModel passes itself)."""
        if not use_cache and kv_mode != 'per_step':
            raise ValueError(f"kv_mode={kv_mode!r} is a KV-cache approximation; it needs use_cache=True")
        forward = forward or self
        block_size, kv_cache = self.config.block_size, None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = forward(idx[:, -block_size:], num_steps=num_steps)
            elif kv_cache is not None and kv_cache[0].length < block_size:
                logits, _ = forward(idx[:, -1:], num_steps=num_steps, kv_cache=kv_cache)
            else:  # the first token, or the window is full and slides: (re)build the cache
                context = idx[:, -block_size:]
                max_len = min(block_size, context.size(1) + max_new_tokens)
                kv_cache = self.new_kv_cache(max_len, num_steps, kv_mode)
                logits, _ = forward(context, num_steps=num_steps, kv_cache=kv_cache)
            token = sample_next(logits[:, -1, :], temperature, top_k)
            idx = torch.cat((idx, token), dim=1)
            yield token

    def sample_depth(self, generator):
        return None  # the depth of a training micro-step (train.py's keyed generator): none for a dense model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on matrices (Linears and embeddings), none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
                  {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
        fused = device_type in ('cuda', 'cpu')  # one kernel for all parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)


# -----------------------------------------------------------------------------
# Recurrent depth: the loop GRT and the baselines share

class RecurrentLM(LanguageModel):
    """Prelude -> r steps of one shared core -> coda. A subclass says what one step does
    (recurrence_step) and what it costs beyond the core's blocks (step_flops)."""

    kv_modes = KV_MODES

    def __init__(self, config):
        super().__init__(config)
        self.transformer.prelude = nn.ModuleList([Block(config) for _ in range(config.n_prelude)])
        self.transformer.core = nn.ModuleList([Block(config) for _ in range(config.n_core)])
        self.transformer.coda = nn.ModuleList([Block(config) for _ in range(config.n_coda)])

    def _finish_init(self):
        """The residual scaling counts the block passes at depth R: each core pass adds again."""
        super()._finish_init(residual_depth=self.num_block_passes(self.config.n_recur))

    def resolve_steps(self, num_steps):
        """r: num_steps if given, else a draw in training (from torch's global generator) and R in eval."""
        if num_steps is None:
            return self.sample_depth(None) if self.training else self.config.n_recur
        check(int(num_steps) == num_steps and num_steps >= 1,
              f"num_steps must be an integer >= 1 (trained with R = {self.config.n_recur}), got {num_steps}")
        return int(num_steps)

    def sample_depth(self, generator):
        """Training's r: Uniform{1..R} trains every exit (the paper); or R; or Huginn's heavy tail."""
        c = self.config
        if c.train_depth == 'heavy':
            return int(heavy_tailed_depths(c.n_recur, 1, generator).item())
        if c.train_depth == 'fixed':
            return c.n_recur
        return int(torch.randint(1, c.n_recur + 1, (), generator=generator).item())

    def mean_train_steps(self):
        """E[r] in training, for training FLOPs and MFU ('heavy': from 65536 seeded draws)."""
        c = self.config
        if c.train_depth == 'heavy':
            return heavy_tailed_depths(c.n_recur, 65536, torch.Generator().manual_seed(0)).float().mean().item()
        return c.n_recur if c.train_depth == 'fixed' else (c.n_recur + 1) / 2

    def num_block_passes(self, r):
        return self.config.n_prelude + self.config.n_core * r + self.config.n_coda

    def new_kv_cache(self, max_len, num_steps=None, kv_mode='per_step'):
        c = self.config
        r = self.resolve_steps(c.n_recur if num_steps is None else num_steps)
        return recurrent_kv_cache(max_len, c.n_prelude, c.n_core, c.n_coda, r, kv_mode)

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token, LM head excluded: 24 d^2 + 4 S d a block pass, step_flops a step;
        num_steps defaults to R, and may be a mean (e.g. (R + 1) / 2 in training)."""
        c, d = self.config, self.config.n_embd
        r = c.n_recur if num_steps is None else num_steps
        return self.num_block_passes(r) * (24 * d * d + 4 * seq_len * d) + self.step_flops() * r

    def step_flops(self):
        return 0  # FLOPs per token of one step beyond its core blocks

    def initial_state(self, e):
        if self.config.init_state == 'random':  # Huginn's h0: TruncNormal(0, 0.02^2), its mean 0 in eval
            return nn.init.trunc_normal_(torch.empty_like(e), std=0.02, a=-0.06, b=0.06) if self.training else 0 * e
        return e.clone()  # h0 = e; a copy, so a compiled step never sees h and e as one tensor

    def before_coda(self, h):
        return h  # what the coda reads (Huginn normalises it first)

    def run_core(self, x, caches):
        """The shared core: n_core blocks, the same weights at every step. Autocast may make x (a
        Linear's output) bf16; the core adds its residuals in the fp32 stream like every other block."""
        return run_blocks(self.transformer.core, x.to(self.transformer.wte.weight.dtype), caches)

    def noise(self, like, std):
        """N(0, std^2) shaped like `like` in training, 0 in eval."""
        return torch.empty_like(like).normal_(0.0, std) if self.training else 0.0

    def body(self, x, num_steps=None, kv_cache=None):
        """After the embeddings: e = Prelude(x), h = initial_state(e) (e by default), r steps, Coda(h)."""
        r = self.resolve_steps(num_steps)  # training: drawn by sample_depth (the paper: U{1..R}); eval: R
        caches = kv_cache or [None] * self.num_block_passes(r)  # prelude, core layer j at step s, coda
        check(len(caches) == self.num_block_passes(r),
              f"kv_cache was made for another depth: build it with new_kv_cache(max_len, {r})")
        p, core = self.config.n_prelude, self.config.n_core * r
        e = run_blocks(self.transformer.prelude, x, caches[:p])
        h = self.recur(self.initial_state(e), e, r, caches[p:p + core])
        return run_blocks(self.transformer.coda, self.before_coda(h), caches[p + core:])

    def recur(self, h, e, r, caches):
        """r recurrence steps from the state h; e, the prelude output, is re-read at every step."""
        n, k = self.config.n_core, self.config.backprop_depth
        steps_without_grad = max(r - k, 0) if self.training and k else 0  # truncated backprop: last k steps only
        for step in range(r):
            with torch.set_grad_enabled(torch.is_grad_enabled() and step >= steps_without_grad):
                h = self.recurrence_step(h, e, caches[step * n:(step + 1) * n])
        return h


# -----------------------------------------------------------------------------
# The Gated Recurrent Transformer

class GRT(RecurrentLM):
    """The paper's gated recurrence: W_proj re-injects the prelude output e into the noisy state, the
    shared core transforms it, and a gate keeps or rewrites the state per token and channel."""

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        self.W_proj = nn.Linear(2 * d, d, bias=config.bias)  # Eq. 2
        self.ln_h = nn.LayerNorm(d, bias=config.bias)  # Eq. 5's LN(h) and LN(e)
        self.ln_e = nn.LayerNorm(d, bias=config.bias)
        self.gate_in = nn.Linear(2 * d, d, bias=config.bias)  # f_g of Eq. 5: gate_in -> SiLU -> gate_out
        self.gate_out = nn.Linear(d, d)
        self._finish_init()
        nn.init.constant_(self.gate_out.bias, config.gate_bias)  # the paper's +4: g starts near 1, keeping h

    def recurrence_step(self, h, e, caches):
        c = self.config
        eps_x, eps_g = self.noise(h, c.state_noise), self.noise(h, c.gate_noise)  # fresh each step; 0 in eval
        u = self.W_proj(torch.cat([h + eps_x, e], dim=-1))  # Eq. 2
        o = self.run_core(u, caches)  # Eq. 3: the same core weights at every step
        g = torch.sigmoid(self.f_g(torch.cat([self.ln_h(h), self.ln_e(e)], dim=-1)) / c.gate_tau + eps_g)  # Eq. 5
        return g * h + (1 - g) * o  # Eq. 4

    def f_g(self, x):
        return self.gate_out(F.silu(self.gate_in(x)))

    def step_flops(self):
        return 10 * self.config.n_embd ** 2  # W_proj (2 * 2d^2) and f_g (2 * 3d^2) a token and step


# -----------------------------------------------------------------------------
# GPT-2, the dense baseline

class GPT(LanguageModel):

    def __init__(self, config):
        super().__init__(config)
        self.transformer.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self._finish_init(residual_depth=config.n_layer)

    def body(self, x, num_steps=None, kv_cache=None):
        """n_layer unique blocks (num_steps is ignored: a dense model has no recurrence)."""
        return run_blocks(self.transformer.h, x, kv_cache or [None] * self.config.n_layer)

    def new_kv_cache(self, max_len, num_steps=None, kv_mode='per_step'):
        check(kv_mode == 'per_step', f"kv_mode={kv_mode!r} is for a GRT's core; a GPT has only 'per_step'")
        return [KVCache(max_len) for _ in self.transformer.h]

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token, LM head excluded: a layer's weights 24 d^2, its attention 4 S d."""
        d = self.config.n_embd
        return self.config.n_layer * (24 * d * d + 4 * seq_len * d)


# -----------------------------------------------------------------------------
# Helpers

def sample_next(logits, temperature=1.0, top_k=None):
    """Draw one token per row from (B, vocab) logits; temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


def heavy_tailed_depths(mean, count, generator=None, sigma=0.5):
    """count depths r = Poisson(tau) + 1, tau ~ LogNormal(log mean - sigma^2 / 2, sigma): Huginn's
    'poisson-lognormal-filling' (Geiping et al., 2025). tau has the given mean and a heavy right tail."""
    tau = torch.empty(count).log_normal_(math.log(mean) - sigma ** 2 / 2, sigma, generator=generator)
    return (torch.poisson(tau, generator=generator) + 1).long()
