"""
The paper's comparisons, each a RecurrentLM (model.py) so they share GRT's prelude, coda, depth loop
and KV-cache layout, and differ only in their recurrence step:

- The ablation ladder (model types rung1..rung4), each rung adding one part of GRT (rung 5 is GRT):
      rung 1, recurrence alone:        h = Core(h),  h0 = wte(x) + wpe  (no prelude, no coda)
      rung 2, + prelude/coda split:    h = Core(h),  h0 = e = Prelude(...)
      rung 3, + state noise:           h = Core(h + eps_x)
      rung 4, + prelude re-injection:  h = Core(W_proj [h + eps_x ; e])
- GRT without its re-injection (model type grt_no_e), the depth tasks' ablation: u = h + eps_x in
  place of Eq. 2, Eq. 3-5 unchanged (the gate still reads LN(e)).
- Huginn (Geiping et al., 2025), heavy-tail depth sampling: h = Core(adapter [h ; e]) from a random
  initial state (in eval too, seeded), the coda reading ln_f(h); each training micro-step draws its
  depth from an unbounded log-normal Poisson distribution and backpropagates through only the last k steps.
- MoR, Mixture-of-Recursions (Bae et al., 2025), middle-cycle sharing: unique first and last layers
  (the prelude and coda) around a shared middle recursed N_r times; every token takes the first
  recursion, then a router keeps fewer and fewer, each kept token becoming h + alpha sigmoid(w . h) Core(h).

They live apart from model.py because they are comparisons, not the method; registry.py names them.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import KVCache
from model import GRT, RecurrentConfig, RecurrentLM

# -----------------------------------------------------------------------------
# The ablation ladder


@dataclass
class Rung1Config(RecurrentConfig):
    n_prelude: int = 0  # recurrence alone: every layer is in the shared core
    n_coda: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.n_prelude or self.n_coda:
            raise ValueError("rung1 is recurrence alone: set n_prelude=0 and n_coda=0 (every layer in the shared core)")


@dataclass
class NoisyRecurrentConfig(RecurrentConfig):
    state_noise: float = 0.1  # std of eps_x, as GRT's

    def __post_init__(self):
        super().__post_init__()
        if self.state_noise < 0:
            raise ValueError(f"state_noise is a standard deviation, >= 0; got {self.state_noise}")


class PlainRecurrence(RecurrentLM):
    """Rungs 1 and 2: h = Core(h). Rung 1 is rung 2 with n_prelude = n_coda = 0, so e = h0 is the
    embedding itself."""

    def __init__(self, config):
        super().__init__(config)
        self._finish_init()

    def recurrence_step(self, h, e, caches):
        return self.run_core(h, caches)


class NoisyRecurrence(RecurrentLM):
    """Rung 3: h = Core(h + eps_x), eps_x ~ N(0, state_noise^2) fresh every step in training."""

    def __init__(self, config):
        super().__init__(config)
        self._finish_init()

    def recurrence_step(self, h, e, caches):
        eps_x = self.noise(h, self.config.state_noise)
        return self.run_core(h + eps_x, caches)


class ReinjectedRecurrence(RecurrentLM):
    """Rung 4: h = Core(W_proj [h + eps_x ; e]), GRT without its gate."""

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias)
        self._finish_init()

    def recurrence_step(self, h, e, caches):
        eps_x = self.noise(h, self.config.state_noise)
        return self.run_core(self.proj(torch.cat([h + eps_x, e], dim=-1)), caches)

    def step_flops(self):
        return 4 * self.config.n_embd ** 2  # W_proj: 2 * 2d^2


class GRTWithoutReinjection(GRT):
    """GRT with u = h + eps_x: the core never reads e (no W_proj); the gate is GRT's, Eq. 4-5."""

    def __init__(self, config):
        super().__init__(config)
        del self.W_proj

    def recurrence_step(self, h, e, caches):
        c = self.config
        eps_x, eps_g = self.noise(h, c.state_noise), self.noise(h, c.gate_noise)
        o = self.run_core(h + eps_x, caches)  # Eq. 3 on u = h + eps_x: no re-injection of e
        g = torch.sigmoid(self.f_g(torch.cat([self.ln_h(h), self.ln_e(e)], dim=-1)) / c.gate_tau + eps_g)
        return g * h + (1 - g) * o  # Eq. 4

    def step_flops(self):
        return 6 * self.config.n_embd ** 2  # f_g: 2 * 3d^2 a token and step


# -----------------------------------------------------------------------------
# Huginn: heavy-tail depth sampling with truncated backpropagation
# Reference: seal-rg/recurrent-pretraining, recpre/model_dynamic.py, RecurrentGPT (initialize_state,
# iterate_forward, core_block_forward, randomized_iteration_sampler's 'poisson-lognormal-filling',
# the scheme of recpre/raven_config_minimal.py). Followed here, written anew for this code base.


HUGINN_EVAL_STATE_SEED = 0  # seeds the eval initial states (one per position), so eval is deterministic


@dataclass
class HuginnConfig(RecurrentConfig):
    # n_recur is Huginn's mean depth r_mean: the eval depth, and the mean of the training draws' tau.
    # Huginn's training choices, which RecurrentLM implements (model.py):
    train_depth: str = 'heavy'  # r = Poisson(tau) + 1, tau ~ LogNormal with mean r_mean (heavy_tailed_depths)
    backprop_depth: int = 8  # k: only the last k steps of a training pass carry gradients
    init_state: str = 'random'  # h0 ~ TruncNormal(0, 0.02^2) on [-0.06, 0.06], our init scale


class Huginn(RecurrentLM):
    """h = Core(adapter [h ; e]), the adapter a Linear(2d -> d), from a random initial state, with
    Huginn's depth distribution and truncated backpropagation; the coda reads ln_f(h)."""

    def __init__(self, config):
        super().__init__(config)
        self.proj = nn.Linear(2 * config.n_embd, config.n_embd, bias=config.bias)  # the adapter
        self._finish_init()
        # The eval initial state of the token at position p is row p of this table: random like the
        # training draws, but fixed by a seed, so eval is deterministic and a token's h0 does not depend
        # on how many tokens a forward pass holds (prefill or one-by-one decoding give the same h0).
        # The reference draws a fresh h0 at every call, in eval too; it is not a weight (not saved).
        table = torch.empty(config.block_size, config.n_embd, device='cpu')
        nn.init.trunc_normal_(table, std=0.02, a=-0.06, b=0.06,
                              generator=torch.Generator().manual_seed(HUGINN_EVAL_STATE_SEED))
        self.register_buffer('eval_state', table, persistent=False)
        self._start = 0  # position of the current forward pass's first token (embed sets it)

    def recurrence_step(self, h, e, caches):
        # core_block_forward with injection_type='linear': x = adapter(cat[x, e]), then the core blocks
        return self.run_core(self.proj(torch.cat([h, e], dim=-1)), caches)

    def step_flops(self):
        return 4 * self.config.n_embd ** 2  # the adapter: 2 * 2d^2

    def embed(self, idx, kv_cache=None):
        self._start = kv_cache[0].length if kv_cache else 0  # earlier tokens in the cache: idx starts there
        return super().embed(idx, kv_cache)

    def initial_state(self, e):
        """h0 ~ TruncNormal(0, 0.02^2) on [-0.06, 0.06] (initialize_state, 'like-init'): fresh in
        training (RecurrentLM's init_state='random'); in eval the seeded draw of each token's position."""
        if self.training:
            return super().initial_state(e)
        B, T, d = e.shape
        return self.eval_state[self._start: self._start + T].to(e.dtype).expand(B, T, d)

    def before_coda(self, h):
        """ln_f(h): iterate_forward returns transformer.ln_f(x), and the same ln_f is applied again
        after the coda ("used twice", recpre/raven_modeling_minimal.py)."""
        return self.transformer.ln_f(h)


# -----------------------------------------------------------------------------
# Mixture-of-Recursions: expert-choice routing over a middle-cycle shared core
# Reference: raymin0223/mixture_of_recursions, model/mor_model/expert_choice_router.py
# (MoRLlamaDecoderLayer.forward: router weights, top-k, the weighted scatter_add, the capacity warm-up),
# model/mor_model/modeling_llama.py (MoRLlamaForCausalLM.transform_layer_to_mor_expert: one such layer
# per recursion, the middle cycle between unique first and last layers; MoRLlamaModel.forward passes
# each recursion's selected tokens to the next), util/config.py (preprocess_config: the default
# capacities (N_r - i) / N_r), conf/pretrain/*mor_expert_linear_alpha_0.1_sigmoid* (alpha 0.1,
# sigmoid, linear router). Followed here, written anew for this code base.


@dataclass
class MoRConfig(RecurrentConfig):
    # n_prelude / n_coda are MoR's unique first and last layers, n_core x n_recur its shared middle
    # recursed N_r = n_recur times
    n_recur: int = 3
    router_hidden: int = 64  # width of each auxiliary (causal) router's hidden layer
    router_alpha: float = 0.1  # alpha: a chosen token gets h + alpha * sigmoid(w . h) * Core(h)
    capacity_warmup: int = 0  # iterations over which each capacity falls (cosine) from 1 to its target; 0: none

    def __post_init__(self):
        super().__post_init__()
        if self.n_prelude < 1 or self.n_coda < 1:
            raise ValueError("mor's middle-cycle sharing keeps unique first and last layers: n_prelude, n_coda >= 1")
        if self.router_hidden < 1:
            raise ValueError(f"router_hidden must be >= 1, got {self.router_hidden}")
        if self.attn_window:  # the core runs on the routed tokens gathered together, not at their positions
            raise ValueError("mor does not take attn_window: its routed tokens are gathered, so a window would "
                             "count kept tokens, not positions; leave attn_window at 0")
        if self.router_alpha <= 0 or self.capacity_warmup < 0:
            raise ValueError(f"mor needs router_alpha > 0 and capacity_warmup >= 0; got {self.router_alpha} "
                             f"and {self.capacity_warmup}")


class RoutedKVCache:
    """MoR's recursion-wise cache for one core layer at one recursion: per batch row, the keys and
    values of only the tokens routed to this recursion (rows route differently, so each has its
    own KVCache, created on first use)."""

    def __init__(self, max_len):
        self.max_len = max_len
        self.rows = []

    def row(self, b):
        while len(self.rows) <= b:
            self.rows.append(KVCache(self.max_len))
        return self.rows[b]


class MoR(RecurrentLM):
    """Expert-choice MoR. At recursion s every token still active gets a router weight
    g = alpha * sigmoid(w_s . h). Recursion s keeps a fraction c_s = (N_r - s) / N_r of the tokens:
    all of them at the first recursion. In training the top-k active tokens of each row by g go on
    (k = floor(c_s T); hierarchical: a token dropped once stays dropped). A chosen token becomes
    h + g * Core(h) (the reference adds the weighted block output, and its block, like ours, returns
    its input plus the residual branches: h + g (h + Delta)); the others keep h. Chosen tokens pass
    the shared core in causal order, attending only to each other. With capacity_warmup = W, c_s
    starts near 1 and falls along a half cosine to its target over W iterations (train.py calls
    set_iteration).
    Expert choice sees the whole sequence, so it is not causal: a small auxiliary router per recursion
    learns to predict the choice from the token alone (BCE on detached states, the reference's
    sampling='aux_router'), and whenever the model is not training (val loss, generation) a token goes
    on if it is active and the auxiliary router says yes (at a capacity-1 recursion, every token).
    Each eval forward records the fraction of tokens each recursion kept in last_keep_fractions;
    eval_flops_per_token turns them into FLOPs."""

    kv_modes = ('per_step',)  # its own recursion-wise cache, exact
    exit_unsupported = ("mor's routers already choose each token's depth (its own routing), so early exit does "
                        "not apply to mor; leave exit_threshold unset (grt, huginn and rung1..rung4 can exit early)")

    def __init__(self, config):
        super().__init__(config)
        d, a = config.n_embd, config.router_hidden
        self.routers = nn.ModuleList([nn.Linear(d, 1, bias=False) for _ in range(config.n_recur)])
        self.aux_routers = nn.ModuleList([nn.Sequential(nn.Linear(d, a), nn.SiLU(), nn.Linear(a, 1))
                                          for _ in range(config.n_recur)])
        self._finish_init()
        self.router_loss = None  # the last training forward's auxiliary BCE, for logging
        self.iteration = None  # the training iteration, for the capacity warm-up (None: warm-up over)
        self.last_keep_fractions = []  # per recursion, the fraction of the last eval forward's tokens kept

    def set_iteration(self, iteration):
        """train.py calls this before every iteration: the capacity warm-up is a function of it."""
        self.iteration = iteration

    def capacity(self, step):
        """The fraction of tokens recursion `step` keeps: (N_r - step) / N_r, during the warm-up raised
        to c + (1 - c) * (1 + cos(pi * min(1, (iteration + 1) / W))) / 2 (the reference counts its
        training forwards from 1)."""
        c = self.config
        target = (c.n_recur - step) / c.n_recur
        if not self.training or c.capacity_warmup == 0 or self.iteration is None:
            return target
        ratio = min(1.0, (self.iteration + 1) / c.capacity_warmup)
        return target + (1 - target) * 0.5 * (1 + math.cos(math.pi * ratio))

    def kept_tokens(self, step, seq_len):
        """k = max(1, floor(capacity * T)), as the reference's max(1, int(capacity_factor * seq_len));
        the 1e-9 makes an exact fraction such as 2/3 of 30 give 20 whatever its rounding."""
        return max(1, math.floor(self.capacity(step) * seq_len + 1e-9))

    def forward(self, idx, targets=None, num_steps=None, kv_cache=None):
        self.router_loss = None
        logits, loss = super().forward(idx, targets, num_steps, kv_cache)
        if loss is not None and self.router_loss is not None:
            # trains the auxiliary routers (inputs detached: nothing else feels it) without changing
            # the loss's value, so the logged training loss is the same cross-entropy as every model's
            loss = loss + self.router_loss - self.router_loss.detach()
        return logits, loss

    def recur(self, h, e, r, caches):
        n = self.config.n_core
        active = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        if not self.training:
            self.last_keep_fractions = []
        for step in range(r):
            weight = self.config.router_alpha * torch.sigmoid(self.routers[step](h)).squeeze(-1)  # (B, T) g
            aux_logit = self.aux_routers[step](h.detach()).squeeze(-1)
            step_caches = caches[step * n: (step + 1) * n]
            if self.training:  # expert choice: the same k in every row, so one batched gather
                idx = self.expert_choice(weight, active, step)
                chosen = torch.zeros_like(active).scatter(1, idx, True)
                bce = F.binary_cross_entropy_with_logits(aux_logit[active], chosen[active].float())
                self.router_loss = bce if self.router_loss is None else self.router_loss + bce
                h = self.update_chosen(h, weight, idx, step_caches)
            else:  # the auxiliary router: causal, each token decides from itself; rows keep different counts
                chosen = active if self.capacity(step) >= 1 else active & (aux_logit > 0)
                h = self.update_rows(h, weight, chosen, step_caches)
                self.last_keep_fractions.append(chosen.float().mean().item())
            active = chosen
        return h

    def expert_choice(self, weight, active, step):
        """(B, k) positions of the top-k active tokens of each row by router weight, ascending
        (training only: it ranks each token against later ones)."""
        k = self.kept_tokens(step, weight.size(1))
        scores = weight.detach().masked_fill(~active, -1.0)  # weights are in (0, alpha): inactive lose
        return scores.topk(k, dim=1).indices.sort(dim=1).values

    def update_rows(self, h, weight, chosen, caches):
        """update_chosen row by row, for a (B, T) mask whose rows keep different numbers of tokens;
        each row has its own routed cache."""
        rows = []
        for b in range(h.size(0)):
            row_caches = [None if cache is None else cache.row(b) for cache in caches]
            rows.append(self.update_chosen(h[b:b + 1], weight[b:b + 1], chosen[b].nonzero().view(1, -1), row_caches))
        return torch.cat(rows)

    def update_chosen(self, h, weight, idx, caches):
        """h + g * Core(h) at positions idx (B, k), ascending, so the gathered tokens keep causal
        order and plain causal attention among them is right; h elsewhere (the reference's
        scatter_add of the weighted block output into the full sequence)."""
        if idx.size(1) == 0:
            return h
        at = idx.unsqueeze(-1).expand(-1, -1, h.size(-1))
        x = h.gather(1, at)
        g = weight.gather(1, idx).unsqueeze(-1)
        return h.scatter(1, at, x + g * self.run_core(x, caches))

    def new_kv_cache(self, max_len, num_steps=None, kv_mode='per_step'):
        """Prelude and coda layers cache every token; each core layer at each recursion caches only
        the tokens routed there (recursion-wise caching), per batch row. Exact: generation with it
        equals generation without."""
        if kv_mode != 'per_step':
            raise ValueError(f"kv_mode={kv_mode!r} is GRT's; mor has its own recursion-wise cache, use 'per_step'")
        c = self.config
        r = self.resolve_steps(num_steps)
        return ([KVCache(max_len) for _ in range(c.n_prelude)]
                + [RoutedKVCache(max_len) for _ in range(c.n_core * r)]
                + [KVCache(max_len) for _ in range(c.n_coda)])

    def resolve_steps(self, num_steps):
        r = self.config.n_recur if num_steps is None else super().resolve_steps(num_steps)
        if r > self.config.n_recur:
            raise ValueError(f"mor has a router for each of its n_recur = {self.config.n_recur} recursions; "
                             f"num_steps must be <= {self.config.n_recur}, got {r}")
        return r

    def sample_depth(self, generator):
        """MoR always trains all N_r recursions (its routers decide the depth of each token)."""
        return self.config.n_recur

    def mean_train_steps(self):
        return self.config.n_recur

    def flops_per_token(self, seq_len, num_steps=None):
        """Forward FLOPs per token in training (expert choice at the target capacities), LM head
        excluded, averaged over tokens; see eval_flops_per_token."""
        r = self.config.n_recur if num_steps is None else round(num_steps)  # train.py passes a mean (float) depth
        fractions = [self.kept_tokens(s, seq_len) / seq_len for s in range(r)]
        return self.eval_flops_per_token(seq_len, fractions)

    def eval_flops_per_token(self, seq_len, keep_fractions=None):
        """Forward FLOPs per token, LM head excluded, when recursion s keeps a fraction f_s of the
        tokens (default: the last eval forward's last_keep_fractions): prelude and coda blocks for
        every token; f_s of the tokens pass n_core blocks whose attention spans f_s * S keys; every
        token is scored by both routers at every recursion (2d + 2da + 2a, the aux router's hidden
        width a; as for the blocks, bias additions are not counted). Exact when every row keeps
        the same count (training); with rows that differ (eval) the attention term uses the mean f_s."""
        c, d, a = self.config, self.config.n_embd, self.config.router_hidden
        fractions = self.last_keep_fractions if keep_fractions is None else keep_fractions
        flops = (c.n_prelude + c.n_coda) * (24 * d * d + 4 * seq_len * d)
        for f in fractions:
            flops += f * c.n_core * (24 * d * d + 4 * f * seq_len * d) + 2 * d + 2 * d * a + 2 * a
        return flops
