"""
The paper's recurrent baselines, built on GRT so they share its prelude, coda, depth loop and KV cache:

- Huginn (Geiping et al., 2025), heavy-tail depth sampling: the step is h = Core(adapter [h ; e])
  (GRT's ablation rung 4 without state noise), from a random initial state in training and zeros
  in eval; each training micro-step draws its depth from a log-normal Poisson distribution and
  backpropagates through only the last k steps.
- MoR, Mixture-of-Recursions (Bae et al., 2025), middle-cycle sharing: unique first and last layers
  (GRT's prelude and coda) around a shared middle recursed N_r times; at each recursion a router
  keeps only some tokens and updates them by h + g (Core(h) - h).

model.py imports this file at its end and this file registers both in model.MODELS, so either
import order works. They live apart from model.py because they are comparisons, not the method.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import model
from model import GRT, GRTConfig, KVCache

# -----------------------------------------------------------------------------
# Huginn: heavy-tail depth sampling with truncated backpropagation


@dataclass
class HuginnConfig(GRTConfig):
    # n_recur is Huginn's mean depth r_mean: the eval depth, and the mean of the training draws' tau
    rung: int = 4  # Huginn's step is GRT's rung 4: h = Core(adapter [h ; e]), no gate
    state_noise: float = 0.0  # Huginn perturbs the initial state, not every step
    backprop_depth: int = 8  # k: only the last k steps of a training pass carry gradients
    depth_sigma: float = 0.5  # sigma of the log-normal in the depth distribution
    state_init_std: float = 0.02  # initial state ~ TruncNormal(0, std^2) on [-3 std, 3 std], our init scale

    def __post_init__(self):
        super().__post_init__()
        if self.rung != 4:
            raise ValueError(f"huginn's step is rung 4 (concatenation adapter, no gate); leave rung out, "
                             f"got {self.rung}")
        if self.backprop_depth < 1 or self.depth_sigma <= 0 or self.state_init_std < 0:
            raise ValueError(f"huginn needs backprop_depth >= 1, depth_sigma > 0, state_init_std >= 0; got "
                             f"{self.backprop_depth}, {self.depth_sigma}, {self.state_init_std}")


class Huginn(GRT):
    """GRT at rung 4 (self.proj is Huginn's concatenation adapter Linear(2d -> d)) with Huginn's
    initial state, depth distribution and truncated backpropagation."""

    def initial_state(self, e):
        """Random h0 in training (the model learns to forget where it starts), zeros in eval."""
        if not self.training:
            return torch.zeros_like(e)
        std = self.config.state_init_std
        return nn.init.trunc_normal_(torch.empty_like(e), std=std, a=-3 * std, b=3 * std)

    def recur(self, h, e, r, caches):
        """In training only the last backprop_depth steps carry gradients; the earlier ones run
        under no_grad, so their activations are never stored (Huginn's truncated backprop)."""
        n = self.config.n_core
        free = max(r - self.config.backprop_depth, 0) if self.training else 0
        with torch.no_grad():
            h = super().recur(h, e, free, caches[:free * n])
        return super().recur(h, e, r - free, caches[free * n:])

    def draw_depths(self, count, generator=None):
        """count depths r = min(Poisson(tau) + 1, 3 r_mean), tau ~ LogNormal(log r_mean - sigma^2/2, sigma):
        tau has mean r_mean and a heavy right tail, so a few passes train very deep."""
        c = self.config
        mu = math.log(c.n_recur) - c.depth_sigma ** 2 / 2
        tau = torch.empty(count, device='cpu').log_normal_(mu, c.depth_sigma, generator=generator)  # CPU generator
        return (torch.poisson(tau, generator=generator) + 1).clamp(max=3 * c.n_recur).long()

    def sample_depth(self, generator):
        return int(self.draw_depths(1, generator).item())

    def resolve_steps(self, num_steps):
        if num_steps is None and self.training:  # a caller without train.py's generator
            return self.sample_depth(None)
        return super().resolve_steps(num_steps)  # eval: r_mean

    def mean_train_steps(self):
        """E[r] under the training distribution (about r_mean + 1), from 65536 seeded draws."""
        return self.draw_depths(65536, torch.Generator().manual_seed(0)).float().mean().item()

    def train_flops_per_token(self, seq_len, num_steps):
        """Training FLOPs per token at depth r: forward (the rung-4 count of GRT.flops_per_token)
        plus backward (2x forward) for everything except the r - k no-grad steps, which run forward only."""
        c, d = self.config, self.config.n_embd
        step = c.n_core * (24 * d * d + 4 * seq_len * d) + 4 * d * d  # core blocks + adapter
        return 3 * self.flops_per_token(seq_len, num_steps) - 2 * max(num_steps - c.backprop_depth, 0) * step

    def expected_train_flops_per_token(self, seq_len):
        """Training FLOPs per token averaged over the depth distribution (for isoFLOP configs)."""
        depths = self.draw_depths(65536, torch.Generator().manual_seed(0)).tolist()
        return sum(self.train_flops_per_token(seq_len, r) for r in depths) / len(depths)

    def estimate_mfu(self, tokens_per_iter, dt, peak_flops, seq_len, num_steps=None):
        """As LanguageModel.estimate_mfu, but no-grad steps count forward only. num_steps is the
        iteration's mean drawn depth; max(r - k, 0) at the mean slightly undercounts mixed depths."""
        r = self.config.n_recur if num_steps is None else num_steps
        return self.train_flops_per_token(seq_len, r) * tokens_per_iter / dt / peak_flops


# -----------------------------------------------------------------------------
# Mixture-of-Recursions: expert-choice routing over a middle-cycle shared core


@dataclass
class MoRConfig(GRTConfig):
    # n_prelude / n_coda are MoR's unique first and last layers, n_core x n_recur its shared middle
    # recursed N_r = n_recur times; state_noise, gate_* are GRT's and unused here
    n_recur: int = 3
    rung: int = 2  # MoR's update is its own routed h + g (Core(h) - h): no W_proj, no gate
    router_hidden: int = 64  # width of each auxiliary (causal) router's hidden layer

    def __post_init__(self):
        super().__post_init__()
        if self.rung != 2:
            raise ValueError(f"mor has its own routed update; leave rung out, got {self.rung}")
        if self.n_prelude < 1 or self.n_coda < 1:
            raise ValueError("mor's middle-cycle sharing keeps unique first and last layers: n_prelude, n_coda >= 1")
        if self.router_hidden < 1:
            raise ValueError(f"router_hidden must be >= 1, got {self.router_hidden}")


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


class MoR(GRT):
    kv_modes = ('per_step',)  # its own recursion-wise cache, exact
    """At recursion s each token still active gets a router weight g = sigmoid(w_s . h). In training
    the top-k active tokens of each row by g go on (expert choice, hierarchical: a token dropped
    once stays dropped; k = ceil(T (N_r - s) / N_r), a linear capacity schedule). Expert choice
    sees the whole sequence, so it is not causal: a small auxiliary router per recursion learns to
    predict the choice from the token alone (BCE, on detached states), and whenever the model is
    not training (val loss, generation) a token goes on if it is active and the auxiliary router
    says yes. Chosen tokens are gathered in causal order, pass the shared core attending only to
    each other, and are updated by h + g (Core(h) - h); the others keep h."""

    def __init__(self, config):
        super().__init__(config)
        d, a = config.n_embd, config.router_hidden
        self.routers = nn.ModuleList([nn.Linear(d, 1, bias=False) for _ in range(config.n_recur)])
        self.aux_routers = nn.ModuleList([nn.Sequential(nn.Linear(d, a), nn.SiLU(), nn.Linear(a, 1))
                                          for _ in range(config.n_recur)])
        self.routers.apply(self._init_weights)
        self.aux_routers.apply(self._init_weights)
        self.router_loss = None  # the last training forward's auxiliary BCE, for logging

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
        for step in range(r):
            weight = torch.sigmoid(self.routers[step](h)).squeeze(-1)  # (B, T) router weight g
            aux_logit = self.aux_routers[step](h.detach()).squeeze(-1)
            step_caches = caches[step * n: (step + 1) * n]
            if self.training:  # expert choice: the same k in every row, so one batched gather
                idx = self.expert_choice(weight, active, step)
                chosen = torch.zeros_like(active).scatter(1, idx, True)
                bce = F.binary_cross_entropy_with_logits(aux_logit[active], chosen[active].float())
                self.router_loss = bce if self.router_loss is None else self.router_loss + bce
                h = self.update_chosen(h, weight, idx, step_caches)
            else:  # the auxiliary router: causal, each token decides from itself; rows keep different counts
                chosen = active & (aux_logit > 0)
                h = self.update_rows(h, weight, chosen, step_caches)
            active = chosen
        return h

    def expert_choice(self, weight, active, step):
        """(B, k) positions of the top-k active tokens of each row by router weight, ascending
        (training only: it ranks each token against later ones)."""
        c = self.config
        k = math.ceil(weight.size(1) * (c.n_recur - step) / c.n_recur)
        scores = weight.detach().masked_fill(~active, -1.0)  # weights are in (0, 1): inactive lose
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
        """h + g (Core(h) - h) at positions idx (B, k), ascending, so the gathered tokens keep
        causal order and plain causal attention among them is right; h elsewhere."""
        if idx.size(1) == 0:
            return h
        at = idx.unsqueeze(-1).expand(-1, -1, h.size(-1))
        x = h.gather(1, at)
        g = weight.gather(1, idx).unsqueeze(-1)
        x = x + g * (self.run_core(x, caches) - x)
        return h.scatter(1, at, x)

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
        """Forward FLOPs per token, LM head excluded, averaged over tokens: prelude and coda blocks
        for every token; at recursion s a fraction f_s = (N_r - s) / N_r of the tokens (the capacity
        schedule) passes n_core blocks whose attention spans f_s * S keys; every token is scored by
        both routers at every recursion (2d + 2da + 2a, the aux router's hidden width a; as for the
        blocks, bias additions are not counted).
        At inference the auxiliary router's choices may keep more or fewer tokens than f_s."""
        c, d, a = self.config, self.config.n_embd, self.config.router_hidden
        r = c.n_recur if num_steps is None else round(num_steps)  # train.py passes a mean (float) depth
        flops = (c.n_prelude + c.n_coda) * (24 * d * d + 4 * seq_len * d)
        for s in range(r):
            f = (c.n_recur - s) / c.n_recur
            flops += f * c.n_core * (24 * d * d + 4 * f * seq_len * d) + 2 * d + 2 * d * a + 2 * a
        return flops


model.MODELS.update(huginn=(HuginnConfig, Huginn), mor=(MoRConfig, MoR))
