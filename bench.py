"""
What the GRT saves when it decodes: the dense GPT-2, the GRT isoFLOP and the GRT isoParam models of one
scale, compared on parameters, FLOPs, KV cache, peak decoding memory and latency (eager and compiled).

    python bench.py --scale=large --dtype=bfloat16       # tiny | small | medium | large
    python bench.py --scale=medium --kv_mode=mean        # the GRTs' approximate KV caches (kv_cache.py)
    python bench.py --out_dir=out-shakespeare-char-grt --dtype=float32   # a trained model (best.pt;
                                                         # --ckpt=ckpt.pt: the latest), + val loss per kv_mode
    python bench.py --scale=small --exit_threshold=0.07  # decode the GRTs with per-token early exit

Weights, activations and the KV cache are in --dtype (the model is cast, as for serving). Peak decoding
memory: on CUDA torch.cuda.max_memory_allocated over one generation; on CPU the bytes of the tensors alive
when generation starts (weights, prompt) plus the highest running total of the allocations and frees that
torch's profiler records during one eager generation (exact and repeatable, unlike RSS). Latencies are
medians after a warm-up run. A readable table goes first; the last line is one JSON object.
The other benchmarks (training speed, the nanoGPT comparison, the GPU check, the early-exit sweep) are
in benchmarks/; docs/benchmarks.md describes them all.
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
from common import compile_regions, fail, load_model, pick_device, pick_dtype, read_settings, share_cores
from early_exit import EarlyExit, ExitingModel, check_early_exit
from kv_cache import KV_MODES
from model import RecurrentLM
from registry import MODELS, preset

DEFAULTS = dict(
    scale='small',  # tiny | small | medium | large (the paper's three, and one for tests)
    device='auto',
    dtype='auto',
    compile=True,  # also time decoding with common.compile_regions (every block compiled once)
    batch_size=1,
    prompt_len=32,  # prompt tokens, prefilled in one forward pass
    new_tokens=12,  # decoded tokens: few, so the large scale stays practical on 2 CPU cores
    kv_mode='per_step',  # how the GRTs cache their core (kv_cache.KV_MODES)
    out_dir='',  # benchmark the model trained in out_dir instead, with its val loss per kv_mode
    ckpt='best.pt',  # with out_dir: 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    exit='state',  # per-token early exit's criterion: 'state' or 'kl' (early_exit.EarlyExit)
    exit_threshold=None,  # decode the recurrent models with early exit below this value; None = fixed depth
    min_steps=1,  # early exit: the fewest core steps a token runs
)
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
OPTIONAL_FIELDS = ('val_loss',)  # in the JSON too, when --out_dir asked for them


# -----------------------------------------------------------------------------
# The torch internals the benchmarks read. No public API gives these figures, so each is read in one
# function, which stops with one line if a torch release changes it (the tests run each).


class TorchInternalsChanged(RuntimeError):
    """A private torch API a benchmark depends on is gone or changed; the message says which and where."""


def cpu_peak_bytes(fn):
    """(fn(), the highest running total of CPU allocations minus frees while fn ran). The public profiler
    API only sums allocations per operator, so the exact peak needs the private kineto_results."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    try:
        events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == '[memory]' and e.device_type() == torch.autograd.DeviceType.CPU]
    except (AttributeError, TypeError) as e:
        raise TorchInternalsChanged(
            f"torch {torch.__version__} changed the profiler's private kineto_results ({e}); the CPU peak "
            f"memory needs bench.cpu_peak_bytes updated") from None
    if not events:
        raise TorchInternalsChanged(
            f"torch {torch.__version__}'s profiler recorded no '[memory]' event for an allocating function; "
            f"the CPU peak memory needs bench.cpu_peak_bytes updated")
    total = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        total += nbytes  # negative for a free
        peak = max(peak, total)
    return result, peak


def compiled_graph_count():
    """Graphs torch.compile has compiled in this process so far (Dynamo's counter; take the difference
    around a run)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters['stats']['unique_graphs'])
    except (ImportError, AttributeError, TypeError, KeyError) as e:
        raise TorchInternalsChanged(
            f"torch {torch.__version__} changed torch._dynamo.utils.counters ({type(e).__name__}: {e}); the graph "
            f"count needs bench.compiled_graph_count updated") from None


# -----------------------------------------------------------------------------
# What every benchmark shares: the hardware line, device synchronization, number formatting

CPU_FLAGS = ('avx512_bf16', 'amx_bf16', 'avx512f', 'avx2')  # what decides CPU kernels' speed


def cpu_description():
    """(CPU model name, {flag: present} for CPU_FLAGS) from /proc/cpuinfo; ('unknown', {}) elsewhere."""
    try:
        with open('/proc/cpuinfo') as f:
            text = f.read()
    except OSError:
        return 'unknown', {}
    name = next((line.split(':', 1)[1].strip() for line in text.splitlines() if line.startswith('model name')),
                'unknown')
    flags = set(text.split())
    return name, {flag: flag in flags for flag in CPU_FLAGS}


def cpu_line():
    """The machine a report ran on: the CPU's name, its cores, which of CPU_FLAGS it has, torch's version."""
    name, flags = cpu_description()
    have = ', '.join(flag for flag, present in flags.items() if present) or 'none of ' + ', '.join(CPU_FLAGS)
    return f"{name} ({os.cpu_count()} cores; {have}), torch {torch.__version__}"


def hardware(device):
    """One line naming what ran: the GPU, or the CPU with its flags and torch's thread count."""
    if device.startswith('cuda'):
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    name, flags = cpu_description()
    flags = ', '.join(f"{flag} {'yes' if present else 'no'}" for flag, present in flags.items())
    return f"{device}: {name} ({flags}), {torch.get_num_threads()} threads, torch {torch.__version__}"


def synchronizer(device):
    return torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)


def free_memory(device):
    gc.collect()
    if device.startswith('cuda'):
        torch.cuda.empty_cache()


def human(n, unit=''):
    for div, suffix in ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.3g}{unit}"


# -----------------------------------------------------------------------------
# Memory


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind tensors (tied weights counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def kv_bytes_per_token(model, kv_mode, itemsize):
    """Keys and values per token over all distinct caches (an approximate mode's per-step handles share
    one buffer per core layer)."""
    caches = model.new_kv_cache(1, kv_mode=kv_mode)
    distinct = {id(getattr(cache, 'layer_cache', cache)) for cache in caches}
    return len(distinct) * 2 * model.config.n_embd * itemsize


def decoder(model, c):
    """What generates: the model, or an early_exit.ExitingModel around it with --exit_threshold (a
    dense GPT, which has no depth loop to cut, always runs whole)."""
    if c['exit_threshold'] is None or not isinstance(model, RecurrentLM):
        return model
    rule = EarlyExit(c['exit_threshold'], c['min_steps'], c['exit'])
    try:
        check_early_exit(model, rule, kv_mode=c['kv_mode'])
    except ValueError as e:
        fail(str(e))
    return ExitingModel(model, rule)


def peak_decode_memory(model, idx, c, device):
    """Peak bytes over one eager generation of c['new_tokens'] tokens after idx."""
    def generate():
        return decoder(model, c).generate(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode'])

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
    """(prefill ms, median decode ms per token): the time to the first token (the prompt's forward pass
    and the sampling), then the time between tokens, streamed from generate_tokens."""
    sync = synchronizer(device)
    times = []
    sync()
    t = time.perf_counter()
    for _ in decoder(model, c).generate_tokens(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode']):
        sync()
        now = time.perf_counter()
        times.append(1000 * (now - t))
        t = now
    return times[0], statistics.median(times[1:]) if len(times) > 1 else None


def timed_after_warmup(model, idx, c, device):
    time_generation(model, idx, c, device)  # warm-up: allocator, caches, and compilation if compiled
    return time_generation(model, idx, c, device)


# -----------------------------------------------------------------------------
# Validation loss through the KV cache (--out_dir; benchmarks/exit_sweep.py)


@torch.no_grad()
def teacher_forced_decode(model, tokens, prompt_len, kv_mode='per_step', num_steps=None, rule=None,
                          sync=lambda: None):
    """Decode tokens (B, L) through the KV cache exactly as generation runs, but feeding the true tokens:
    prefill tokens[:, :prompt_len] in one pass, then the rest one token a pass; rule: an EarlyExit, run
    by early_exit.ExitingModel. Returns 'loss' (the mean cross-entropy of every prediction generation
    would make after this prompt), 'mean_steps' (core steps behind each prediction), 'steps_run' and
    'probes' (the batch's core steps and 'kl' probes per decode step) and 'decode_ms' (sync: the
    device's synchronize)."""
    net = model if rule is None else ExitingModel(model, rule)
    R = model.resolve_steps(num_steps) if isinstance(model, RecurrentLM) else 0
    x, y = tokens[:, :-1], tokens[:, 1:]
    cache = model.new_kv_cache(x.size(1), num_steps, kv_mode=kv_mode)
    logits = [net(x[:, :prompt_len], num_steps=num_steps, kv_cache=cache)[0][:, -1:]]
    steps = [net.exit_steps[:, -1:] if rule else None]  # the prompt's last position predicts first
    steps_run = probes = elapsed = 0.0
    for i in range(prompt_len, x.size(1)):
        sync()
        t = time.perf_counter()
        logits.append(net(x[:, i:i + 1], num_steps=num_steps, kv_cache=cache)[0])
        sync()
        elapsed += time.perf_counter() - t
        steps.append(net.exit_steps if rule else None)
        steps_run += net.exit_stats['steps_run'] if rule else R
        probes += net.exit_stats['probes'] if rule else 0
    logits = torch.cat(logits, dim=1).float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[:, prompt_len - 1:].flatten()).item()
    decoded = max(x.size(1) - prompt_len, 1)
    return dict(loss=loss, mean_steps=torch.cat(steps, dim=1).float().mean().item() if rule else R,
                steps_run=steps_run / decoded, probes=probes / decoded, decode_ms=1000 * elapsed / decoded)


def cached_val_loss(model, tokens, prompt_len, kv_mode):
    """teacher_forced_decode's loss: for 'per_step' it equals the uncached forward's on those tokens."""
    return teacher_forced_decode(model, tokens, prompt_len, kv_mode)['loss']


def val_windows(checkpoint, length, device, count=VAL_WINDOWS):
    """count fixed windows of length tokens, evenly spaced over the first validation file of the dataset
    the checkpoint was trained on (the data_dir and dataset of its train.py config)."""
    config = checkpoint.get('config') or {}
    data_dir = os.path.join(config.get('data_dir', 'data'), config.get('dataset', ''))
    try:
        data = prepare_data.read_tokens(prepare_data.token_files(data_dir, 'val')[0])
    except ValueError as e:
        fail(f"validation data for the kv_mode losses: {e}")
    if len(data) < length:
        fail(f"{data_dir} has only {len(data)} validation tokens; the kv_mode losses need {length}")
    starts = np.linspace(0, len(data) - length, count).astype(np.int64)
    return torch.from_numpy(np.stack([data[s:s + length] for s in starts]).astype(np.int64)).to(device)


# -----------------------------------------------------------------------------
# One model, all figures


def bench_model(model, c, device, dtype, val_tokens=None):
    ptdtype = getattr(torch, dtype)
    model.to(device=device, dtype=ptdtype).eval()
    itemsize = torch.empty((), dtype=ptdtype).element_size()
    mode = c['kv_mode'] if c['kv_mode'] in model.kv_modes else 'per_step'  # a dense GPT: only per_step
    run = dict(c, kv_mode=mode)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(model.config.vocab_size, (c['batch_size'], c['prompt_len']), generator=gen).to(device)
    kv_per_token = kv_bytes_per_token(model, mode, itemsize)
    m = dict(params=model.get_num_params(non_embedding=False),
             params_non_embedding=model.get_num_params(non_embedding=True),
             flops_per_token=model.flops_per_token(model.config.block_size),
             kv_bytes_per_token=kv_per_token)
    context = c['prompt_len'] + c['new_tokens']
    m['analytic_mem_bytes'] = m['params'] * itemsize + kv_per_token * context * c['batch_size']
    m['prefill_ms'], m['decode_ms_per_token'] = timed_after_warmup(model, idx, run, device)
    m['peak_mem_bytes'] = peak_decode_memory(model, idx, run, device)
    if val_tokens is not None:  # before compiling: the losses run eager
        m['val_loss'] = {k: cached_val_loss(model, val_tokens, c['prompt_len'], k) for k in model.kv_modes}
    m['decode_ms_per_token_compiled'] = None
    if c['compile']:
        torch.compiler.reset()  # each model compiles from scratch, within the recompile limit
        graphs_before = compiled_graph_count()
        # dynamic=True: the cache length is symbolic, so decoding compiles once, not per length
        compile_regions(model, dynamic=True)
        m['prefill_ms_compiled'], m['decode_ms_per_token_compiled'] = timed_after_warmup(model, idx, run, device)
        m['graphs_compiled'] = compiled_graph_count() - graphs_before
    m['kv_mode'] = mode
    return m


def build_preset(name, overrides):
    model_type, config = preset(name, **overrides)
    return MODELS[model_type][1](config)


def check_fits(model, c):
    if c['prompt_len'] + c['new_tokens'] > model.config.block_size:
        fail(f"prompt_len + new_tokens = {c['prompt_len'] + c['new_tokens']} exceeds block_size "
             f"{model.config.block_size}; lower them")


def bench_scale(c, device, dtype):
    """The three models of c['scale'], each built, measured and freed in turn."""
    models = {}
    for key, (name, overrides) in SCALES[c['scale']].items():
        model = build_preset(name, overrides)
        check_fits(model, c)
        print(f"benchmarking {key} ...", file=sys.stderr, flush=True)
        models[key] = bench_model(model, c, device, dtype)
        del model
        free_memory(device)
    return models


def bench_trained(c, device, dtype):
    """The model of out_dir/ckpt, and what each kv_mode costs it in val loss on its own dataset."""
    model, checkpoint = load_model('resume', c['out_dir'], device, c['ckpt'])
    val = val_windows(checkpoint, min(VAL_WINDOW_LEN, model.config.block_size) + 1, device)
    del checkpoint
    check_fits(model, c)
    if c['prompt_len'] >= val.size(1) - 1:
        fail(f"prompt_len {c['prompt_len']} leaves no tokens to decode in the {val.size(1) - 1}-token val windows")
    print(f"benchmarking {os.path.join(c['out_dir'], c['ckpt'])} ...", file=sys.stderr, flush=True)
    return {'trained': bench_model(model, c, device, dtype, val)}


# -----------------------------------------------------------------------------
# Output


ROWS = [('params', 'params', human), ('params_non_embedding', 'params (non-embedding)', human),
        ('flops_per_token', 'forward FLOPs/token (S=block_size)', human),
        ('kv_bytes_per_token', 'KV cache/token', lambda n: human(n, 'B')),
        ('peak_mem_bytes', 'peak decode memory', lambda n: human(n, 'B')),
        ('analytic_mem_bytes', 'params + KV (analytic)', lambda n: human(n, 'B')),
        ('prefill_ms', 'prefill ms (eager)', lambda n: f"{n:.1f}"),
        ('decode_ms_per_token', 'decode ms/token (eager)', lambda n: f"{n:.2f}"),
        ('prefill_ms_compiled', 'prefill ms (compiled)', lambda n: f"{n:.1f}"),
        ('decode_ms_per_token_compiled', 'decode ms/token (compiled)', lambda n: f"{n:.2f}"),
        ('graphs_compiled', 'graphs compiled', str)]


def print_table(models, rows=ROWS):
    """One column a model, one line a row (key, label, format) that some model has, with each figure's
    ratio to the dense gpt's."""
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
    modes = ', '.join(f"{n} {models[n]['kv_mode']}" for n in names if 'kv_mode' in models[n])
    print("(ratios are to the dense gpt" + (f"; kv_mode: {modes})" if modes else ")"))


def check_settings(c):
    if c['scale'] not in SCALES:
        fail(f"scale must be one of {', '.join(SCALES)}, got {c['scale']!r}")
    if c['kv_mode'] not in KV_MODES:
        fail(f"kv_mode must be one of {', '.join(KV_MODES)}, got {c['kv_mode']!r}")
    if c['prompt_len'] < 1 or c['new_tokens'] < 2 or c['batch_size'] < 1:
        fail("prompt_len and batch_size must be >= 1 and new_tokens >= 2 (one prefill, then decode steps)")


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    check_settings(c)
    torch.manual_seed(0)
    device = pick_device(c['device'], 0)
    share_cores(device)  # torch's threads on the cores other work leaves free
    dtype = pick_dtype(c['dtype'], 'cuda' if device.startswith('cuda') else device)
    try:
        models = bench_trained(c, device, dtype) if c['out_dir'] else bench_scale(c, device, dtype)
    except TorchInternalsChanged as e:
        fail(str(e))
    scale = c['out_dir'] or c['scale']  # a trained model's own size
    exits = '' if c['exit_threshold'] is None else f", early exit {c['exit']} < {c['exit_threshold']:g}"
    print(f"scale {scale}, {dtype}, batch {c['batch_size']}, prompt {c['prompt_len']} + {c['new_tokens']} new "
          f"tokens{exits}; {hardware(device)}")
    print_table(models)
    models = {key: {k: m[k] for k in FIELDS + OPTIONAL_FIELDS if k in m} for key, m in models.items()}
    result = dict(scale=scale, device=device, dtype=dtype, batch_size=c['batch_size'], prompt_len=c['prompt_len'],
                  new_tokens=c['new_tokens'], models=models)
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
