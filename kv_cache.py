"""
KV caches for generation: the keys and values of the tokens seen so far, one cache per executed layer.

A dense GPT keeps one KVCache per layer. A recurrent model runs its shared core r times, so by default
(kv_mode 'per_step', the paper's) each core layer keeps its own KVCache at every step; the approximate
modes 'shared' and 'mean' keep one CoreLayerCache per core layer instead (recurrent_kv_cache below;
docs/sampling_and_kv_cache.md says what each costs).
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


def recurrent_kv_cache(max_len, n_prelude, n_core, n_coda, r, kv_mode='per_step'):
    """The caches of one generation with a recurrent model, in the order its body runs its layers: the
    prelude layers, core layer j at step s (index n_prelude + s * n_core + j), the coda layers.
    Prelude and coda layers get one exact KVCache each. The core, by kv_mode:
      'per_step' (exact): a KVCache for every core layer at every step s, so a new token at step s
                 attends to earlier tokens' step-s keys and values; n_core * r caches.
      'shared':  one CoreLayerCache per core layer holding each earlier token's step-r keys and values.
      'mean':    one CoreLayerCache per core layer holding their mean over the r steps.
    'shared' and 'mean' hold n_core caches instead of n_core * r and change the function."""
    if kv_mode not in KV_MODES:
        raise ValueError(f"unknown kv_mode {kv_mode!r}; choose one of {', '.join(KV_MODES)}")
    if kv_mode == 'per_step':
        core = [KVCache(max_len) for _ in range(n_core * r)]
    else:
        layers = [CoreLayerCache(max_len, r, kv_mode).steps() for _ in range(n_core)]  # layers[j][s]
        core = [layers[j][s] for s in range(r) for j in range(n_core)]
    return [KVCache(max_len) for _ in range(n_prelude)] + core + [KVCache(max_len) for _ in range(n_coda)]
