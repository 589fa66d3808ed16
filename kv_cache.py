"""
KV caches for generation: the keys and values of the tokens seen so far, one cache per executed layer.

A dense GPT keeps one KVCache per layer. A recurrent model runs its shared core r times, so by
default (kv_mode 'per_step', the paper's) each core layer keeps its own KVCache at every step; the
approximate modes 'shared' and 'mean' keep one CoreLayerCache per core layer instead (see
RecurrentLM.new_kv_cache in model.py for the layout, and docs/kv_cache.md for what each costs).
Per-token early exit (RecurrentLM.recur_with_exit) wraps the core's caches in ExitFillCache, which
fills the entries an exited token never computed (the rule is in its docstring), and reads the coda
through PeekCache for its 'kl' criterion.
"""

import torch


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


# How a recurrent model caches the keys and values of its shared core across the R recurrence steps
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
        """The R per-step handles RecurrentLM.body indexes, all backed by this one buffer."""
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


# -----------------------------------------------------------------------------
# Early exit (RecurrentLM.recur_with_exit): the cache handles of a forward pass that lets each token
# stop its recurrence at its own depth


class ExitFillCache:
    """One core layer's cache at one recurrence step s while tokens exit early, wrapping the cache
    that step would use (a KVCache, a CoreStepCache, or None when there is no cache).

    The fill rule: a token that exited after step d < s never computes its step-s keys and values,
    yet later tokens (and, in a chunk of several tokens, later tokens of the same chunk) attend at
    step s to step-s keys and values. Its step-s entry is filled with the keys and values of its last
    computed step d at the same core layer, as Huginn does (Geiping et al., 2025: the 'latest'
    lookup of recpre/raven_modeling_minimal.py's HuginnDynamicCache takes, for a token missing at
    a step, the latest step it computed at the same position in the core). Why this rule: an exited
    token's state stays h_d from then on, so its step-d keys and values are the newest description
    of it that exists; the entry of step d was computed by the same core layer, so it is in the
    space that layer's queries were trained against at every step; and it costs a copy, not compute.

    The fill is applied before the write and before attention, so a token's own chunk sees it too
    (a prefilled prompt with exits equals the same tokens decoded one at a time), and it is the
    same for every kv_mode: 'per_step' stores the filled entry at step s, 'shared' stores the
    filled step-R entry (= the step-d one), and 'mean' averages the steps 1..R with steps d+1..R
    counting as step d.

    exited: (B, T) bool, the chunk's tokens that exited before this step (None: none has). last: (k, v) of the chunk
    at this layer at the previous step, after its own fill (None at the first step). After update,
    .chunk holds this step's (k, v), the next step's `last`.
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
        """Every token of the chunk has exited before this step: store their last keys and values
        without running the step."""
        self.chunk = self.last
        if self.cache is not None:
            self.cache.update(*self.last)


class PeekCache:
    """A cache for a probe that must not change it: attention sees the stored tokens plus the chunk,
    as an update would give, but the stored length stays put, so the real pass that follows
    overwrites the same slots (early exit's 'kl' criterion reads the coda this way)."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def length(self):
        return self.cache.length

    def update(self, k, v):
        keys, values = self.cache.update(k, v)
        self.cache.length -= k.size(2)
        return keys, values
