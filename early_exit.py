"""
Per-token early exit at inference, for the recurrent models of model.py (beyond the paper).

A token runs the recurrence steps s = 1, 2, ... and stops after the first s >= min_steps whose
criterion c_s falls below a threshold (never after r). With h_s its state after step s:
  'state': c_s = ||h_s - h_(s-1)|| / ||h_(s-1)||, the relative change of the token's state (fp32).
  'kl':    c_s = KL(p_(s-1) || p_s), p_s = softmax(lm_head(ln_f(Coda(h_s)))) the next-token distribution
           of exiting after step s, as Huginn's KL exit (Geiping et al., 2025), which costs a probe
           through the coda and head per step.
Threshold 0 never exits, so every token runs r steps, exactly as model.py's fixed-depth forward.
in_order: a token stops only once the token before it has: at the first s >= max(min_steps, d_(t-1)),
d_(t-1) the depth of the token before it. Depths never fall along the sequence, so no token stops before
a token it reads, directly or through the tokens between.

    exiting = ExitingModel(model, EarlyExit(threshold=0.07))
    out = exiting.generate(idx, 100)      # exiting.exit_steps: the depths of the last forward pass

docs/sampling_and_kv_cache.md#adaptive-early-exit has the rules in full and what they save.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import RecurrentLM, run_blocks

EXIT_CRITERIA = ('state', 'kl')


@dataclass
class EarlyExit:
    threshold: float
    min_steps: int = 1
    criterion: str = 'state'
    in_order: bool = False

    def __post_init__(self):
        if self.criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit must be one of {', '.join(EXIT_CRITERIA)}, got {self.criterion!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold >= 0:
            raise ValueError(f"exit_threshold must be a number >= 0 (0 never exits), got {self.threshold!r}")
        if isinstance(self.min_steps, bool) or int(self.min_steps) != self.min_steps or self.min_steps < 1:
            raise ValueError(f"min_steps must be an integer >= 1, got {self.min_steps!r}")
        self.min_steps = int(self.min_steps)
        if not isinstance(self.in_order, bool):
            raise ValueError(f"in_order must be True or False, got {self.in_order!r}")


def check_early_exit(model, rule, num_steps=None, kv_mode='per_step'):
    """Raise ValueError with a one-line fix unless model can exit early with these settings."""
    if not isinstance(model, RecurrentLM):
        raise ValueError("early exit stops a recurrent model's core loop per token; a dense GPT has no loop "
                         "(use a GRT or a recurrent baseline, or leave exit_threshold unset)")
    if getattr(model, 'exit_unsupported', None):  # MoR: its routers choose each token's depth
        raise ValueError(model.exit_unsupported)
    if rule.criterion == 'kl' and kv_mode != 'per_step':
        raise ValueError(f"exit='kl' prefills a prompt one token at a time (its probe reads the coda), which "
                         f"changes what kv_mode={kv_mode!r} gives a prompt; use kv_mode='per_step' or exit='state'")
    if model.training:
        raise ValueError("early exit is for inference: call model.eval() first (training samples the depth)")
    r = model.resolve_steps(num_steps)
    if rule.min_steps > r:
        raise ValueError(f"min_steps={rule.min_steps} exceeds the {r} recurrence steps this forward runs; "
                         f"pick min_steps <= {r}")


def probe_flops(model, seq_len):
    """Forward FLOPs per token of one 'kl' probe: the coda's blocks and the LM head (2 d vocab)."""
    c, d = model.config, model.config.n_embd
    return c.n_coda * (24 * d * d + 4 * seq_len * d) + 2 * d * c.vocab_size


class ExitingModel:
    """A recurrent model whose forward pass lets each token stop its recurrence at its own depth.
    Called like the model; after each call, exit_steps (B, T) holds each token's depth d and
    exit_stats 'steps_run' (steps the chunk ran, the batch's max of d) and 'probes' ('kl' probes).
    With in_order it keeps the cache it last filled (and so its memory), which only it may continue."""

    def __init__(self, model, rule):
        self.model, self.rule = model, rule
        self.exit_steps = self.exit_stats = None
        self.last_cache = self.last_length = self.last_depth = None  # in_order: that cache, its length, its last d

    def __call__(self, idx, targets=None, num_steps=None, kv_cache=None):
        m = self.model
        check_early_exit(m, self.rule, num_steps)
        r = m.resolve_steps(num_steps)
        if self.rule.criterion == 'kl' and idx.size(1) > 1:
            return m.head(self.body_token_by_token(idx, r, kv_cache), targets)
        return m.head(self.body(idx, r, kv_cache), targets)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None, use_cache=True,
                 kv_mode='per_step'):
        new = self.generate_tokens(idx, max_new_tokens, temperature, top_k, num_steps, use_cache, kv_mode)
        return torch.cat([idx, *new], dim=1)

    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, num_steps=None, use_cache=True,
                        kv_mode='per_step'):
        check_early_exit(self.model, self.rule, num_steps, kv_mode)
        return self.model.generate_tokens(idx, max_new_tokens, temperature, top_k, num_steps, use_cache, kv_mode,
                                          forward=self)

    def body(self, idx, r, kv_cache):
        """The embeddings and RecurrentLM.body, with recur_with_exit in place of the fixed-depth loop."""
        m = self.model
        x = m.embed(idx, kv_cache)
        caches = kv_cache or [None] * m.num_block_passes(r)
        p, core = m.config.n_prelude, m.config.n_core * r
        floor = self.depth_before(idx, kv_cache) if self.rule.in_order else None
        e = run_blocks(m.transformer.prelude, x, caches[:p])
        h = self.recur_with_exit(m.initial_state(e), e, r, caches[p:p + core], caches[p + core:], floor)
        if self.rule.in_order and kv_cache is not None:  # where the next chunk through this cache starts
            self.last_cache, self.last_length = kv_cache, kv_cache[0].length
            self.last_depth = self.exit_steps[:, -1]
        return run_blocks(m.transformer.coda, m.before_coda(h), caches[p + core:])

    def depth_before(self, idx, kv_cache):
        """(B,) the depth of the token before the chunk idx, the last this cache holds (0 at a sequence's start)."""
        if kv_cache is None or kv_cache[0].length == 0:
            return torch.zeros(idx.size(0), dtype=torch.long, device=idx.device)
        if kv_cache is not self.last_cache or kv_cache[0].length != self.last_length:
            raise ValueError("in_order exit needs the depth of the token before the chunk: continue only the cache "
                             "this ExitingModel filled last, as it left it, or start from an empty one")
        return self.last_depth

    def recur_with_exit(self, h, e, r, caches, coda_caches, floor):
        """The recurrence with per-token exit. While any token of the chunk still runs, every token
        passes the step (rows exit independently, at the cost of the slowest) and an exited token's
        state stays h_d; its keys and values at later steps are filled from step d (ExitFillCache).
        Once every token has exited, the remaining steps only fill their caches. floor (B,): in_order,
        the depth of the token before the chunk, before which no token of the chunk stops (else None)."""
        m, rule, n = self.model, self.rule, self.model.config.n_core
        # the first step after which a token of the chunk may stop
        first = rule.min_steps if floor is None else max(rule.min_steps, int(floor.min()))
        exited = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
        depth = torch.full(h.shape[:2], r, dtype=torch.long, device=h.device)
        n_exited, n_tokens = 0, exited.numel()  # counted on the host: one sync a step
        log_p = None  # 'kl': log p_(s-1), the previous exit's distribution
        if rule.criterion == 'kl' and first == 1 and r > 1:
            log_p = self.exit_log_probs(h, coda_caches)  # p_0
        probes, steps_run = int(log_p is not None), 0
        fills = [None] * n
        for step in range(r):
            s = step + 1  # the steps a token has run after this one
            fills = [ExitFillCache(cache, exited if n_exited else None, None if fill is None else fill.chunk)
                     for cache, fill in zip(caches[step * n:(step + 1) * n], fills)]
            if n_exited == n_tokens:  # nothing left to run: store the exited tokens' last keys and values
                for fill in fills:
                    fill.fill()
                continue
            h_next = m.recurrence_step(h, e, fills)
            if n_exited:  # exited tokens keep h_d
                h_next = torch.where(exited.unsqueeze(-1), h.to(h_next.dtype), h_next)
            steps_run += 1
            if s == r:  # the last step: every token stops here
                h = h_next
                break
            stop = None  # tokens whose c_s < threshold, (B, T), from step first on
            if rule.criterion == 'state' and s >= first:
                # ||h_s - h_(s-1)|| < threshold ||h_(s-1)||, multiplied out: an all-zero h_(s-1) never exits
                h_prev = h.float()
                stop = (h_next.float() - h_prev).norm(dim=-1) < rule.threshold * h_prev.norm(dim=-1)
            elif rule.criterion == 'kl' and s >= first - 1:
                log_p_next = self.exit_log_probs(h_next, coda_caches)
                probes += 1
                if log_p is not None:  # KL(p_(s-1) || p_s), clamped at 0 against rounding
                    stop = (log_p.exp() * (log_p - log_p_next)).sum(dim=-1).clamp_min(0) < rule.threshold
                log_p = log_p_next
            if stop is not None and rule.in_order:  # stop only once every earlier token has (exited: kept stopped)
                stop = (stop | exited).cummin(dim=1).values & (floor <= s)[:, None]
            if stop is not None and bool(stop.any()):  # one sync a step; no bookkeeping until a token stops
                stop &= ~exited
                depth.masked_fill_(stop, s)
                exited = exited | stop
                n_exited = int(exited.sum())
            h = h_next
        self.exit_steps, self.exit_stats = depth, dict(steps_run=steps_run, probes=probes)
        return h

    def body_token_by_token(self, idx, r, kv_cache):
        """A chunk of several tokens under 'kl', one token at a time through the cache (a cache for the
        chunk alone when there is none): a token's probe reads the coda, whose attention needs the
        earlier tokens' final coda keys and values. So a prefilled prompt equals the same tokens
        decoded, as Huginn's prefill with exits (recpre/raven_modeling_minimal.py)."""
        cache = kv_cache or self.model.new_kv_cache(idx.size(1), r)
        outputs, depths, steps_run, probes = [], [], 0, 0
        for t in range(idx.size(1)):
            outputs.append(self.body(idx[:, t:t + 1], r, cache))
            depths.append(self.exit_steps)
            steps_run, probes = steps_run + self.exit_stats['steps_run'], probes + self.exit_stats['probes']
        self.exit_steps, self.exit_stats = torch.cat(depths, dim=1), dict(steps_run=steps_run, probes=probes)
        return torch.cat(outputs, dim=1)

    def exit_log_probs(self, h, coda_caches):
        """log p_s (fp32) of exiting with state h: the coda (reading its caches without changing them),
        ln_f and the head."""
        m = self.model
        x = run_blocks(m.transformer.coda, m.before_coda(h), [None if c is None else PeekCache(c) for c in coda_caches])
        return F.log_softmax(m.lm_head(m.transformer.ln_f(x)).float(), dim=-1)


class ExitFillCache:
    """One core layer's cache at one recurrence step s while tokens exit early, wrapping the cache that
    step would use (a KVCache, a CoreStepCache, or None).

    A token that exited after step d < s never computes its step-s keys and values, yet later tokens
    attend to them at step s. Its entry is filled with its step-d keys and values from the same core
    layer, as Huginn's 'latest' lookup (HuginnDynamicCache): the newest description of the token,
    in the space that layer's queries were trained on, for the cost of a copy. The fill comes before
    the write and the attention, so a prefilled chunk equals the same tokens decoded, in every kv_mode.

    exited: (B, T) bool, the chunk's tokens that exited before this step (None: none has). last: the
    chunk's (k, v) at this layer at the previous step (None at the first). After update, .chunk holds
    this step's (k, v), the next step's `last`.
    """

    def __init__(self, cache, exited, last=None):
        self.cache, self.exited, self.last = cache, exited, last
        self.chunk = None

    @property
    def length(self):
        return 0 if self.cache is None else self.cache.length

    def update(self, k, v):
        if self.exited is not None:
            keep = self.exited[:, None, :, None]  # (B, 1, T, 1) against (B, n_head, T, head_size)
            k = torch.where(keep, self.last[0], k)
            v = torch.where(keep, self.last[1], v)
        self.chunk = (k, v)
        return (k, v) if self.cache is None else self.cache.update(k, v)

    def fill(self):
        """Every token of the chunk exited before this step: store their last keys and values."""
        self.chunk = self.last
        if self.cache is not None:
            self.cache.update(*self.last)


class PeekCache:
    """A cache for a probe that must not change it: attention sees the stored tokens plus the chunk, but
    the stored length stays put, so the real pass that follows overwrites the same slots."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def length(self):
        return self.cache.length

    def update(self, k, v):
        keys, values = self.cache.update(k, v)
        self.cache.length -= k.size(2)
        return keys, values
