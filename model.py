"""
The GPT-2 baseline and the Gated Recurrent Transformer (GRT), side by side.

Both models are built from the same Block (pre-LN attention + MLP). GPT stacks n_layer unique
blocks. GRT runs a prelude of unique blocks, then one shared core of blocks R times under a gated
update (the paper's Eq. 2-5, all in GRT.recurrence_step), then a coda of unique blocks:

    e = Prelude(wte(x) + wpe(pos));  h = e
    repeat r times:  u = W_proj [h + eps_x ; e]                         (Eq. 2)
                     o = Core(u)                                         (Eq. 3)
                     g = sigmoid(f_g([LN(h) ; LN(e)]) / tau + eps_g)     (Eq. 5)
                     h = g * h + (1 - g) * o                             (Eq. 4)
    logits = lm_head(ln_f(Coda(h)))

References: nanoGPT (Karpathy) for the GPT-2 side; the GRT paper for the recurrence.
"""

import inspect
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    def __post_init__(self):
        for name in ('block_size', 'vocab_size', 'n_head', 'n_embd'):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                             f"pick n_head from the divisors of n_embd")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass
class GRTConfig(GPTConfig):
    n_layer: int = None  # derived: n_prelude + n_core + n_coda unique blocks
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    n_recur: int = 10  # R: recurrence steps at eval; training samples r ~ Uniform{1..R}
    state_noise: float = 0.1  # std of eps_x, Eq. 2
    gate_noise: float = 0.1  # std of eps_g, Eq. 5
    gate_bias: float = 4.0  # initial bias of f_g's last Linear: g ~ sigmoid(4) = 0.98 keeps h at first
    gate_tau: float = 1.0  # temperature tau of Eq. 5
    # The paper's ablation ladder; each rung adds one part of GRT (see GRT.recurrence_step):
    # 1 recurrence alone (no prelude/coda), 2 + prelude/coda split, 3 + state noise,
    # 4 + prelude re-injection W_proj, 5 + gate = full GRT (Eq. 2-5)
    rung: int = 5

    def __post_init__(self):
        super().__post_init__()
        if self.n_core < 1:
            raise ValueError(f"n_core must be >= 1 (the shared core is the recurrence), got {self.n_core}")
        if self.n_prelude < 0 or self.n_coda < 0:
            raise ValueError(f"n_prelude and n_coda must be >= 0, got {self.n_prelude} and {self.n_coda}")
        if self.n_recur < 1:
            raise ValueError(f"n_recur (R) must be >= 1, got {self.n_recur}")
        if self.gate_tau <= 0:
            raise ValueError(f"gate_tau must be > 0, got {self.gate_tau}")
        if self.rung not in (1, 2, 3, 4, 5):
            raise ValueError(f"rung must be 1..5 (5 = full GRT; lower rungs are the ablation ladder), got {self.rung}")
        if self.rung == 1 and (self.n_prelude or self.n_coda):
            raise ValueError("rung 1 is recurrence alone: set n_prelude=0 and n_coda=0 (every layer in the shared core)")
        unique = self.n_prelude + self.n_core + self.n_coda
        if self.n_layer is not None and self.n_layer != unique:
            raise ValueError(f"n_layer={self.n_layer} conflicts with n_prelude + n_core + n_coda = {unique}; "
                             f"leave n_layer out, it is derived")
        self.n_layer = unique


def config_fields(config_class):
    """The names a config class accepts (used by the scripts to validate model arguments)."""
    return [f.name for f in fields(config_class)]


# -----------------------------------------------------------------------------
# The shared building blocks


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer at one depth.

    The buffer is allocated once for max_len tokens on first use, so decoding never reallocates
    (and peak memory is the cache plus activations, not a growing chain of concatenations).
    """

    def __init__(self, max_len):
        self.max_len = max_len
        self.k = self.v = None
        self.length = 0

    def update(self, k, v):
        """Append k, v of shape (B, n_head, T, head_size); return all keys and values so far."""
        if self.k is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k = k.new_empty(shape)
            self.v = v.new_empty(shape)
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; cannot append up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


# How a GRT caches the keys and values of its shared core across the R recurrence steps
# (prelude and coda layers always keep one exact KVCache each, and a GPT only has per_step):
KV_MODES = ('per_step', 'shared', 'mean')


class CoreLayerCache:
    """One core layer's keys and values for all R steps in one buffer: kv_mode 'shared' or 'mean'.

    For a chunk of T new tokens (T = 1 when decoding, T = the prompt when prefilling), at step
    s = 1..R the chunk's queries attend to
      - every earlier token's stored k, v: its step-R k, v ('shared') or its mean over the R
        steps ('mean'), and
      - the chunk's own step-s k, v, causally (so a chunk is computed exactly within itself:
        prefilling a prompt into an empty cache equals the uncached forward).
    After the chunk's last step its stored entries become its step-R k, v ('shared') or its
    k, v averaged over steps 1..R ('mean'). Memory: one step's cache instead of R steps'.

    The chunk's step-s k, v are written into the slots after the stored tokens, so attention is
    one slice of one buffer (no concatenation); the next step overwrites them. In 'mean' mode the
    slots still hold step R when the chunk's forward ends (its own attention at step R needs them),
    so the mean is written in at the start of the next chunk, before anything reads it.
    """

    def __init__(self, max_len, num_steps, mode):
        assert mode in ('shared', 'mean')
        self.max_len, self.num_steps, self.mode = max_len, num_steps, mode
        self.k = self.v = None
        self.length = 0  # tokens whose stored k, v are final (including a pending mean)
        self.pending = None  # mean mode: (start, end, mean_k, mean_v) of the last chunk, to write in

    def steps(self):
        """The R per-step handles GRT.body indexes, all backed by this one buffer."""
        return [CoreStepCache(self, s) for s in range(self.num_steps)]

    def update(self, k, v, step):
        if self.k is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        if self.pending is not None and step == 0:  # the previous chunk's means replace its step-R k, v
            start, end, mean_k, mean_v = self.pending
            self.k[:, :, start:end] = mean_k
            self.v[:, :, start:end] = mean_v
            self.pending = None
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; cannot append up to {end}")
        self.k[:, :, start:end] = k  # this step's k, v for the chunk's own attention
        self.v[:, :, start:end] = v
        if self.mode == 'mean':
            # running mean m_s = m_{s-1} + (k_s - m_{s-1}) / s, in the cache's dtype: it stays at the
            # keys' scale (bf16 does not drift as a sum would), and a prompt's accumulators cost
            # n_core x prompt x 2d elements, not twice that in fp32
            if step == 0:
                self.mean_k, self.mean_v = k.clone(), v.clone()
            else:
                self.mean_k = self.mean_k + (k - self.mean_k) / (step + 1)
                self.mean_v = self.mean_v + (v - self.mean_v) / (step + 1)
        if step == self.num_steps - 1:  # last step: the chunk's entries are now stored
            self.length = end
            if self.mode == 'mean':
                self.pending = (start, end, self.mean_k, self.mean_v)
                self.mean_k = self.mean_v = None
        return self.k[:, :, :end], self.v[:, :, :end]


class CoreStepCache:
    """The handle of one CoreLayerCache at one recurrence step, with KVCache's interface (k, v and
    length too: torch.compile's guards read them when a compiled step meets another cache kind)."""

    def __init__(self, layer_cache, step):
        self.layer_cache, self.step = layer_cache, step

    @property
    def length(self):
        return self.layer_cache.length

    @property
    def k(self):
        return self.layer_cache.k

    @property
    def v(self):
        return self.layer_cache.v

    def update(self, k, v):
        return self.layer_cache.update(k, v, self.step)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.update(k, v)
        dropout_p = self.dropout if self.training else 0.0
        if past == 0 and self.training and x.device.type == 'cpu' and torch.compiler.is_compiling():
            # compiled CPU training: torch's fused attention backward is slow at small head sizes
            # (37% of a step at head size 32), while the written-out form compiles into fused kernels
            # (README, Training: Speed); eager keeps the fused kernel, which is faster uncompiled
            y = explicit_causal_attention(q, k, v, dropout_p)
        elif past == 0:  # no earlier tokens: plain causal attention
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        elif T == 1:  # one new token sees every cached token and itself
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        else:  # several new tokens after a cached prefix: the causal mask is offset by `past`
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def explicit_causal_attention(q, k, v, dropout_p):
    """softmax(q k^T / sqrt(head_size), causal) v, as F.scaled_dot_product_attention computes it."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = F.dropout(F.softmax(att.masked_fill(~causal, float('-inf')), dim=-1), p=dropout_p)
    return att @ v


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate='tanh')  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block, the one block every model in this file is made of."""

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


# -----------------------------------------------------------------------------
# What every language model here shares: embeddings, tied head, loss, init, generation


class LanguageModel(nn.Module):
    """Token and position embeddings -> body (defined by the subclass) -> ln_f -> tied LM head."""

    kv_modes = ('per_step',)  # the KV-cache modes generate() accepts (GRT adds its approximate ones)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def _finish_init(self, residual_depth):
        """Tie the head, then GPT-2 init: N(0, 0.02), residual projections by 1/sqrt(2 * depth)
        (two residual additions per block, so the residual stream's variance stays bounded)."""
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith('c_proj.weight'):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * residual_depth))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Unique parameters (the tied head once). non_embedding drops both embedding tables, as
        nanoGPT drops the position table; the token table is counted as the head's when False."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields tied weights once
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None, num_steps=None, kv_cache=None):
        """idx (B, T) -> (logits, loss). Logits at every position when targets are given (loss
        ignores target -1), else at the last position only. kv_cache (from new_kv_cache) holds the
        earlier tokens: idx are then the tokens after them."""
        B, T = idx.size()
        start = kv_cache[0].length if kv_cache else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}; "
                             f"crop the context to its last {self.config.block_size} tokens")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        x = self.body(x, num_steps, kv_cache)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def compile_regions(self, **compile_kwargs):
        """torch.compile each block once instead of the whole model: the Python depth loop stays
        outside compiled code, so a new r (or a new layout) never triggers a recompile. (Compiling
        one whole GRT recurrence step also works, but a 20-30 block core makes one huge graph that
        takes many minutes to compile; per block, every model compiles in seconds.)"""
        for block in self.modules():
            if isinstance(block, Block):
                block.compile(**compile_kwargs)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None, use_cache=True,
                 kv_mode='per_step'):
        """Append max_new_tokens sampled tokens to idx (B, T) and return it; temperature 0 is greedy.
        kv_mode (GRT only; see KV_MODES and CoreLayerCache): 'per_step' (exact, the default),
        'shared' or 'mean'. generate_tokens yields the same tokens one at a time, for streaming."""
        new_tokens = list(self.generate_tokens(idx, max_new_tokens, temperature, top_k, num_steps,
                                               use_cache, kv_mode))
        return torch.cat([idx, *new_tokens], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None,
                        use_cache=True, kv_mode='per_step'):
        """Yield max_new_tokens sampled tokens after idx (B, T), each of shape (B, 1), as generated.

        With the KV cache the prompt is prefilled in one forward pass, then each new token costs one
        position's forward pass. Once the context exceeds block_size it is cropped to its last
        block_size tokens, as nanoGPT does, and the cache is rebuilt from that window: every token's
        learned absolute position shifts by one when the window slides, so no rolling cache could
        give the same result."""
        if not use_cache and kv_mode != 'per_step':
            raise ValueError(f"kv_mode={kv_mode!r} is a KV-cache approximation; it needs use_cache=True")
        block_size = self.config.block_size
        kv_cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -block_size:], num_steps=num_steps)
            elif kv_cache is not None and kv_cache[0].length < block_size:
                logits, _ = self(idx[:, -1:], num_steps=num_steps, kv_cache=kv_cache)
            else:  # first step, or the window is full and slides: (re)build the cache
                context = idx[:, -block_size:]
                max_len = min(block_size, context.size(1) + max_new_tokens)
                kv_cache = self.new_kv_cache(max_len, num_steps, kv_mode=kv_mode)
                logits, _ = self(context, num_steps=num_steps, kv_cache=kv_cache)
            token = sample_next(logits[:, -1, :], temperature, top_k)
            idx = torch.cat((idx, token), dim=1)
            yield token

    def sample_depth(self, generator):
        """The depth of one training micro-step, drawn by the caller's generator (train.py keys it on
        seed, iteration and micro-step, so DDP ranks agree and a resumed run repeats). Dense: None."""
        return None

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops, seq_len, num_steps=None):
        """Model FLOPs utilisation: training FLOPs (forward + backward = 3x forward) achieved per
        second over peak_flops. num_steps is the depth the iteration ran (GRT: mean r if mixed)."""
        flops = 3 * self.flops_per_token(seq_len, num_steps) * tokens_per_iter
        return flops / dt / peak_flops

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on matrices (>= 2-D: Linears and embeddings), none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{'params': decay, 'weight_decay': weight_decay},
                  {'params': no_decay, 'weight_decay': 0.0}]
        fused = 'fused' in inspect.signature(torch.optim.AdamW).parameters and device_type in ('cuda', 'cpu')
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)


def sample_next(logits, temperature=1.0, top_k=None):
    """Draw one token per row from (B, vocab) logits; temperature 0 means greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


# -----------------------------------------------------------------------------
# GPT-2


class GPT(LanguageModel):

    def __init__(self, config):
        super().__init__(config)
        self.transformer.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self._finish_init(residual_depth=config.n_layer)

    def body(self, x, num_steps=None, kv_cache=None):
        """n_layer unique blocks. num_steps is accepted for a uniform interface and ignored."""
        for i, block in enumerate(self.transformer.h):
            x = block(x, kv_cache[i] if kv_cache else None)
        return x

    def new_kv_cache(self, max_len, num_steps=None, kv_mode='per_step'):
        """One exact cache per layer. kv_mode exists for GRT's core; a dense model has only per_step."""
        if kv_mode != 'per_step':
            raise ValueError(f"kv_mode={kv_mode!r} applies to a GRT's recurrent core; a GPT has only 'per_step'")
        return [KVCache(max_len) for _ in self.transformer.h]

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token, LM head excluded: per layer 24 d^2 (weights) + 4 S d (attention)."""
        d = self.config.n_embd
        return self.config.n_layer * (24 * d * d + 4 * seq_len * d)

    @classmethod
    def from_pretrained(cls, name_or_model, dropout=0.0):
        """Load GPT-2 weights: a name ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl') or a
        Hugging Face GPT2LMHeadModel instance. transformers is needed only here."""
        if isinstance(name_or_model, str):
            try:
                from transformers import GPT2LMHeadModel
            except ImportError:
                raise ImportError("loading pretrained GPT-2 needs transformers: pip install transformers") from None
            hf = GPT2LMHeadModel.from_pretrained(name_or_model)
        else:
            hf = name_or_model
        c = hf.config
        model = cls(GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer,
                              n_head=c.n_head, n_embd=c.n_embd, dropout=dropout, bias=True))
        sd, sd_hf = model.state_dict(), hf.state_dict()
        # HF stores these as Conv1D, i.e. (in, out): transpose them into our Linears
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        keys = [k for k in sd if k != 'lm_head.weight']  # tied to wte
        for k in keys:
            w = sd_hf[k]
            with torch.no_grad():
                sd[k].copy_(w.t() if k.endswith(transposed) else w)
        return model


# -----------------------------------------------------------------------------
# The Gated Recurrent Transformer


class GRT(LanguageModel):
    kv_modes = KV_MODES

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        self.transformer.prelude = nn.ModuleList([Block(config) for _ in range(config.n_prelude)])
        self.transformer.core = nn.ModuleList([Block(config) for _ in range(config.n_core)])
        self.transformer.coda = nn.ModuleList([Block(config) for _ in range(config.n_coda)])
        # the ablation ladder's lower rungs have no W_proj (rungs 1-3) or no gate (rungs 1-4)
        self.proj = nn.Linear(2 * d, d, bias=config.bias) if config.rung >= 4 else None  # W_proj of Eq. 2
        if config.rung == 5:
            self.ln_h = nn.LayerNorm(d, bias=config.bias)  # the two LayerNorms of Eq. 5
            self.ln_e = nn.LayerNorm(d, bias=config.bias)
            # f_g of Eq. 5; its last Linear always has a bias, because Eq. 5's +4 initialisation lives there
            self.gate = nn.Sequential(nn.Linear(2 * d, d, bias=config.bias), nn.SiLU(), nn.Linear(d, d))
        # Residual scaling counts the blocks a token passes through at eval depth R, not the
        # unique ones: every core pass adds to the residual stream again.
        self._finish_init(residual_depth=config.n_prelude + config.n_core * config.n_recur + config.n_coda)
        if config.rung == 5:
            nn.init.constant_(self.gate[-1].bias, config.gate_bias)

    def recurrence_step(self, h, e, caches):
        """One step of the gated recurrence, the paper's Eq. 2-5. h: state, e: prelude output."""
        c = self.config
        if c.rung < 5:
            return self.ablated_step(h, e, caches)
        eps_x = torch.randn_like(h) * c.state_noise if self.training else 0.0  # fresh every step
        eps_g = torch.randn_like(h) * c.gate_noise if self.training else 0.0
        u = self.proj(torch.cat([h + eps_x, e], dim=-1))  # Eq. 2: u = W_proj [h + eps_x ; e]
        o = self.run_core(u, caches)  # Eq. 3: o = Core(u), shared weights
        g = torch.sigmoid(self.gate(torch.cat([self.ln_h(h), self.ln_e(e)], dim=-1)) / c.gate_tau + eps_g)  # Eq. 5
        return g * h + (1 - g) * o  # Eq. 4: g near 1 keeps h

    def ablated_step(self, h, e, caches):
        """One step at a lower rung of the ablation ladder (config.rung), each adding one part of GRT:
            rung 1, recurrence alone:      h = Core(h),  h0 = wte(x) + wpe  (no prelude, no coda)
            rung 2, + prelude/coda split:  h = Core(h),  h0 = e
            rung 3, + state noise:         h = Core(h + eps_x)
            rung 4, + prelude re-injection: h = Core(W_proj [h + eps_x ; e])
        (rung 5 adds the gate: full GRT.) Rungs 1 and 2 share this code: rung 1 is rung 2 with
        n_prelude = n_coda = 0, so e = h0 is the embedding itself."""
        c = self.config
        u = h
        if c.rung >= 3 and self.training:
            u = u + torch.randn_like(h) * c.state_noise
        if c.rung >= 4:
            u = self.proj(torch.cat([u, e], dim=-1))
        return self.run_core(u, caches)

    def run_core(self, x, caches):
        """The shared core: n_core blocks, the same weights at every step."""
        for block, cache in zip(self.transformer.core, caches):
            x = block(x, cache)
        return x

    def body(self, x, num_steps=None, kv_cache=None):
        """Prelude -> r gated steps of the shared core -> coda. r: num_steps if given, else
        r ~ Uniform{1..R} in training (every exit is trained) and R in eval."""
        r = self.resolve_steps(num_steps)
        caches = kv_cache if kv_cache else [None] * self.num_block_passes(r)
        if len(caches) != self.num_block_passes(r):
            raise ValueError(f"kv_cache was made for another depth: build it with new_kv_cache(max_len, {r})")
        p, n = self.config.n_prelude, self.config.n_core
        for block, cache in zip(self.transformer.prelude, caches[:p]):
            x = block(x, cache)
        e = x
        h = self.initial_state(e)
        h = self.recur(h, e, r, caches[p: p + r * n])
        for block, cache in zip(self.transformer.coda, caches[p + r * n:]):
            h = block(h, cache)
        return h

    def initial_state(self, e):
        """h0 = e, the prelude output (the Huginn baseline draws a random h0 instead)."""
        return e

    def recur(self, h, e, r, caches):
        """r recurrence steps; caches holds n_core per step."""
        n = self.config.n_core
        for step in range(r):
            h = self.recurrence_step(h, e, caches[step * n: (step + 1) * n])
        return h

    def resolve_steps(self, num_steps):
        if num_steps is None:
            if self.training:  # drawn here, outside any compiled region, from torch's seeded generator
                return int(torch.randint(1, self.config.n_recur + 1, ()).item())
            return self.config.n_recur
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1 (the model was trained with R = "
                             f"{self.config.n_recur}), got {num_steps}")
        return int(num_steps)

    def num_block_passes(self, r):
        c = self.config
        return c.n_prelude + c.n_core * r + c.n_coda

    def new_kv_cache(self, max_len, num_steps=None, kv_mode='per_step'):
        """The caches of one generation, a list in the order body() executes its layers: the
        prelude layers, core layer j at step s (index n_prelude + s * n_core + j), the coda layers.
        Prelude and coda layers get one exact KVCache each. The core, by kv_mode:
          'per_step' (the paper's, exact): an own KVCache for every core layer at every step s, so a
                new token at step s attends to earlier tokens' step-s keys and values; equals the
                uncached forward. Memory: n_core * R caches.
          'shared': one CoreLayerCache per core layer; a new token at step s attends to earlier
                tokens' keys and values from their final step R (and its own step-s ones).
          'mean':   one CoreLayerCache per core layer holding each earlier token's keys and values
                averaged over the R steps (and its own step-s ones).
        'shared' and 'mean' hold n_core caches instead of n_core * R and change the function
        (bench.py measures their val loss); a prefilled chunk is exact within itself."""
        r = self.resolve_steps(self.config.n_recur if num_steps is None else num_steps)
        c = self.config
        if kv_mode == 'per_step':
            return [KVCache(max_len) for _ in range(self.num_block_passes(r))]
        if kv_mode not in KV_MODES:
            raise ValueError(f"unknown kv_mode {kv_mode!r}; choose one of {', '.join(KV_MODES)}")
        layers = [CoreLayerCache(max_len, r, kv_mode) for _ in range(c.n_core)]
        per_step = [layer.steps() for layer in layers]  # per_step[j][s]: core layer j at step s
        core = [per_step[j][s] for s in range(r) for j in range(c.n_core)]
        return ([KVCache(max_len) for _ in range(c.n_prelude)] + core +
                [KVCache(max_len) for _ in range(c.n_coda)])

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token, LM head excluded: every block pass costs 24 d^2 + 4 S d, and each
        step adds 10 d^2 (W_proj: 2 * 2d^2, gate f_g: 2 * 3d^2). r = R unless given; a mean r
        (e.g. (R + 1) / 2 for training under uniform sampling) may be fractional. Ablation rungs:
        4 d^2 per step at rung 4 (W_proj only), nothing at rungs 1-3."""
        c, d = self.config, self.config.n_embd
        r = c.n_recur if num_steps is None else num_steps
        per_step = {5: 10, 4: 4}.get(c.rung, 0) * d * d
        return (c.n_prelude + c.n_core * r + c.n_coda) * (24 * d * d + 4 * seq_len * d) + per_step * r

    def sample_depth(self, generator):
        """r ~ Uniform{1..R}: every exit is trained."""
        return int(torch.randint(1, self.config.n_recur + 1, (), generator=generator).item())

    def mean_train_steps(self):
        """Mean r under training's Uniform{1..R} sampling, for training FLOPs and MFU."""
        return (self.config.n_recur + 1) / 2


# -----------------------------------------------------------------------------
# Registry and presets shared by every script and test

MODELS = {
    'gpt': (GPTConfig, GPT),
    'grt': (GRTConfig, GRT),
    # 'huginn' and 'mor', the paper's recurrent baselines, are added by baselines.py (imported at the end)
}


def _grt(prelude, core, recur, coda, n_embd, n_head):
    return dict(model_type='grt', n_prelude=prelude, n_core=core, n_recur=recur, n_coda=coda,
                n_embd=n_embd, n_head=n_head)


PRESETS = {
    # paper scale (vocab 50304, block 1024): the dense GPT-2 and the GRT layouts p + c x R + k
    'gpt2-small': dict(model_type='gpt', n_layer=12, n_embd=768, n_head=12),
    'gpt2-medium': dict(model_type='gpt', n_layer=24, n_embd=1024, n_head=16),
    'gpt2-large': dict(model_type='gpt', n_layer=36, n_embd=1280, n_head=20),
    'grt-small-isoflop': _grt(1, 1, 10, 1, 768, 12),
    'grt-medium-isoflop': _grt(2, 5, 4, 2, 1024, 16),
    'grt-large-isoflop': _grt(1, 5, 6, 5, 1280, 20),
    'grt-small-isoparam': _grt(1, 10, 10, 1, 768, 12),
    'grt-medium-isoparam': _grt(2, 20, 4, 2, 1024, 16),
    'grt-large-isoparam': _grt(3, 30, 6, 3, 1280, 20),
    # small enough for tests and CPU smoke runs
    'tiny-gpt': dict(model_type='gpt', n_layer=4, n_embd=64, n_head=4, block_size=64, vocab_size=256),
    'tiny-grt': dict(_grt(1, 1, 4, 1, 64, 4), block_size=64, vocab_size=256),
}
for _preset in PRESETS.values():
    _preset.setdefault('block_size', 1024)
    _preset.setdefault('vocab_size', 50304)


def preset(name, **overrides):
    """(model_type, config) of a named preset, with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    args = {**PRESETS[name], **overrides}
    model_type = args.pop('model_type')
    return model_type, MODELS[model_type][0](**args)


def from_checkpoint(checkpoint, **config_overrides):
    """The model a train.py checkpoint holds (its 'model_type', 'model_args' and 'model' entries)."""
    model = build_model(checkpoint['model_type'], **{**checkpoint['model_args'], **config_overrides})
    state = {k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()}  # compiled models
    model.load_state_dict(state)
    return model


def build_model(model_type, **config_args):
    """A fresh model of a registered type from config fields."""
    if model_type not in MODELS:
        raise ValueError(f"unknown model_type {model_type!r}; known: {', '.join(MODELS)}")
    config_class, model_class = MODELS[model_type]
    return model_class(config_class(**config_args))


# The paper's baselines (Huginn, MoR) are built on GRT; importing them registers them in MODELS.
import baselines  # noqa: E402,F401  (last, because baselines imports this module)
