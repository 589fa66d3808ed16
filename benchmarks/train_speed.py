"""
Training speed of one scale's three models (bench.py's dense GPT-2, GRT isoFLOP and GRT isoParam):
tokens/s and MFU of the optimizer step train.py takes, eager and compiled, on random tokens.

    python -m benchmarks.train_speed --scale=small --dtype=bfloat16
    python -m benchmarks.train_speed --scale=tiny --steps=2 --compile=False   # seconds, for a check

Each model trains fresh: one warm-up step (compilation, when compiled), then --steps timed steps at
batch --batch_size x 256 tokens (capped at block_size), the GRTs' depth drawn per step as train.py draws
it. MFU is train.py's: common.estimate_mfu against common.peak_flops_for in the run's dtype (on a CPU a
measured matrix-product peak). A table, then one JSON line.
"""

import json
import sys
import time

import torch

from bench import SCALES, build_preset, free_memory, hardware, print_table, synchronizer
from common import (autocast_context, compile_regions, estimate_mfu, fail, measure_cpu_peak, peak_flops_for,
                    pick_device, pick_dtype, read_settings)

DEFAULTS = dict(
    scale='small',  # bench.py's scales: tiny | small | medium | large
    device='auto',
    dtype='auto',
    compile=True,  # also time the step compiled by common.compile_regions
    batch_size=1,
    steps=3,  # timed steps a model, after one warm-up step
    peak_flops=0.0,  # the peak for MFU, as train.py's; 0 = measured (CPU) or the datasheet figure (CUDA)
)
SEQ_LEN = 256  # training sequence length (capped at block_size): fits in 24 GB at the large scale
ROWS = [('train_tokens_per_s', 'train tokens/s (eager)', lambda n: f"{n:.0f}"),
        ('train_tokens_per_s_compiled', 'train tokens/s (compiled)', lambda n: f"{n:.0f}"),
        ('mfu', 'train MFU (eager)', lambda n: f"{100 * n:.1f}%"),
        ('mfu_compiled', 'train MFU (compiled)', lambda n: f"{100 * n:.1f}%")]


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
    """MFU as train.py computes it. On CPU a figure above 100% first measures the peak again (the first
    measurement may have run on loaded cores); None where no peak is known, or where the figure would
    still exceed 100%: then the peak is wrong, and a warning says so instead."""
    peak = peak_flops_for(device, getattr(torch, dtype), peak_flops)
    if not peak:
        return None
    mfu = estimate_mfu(model, tokens, seconds, peak, seq_len, mean_depth)
    if mfu > 1 and device == 'cpu' and peak_flops <= 0:
        peak = measure_cpu_peak(getattr(torch, dtype), again=True)
        mfu = estimate_mfu(model, tokens, seconds, peak, seq_len, mean_depth)
    if mfu > 1:
        print(f"warning: MFU would be {100 * mfu:.0f}% against a {dtype} peak of {peak / 1e9:.1f} GFLOP/s, so that "
              f"peak is wrong for this device; MFU not reported (set --peak_flops=...)", file=sys.stderr)
        return None
    return mfu


def train_throughput(model, c, device, dtype):
    """(tokens/s, MFU) of train_step on random tokens over c['steps'] steps after one warm-up step.
    Depths are drawn per step as train.py draws them, from a fixed generator."""
    device_type = 'cuda' if device.startswith('cuda') else device
    seq_len = min(SEQ_LEN, model.config.block_size)
    model.train()
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(model.config.vocab_size, (c['batch_size'], seq_len + 1), generator=gen).to(device)
    sync = synchronizer(device)
    depths, elapsed = [], 0.0
    for step in range(c['steps'] + 1):
        num_steps = model.sample_depth(gen)
        sync()
        t = time.perf_counter()
        train_step(model, optimizer, x[:, :-1], x[:, 1:], num_steps, device_type, dtype)
        sync()
        if step > 0:  # step 0 warms up (and compiles)
            elapsed += time.perf_counter() - t
            depths.append(num_steps)
    tokens = c['steps'] * c['batch_size'] * seq_len
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
            compile_regions(model)
        suffix = '_compiled' if compiled else ''
        figures['train_tokens_per_s' + suffix], figures['mfu' + suffix] = train_throughput(model, c, device, dtype)
        del model
        free_memory(device)
    return figures


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if c['scale'] not in SCALES:
        fail(f"scale must be one of {', '.join(SCALES)}, got {c['scale']!r}")
    if c['steps'] < 1 or c['batch_size'] < 1:
        fail("steps and batch_size must be >= 1")
    device = pick_device(c['device'], 0)
    dtype = pick_dtype(c['dtype'], 'cuda' if device.startswith('cuda') else device)
    models = {}
    for key, (name, overrides) in SCALES[c['scale']].items():
        print(f"training {key} ...", file=sys.stderr, flush=True)
        models[key] = train_figures(name, overrides, c, device, dtype)
    print(f"training speed, scale {c['scale']}, {dtype} autocast, batch {c['batch_size']} x {SEQ_LEN} tokens "
          f"(capped at block_size), {c['steps']} timed steps after 1; {hardware(device)}")
    print_table(models, ROWS)
    result = dict(mode='train_speed', scale=c['scale'], device=device, dtype=dtype, batch_size=c['batch_size'],
                  steps=c['steps'], models=models)
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
