"""
The decode benchmark behind the paper's headline: the dense GPT-2, the GRT isoFLOP and the GRT
isoParam models of one scale, compared on parameters, FLOPs, KV cache, peak decoding memory and
latency (eager and compiled).

    python bench.py --scale=large --dtype=bfloat16
    python bench.py --scale=small --train=True          # + training tokens/s and MFU
    python bench.py --out_dir=out-shakespeare-char-grt   # a trained model, + val loss per kv_mode

Weights, activations and the KV cache are in --dtype (the model is cast, as for serving). Peak
decoding memory: on CUDA torch.cuda.max_memory_allocated over one generation; on CPU the bytes of
the tensors alive when generation starts (weights, prompt) plus the highest running total of the
allocations and frees torch's profiler records during one eager generation (exact and repeatable,
unlike RSS). Latencies are medians after a warm-up run. A readable table goes first; the last line
is one JSON object.
"""

import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import prepare_data
from config import ConfigError, parse_config
from model import KV_MODES, MODELS, preset
from sample import load_model
from train import autocast_context, peak_flops_for, pick_device, pick_dtype

DEFAULTS = dict(
    scale='small',  # tiny | small | medium | large (the paper's three, and one for tests)
    device='auto',
    dtype='auto',
    compile=True,  # also time decoding with compile_regions (every block compiled once)
    batch_size=1,
    prompt_len=32,  # prompt tokens, prefilled in one forward pass
    new_tokens=12,  # decoded tokens: few, so the large scale stays practical on 2 CPU cores
    kv_mode='per_step',  # how the GRTs cache their core (model.KV_MODES)
    train=False,  # also measure training tokens/s and MFU, eager and compiled
    out_dir='',  # benchmark the model of out_dir/ckpt.pt instead, with its val loss per kv_mode
)
TRAIN_SEQ_LEN = 256  # training sequence length for --train (capped at block_size): fits in 24 GB at large
VAL_WINDOWS = 8  # --out_dir: validation windows for the per-kv_mode loss, evenly spaced, as one batch
VAL_WINDOW_LEN = 256  # tokens per window (capped at block_size)

# the three models of each scale: (preset name, config overrides)
SCALES = {
    'tiny': {'gpt': ('tiny-gpt', {}),  # 4 layers; GRTs 1 + 1x2 + 1 (isoFLOP) and 1 + 2x2 + 1 (isoParam)
             'grt_isoflop': ('tiny-grt', {'n_recur': 2}),
             'grt_isoparam': ('tiny-grt', {'n_core': 2, 'n_recur': 2})},
    **{scale: {'gpt': (f'gpt2-{scale}', {}), 'grt_isoflop': (f'grt-{scale}-isoflop', {}),
               'grt_isoparam': (f'grt-{scale}-isoparam', {})} for scale in ('small', 'medium', 'large')},
}
FIELDS = ('params', 'params_non_embedding', 'flops_per_token', 'kv_bytes_per_token', 'peak_mem_bytes',
          'analytic_mem_bytes', 'prefill_ms', 'decode_ms_per_token', 'decode_ms_per_token_compiled', 'kv_mode')
# in the JSON too, when --train / --out_dir asked for them
OPTIONAL_FIELDS = ('train_tokens_per_s', 'train_tokens_per_s_compiled', 'mfu', 'mfu_compiled', 'val_loss')


def fail(message):
    sys.exit(f"error: {message}")


# -----------------------------------------------------------------------------
# Memory


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind tensors (tied weights counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def cpu_peak_bytes(fn):
    """(fn(), the highest running total of CPU allocations minus frees while fn ran). The profiler
    records every allocation and free with its size and time, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == '[memory]' and e.device_type() == torch.autograd.DeviceType.CPU]
    total = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        total += e.nbytes()  # negative for a free
        peak = max(peak, total)
    return result, peak


def kv_bytes_per_token(model, kv_mode, itemsize):
    """Keys and values per token over all distinct caches (an approximate mode's per-step handles
    share one buffer per core layer)."""
    caches = model.new_kv_cache(1, kv_mode=kv_mode)
    distinct = {id(getattr(cache, 'layer_cache', cache)) for cache in caches}
    return len(distinct) * 2 * model.config.n_embd * itemsize


def peak_decode_memory(model, idx, c, device):
    """Peak bytes over one eager generation of c['new_tokens'] tokens after idx."""
    generate = lambda: model.generate(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode'])
    if device.startswith('cuda'):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        generate()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)
    live = tensor_bytes([*model.parameters(), *model.buffers(), idx])
    _, peak = cpu_peak_bytes(generate)
    return live + peak


# -----------------------------------------------------------------------------
# Latency


def time_generation(model, idx, c, device):
    """(prefill ms, median decode ms per token): the time to the first token (the prompt's forward
    pass and the sampling), then the time between tokens, streamed from generate_tokens."""
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    times = []
    sync()
    t = time.perf_counter()
    for _ in model.generate_tokens(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode']):
        sync()
        now = time.perf_counter()
        times.append(1000 * (now - t))
        t = now
    return times[0], statistics.median(times[1:]) if len(times) > 1 else None


def timed_after_warmup(model, idx, c, device):
    time_generation(model, idx, c, device)  # warm-up: allocator, caches, and compilation if compiled
    return time_generation(model, idx, c, device)


# -----------------------------------------------------------------------------
# Training throughput (--train)


def train_throughput(model, c, device, dtype, steps=3):
    """(tokens/s, MFU) of forward, backward and AdamW step on random tokens, after one warm-up step.
    Depths are drawn per step as train.py draws them, from a fixed generator."""
    device_type = 'cuda' if device.startswith('cuda') else device
    seq_len = min(TRAIN_SEQ_LEN, model.config.block_size)
    model.train()
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(model.config.vocab_size, (c['batch_size'], seq_len + 1), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    depths, elapsed = [], 0.0
    for step in range(steps + 1):
        num_steps = model.sample_depth(gen)
        sync()
        t = time.perf_counter()
        with autocast_context(device_type, dtype):
            _, loss = model(x[:, :-1], targets=x[:, 1:], num_steps=num_steps)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        if step > 0:  # step 0 warms up (and compiles)
            elapsed += time.perf_counter() - t
            depths.append(num_steps)
    tokens = steps * c['batch_size'] * seq_len
    mean_depth = None if depths[0] is None else sum(depths) / len(depths)
    peak = peak_flops_for(device, getattr(torch, dtype), 0.0)
    mfu = model.estimate_mfu(tokens, elapsed, peak, seq_len, mean_depth) if peak else None
    return tokens / elapsed, mfu


# -----------------------------------------------------------------------------
# Quality of the approximate KV-cache modes (--out_dir)


@torch.no_grad()
def cached_val_loss(model, tokens, prompt_len, kv_mode, num_steps=None):
    """Teacher-forced decoding through the KV cache, exactly as generation runs it: tokens (B, L);
    prefill tokens[:, :prompt_len] in one pass, then feed the rest one token at a time. Returns the
    mean cross-entropy of predicting tokens[:, prompt_len:] (every prediction generation would make
    after this prompt). kv_mode 'per_step' equals the uncached forward's loss on those tokens."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    cache = model.new_kv_cache(x.size(1), num_steps, kv_mode=kv_mode)
    logits, _ = model(x[:, :prompt_len], targets=y[:, :prompt_len], num_steps=num_steps, kv_cache=cache)
    logits = [logits[:, -1:]]  # the prompt's last position predicts the first new token
    for i in range(prompt_len, x.size(1)):
        step_logits, _ = model(x[:, i:i + 1], targets=y[:, i:i + 1], num_steps=num_steps, kv_cache=cache)
        logits.append(step_logits)
    logits = torch.cat(logits, dim=1).float()
    targets = y[:, prompt_len - 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).item()


def val_windows(checkpoint, length, device):
    """VAL_WINDOWS fixed windows of length tokens, evenly spaced over the first validation file of
    the checkpoint's dataset (its train.py config names data_dir and dataset)."""
    config = checkpoint.get('config') or {}
    data_dir = os.path.join(config.get('data_dir', 'data'), config.get('dataset', ''))
    try:
        data = prepare_data.read_tokens(prepare_data.token_files(data_dir, 'val')[0])
    except ValueError as e:
        fail(f"validation data for the kv_mode losses: {e}")
    if len(data) < length:
        fail(f"{data_dir} has only {len(data)} validation tokens; the kv_mode losses need {length}")
    starts = np.linspace(0, len(data) - length, VAL_WINDOWS).astype(np.int64)
    return torch.from_numpy(np.stack([data[s:s + length] for s in starts]).astype(np.int64)).to(device)


# -----------------------------------------------------------------------------
# One model, all figures


def bench_model(model, c, device, dtype, val_tokens=None):
    ptdtype = getattr(torch, dtype)
    model.to(device=device, dtype=ptdtype).eval()
    itemsize = torch.empty((), dtype=ptdtype).element_size()
    mode = c['kv_mode'] if c['kv_mode'] in model.kv_modes else 'per_step'  # dense and MoR: only per_step
    run = dict(c, kv_mode=mode)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(model.config.vocab_size, (c['batch_size'], c['prompt_len']), generator=gen).to(device)
    kv_per_token = kv_bytes_per_token(model, mode, itemsize)
    context = c['prompt_len'] + c['new_tokens']
    m = dict(params=model.get_num_params(non_embedding=False),
             params_non_embedding=model.get_num_params(non_embedding=True),
             flops_per_token=model.flops_per_token(model.config.block_size),
             kv_bytes_per_token=kv_per_token)
    m['analytic_mem_bytes'] = m['params'] * itemsize + kv_per_token * context * c['batch_size']
    m['prefill_ms'], m['decode_ms_per_token'] = timed_after_warmup(model, idx, run, device)
    m['peak_mem_bytes'] = peak_decode_memory(model, idx, run, device)
    if val_tokens is not None:  # before compiling: the losses run eager
        m['val_loss'] = {k: cached_val_loss(model, val_tokens, c['prompt_len'], k) for k in model.kv_modes}
    m['decode_ms_per_token_compiled'] = None
    if c['compile']:
        torch._dynamo.reset()  # each model compiles from scratch, within the recompile limit
        torch._dynamo.utils.counters.clear()
        # dynamic=True: the cache length is symbolic, so decoding compiles once, not per length
        model.compile_regions(dynamic=True)
        m['prefill_ms_compiled'], m['decode_ms_per_token_compiled'] = timed_after_warmup(model, idx, run, device)
        m['graphs_compiled'] = torch._dynamo.utils.counters['stats']['unique_graphs']
    m['kv_mode'] = mode
    return m


def build_preset(name, overrides):
    model_type, config = preset(name, **overrides)
    return MODELS[model_type][1](config)


def train_model(name, overrides, c, device, dtype):
    """Training tokens/s and MFU of a fresh fp32 model under autocast, eager then compiled."""
    figures = {}
    for compiled in ([False, True] if c['compile'] else [False]):
        torch.manual_seed(0)
        model = build_preset(name, overrides).to(device)
        if compiled:
            torch._dynamo.reset()
            model.compile_regions()
        suffix = '_compiled' if compiled else ''
        figures['train_tokens_per_s' + suffix], figures['mfu' + suffix] = train_throughput(model, c, device, dtype)
        del model
        gc.collect()
    return figures


# -----------------------------------------------------------------------------
# Output


def human(n, unit=''):
    for div, suffix in ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.3g}{unit}"


def print_table(models):
    rows = [('params', 'params', human), ('params_non_embedding', 'params (non-embedding)', human),
            ('flops_per_token', 'forward FLOPs/token (S=block_size)', human),
            ('kv_bytes_per_token', 'KV cache/token', lambda n: human(n, 'B')),
            ('peak_mem_bytes', 'peak decode memory', lambda n: human(n, 'B')),
            ('analytic_mem_bytes', 'params + KV (analytic)', lambda n: human(n, 'B')),
            ('prefill_ms', 'prefill ms (eager)', lambda n: f"{n:.1f}"),
            ('decode_ms_per_token', 'decode ms/token (eager)', lambda n: f"{n:.2f}"),
            ('prefill_ms_compiled', 'prefill ms (compiled)', lambda n: f"{n:.1f}"),
            ('decode_ms_per_token_compiled', 'decode ms/token (compiled)', lambda n: f"{n:.2f}"),
            ('graphs_compiled', 'graphs compiled', str),
            ('train_tokens_per_s', 'train tokens/s (eager)', lambda n: f"{n:.0f}"),
            ('train_tokens_per_s_compiled', 'train tokens/s (compiled)', lambda n: f"{n:.0f}"),
            ('mfu', 'train MFU (eager)', lambda n: f"{100 * n:.1f}%"),
            ('mfu_compiled', 'train MFU (compiled)', lambda n: f"{100 * n:.1f}%")]
    names = list(models)
    dense = models.get('gpt')
    print(f"{'':36s}" + ''.join(f"{n:>24s}" for n in names))
    for key, label, fmt in rows:
        if not any(models[n].get(key) is not None for n in names):
            continue
        cells = []
        for n in names:
            value = models[n].get(key)
            cell = '-' if value is None else fmt(value)
            if value is not None and dense is not None and n != 'gpt' and dense.get(key):
                cell += f" ({value / dense[key]:.2f}x)"
            cells.append(cell)
        print(f"{label:36s}" + ''.join(f"{cell:>24s}" for cell in cells))
    for n in names:
        if 'val_loss' in models[n]:
            exact = models[n]['val_loss']['per_step']
            losses = ', '.join(f"{k} {v:.5f} ({v - exact:+.5f})" for k, v in models[n]['val_loss'].items())
            print(f"val loss through the KV cache ({n}): {losses}")
    print("(ratios are to the dense gpt; kv_mode: " + ', '.join(f"{n} {models[n]['kv_mode']}" for n in names) + ")")


def main(argv=None):
    try:
        c = parse_config(DEFAULTS, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(str(e))
    if c['scale'] not in SCALES:
        fail(f"scale must be one of {', '.join(SCALES)}, got {c['scale']!r}")
    if c['kv_mode'] not in KV_MODES:
        fail(f"kv_mode must be one of {', '.join(KV_MODES)}, got {c['kv_mode']!r}")
    if c['prompt_len'] < 1 or c['new_tokens'] < 2 or c['batch_size'] < 1:
        fail("prompt_len and batch_size must be >= 1 and new_tokens >= 2 (one prefill, then decode steps)")
    device = pick_device(c['device'], 0)
    device_type = 'cuda' if device.startswith('cuda') else device
    dtype = pick_dtype(c['dtype'], device_type)
    torch.manual_seed(0)

    models = {}
    if c['out_dir']:  # one trained model, and what each kv_mode costs it in val loss
        model, _ = load_model('resume', c['out_dir'], device)
        checkpoint = torch.load(os.path.join(c['out_dir'], 'ckpt.pt'), map_location='cpu', weights_only=False)
        val = val_windows(checkpoint, min(VAL_WINDOW_LEN, model.config.block_size) + 1, device)
        del checkpoint
        runs = {'trained': lambda: model}
        if c['prompt_len'] >= val.size(1) - 1:
            fail(f"prompt_len {c['prompt_len']} leaves no tokens to decode in the {val.size(1) - 1}-token val windows")
    else:
        val = None
        runs = {key: (lambda spec=spec: build_preset(*spec)) for key, spec in SCALES[c['scale']].items()}
    for key, build in runs.items():
        model = build()
        if c['prompt_len'] + c['new_tokens'] > model.config.block_size:
            fail(f"prompt_len + new_tokens = {c['prompt_len'] + c['new_tokens']} exceeds block_size "
                 f"{model.config.block_size}; lower them")
        print(f"benchmarking {key} ...", file=sys.stderr, flush=True)
        models[key] = bench_model(model, c, device, dtype, val)
        del model
        gc.collect()
        if device_type == 'cuda':
            torch.cuda.empty_cache()
        if c['train'] and not c['out_dir']:
            print(f"training {key} ...", file=sys.stderr, flush=True)
            models[key].update(train_model(*SCALES[c['scale']][key], c, device, dtype))

    scale = c['out_dir'] or c['scale']  # a trained model's own size
    print(f"scale {scale}, {device} "
          f"({torch.get_num_threads()} threads), {dtype}, batch {c['batch_size']}, prompt {c['prompt_len']} "
          f"+ {c['new_tokens']} new tokens, torch {torch.__version__}")
    print_table(models)
    models = {key: {k: m[k] for k in FIELDS + OPTIONAL_FIELDS if k in m} for key, m in models.items()}
    result = dict(scale=scale, device=device, dtype=dtype, batch_size=c['batch_size'],
                  prompt_len=c['prompt_len'], new_tokens=c['new_tokens'], models=models)
    print(json.dumps(result))


if __name__ == '__main__':
    main()
