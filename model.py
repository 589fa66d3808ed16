"""
The GPT-2 baseline and the Gated Recurrent Transformer (GRT), side by side.

Both models are built from the same Block (pre-LN attention + MLP). GPT stacks n_layer unique
blocks. GRT runs a prelude of unique blocks, then one shared core of blocks R times under a gated
update (the paper's Eq. 2-5, all in GRT.recurrence_step; their terms in e alone are the same at
every step, so GRT.step_inputs computes them once), then a coda of unique blocks:

    e = Prelude(wte(x) + wpe(pos));  h = e
    repeat r times:  u = W_proj [h + eps_x ; e]                         (Eq. 2)
                     o = Core(u)                                         (Eq. 3)
                     g = sigmoid(f_g([LN(h) ; LN(e)]) / tau + eps_g)     (Eq. 5)
                     h = g * h + (1 - g) * o                             (Eq. 4)
    logits = lm_head(ln_f(Coda(h)))

Read top to bottom: the configs, the Block every model is made of, LanguageModel (embeddings, tied
head, loss, generation), GPT, RecurrentLM (prelude -> core loop -> coda, shared with the baselines
in baselines.py, and per-token early exit at inference), and GRT, which adds only its parameters
and Eq. 2-5. The KV caches are in kv_cache.py; registry.py names every model type for the scripts.

References: nanoGPT (Karpathy) for the GPT-2 side; the GRT paper for the recurrence.
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import KV_MODES, CoreLayerCache, ExitFillCache, KVCache, PeekCache

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
    gelu_approximate: str = 'none'  # the MLP's nn.GELU: 'none' (exact, as nanoGPT) or 'tanh' (GPT-2's own)

    def __post_init__(self):
        for name in ('block_size', 'vocab_size', 'n_head', 'n_embd'):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                             f"pick n_head from the divisors of n_embd")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.gelu_approximate not in ('none', 'tanh'):
            raise ValueError(f"gelu_approximate must be 'none' (exact GELU) or 'tanh', got {self.gelu_approximate!r}")


@dataclass
class RecurrentConfig(GPTConfig):
    """A recurrent-depth layout, written n_prelude + n_core x n_recur + n_coda."""
    n_layer: int = None  # derived: n_prelude + n_core + n_coda unique blocks
    n_prelude: int = 1
    n_core: int = 1
    n_coda: int = 1
    n_recur: int = 10  # R: recurrence steps at eval; training samples r ~ Uniform{1..R}

    def __post_init__(self):
        super().__post_init__()
        if self.n_core < 1:
            raise ValueError(f"n_core must be >= 1 (the shared core is the recurrence), got {self.n_core}")
        if self.n_prelude < 0 or self.n_coda < 0:
            raise ValueError(f"n_prelude and n_coda must be >= 0, got {self.n_prelude} and {self.n_coda}")
        if self.n_recur < 1:
            raise ValueError(f"n_recur (R) must be >= 1, got {self.n_recur}")
        unique = self.n_prelude + self.n_core + self.n_coda
        if self.n_layer is not None and self.n_layer != unique:
            raise ValueError(f"n_layer={self.n_layer} conflicts with n_prelude + n_core + n_coda = {unique}; "
                             f"leave n_layer out, it is derived")
        self.n_layer = unique


@dataclass
class GRTConfig(RecurrentConfig):
    state_noise: float = 0.1  # std of eps_x, Eq. 2
    gate_noise: float = 0.1  # std of eps_g, Eq. 5
    gate_bias: float = 4.0  # initial bias of f_g's last Linear: g ~ sigmoid(4) = 0.98 keeps h at first
    gate_tau: float = 1.0  # temperature tau of Eq. 5

    def __post_init__(self):
        super().__post_init__()
        if self.gate_tau <= 0:
            raise ValueError(f"gate_tau must be > 0, got {self.gate_tau}")
        if self.state_noise < 0 or self.gate_noise < 0:
            raise ValueError(f"state_noise and gate_noise are standard deviations, >= 0; got "
                             f"{self.state_noise} and {self.gate_noise}")


# -----------------------------------------------------------------------------
# The shared building blocks

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
        # exact GELU by default, as nanoGPT: GPT-2's tanh form ("gelu_new") is within 5e-4 of it, and
        # torch's CPU kernel for the tanh form is 2.4x slower (9% of a width-128 fp32 step; docs/benchmarks.md).
        # GPT-2's own weights get their own tanh form (from_pretrained), so they give OpenAI's logits
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
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

    def forward(self, idx, targets=None, num_steps=None, kv_cache=None, early_exit=None):
        """idx (B, T) -> (logits, loss). Logits at every position when targets are given (loss
        ignores target -1), else at the last position only. kv_cache (from new_kv_cache) holds the
        earlier tokens: idx are then the tokens after them. early_exit (an EarlyExit, recurrent
        models at inference only) lets each token stop its recurrence early."""
        B, T = idx.size()
        start = kv_cache[0].length if kv_cache else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.config.block_size}; "
                             f"crop the context to its last {self.config.block_size} tokens")
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        if early_exit is None:  # the fixed-depth path
            x = self.body(x, num_steps, kv_cache)
        else:
            self.check_early_exit(early_exit, num_steps)
            x = self.body(x, num_steps, kv_cache, early_exit)
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
                 kv_mode='per_step', exit_threshold=None, min_steps=1, exit='state'):
        """Append max_new_tokens sampled tokens to idx (B, T) and return it; temperature 0 is greedy.
        kv_mode (GRT only; see KV_MODES and CoreLayerCache): 'per_step' (exact, the default),
        'shared' or 'mean'. exit_threshold (recurrent models): per-token early exit with criterion
        exit ('state' or 'kl') after at least min_steps steps, see EarlyExit; None runs every token
        num_steps deep. generate_tokens yields the same tokens one at a time, for streaming."""
        new_tokens = list(self.generate_tokens(idx, max_new_tokens, temperature, top_k, num_steps,
                                               use_cache, kv_mode, exit_threshold, min_steps, exit))
        return torch.cat([idx, *new_tokens], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None,
                        use_cache=True, kv_mode='per_step', exit_threshold=None, min_steps=1, exit='state'):
        """Yield max_new_tokens sampled tokens after idx (B, T), each of shape (B, 1), as generated.

        With the KV cache the prompt is prefilled in one forward pass, then each new token costs one
        position's forward pass. Once the context exceeds block_size it is cropped to its last
        block_size tokens, as nanoGPT does, and the cache is rebuilt from that window: every token's
        learned absolute position shifts by one when the window slides, so no rolling cache could
        give the same result.

        With exit_threshold set, every token (the prompt's too) stops its recurrence at its own depth
        (RecurrentLM.recur_with_exit); after each token, self.exit_steps holds the depths the last
        forward pass ran, (B, T) for its T positions."""
        if not use_cache and kv_mode != 'per_step':
            raise ValueError(f"kv_mode={kv_mode!r} is a KV-cache approximation; it needs use_cache=True")
        exiting = {}  # forward's early_exit, passed only when set (the fixed-depth call stays as it was)
        if exit_threshold is not None:
            exiting = dict(early_exit=EarlyExit(exit_threshold, min_steps, exit))
            self.check_early_exit(exiting['early_exit'], num_steps, kv_mode)
        block_size = self.config.block_size
        kv_cache = None
        for _ in range(max_new_tokens):
            if not use_cache:
                logits, _ = self(idx[:, -block_size:], num_steps=num_steps, **exiting)
            elif kv_cache is not None and kv_cache[0].length < block_size:
                logits, _ = self(idx[:, -1:], num_steps=num_steps, kv_cache=kv_cache, **exiting)
            else:  # first step, or the window is full and slides: (re)build the cache
                context = idx[:, -block_size:]
                max_len = min(block_size, context.size(1) + max_new_tokens)
                kv_cache = self.new_kv_cache(max_len, num_steps, kv_mode=kv_mode)
                logits, _ = self(context, num_steps=num_steps, kv_cache=kv_cache, **exiting)
            token = sample_next(logits[:, -1, :], temperature, top_k)
            idx = torch.cat((idx, token), dim=1)
            yield token

    def sample_depth(self, generator):
        """The depth of one training micro-step, drawn by the caller's generator (train.py keys it on
        seed, iteration and micro-step, so DDP ranks agree and a resumed run repeats). Dense: None."""
        return None

    # why this model cannot exit early (None where it can: RecurrentLM)
    exit_unsupported = ("early exit stops a recurrent model's core loop per token; a dense GPT has no loop "
                        "(use a GRT or a recurrent baseline, or leave exit_threshold unset)")

    def check_early_exit(self, early_exit, num_steps, kv_mode='per_step'):
        """Raise ValueError with a one-line fix unless this model can exit early with these settings."""
        raise ValueError(self.exit_unsupported)

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
        Hugging Face GPT2LMHeadModel instance. transformers is needed only here. The MLP uses GPT-2's
        tanh GELU (gelu_approximate='tanh'), so the logits are OpenAI's."""
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
                              n_head=c.n_head, n_embd=c.n_embd, dropout=dropout, bias=True,
                              gelu_approximate='tanh'))
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
# Recurrent depth: the loop GRT and the baselines share


EXIT_CRITERIA = ('state', 'kl')


@dataclass
class EarlyExit:
    """Per-token early exit at inference (RecurrentLM.recur_with_exit). A token runs the recurrence
    steps s = 1, 2, ... and stops after the first s >= min_steps whose criterion c_s < threshold
    (never after num_steps). With h_s the token's state after step s (h_0 the initial state):

      'state': c_s = ||h_s - h_(s-1)|| / ||h_(s-1)||, the relative change of the token's state over
               its n_embd channels, in fp32 (compared multiplied out, ||h_s - h_(s-1)|| < threshold
               ||h_(s-1)||, so an all-zero h_0, Huginn's in eval, never exits at s = 1). Cheap: two
               norms per token and step.
      'kl':    c_s = KL(p_(s-1) || p_s) = sum_v p_(s-1)(v) [log p_(s-1)(v) - log p_s(v)], where
               p_s = softmax(lm_head(ln_f(Coda(h_s)))) is the next-token distribution of exiting
               after step s (p_0: exiting before the first step), in fp32, clamped at 0 against
               rounding. Huginn's KL exit (Geiping et al., 2025; KLExitEvaluator in
               seal-rg/recurrent-pretraining's recpre/raven_modeling_minimal.py) compares the same
               two successive exits in the same order, but starts from a uniform p_0. The probe costs
               a coda-and-head pass per token for every step from min_steps - 1 to the exit
               (RecurrentLM.exit_probe_flops), on top of the final coda pass.

    threshold 0 never exits (c_s >= 0), so every token runs num_steps steps, exactly as without
    early exit; a huge threshold exits every token after exactly min_steps steps."""
    threshold: float
    min_steps: int = 1
    criterion: str = 'state'

    def __post_init__(self):
        if self.criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit must be one of {', '.join(EXIT_CRITERIA)}, got {self.criterion!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold >= 0:
            raise ValueError(f"exit_threshold must be a number >= 0 (0 never exits), got {self.threshold!r}")
        if isinstance(self.min_steps, bool) or int(self.min_steps) != self.min_steps or self.min_steps < 1:
            raise ValueError(f"min_steps must be an integer >= 1, got {self.min_steps!r}")
        self.min_steps = int(self.min_steps)


class RecurrentLM(LanguageModel):
    """Prelude -> r steps of one shared core -> coda. A subclass says what one step does
    (recurrence_step) and what it costs beyond the core's blocks (step_flops); the depth loop,
    depth sampling and the per-step KV-cache layout live here. A subclass builds its own
    parameters after these blocks, then calls _finish_init."""

    kv_modes = KV_MODES

    def __init__(self, config):
        super().__init__(config)
        self.transformer.prelude = nn.ModuleList([Block(config) for _ in range(config.n_prelude)])
        self.transformer.core = nn.ModuleList([Block(config) for _ in range(config.n_core)])
        self.transformer.coda = nn.ModuleList([Block(config) for _ in range(config.n_coda)])

    def _finish_init(self, residual_depth=None):
        """Residual scaling counts the blocks a token passes through at eval depth R, not the unique
        ones: every core pass adds to the residual stream again."""
        super()._finish_init(residual_depth or self.num_block_passes(self.config.n_recur))

    def recurrence_step(self, h, e, caches):
        """One step: the new state from the state h and e, what step_inputs made of the prelude
        output (the output itself unless a subclass says otherwise). The subclass's method."""
        raise NotImplementedError

    def step_flops(self):
        """Forward FLOPs per token of one step beyond its n_core block passes (e.g. GRT's W_proj and gate)."""
        return 0

    def compile_regions(self, **compile_kwargs):
        """The blocks, each once (LanguageModel.compile_regions), and one step's own ops around its
        core (for the GRT: Eq. 2's W_proj on h + eps_x, Eq. 5's LN(h) and f_g, Eq. 4's update), a dozen
        small kernels a step in eager; compiling only the blocks left the compiled GRT step slower at
        width 128 (docs/benchmarks.md). The step's graph breaks at the noise, drawn by torch's own
        generator. A one-block core compiles into the step's graph, which took 6-9% off a GRT training
        step at width 128; a longer core breaks it at run_core and keeps its blocks' own graphs, so
        the step compiles in seconds whatever n_core is (one graph of a 20-30 block core took
        minutes). Every r reuses it. step_inputs runs once a forward, uncompiled."""
        super().compile_regions(**compile_kwargs)
        if self.config.n_core > 1:
            self.run_core = torch.compiler.disable(self.run_core, recursive=False)
        self.noise = torch.compiler.disable(self.noise)
        self.recurrence_step = torch.compile(self.recurrence_step, **compile_kwargs)

    def noise(self, like, std):
        """N(0, std^2) noise shaped like `like` in training, 0 in eval. Never compiled (compile_regions
        leaves it out; a decorator here would import torch._dynamo, 1-2 s, in every script): torch's own
        randn keeps a compiled step's noise equal to eager's (train.py seeds it per micro-step), and
        Inductor's generated CPU randn made a small step 3x slower."""
        return torch.empty_like(like).normal_(0.0, std) if self.training else 0.0  # randn_like(like) * std, one kernel

    def run_core(self, x, caches):
        """The shared core: n_core blocks, the same weights at every step. Its input is often a Linear's
        output (GRT's W_proj, Huginn's adapter), which autocast makes bf16: it is cast back to the residual
        stream's dtype, the embeddings' (fp32 under autocast), so the core adds its residuals in the
        precision every other block does, and its blocks compile for one input dtype."""
        x = x.to(self.transformer.wte.weight.dtype)
        for block, cache in zip(self.transformer.core, caches):
            x = block(x, cache)
        return x

    def body(self, x, num_steps=None, kv_cache=None, early_exit=None):
        """Prelude -> r steps of the shared core -> coda. r: num_steps if given, else
        r ~ Uniform{1..R} in training (every exit is trained) and R in eval. early_exit (an
        EarlyExit): each token stops at its own depth <= r (recur_with_exit)."""
        r = self.resolve_steps(num_steps)
        caches = kv_cache if kv_cache else [None] * self.num_block_passes(r)
        if len(caches) != self.num_block_passes(r):
            raise ValueError(f"kv_cache was made for another depth: build it with new_kv_cache(max_len, {r})")
        if early_exit is not None and early_exit.criterion == 'kl' and x.size(1) > 1:
            return self.body_token_by_token(x, r, kv_cache, early_exit)
        p, n = self.config.n_prelude, self.config.n_core
        for block, cache in zip(self.transformer.prelude, caches[:p]):
            x = block(x, cache)
        h = self.initial_state(x)
        e = self.step_inputs(x)
        if early_exit is None:
            h = self.recur(h, e, r, caches[p: p + r * n])
        else:
            h = self.recur_with_exit(h, e, r, caches[p: p + r * n], caches[p + r * n:], early_exit)
        h = self.before_coda(h)
        for block, cache in zip(self.transformer.coda, caches[p + r * n:]):
            h = block(h, cache)
        return h

    def initial_state(self, e):
        """h0 = e, the prelude output, as a copy: passed as one tensor for both, h and e would make the
        compiled step specialise on the two being the same at the first step (and torch 2.13 crashes
        building that recompile's reason once a KV cache with early exit is traced, pytorch#176211)."""
        return e.clone()

    def step_inputs(self, e):
        """What every step reads of the prelude output e: e itself (GRT computes its terms of e
        here, once per forward)."""
        return e

    def before_coda(self, h):
        """What the coda reads: the last state itself (Huginn normalises it first)."""
        return h

    def recur(self, h, e, r, caches):
        """r recurrence steps; caches holds n_core per step."""
        n = self.config.n_core
        for step in range(r):
            h = self.recurrence_step(h, e, caches[step * n: (step + 1) * n])
        return h

    # -- per-token early exit at inference (EarlyExit); recur above is the fixed-depth loop

    exit_unsupported = None

    def check_early_exit(self, early_exit, num_steps, kv_mode='per_step'):
        if self.exit_unsupported:
            raise ValueError(self.exit_unsupported)
        if early_exit.criterion == 'kl' and kv_mode != 'per_step':
            raise ValueError(f"exit='kl' prefills a prompt one token at a time (its probe reads the coda), which "
                             f"changes what kv_mode={kv_mode!r} gives a prompt; use kv_mode='per_step' or exit='state'")
        if self.training:
            raise ValueError("early exit is for inference: call model.eval() first (training samples the depth)")
        r = self.resolve_steps(num_steps)
        if early_exit.min_steps > r:
            raise ValueError(f"min_steps={early_exit.min_steps} exceeds the {r} recurrence steps this "
                             f"forward runs; pick min_steps <= {r}")

    def recur_with_exit(self, h, e, r, caches, coda_caches, early_exit):
        """recur with per-token early exit: each token stops after its own depth d <= r, by
        early_exit's criterion (EarlyExit). While any token of the chunk still runs, every token
        passes the step (masking: rows of a batch exit independently, at the cost of the slowest),
        and an exited token's state stays h_d. Its keys and values at later steps are filled from
        step d (ExitFillCache, which also runs without a cache, so an uncached forward keeps the same
        rule). Once every token has exited, the remaining steps only fill their caches.
        Records self.exit_steps (B, T), each token's d, and self.exit_stats: 'steps_run' (steps
        the chunk ran, the batch's max of d) and 'probes' (coda-and-head passes for 'kl')."""
        n, rule = self.config.n_core, early_exit
        exited = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        depth = torch.full(h.shape[:2], r, dtype=torch.long, device=h.device)
        n_exited, n_tokens = 0, exited.numel()  # counted on the host: one sync a step
        log_p = None  # 'kl': log p_(s-1), the previous exit's distribution
        if rule.criterion == 'kl' and rule.min_steps == 1 and r > 1:
            log_p = self.exit_log_probs(h, coda_caches)  # p_0
        probes, steps_run = int(log_p is not None), 0
        fills = [None] * n
        for step in range(r):
            s = step + 1  # the steps a token has run after this one
            fills = [ExitFillCache(cache, exited if n_exited else None, None if fill is None else fill.chunk)
                     for cache, fill in zip(caches[step * n: (step + 1) * n], fills)]
            if n_exited == n_tokens:  # nothing left to run: store the exited tokens' last keys and values
                for fill in fills:
                    fill.fill()
                continue
            h_next = self.recurrence_step(h, e, fills)
            if n_exited:  # exited tokens keep h_d
                h_next = torch.where(exited.unsqueeze(-1), h.to(h_next.dtype), h_next)
            steps_run += 1
            if s == r:  # the last step: every token stops here
                h = h_next
                break
            stop = None  # tokens whose c_s < threshold, (B, T), from step min_steps on
            if rule.criterion == 'state' and s >= rule.min_steps:
                # ||h_s - h_(s-1)|| / ||h_(s-1)|| < threshold, multiplied out (an all-zero h_(s-1) never exits)
                h_prev = h.float()
                stop = (h_next.float() - h_prev).norm(dim=-1) < rule.threshold * h_prev.norm(dim=-1)
            elif rule.criterion == 'kl' and s >= rule.min_steps - 1:
                log_p_next = self.exit_log_probs(h_next, coda_caches)
                probes += 1
                if log_p is not None:  # KL(p_(s-1) || p_s)
                    stop = (log_p.exp() * (log_p - log_p_next)).sum(dim=-1).clamp_min(0) < rule.threshold
                log_p = log_p_next
            if stop is not None and bool(stop.any()):  # one sync a step; no bookkeeping until a token stops
                stop &= ~exited
                depth.masked_fill_(stop, s)
                exited = exited | stop
                n_exited = int(exited.sum())
            h = h_next
        self.exit_steps, self.exit_stats = depth, dict(steps_run=steps_run, probes=probes)
        return h

    def body_token_by_token(self, x, r, kv_cache, early_exit):
        """body for a chunk of several tokens under the 'kl' criterion, one token at a time through
        the cache (a cache for the chunk alone when there is none). The 'kl' probe of a token reads
        the coda, whose attention needs the earlier tokens' final coda keys and values; in one
        parallel pass the chunk's earlier tokens would still be at the probe's step. One at a time,
        a prefilled prompt equals the same tokens decoded, as Huginn's prefill with exits does
        (_prefill_with_varied_exit_steps in recpre/raven_modeling_minimal.py)."""
        cache = kv_cache or self.new_kv_cache(x.size(1), r)
        outputs, depths, steps_run, probes = [], [], 0, 0
        for t in range(x.size(1)):
            outputs.append(self.body(x[:, t:t + 1], r, cache, early_exit))
            depths.append(self.exit_steps)
            steps_run, probes = steps_run + self.exit_stats['steps_run'], probes + self.exit_stats['probes']
        self.exit_steps, self.exit_stats = torch.cat(depths, dim=1), dict(steps_run=steps_run, probes=probes)
        return torch.cat(outputs, dim=1)

    def exit_log_probs(self, h, coda_caches):
        """log p_s: the next-token log-probabilities (fp32) of exiting with state h, through the coda
        (reading its caches without changing them), ln_f and the head: the 'kl' criterion's probe."""
        x = self.before_coda(h)
        for block, cache in zip(self.transformer.coda, coda_caches):
            x = block(x, None if cache is None else PeekCache(cache))
        return F.log_softmax(self.lm_head(self.transformer.ln_f(x)).float(), dim=-1)

    def exit_probe_flops(self, seq_len):
        """Forward FLOPs per token of one 'kl' probe: the coda's blocks and the LM head (2 d vocab)."""
        c, d = self.config, self.config.n_embd
        return c.n_coda * (24 * d * d + 4 * seq_len * d) + 2 * d * c.vocab_size

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
        if kv_mode not in self.kv_modes:
            raise ValueError(f"unknown kv_mode {kv_mode!r}; choose one of {', '.join(self.kv_modes)}")
        layers = [CoreLayerCache(max_len, r, kv_mode) for _ in range(c.n_core)]
        per_step = [layer.steps() for layer in layers]  # per_step[j][s]: core layer j at step s
        core = [per_step[j][s] for s in range(r) for j in range(c.n_core)]
        return ([KVCache(max_len) for _ in range(c.n_prelude)] + core +
                [KVCache(max_len) for _ in range(c.n_coda)])

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token, LM head excluded: every block pass costs 24 d^2 + 4 S d, and each
        step adds step_flops(). r = R unless given; a mean r (e.g. (R + 1) / 2 for training under
        uniform sampling) may be fractional."""
        c, d = self.config, self.config.n_embd
        r = c.n_recur if num_steps is None else num_steps
        return (c.n_prelude + c.n_core * r + c.n_coda) * (24 * d * d + 4 * seq_len * d) + self.step_flops() * r

    def sample_depth(self, generator):
        """r ~ Uniform{1..R}: every exit is trained."""
        return int(torch.randint(1, self.config.n_recur + 1, (), generator=generator).item())

    def mean_train_steps(self):
        """Mean r under training's Uniform{1..R} sampling, for training FLOPs and MFU."""
        return (self.config.n_recur + 1) / 2


# -----------------------------------------------------------------------------
# The Gated Recurrent Transformer


def left_half(linear, a):
    """A Linear(2d, d) on a concatenation [a ; b] is left_half(linear, a) + right_half(linear, b):
    its first d columns times a, plus its last d columns times b and the bias."""
    return F.linear(a, linear.weight[:, :a.size(-1)])


def right_half(linear, b):
    return F.linear(b, linear.weight[:, -b.size(-1):], linear.bias)


class GRT(RecurrentLM):
    """RecurrentLM with the paper's gated step: W_proj re-injects the prelude output e into the
    noisy state, the shared core transforms it, and a gate keeps or rewrites the state per token
    and channel. proj and gate[0] are never called as modules (their halves are applied by
    left_half and right_half), so a forward hook on them never fires; gate[-1]'s output is f_g."""

    def __init__(self, config):
        super().__init__(config)
        d = config.n_embd
        self.proj = nn.Linear(2 * d, d, bias=config.bias)  # W_proj of Eq. 2
        self.ln_h = nn.LayerNorm(d, bias=config.bias)  # the two LayerNorms of Eq. 5
        self.ln_e = nn.LayerNorm(d, bias=config.bias)
        # f_g of Eq. 5; its last Linear always has a bias, because Eq. 5's +4 initialisation lives there
        self.gate = nn.Sequential(nn.Linear(2 * d, d, bias=config.bias), nn.SiLU(), nn.Linear(d, d))
        self._finish_init()
        nn.init.constant_(self.gate[-1].bias, config.gate_bias)

    def step_inputs(self, e):
        """The terms of Eq. 2 and Eq. 5 that read e alone, the same at every step, so computed once
        per forward instead of r times: W_proj's e columns times e (right_half), and f_g's first
        Linear on LN(e). Two steps of W_proj, gate and update (forward and backward) took 7.5 ms
        instead of 9.2 at width 128, this and Eq. 4's lerp together (docs/benchmarks.md)."""
        return right_half(self.proj, e), right_half(self.gate[0], self.ln_e(e))

    def recurrence_step(self, h, e_terms, caches):
        """One step of the gated recurrence, the paper's Eq. 2-5. h: the state; e_terms: the prelude
        output e's terms of Eq. 2 and 5 (step_inputs)."""
        c = self.config
        e_proj, e_gate = e_terms
        eps_x = self.noise(h, c.state_noise)  # fresh every step, 0 in eval
        eps_g = self.noise(h, c.gate_noise)
        u = left_half(self.proj, h + eps_x) + e_proj  # Eq. 2: u = W_proj [h + eps_x ; e]
        o = self.run_core(u, caches)  # Eq. 3: o = Core(u), shared weights
        g = torch.sigmoid(self.f_g(h, e_gate) / c.gate_tau + eps_g)  # Eq. 5
        # Eq. 4: h = g * h + (1 - g) * o, as one lerp kernel; g near 1 keeps h (lerp wants one dtype: o has
        # h's, run_core sees to it, but autocast may make g bf16)
        return torch.lerp(o, h, g.to(h.dtype))

    def f_g(self, h, e_gate):
        """f_g([LN(h) ; LN(e)]) of Eq. 5, Linear(2d, d) -> SiLU -> Linear(d, d), given e_gate, the
        first Linear's LN(e) term (step_inputs)."""
        return self.gate[2](self.gate[1](left_half(self.gate[0], self.ln_h(h)) + e_gate))

    def step_flops(self):
        """W_proj (2 * 2d^2) and the gate's f_g (2 * 3d^2) per token and step, as the paper counts
        them (step_inputs computes the e halves, 4d^2 of them, once per forward instead, so a GRT runs
        4 (r - 1) d^2 a token fewer than flops_per_token counts)."""
        d = self.config.n_embd
        return 10 * d * d
