"""
The decode benchmark behind the paper's headline: the dense GPT-2, the GRT isoFLOP and the GRT
isoParam models of one scale, compared on parameters, FLOPs, KV cache, peak decoding memory and
latency (eager and compiled). Two more modes compare training speed.

    python bench.py --scale=large --dtype=bfloat16
    python bench.py --scale=small --train=True          # + training tokens/s and MFU, as train.py reports them
    python bench.py --out_dir=out-shakespeare-char-grt   # a trained model (best.pt; --ckpt=ckpt.pt: the latest),
                                                         # + val loss per kv_mode
    python bench.py --out_dir=out-shakespeare-char-grt --exit_sweep=True  # per-token early exit: val loss
                                                         # against mean core steps, + docs/img/exit_curve.png
    python bench.py --peer=True                          # training ms/iteration, GRT against dense, at nanoGPT's
                                                         # CPU shapes: eager and compiled, fp32 and bf16 if faster
    python bench.py --gpu_check=True                     # (or bash scripts/gpu_check.sh) on a CUDA GPU: the
                                                         # paper-scale small configs train, then --scale=large

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
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import prepare_data
from common import (autocast_context, cpu_bf16_speedup, fail, load_model, measure_cpu_peak,
                    peak_flops_for, pick_device, pick_dtype, read_settings)
from kv_cache import KV_MODES
from model import EarlyExit, RecurrentLM
from registry import MODELS, build_model, preset

DEFAULTS = dict(
    scale='small',  # tiny | small | medium | large (the paper's three, and one for tests)
    device='auto',
    dtype='auto',
    compile=True,  # also time decoding (and --train, --peer) with compile_regions (every block compiled once)
    batch_size=1,
    prompt_len=32,  # prompt tokens, prefilled in one forward pass
    new_tokens=12,  # decoded tokens: few, so the large scale stays practical on 2 CPU cores
    kv_mode='per_step',  # how the GRTs cache their core (kv_cache.KV_MODES)
    train=False,  # also measure training tokens/s and MFU, eager and compiled
    peak_flops=0.0,  # --train: the peak for MFU, as train.py's; 0 = measured (CPU) or the datasheet figure (CUDA)
    out_dir='',  # benchmark the model trained in out_dir instead, with its val loss per kv_mode
    ckpt='best.pt',  # with out_dir: 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    peer=False,  # training ms/iteration of a dense GPT and a FLOP-matched GRT at nanoGPT's CPU shapes
    peer_iters=150,  # --peer: timed iterations a run (rounded up to whole cycles of the GRT's depths 1..R)
    peer_warmup=20,  # --peer: untimed iterations first (allocator; compilation when compiled)
    peer_repeats=3,  # --peer: runs per mode (fresh models each); the spread is over these
    gpu_check=False,  # CUDA only: train config/gpt2_small.py and config/grt_small.py briefly, then --scale=large
    exit='state',  # per-token early exit's criterion (recurrent models): 'state' or 'kl' (model.EarlyExit)
    exit_threshold=None,  # early exit below this criterion value in the decode timings; None = fixed depth
    min_steps=1,  # early exit: the fewest core steps a token runs (also in --exit_sweep)
    exit_sweep=False,  # with out_dir: loss against mean core steps for a sweep of thresholds and r = 1..R
    exit_plot='docs/img/exit_curve.png',  # --exit_sweep: where the plot goes (needs matplotlib)
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


# -----------------------------------------------------------------------------
# The two torch internals bench.py reads. No public API gives these figures, so each is read in
# exactly one function, which stops with one line if a torch release changes it (test_bench runs
# both, so such a release fails the tests loudly rather than the figures quietly).


class TorchInternalsChanged(RuntimeError):
    """A private torch API bench.py depends on is gone or changed; the message says which and where."""


def cpu_peak_bytes(fn):
    """(fn(), the highest running total of CPU allocations minus frees while fn ran). The profiler
    records every allocation and free with its size and time, in order; the public profiler API only
    sums them per operator, so the exact peak needs the private kineto_results. fn must allocate."""
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
    """Graphs torch.compile has compiled in this process so far (Dynamo's own counter; take the
    difference around a run). A count above one graph per distinct use means recompiles."""
    try:
        from torch._dynamo.utils import counters
        return int(counters['stats']['unique_graphs'])
    except (ImportError, AttributeError, TypeError, KeyError) as e:
        raise TorchInternalsChanged(
            f"torch {torch.__version__} changed torch._dynamo.utils.counters ({type(e).__name__}: {e}); the graph "
            f"count needs bench.compiled_graph_count updated") from None


def recompile_count():
    """Recompiles in a train.py run: compiles of one compiled function beyond its first two, since
    compile_regions compiles a GPT's or GRT's functions once for training and once for evaluation
    (under no_grad). The graph count cannot say: a GRT step breaks into several graphs around its
    noise (and a longer core), so a grt_small run compiles 5 and a GPT run 2, neither recompiling.
    Read from Dynamo's compilation metrics, ids 'frame/attempt', one or two entries a compile (its
    backward may add one); they keep only the last 64 entries, enough for one run in a fresh process."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
        ids = {str(m.compile_id) for m in get_compilation_metrics()}
        attempts = [re.search(r'(\d+)/(\d+)(_\d+)?$', compile_id) for compile_id in ids]
        return sum(int(match.group(2)) >= 2 for match in attempts if match)
    except (ImportError, AttributeError, TypeError) as e:
        raise TorchInternalsChanged(
            f"torch {torch.__version__} changed torch._dynamo.utils.get_compilation_metrics ({type(e).__name__}: "
            f"{e}); the recompile count needs bench.recompile_count updated") from None


# -----------------------------------------------------------------------------
# Memory


def tensor_bytes(tensors):
    """Bytes of the distinct storages behind tensors (tied weights counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def kv_bytes_per_token(model, kv_mode, itemsize):
    """Keys and values per token over all distinct caches (an approximate mode's per-step handles
    share one buffer per core layer)."""
    caches = model.new_kv_cache(1, kv_mode=kv_mode)
    distinct = {id(getattr(cache, 'layer_cache', cache)) for cache in caches}
    return len(distinct) * 2 * model.config.n_embd * itemsize


def peak_decode_memory(model, idx, c, device):
    """Peak bytes over one eager generation of c['new_tokens'] tokens after idx."""
    def generate():
        return model.generate(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode'], **exit_kwargs(model, c))

    if device.startswith('cuda'):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        generate()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)
    live = tensor_bytes([*model.parameters(), *model.buffers(), idx])
    _, peak = cpu_peak_bytes(generate)
    return live + peak


def free_memory(device):
    gc.collect()
    if device.startswith('cuda'):
        torch.cuda.empty_cache()


# -----------------------------------------------------------------------------
# Latency


def synchronizer(device):
    return torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)


def time_generation(model, idx, c, device):
    """(prefill ms, median decode ms per token): the time to the first token (the prompt's forward
    pass and the sampling), then the time between tokens, streamed from generate_tokens."""
    sync = synchronizer(device)
    times = []
    sync()
    t = time.perf_counter()
    for _ in model.generate_tokens(idx, c['new_tokens'], temperature=0, kv_mode=c['kv_mode'], **exit_kwargs(model, c)):
        sync()
        now = time.perf_counter()
        times.append(1000 * (now - t))
        t = now
    return times[0], statistics.median(times[1:]) if len(times) > 1 else None


def timed_after_warmup(model, idx, c, device):
    time_generation(model, idx, c, device)  # warm-up: allocator, caches, and compilation if compiled
    return time_generation(model, idx, c, device)


# -----------------------------------------------------------------------------
# Training speed (--train, --peer): the step train.py takes, and its MFU


def train_step(model, optimizer, x, y, num_steps, device_type, dtype, grad_clip=1.0):
    """One optimizer step as train.py takes it (one micro-step): forward under autocast, backward,
    gradient clipping, AdamW."""
    with autocast_context(device_type, dtype):
        _, loss = model(x, targets=y, num_steps=num_steps)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_mfu(model, tokens, seconds, seq_len, mean_depth, device, dtype, peak_flops=0.0):
    """MFU as train.py computes it: model.estimate_mfu against common.peak_flops_for in the dtype the
    run computes in; on CPU, a figure above 100% first measures the peak again (the first measurement
    may have run on loaded cores), as train.py does. None where no peak is known, or where the figure
    would still exceed 100%: then the peak is wrong, and a warning says so instead of printing it."""
    peak = peak_flops_for(device, getattr(torch, dtype), peak_flops)
    if not peak:
        return None
    mfu = model.estimate_mfu(tokens, seconds, peak, seq_len, mean_depth)
    if mfu > 1 and device == 'cpu' and peak_flops <= 0:
        peak = measure_cpu_peak(getattr(torch, dtype), again=True)
        mfu = model.estimate_mfu(tokens, seconds, peak, seq_len, mean_depth)
    if mfu > 1:
        print(f"warning: MFU would be {100 * mfu:.0f}% against a {dtype} peak of {peak / 1e9:.1f} GFLOP/s, so that "
              f"peak is wrong for this device; MFU not reported (set --peak_flops=...)", file=sys.stderr)
        return None
    return mfu


def train_throughput(model, c, device, dtype, steps=3):
    """(tokens/s, MFU) of train_step on random tokens, after one warm-up step. Depths are drawn per
    step as train.py draws them, from a fixed generator."""
    device_type = 'cuda' if device.startswith('cuda') else device
    seq_len = min(TRAIN_SEQ_LEN, model.config.block_size)
    model.train()
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(model.config.vocab_size, (c['batch_size'], seq_len + 1), generator=gen).to(device)
    sync = synchronizer(device)
    depths, elapsed = [], 0.0
    for step in range(steps + 1):
        num_steps = model.sample_depth(gen)
        sync()
        t = time.perf_counter()
        train_step(model, optimizer, x[:, :-1], x[:, 1:], num_steps, device_type, dtype)
        sync()
        if step > 0:  # step 0 warms up (and compiles)
            elapsed += time.perf_counter() - t
            depths.append(num_steps)
    tokens = steps * c['batch_size'] * seq_len
    mean_depth = None if depths[0] is None else sum(depths) / len(depths)
    return tokens / elapsed, training_mfu(model, tokens, elapsed, seq_len, mean_depth, device, dtype, c['peak_flops'])


def train_figures(name, overrides, c, device, dtype):
    """Training tokens/s and MFU of a fresh fp32 model under autocast, eager then compiled."""
    figures = {}
    for compiled in ([False, True] if c['compile'] else [False]):
        torch.manual_seed(0)
        model = build_preset(name, overrides).to(device)
        if compiled:
            torch.compiler.reset()
            model.compile_regions()
        suffix = '_compiled' if compiled else ''
        figures['train_tokens_per_s' + suffix], figures['mfu' + suffix] = train_throughput(model, c, device, dtype)
        del model
        free_memory(device)
    return figures


# -----------------------------------------------------------------------------
# Quality of the approximate KV-cache modes (--out_dir)


@torch.no_grad()
def cached_val_loss(model, tokens, prompt_len, kv_mode, num_steps=None, early_exit=None):
    """Teacher-forced decoding through the KV cache, exactly as generation runs it: tokens (B, L);
    prefill tokens[:, :prompt_len] in one pass, then feed the rest one token at a time. Returns the
    mean cross-entropy of predicting tokens[:, prompt_len:] (every prediction generation would make
    after this prompt). kv_mode 'per_step' equals the uncached forward's loss on those tokens."""
    return teacher_forced_decode(model, tokens, prompt_len, kv_mode, num_steps, early_exit)['loss']


@torch.no_grad()
def teacher_forced_decode(model, tokens, prompt_len, kv_mode='per_step', num_steps=None, early_exit=None,
                          sync=lambda: None):
    """cached_val_loss's decoding, with early_exit (an EarlyExit) if given, and its figures: 'loss';
    'mean_steps', the core steps behind each prediction (the prompt's last one and every decoded
    one); 'steps_run', the core steps the batch ran per decode step (its slowest row's); 'probes',
    the 'kl' coda probes per decode step; 'decode_ms', the time of one decode step (sync: the
    device's synchronize, for the timing)."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    exiting = {} if early_exit is None else dict(early_exit=early_exit)
    R = model.resolve_steps(num_steps) if isinstance(model, RecurrentLM) else None
    cache = model.new_kv_cache(x.size(1), num_steps, kv_mode=kv_mode)
    logits, _ = model(x[:, :prompt_len], targets=y[:, :prompt_len], num_steps=num_steps, kv_cache=cache, **exiting)
    logits = [logits[:, -1:]]  # the prompt's last position predicts the first new token
    steps = [model.exit_steps[:, -1:] if exiting else None]
    steps_run = probes = elapsed = 0.0
    for i in range(prompt_len, x.size(1)):
        sync()
        t = time.perf_counter()
        step_logits, _ = model(x[:, i:i + 1], targets=y[:, i:i + 1], num_steps=num_steps, kv_cache=cache, **exiting)
        sync()
        elapsed += time.perf_counter() - t
        logits.append(step_logits)
        steps.append(model.exit_steps if exiting else None)
        steps_run += model.exit_stats['steps_run'] if exiting else (R or 0)
        probes += model.exit_stats['probes'] if exiting else 0
    logits = torch.cat(logits, dim=1).float()
    targets = y[:, prompt_len - 1:]
    decoded = x.size(1) - prompt_len
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).item()
    mean_steps = torch.cat(steps, dim=1).float().mean().item() if exiting else R
    return dict(loss=loss, mean_steps=mean_steps, steps_run=steps_run / max(decoded, 1),
                probes=probes / max(decoded, 1), decode_ms=1000 * elapsed / max(decoded, 1))


def val_windows(checkpoint, length, device, count=VAL_WINDOWS):
    """count (VAL_WINDOWS) fixed windows of length tokens, evenly spaced over the first validation file of
    the dataset the checkpoint was trained on (the data_dir and dataset of its train.py config)."""
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
        torch.compiler.reset()  # each model compiles from scratch, within the recompile limit
        graphs_before = compiled_graph_count()
        # dynamic=True: the cache length is symbolic, so decoding compiles once, not per length
        model.compile_regions(dynamic=True)
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
        if c['train']:
            print(f"training {key} ...", file=sys.stderr, flush=True)
            models[key].update(train_figures(name, overrides, c, device, dtype))
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


def decode_benchmark(c, device, dtype):
    if c['out_dir']:
        models = bench_trained(c, device, dtype)
    else:
        models = bench_scale(c, device, dtype)
    scale = c['out_dir'] or c['scale']  # a trained model's own size
    print(f"scale {scale}, {device} "
          f"({torch.get_num_threads()} threads), {dtype}, batch {c['batch_size']}, prompt {c['prompt_len']} "
          f"+ {c['new_tokens']} new tokens, torch {torch.__version__}")
    print_table(models)
    models = {key: {k: m[k] for k in FIELDS + OPTIONAL_FIELDS if k in m} for key, m in models.items()}
    return dict(scale=scale, device=device, dtype=dtype, batch_size=c['batch_size'],
                prompt_len=c['prompt_len'], new_tokens=c['new_tokens'], models=models)


# -----------------------------------------------------------------------------
# --peer: training ms/iteration, GRT against dense, at nanoGPT's CPU shapes
#
# nanoGPT's CPU example (shakespeare_char: block 64, batch 12, 4 layers, 4 heads, 128 wide, no
# dropout) for the dense GPT, and a GRT 1 + 1x3 + 1 of the same width: r ~ Uniform{1..3} in training,
# mean depth 2, so 4 block passes a token like the dense model, plus W_proj and the gate. A run
# trains both side by side, R iterations of one, then R of the other (the GRT once at each depth
# 1..R), and times each such cycle: ms/iteration is the median over cycles, and the step ratio the
# median of the GRT/dense ratios of adjacent cycles, which a machine shared with other work affects
# far less than two runs one after the other.

PEER_SHAPE = dict(block_size=64, vocab_size=65, n_embd=128, n_head=4, dropout=0.0)
PEER_BATCH = 12
PEER_MODELS = {'gpt': dict(model_type='gpt', n_layer=4),
               'grt': dict(model_type='grt', n_prelude=1, n_core=1, n_recur=3, n_coda=1)}
CPU_FLAGS = ('avx512_bf16', 'amx_bf16', 'avx512f', 'avx2')


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


def peer_modes(c, device_type):
    """(dtype, compiled) pairs to time: fp32, and bf16 autocast on CUDA and on a CPU whose bf16 matrix
    products are faster than fp32 ones (or only the --dtype given); each eager, and compiled unless
    --compile=False."""
    if c['dtype'] == 'auto':
        dtypes = ['float32']
        if device_type == 'cuda' or (device_type == 'cpu' and cpu_bf16_speedup() > 1):
            dtypes.append('bfloat16')
    else:
        dtypes = [pick_dtype(c['dtype'], device_type)]
    return [(dtype, compiled) for dtype in dtypes for compiled in ([False, True] if c['compile'] else [False])]


def peer_model(key):
    torch.manual_seed(0)
    fields = dict(PEER_MODELS[key])
    return build_model(fields.pop('model_type'), **PEER_SHAPE, **fields)


def peer_repeat(iters, warmup, cycle, device, dtype, compiled):
    """One run: a fresh dense GPT and GRT trained side by side, a cycle of `cycle` iterations of one,
    then of the other (the GRT at depths 1..cycle, once each), so load from other work on the
    machine hits both alike. After warmup iterations (compilation, allocator), iters timed ones.
    Returns ({model: median ms/iteration over its cycles}, median over cycles of the GRT's time over
    the dense model's in the cycle just before)."""
    device_type = 'cuda' if device.startswith('cuda') else device
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(PEER_SHAPE['vocab_size'], (PEER_BATCH, PEER_SHAPE['block_size'] + 1), generator=gen).to(device)
    runs = {}
    for key in PEER_MODELS:
        model = peer_model(key).to(device)
        if compiled:
            model.compile_regions()
        model.train()
        runs[key] = (model, model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), device_type))
    sync = synchronizer(device)
    cycle_ms = {key: [] for key in PEER_MODELS}
    warmup_cycles = -(-warmup // cycle)
    for i in range(warmup_cycles + iters // cycle):
        for key, (model, optimizer) in runs.items():
            depths = range(1, cycle + 1) if isinstance(model, RecurrentLM) else [None] * cycle
            sync()
            t = time.perf_counter()
            for num_steps in depths:
                train_step(model, optimizer, x[:, :-1], x[:, 1:], num_steps, device_type, dtype)
            sync()
            if i >= warmup_cycles:
                cycle_ms[key].append(1000 * (time.perf_counter() - t) / cycle)
    ratios = [grt / gpt for grt, gpt in zip(cycle_ms['grt'], cycle_ms['gpt'])]
    return {key: statistics.median(ms) for key, ms in cycle_ms.items()}, statistics.median(ratios)


def spread(values):
    return [min(values), max(values)]


def peer_benchmark(c):
    """The --peer table and its JSON: for each mode, ms/iteration of both models over
    c['peer_repeats'] runs (median and min-max), the GRT/dense step ratio and that ratio per FLOP."""
    if c['peer_iters'] < 1 or c['peer_warmup'] < 0 or c['peer_repeats'] < 1:
        fail("peer_iters and peer_repeats must be >= 1 and peer_warmup >= 0")
    device = 'cpu' if c['device'] == 'auto' else c['device']  # nanoGPT's CPU shapes: the CPU unless asked
    device_type = 'cuda' if device.startswith('cuda') else device
    cycle = PEER_MODELS['grt']['n_recur']
    iters = -(-c['peer_iters'] // cycle) * cycle  # whole cycles
    flops = {}
    for key in PEER_MODELS:
        model = peer_model(key)
        depth = model.mean_train_steps() if key == 'grt' else None
        flops[key] = model.flops_per_token(PEER_SHAPE['block_size'], depth)
    flop_ratio = flops['grt'] / flops['gpt']
    modes = {}
    for dtype, compiled in peer_modes(c, device_type):
        label = f"{dtype} {'compiled' if compiled else 'eager'}"
        print(f"peer: {label}, {c['peer_repeats']} runs of gpt and grt side by side, {c['peer_warmup']} + {iters} "
              f"iterations each ...", file=sys.stderr, flush=True)
        if compiled:
            torch.compiler.reset()
        graphs_before = compiled_graph_count() if compiled else 0
        ms = {key: [] for key in PEER_MODELS}
        step_ratios = []
        for _ in range(c['peer_repeats']):
            run_ms, ratio = peer_repeat(iters, c['peer_warmup'], cycle, device, dtype, compiled)
            for key in PEER_MODELS:
                ms[key].append(run_ms[key])
            step_ratios.append(ratio)
            free_memory(device)
        step_ratio = statistics.median(step_ratios)
        modes[label] = dict(
            gpt_ms=statistics.median(ms['gpt']), gpt_ms_spread=spread(ms['gpt']), gpt_ms_runs=ms['gpt'],
            grt_ms=statistics.median(ms['grt']), grt_ms_spread=spread(ms['grt']), grt_ms_runs=ms['grt'],
            step_ratio=step_ratio, step_ratio_spread=spread(step_ratios), step_ratio_runs=step_ratios,
            ratio_per_flop=step_ratio / flop_ratio, ratio_per_flop_spread=[r / flop_ratio for r in spread(step_ratios)],
            graphs_compiled=compiled_graph_count() - graphs_before if compiled else None)
    cpu, flags = cpu_description()
    result = dict(mode='peer', device=device, threads=torch.get_num_threads(), torch=torch.__version__, cpu=cpu,
                  cpu_flags=flags, bf16_speedup=cpu_bf16_speedup() if device_type == 'cpu' else None,
                  shape=dict(PEER_SHAPE, batch_size=PEER_BATCH), models=PEER_MODELS,
                  iters=iters, warmup=c['peer_warmup'], repeats=c['peer_repeats'], flops_per_token=flops,
                  flop_ratio=flop_ratio, modes=modes)
    print_peer_table(result)
    return result


def print_peer_table(result):
    print(f"--peer: training ms/iteration at nanoGPT's CPU shapes (block {PEER_SHAPE['block_size']}, batch "
          f"{PEER_BATCH}, d {PEER_SHAPE['n_embd']}, {PEER_SHAPE['n_head']} heads); {result['device']}, "
          f"{result['threads']} threads, torch {result['torch']}")
    print(f"CPU: {result['cpu']}; " + ', '.join(f"{k} {'yes' if v else 'no'}" for k, v in result['cpu_flags'].items()))
    if result['bf16_speedup'] is not None:  # what decides whether bf16 is timed, not the flags
        print(f"bf16 matrix products measured {result['bf16_speedup']:.2f}x as fast as fp32")
    f = result['flops_per_token']
    print(f"forward FLOPs/token at the mean training depth: gpt (4 layers) {human(f['gpt'])}, grt (1+1x3+1, "
          f"mean depth 2) {human(f['grt'])}: {result['flop_ratio']:.3f}x")
    print(f"median [min-max] over {result['repeats']} runs; a run: {result['iters']} iterations of each model after "
          f"{result['warmup']} of warm-up, side by side in cycles of 3")
    print(f"{'mode':18s}{'gpt ms/iter':>24s}{'grt ms/iter':>24s}{'grt/gpt step':>24s}{'per FLOP':>24s}")
    for label, m in result['modes'].items():
        cells = [f"{m['gpt_ms']:.1f} [{m['gpt_ms_spread'][0]:.1f}-{m['gpt_ms_spread'][1]:.1f}]",
                 f"{m['grt_ms']:.1f} [{m['grt_ms_spread'][0]:.1f}-{m['grt_ms_spread'][1]:.1f}]",
                 f"{m['step_ratio']:.3f} [{m['step_ratio_spread'][0]:.2f}-{m['step_ratio_spread'][1]:.2f}]",
                 f"{m['ratio_per_flop']:.3f} [{m['ratio_per_flop_spread'][0]:.2f}-"
                 f"{m['ratio_per_flop_spread'][1]:.2f}]"]
        print(f"{label:18s}" + ''.join(f"{cell:>24s}" for cell in cells))
    print("(per FLOP = step ratio / FLOP ratio; the goal is per FLOP <= 1.10)")


# -----------------------------------------------------------------------------
# --gpu_check: is a CUDA machine ready for the paper-scale runs? One command, about 5 minutes on one
# GPU: train config/gpt2_small.py and config/grt_small.py for 50 iterations each (bf16, compiled) on
# random tokens it writes itself, then `bench.py --scale=large`. Each runs in its own process, as a
# user's command would, so one run's memory and compiled graphs never count in another's.

GPU_CHECK_CONFIGS = ('config/gpt2_small.py', 'config/grt_small.py')
GPU_CHECK_TRAIN_ARGS = ('--max_iters=50', '--eval_interval=50', '--eval_iters=5', '--log_interval=10',
                        '--gradient_accumulation_steps=4', '--dtype=bfloat16', '--compile=True')
GPU_CHECK_BENCH_ARGS = ('--scale=large',)
GPU_CHECK_DATASET = 'gpu_check'  # written into a temporary data_dir
GPU_CHECK_TOKENS = 2_000_000  # random GPT-2 token ids for training (and a tenth as many for validation)
HERE = os.path.dirname(os.path.abspath(__file__))

# Runs train.main in a fresh process and writes what only that process can see: train.main's result,
# the peak device memory, the graphs compiled and the recompiles. argv: the JSON file to write, then
# train.py's argv.
TRAIN_DRIVER = """
import json, sys
import torch
import bench, train
graphs_before = bench.compiled_graph_count()
result = train.main(sys.argv[2:])
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
with open(sys.argv[1], 'w') as f:
    json.dump(dict(result=result, peak_mem_bytes=peak, graphs_compiled=bench.compiled_graph_count() - graphs_before,
                   recompiles=bench.recompile_count()), f, default=str)
"""


def write_check_data(data_root, tokens=GPU_CHECK_TOKENS):
    """data_root/GPU_CHECK_DATASET/: random GPT-2 token ids as train.bin and val.bin, and a GPT-2 meta.json."""
    data_dir = os.path.join(data_root, GPU_CHECK_DATASET)
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = prepare_data.GPT2_VOCAB_SIZE
    prepare_data.write_tokens(os.path.join(data_dir, 'train.bin'), rng.integers(0, vocab, tokens))
    prepare_data.write_tokens(os.path.join(data_dir, 'val.bin'), rng.integers(0, vocab, max(tokens // 10, 10_000)))
    with open(os.path.join(data_dir, 'meta.json'), 'w') as f:
        json.dump({'tokenizer': 'gpt2', 'vocab_size': vocab}, f)  # as prepare_data.py writes fineweb10B's


def read_log(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_check(config_path, data_root, out_dir, extra_args):
    """Train one config in its own process; its tokens/s and MFU after the first logged iterations
    (which include compilation), peak memory, graphs compiled and final val loss."""
    report = os.path.join(out_dir, 'gpu_check.json')
    argv = [config_path, f'--data_dir={data_root}', f'--dataset={GPU_CHECK_DATASET}',
            f'--out_dir={out_dir}', *GPU_CHECK_TRAIN_ARGS, *extra_args]
    print(f"gpu_check: python train.py {' '.join(argv)}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, '-c', TRAIN_DRIVER, report, *argv], cwd=HERE)
    if r.returncode != 0 or not os.path.isfile(report):
        fail(f"training {config_path} failed (exit code {r.returncode}); its output is above")
    with open(report) as f:
        run = json.load(f)
    records = [rec for rec in read_log(os.path.join(out_dir, 'log.jsonl')) if 'tokens' in rec and 'time_s' in rec]
    steady = records[1:]  # the first logged interval includes compilation
    tokens_per_s = mfu = None
    if steady:
        seconds = records[-1]['time_s'] - records[0]['time_s']
        tokens_per_s = (records[-1]['tokens'] - records[0]['tokens']) / seconds if seconds > 0 else None
        mfus = [rec['mfu'] for rec in steady if rec.get('mfu') is not None]
        mfu = statistics.median(mfus) if mfus else None
    result = run.get('result') or {}
    return dict(tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_bytes=run['peak_mem_bytes'],
                graphs_compiled=run['graphs_compiled'], recompiles=run['recompiles'], val_loss=result.get('val_loss'),
                wall_s=time.perf_counter() - t)


def bench_check(bench_args):
    """bench.py with bench_args in its own process: its output passes through, its JSON line returns."""
    print(f"gpu_check: python bench.py {' '.join(bench_args)}", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, os.path.join(HERE, 'bench.py'), *bench_args], cwd=HERE,
                       stdout=subprocess.PIPE, text=True)
    print(r.stdout, end='')
    if r.returncode != 0:
        fail(f"bench.py {' '.join(bench_args)} failed (exit code {r.returncode}); its output is above")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_gpu_check(train_args=None, bench_args=GPU_CHECK_BENCH_ARGS, tokens=GPU_CHECK_TOKENS):
    """The check itself, on whatever device train_args and bench_args name (the tests run it tiny on
    CPU). train_args: {config path: extra train.py arguments}."""
    train_args = train_args or {path: () for path in GPU_CHECK_CONFIGS}
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix='gpu_check_') as tmp:
        write_check_data(tmp, tokens)
        runs = {}
        for path, extra in train_args.items():
            name = os.path.splitext(os.path.basename(path))[0]
            runs[name] = train_check(path, tmp, os.path.join(tmp, 'out-' + name), extra)
    dense, grt = (runs.get(os.path.splitext(os.path.basename(p))[0]) for p in GPU_CHECK_CONFIGS)
    step_ratio = per_flop = None
    if dense and grt and dense['tokens_per_s'] and grt['tokens_per_s']:
        step_ratio = dense['tokens_per_s'] / grt['tokens_per_s']  # the same tokens per iteration
        # time per FLOP, GRT over dense, from MFUs: only on CUDA, where both runs divide by one datasheet
        # peak (on a CPU each run measures its own)
        if dense['mfu'] and grt['mfu'] and torch.cuda.is_available():
            per_flop = dense['mfu'] / grt['mfu']
    large = bench_check(list(bench_args))
    result = dict(mode='gpu_check', device=torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
                  torch=torch.__version__, train=runs, grt_dense_step_ratio=step_ratio,
                  grt_dense_ratio_per_flop=per_flop, bench=large, wall_s=time.perf_counter() - t)
    print_gpu_check(result)
    return result


def print_gpu_check(result):
    print(f"--gpu_check on {result['device']}, torch {result['torch']}: 50 iterations of each config, bf16, compiled")
    print(f"{'config':16s}{'tokens/s':>14s}{'MFU':>10s}{'peak memory':>14s}{'graphs':>8s}{'recompiles':>12s}"
          f"{'val loss':>10s}")
    for name, run in result['train'].items():
        cells = ['-' if run['tokens_per_s'] is None else f"{run['tokens_per_s']:,.0f}",
                 '-' if run['mfu'] is None else f"{100 * run['mfu']:.1f}%",
                 '-' if run['peak_mem_bytes'] is None else human(run['peak_mem_bytes'], 'B'),
                 str(run['graphs_compiled']), str(run['recompiles']),
                 '-' if run['val_loss'] is None else f"{run['val_loss']:.3f}"]
        print(f"{name:16s}{cells[0]:>14s}{cells[1]:>10s}{cells[2]:>14s}{cells[3]:>8s}{cells[4]:>12s}{cells[5]:>10s}")
    if result['grt_dense_step_ratio'] is not None:
        per_flop = result['grt_dense_ratio_per_flop']
        print(f"GRT/dense step time {result['grt_dense_step_ratio']:.3f}x"
              + ('' if per_flop is None else f", per FLOP {per_flop:.3f}x"))
    print(f"(graphs: compiled by torch.compile; recompiles: compiles of a function beyond one for training and one "
          f"for evaluation, bench.recompile_count.) Total {result['wall_s']:.0f} s.")


def gpu_check(c):
    if not torch.cuda.is_available():
        fail("needs a CUDA GPU (torch.cuda.is_available() is False): --gpu_check trains the paper-scale configs; "
             "on CPU run `python bench.py --peer=True`")
    return run_gpu_check()


# -----------------------------------------------------------------------------
# --exit_sweep: per-token early exit's quality against its compute, on a trained recurrent model
#
# Every figure is teacher-forced through the KV cache exactly as generation runs (teacher_forced_decode:
# the prompt prefilled, then one token a forward pass), on fixed validation windows: each threshold of
# each criterion, and the fixed depths r = 1..R, so the curve shows whether exiting per token beats
# simply running fewer steps.

EXIT_SWEEP = {'state': (0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),  # thresholds, cheapest criterion first
              'kl': (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03)}
EXIT_SWEEP_WINDOWS = 64  # validation windows for the loss and the mean steps, decoded 8 at a time
EXIT_TIMED_WINDOWS = 2  # of those, decoded one at a time for the batch-1 latency (the first 8: batch 8)
EXIT_TIMING_ROUNDS = 5  # latency: rounds over every setting in turn; a setting's figure is its fastest round
EXIT_GOAL = dict(saving=0.30, loss_cost=0.01)  # issue 11: >= 30% fewer core steps at <= 0.01 nats


def exit_kwargs(model, c):
    """The early-exit settings generate takes from --exit_threshold, --min_steps and --exit ({} when
    unset or for a model without a depth loop to cut: the dense GPT, MoR)."""
    if c['exit_threshold'] is None or model.exit_unsupported:
        return {}
    try:
        model.check_early_exit(EarlyExit(c['exit_threshold'], c['min_steps'], c['exit']), None, c['kv_mode'])
    except ValueError as e:
        fail(str(e))
    return dict(exit_threshold=c['exit_threshold'], min_steps=c['min_steps'], exit=c['exit'])


def exit_point(model, windows, prompt_len, device, batch_size, num_steps=None, early_exit=None):
    """One point of the curve: teacher_forced_decode over windows, batch_size rows at a time; the
    loss and mean core steps over every prediction, the core steps run and the ms per decode step."""
    runs = [teacher_forced_decode(model, windows[i:i + batch_size], prompt_len, num_steps=num_steps,
                                  early_exit=early_exit, sync=synchronizer(device))
            for i in range(0, windows.size(0), batch_size)]
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}  # equal predictions a run


def exit_latencies(model, windows, prompt_len, device, settings):
    """Decode ms per step of every setting (num_steps, early_exit) at batch 1 (EXIT_TIMED_WINDOWS
    windows one at a time) and batch 8 (the first 8 at once), with the mean core steps of the batch-1
    run: EXIT_TIMING_ROUNDS rounds over all settings in turn, each figure the setting's fastest
    round, so a burst of another job's load lands on every setting alike and rarely in a figure."""
    best = [dict(ms_b1=float('inf'), ms_b8=float('inf')) for _ in settings]
    for round_ in range(EXIT_TIMING_ROUNDS):
        print(f"timing round {round_ + 1}/{EXIT_TIMING_ROUNDS} ...", file=sys.stderr, flush=True)
        for figures, (num_steps, rule) in zip(best, settings):
            b1 = exit_point(model, windows[:EXIT_TIMED_WINDOWS], prompt_len, device, 1, num_steps, rule)
            b8 = exit_point(model, windows[:8], prompt_len, device, 8, num_steps, rule)
            figures.update(ms_b1=min(figures['ms_b1'], b1['decode_ms']), ms_b8=min(figures['ms_b8'], b8['decode_ms']),
                           mean_steps_b1=b1['mean_steps'])
    return best


def fixed_depth_loss(points, steps):
    """The fixed-depth curve's loss at a (fractional) mean depth, linear between neighbouring r."""
    fixed = sorted((p['mean_steps'], p['loss']) for p in points if p['exit'] is None)
    lo = max((f for f in fixed if f[0] <= steps), default=fixed[0])
    hi = min((f for f in fixed if f[0] >= steps), default=fixed[-1])
    if hi[0] == lo[0]:
        return lo[1]
    return lo[1] + (hi[1] - lo[1]) * (steps - lo[0]) / (hi[0] - lo[0])


def exit_sweep(c, device, dtype):
    """The curve: loss against mean core steps per token, for fixed r = 1..R and every threshold in
    EXIT_SWEEP of both criteria (min_steps from --min_steps), at batch 8 over EXIT_SWEEP_WINDOWS
    windows; decode latency at batch 8 (the first 8 windows) and batch 1 (EXIT_TIMED_WINDOWS of
    them, one at a time); a table, a PNG and the figures."""
    if not c['out_dir']:
        fail("--exit_sweep measures a trained model: pass --out_dir=<a recurrent model's training directory>")
    model, checkpoint = load_model('resume', c['out_dir'], device, c['ckpt'])
    if model.exit_unsupported:
        fail(model.exit_unsupported)
    model.to(dtype=getattr(torch, dtype))
    R = model.config.n_recur
    length = min(VAL_WINDOW_LEN, model.config.block_size) + 1
    windows = val_windows(checkpoint, length, device, count=EXIT_SWEEP_WINDOWS)
    if not 1 <= c['prompt_len'] < length - 1:
        fail(f"prompt_len must be in 1..{length - 2}: the {length - 1}-token val windows need tokens to decode")
    settings = [dict(exit=None, threshold=None, num_steps=r) for r in range(1, R + 1)]
    settings += [dict(exit=exit, threshold=t, num_steps=None) for exit, ts in EXIT_SWEEP.items() for t in ts]
    rules = [None if s['exit'] is None else EarlyExit(s['threshold'], c['min_steps'], s['exit']) for s in settings]
    points = []
    for i, (s, rule) in enumerate(zip(settings, rules)):
        label = f"r = {s['num_steps']}" if rule is None else f"{s['exit']} < {s['threshold']:g}"
        print(f"[{i + 1}/{len(settings)}] {label}: loss and steps ...", file=sys.stderr, flush=True)
        batch8 = exit_point(model, windows, c['prompt_len'], device, 8, s['num_steps'], rule)
        points.append(dict(s, min_steps=c['min_steps'] if rule else None, loss=batch8['loss'],
                           mean_steps=batch8['mean_steps'], steps_run_b8=batch8['steps_run'],
                           probes_b8=batch8['probes']))
    latencies = exit_latencies(model, windows, c['prompt_len'], device, [(s['num_steps'], rule)
                                                                          for s, rule in zip(settings, rules)])
    for p, figures in zip(points, latencies):
        p.update(figures)
    full = next(p for p in points if p['num_steps'] == R)
    for p in points:
        p['saving'] = 1 - p['mean_steps'] / R
        p['loss_cost'] = p['loss'] - full['loss']
        p['vs_fixed_depth'] = p['loss'] - fixed_depth_loss(points, p['mean_steps'])
    goal = [p for p in points if p['exit'] and p['saving'] >= EXIT_GOAL['saving']
            and p['loss_cost'] <= EXIT_GOAL['loss_cost']]
    result = dict(out_dir=c['out_dir'], ckpt=c['ckpt'], device=device, dtype=dtype, threads=torch.get_num_threads(),
                  R=R, prompt_len=c['prompt_len'], window_len=length - 1, windows=EXIT_SWEEP_WINDOWS,
                  timed_windows=EXIT_TIMED_WINDOWS, min_steps=c['min_steps'],
                  probe_flops=model.exit_probe_flops(length - 1),
                  step_flops=model.flops_per_token(length - 1, 1) - model.flops_per_token(length - 1, 0),
                  points=points, goal=dict(EXIT_GOAL, met=[p['exit'] + f" < {p['threshold']:g}" for p in goal
                                                         if p['vs_fixed_depth'] < 0]))
    print_exit_sweep(result)
    plot_exit_sweep(result, c['exit_plot'])
    return result


def print_exit_sweep(result):
    R = result['R']
    print(f"early exit on {result['out_dir']}/{result['ckpt']}: R = {R}, min_steps {result['min_steps']}, "
          f"{result['windows']} val windows of {result['window_len']} tokens (prompt {result['prompt_len']}, "
          f"the rest decoded one token at a time through the cache), {result['device']} "
          f"({result['threads']} threads), {result['dtype']}")
    print(f"{'setting':>14s} {'mean steps':>10s} {'saving':>7s} {'val loss':>9s} {'vs R':>8s} {'vs fixed':>9s} "
          f"{'steps b1':>8s} {'ms/tok b1':>9s} {'steps run b8':>12s} {'ms/tok b8':>9s}")
    for p in result['points']:
        label = f"r = {p['num_steps']}" if p['exit'] is None else f"{p['exit']} < {p['threshold']:g}"
        print(f"{label:>14s} {p['mean_steps']:10.2f} {100 * p['saving']:6.1f}% {p['loss']:9.4f} "
              f"{p['loss_cost']:+8.4f} {p['vs_fixed_depth']:+9.4f} {p['mean_steps_b1']:8.2f} {p['ms_b1']:9.2f} "
              f"{p['steps_run_b8']:12.2f} {p['ms_b8']:9.2f}")
    print(f"(vs fixed: loss minus the fixed-depth curve's at the same mean steps, linear between r; 'kl' "
          f"probes cost {human(result['probe_flops'])} FLOPs each against {human(result['step_flops'])} a "
          f"core step; b1: the first {result['timed_windows']} windows one at a time; b8: the first 8 at once, "
          f"the ms of a decode step of all 8 rows, which runs the slowest row's steps; latencies: the fastest of "
          f"{EXIT_TIMING_ROUNDS} rounds over all settings)")
    goal = result['goal']
    print(f"goal (>= {100 * goal['saving']:.0f}% fewer steps at <= {goal['loss_cost']} nats, below fixed depth): "
          + (', '.join(goal['met']) if goal['met'] else 'not met'))


def plot_exit_sweep(result, path):
    """Loss against mean core steps per token (left) and against batch-1 decode ms/token (right)."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("(the plot needs matplotlib: pip install matplotlib; the table above has every figure)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {None: ('fixed depth r = 1..R', 'k', 's'), 'state': ("exit: 'state'", 'tab:blue', 'o'),
              'kl': ("exit: 'kl'", 'tab:red', '^')}
    for exit, (label, color, marker) in styles.items():
        ps = sorted((p for p in result['points'] if p['exit'] == exit), key=lambda p: p['mean_steps'])
        for ax, x in zip(axes, ('mean_steps', 'ms_b1')):
            ax.plot([p[x] for p in ps], [p['loss'] for p in ps], marker=marker, color=color, label=label)
        for p in ps:
            text = f"r={p['num_steps']}" if exit is None else f"{p['threshold']:g}"
            axes[0].annotate(text, (p['mean_steps'], p['loss']), textcoords='offset points', xytext=(4, 4),
                             fontsize=7, color=color)
    full = next(p for p in result['points'] if p['num_steps'] == result['R'])
    axes[0].axhline(full['loss'] + result['goal']['loss_cost'], color='grey', ls=':', lw=1,
                    label=f"R's loss + {result['goal']['loss_cost']}")
    axes[0].axvline(result['R'] * (1 - result['goal']['saving']), color='grey', ls='--', lw=1,
                    label=f"{100 * result['goal']['saving']:.0f}% fewer steps than R")
    axes[0].set_xlabel('mean core steps per token')
    axes[1].set_xlabel(f"decode ms/token, batch 1 ({result['device']}, {result['threads']} threads)")
    for ax in axes:
        ax.set_ylabel('val loss (teacher-forced through the cache)')
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"per-token early exit: {result['out_dir']} (R = {result['R']}, min_steps {result['min_steps']})",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


# -----------------------------------------------------------------------------


def check_settings(c):
    if c['scale'] not in SCALES:
        fail(f"scale must be one of {', '.join(SCALES)}, got {c['scale']!r}")
    if c['kv_mode'] not in KV_MODES:
        fail(f"kv_mode must be one of {', '.join(KV_MODES)}, got {c['kv_mode']!r}")
    if c['prompt_len'] < 1 or c['new_tokens'] < 2 or c['batch_size'] < 1:
        fail("prompt_len and batch_size must be >= 1 and new_tokens >= 2 (one prefill, then decode steps)")
    modes = [f"--{k}" for k in ('peer', 'gpu_check', 'out_dir', 'train') if c[k]]
    if len(modes) > 1:
        fail(f"{' and '.join(modes)} are separate modes; pass one of them")


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    check_settings(c)
    torch.manual_seed(0)
    try:
        if c['peer']:
            result = peer_benchmark(c)
        elif c['gpu_check']:
            result = gpu_check(c)
        else:
            device = pick_device(c['device'], 0)
            dtype = pick_dtype(c['dtype'], 'cuda' if device.startswith('cuda') else device)
            result = exit_sweep(c, device, dtype) if c['exit_sweep'] else decode_benchmark(c, device, dtype)
    except TorchInternalsChanged as e:
        fail(str(e))
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
