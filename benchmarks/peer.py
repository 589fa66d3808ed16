"""
Training speed at nanoGPT's CPU shapes (its shakespeare_char CPU example: block 64, batch 12, 4 heads,
128 wide, no dropout), in two comparisons:

1. GRT against dense, per FLOP: our dense GPT (4 layers) and a FLOP-matched GRT (1 + 1x3 + 1; r ~
   Uniform{1..3} in training, mean depth 2, so 4 block passes a token like the dense model, plus W_proj
   and the gate) trained side by side in one process: R iterations of one, then R of the other (the GRT
   once at each depth 1..R), each such cycle timed. ms/iteration is the median over cycles, and the step
   ratio the median of the GRT/dense ratios of adjacent cycles, which other work on the machine affects
   far less than two runs one after the other. In fp32 and, where the CPU's bf16 matrix products are
   faster, bf16; eager and compiled; over --repeats runs.
2. With --nanogpt=PATH (a checkout of karpathy/nanoGPT): nanoGPT's own train.py with its CPU command
   against our train.py with the same settings (the dense GPT, fp32, eager), whole-script runs in
   alternating order, both on Tiny Shakespeare's characters written into a temporary directory (nanoGPT's
   files are copied there too, so the checkout stays untouched). ms/iteration: the median over the last
   five sixths of the iterations, from nanoGPT's printed `time` and our log.jsonl.

    python -m benchmarks.peer                                    # 1., every mode
    python -m benchmarks.peer --dtype=float32 --compile=False --nanogpt=../nanoGPT   # fp32 eager, 1. and 2.

It prints the CPU and its flags, the measured bf16 speed-up, the tables, and one JSON line last.
"""

import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import prepare_data
from bench import (TorchInternalsChanged, compiled_graph_count, cpu_description, free_memory, hardware, human,
                   synchronizer)
from benchmarks.train_speed import train_step
from common import compile_regions, cpu_bf16_speedup, fail, pick_dtype, read_settings
from model import RecurrentLM
from registry import build_model

DEFAULTS = dict(
    device='cpu',  # nanoGPT's CPU shapes
    dtype='auto',  # 'auto': fp32, and bf16 where it is faster; or only the dtype given
    compile=True,  # also time the compiled step (common.compile_regions)
    iters=150,  # 1.: timed iterations a run (rounded up to whole cycles of the GRT's depths 1..R)
    warmup=20,  # 1.: untimed iterations first (allocator; compilation when compiled)
    repeats=3,  # 1.: runs per mode (fresh models each); the spread is over these
    nanogpt='',  # 2.: path to a karpathy/nanoGPT checkout; '' skips the comparison with its train.py
    runs=2,  # 2.: runs of each train.py, alternating
    train_iters=300,  # 2.: iterations a train.py run
    text='data/shakespeare_char/input.txt',  # 2.: Tiny Shakespeare, the text both train on
)
SHAPE = dict(block_size=64, vocab_size=65, n_embd=128, n_head=4, dropout=0.0)
BATCH = 12
PEER_MODELS = {'gpt': dict(model_type='gpt', n_layer=4),
               'grt': dict(model_type='grt', n_prelude=1, n_core=1, n_recur=3, n_coda=1)}
# nanoGPT's README CPU command (fewer iterations, fp32 spelled out: on a CPU it computes in fp32 anyway)
NANOGPT_ARGS = ['config/train_shakespeare_char.py', '--device=cpu', '--compile=False', '--eval_iters=20',
                '--log_interval=1', '--block_size=64', '--batch_size=12', '--n_layer=4', '--n_head=4',
                '--n_embd=128', '--lr_decay_iters=2000', '--dropout=0.0', '--dtype=float32']
OURS_ARGS = ['config/shakespeare_char_gpt.py', '--n_layer=4', '--block_size=64', '--batch_size=12',
             '--dtype=float32', '--dropout=0.0', '--compile=False', '--eval_iters=20', '--eval_interval=250',
             '--log_interval=1', '--lr_decay_iters=2000']
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


# -----------------------------------------------------------------------------
# 1. GRT against dense, per FLOP


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
    return build_model(fields.pop('model_type'), **SHAPE, **fields)


def peer_repeat(iters, warmup, cycle, device, dtype, compiled):
    """One run: a fresh dense GPT and GRT trained side by side in cycles of `cycle` iterations each;
    warmup iterations, then iters timed ones. Returns ({model: median ms/iteration over its cycles},
    median over cycles of the GRT's time over the dense model's in the cycle just before)."""
    device_type = 'cuda' if device.startswith('cuda') else device
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(SHAPE['vocab_size'], (BATCH, SHAPE['block_size'] + 1), generator=gen).to(device)
    runs = {}
    for key in PEER_MODELS:
        model = peer_model(key).to(device)
        if compiled:
            compile_regions(model)
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


def per_flop(c, device):
    """For each mode: ms/iteration of both models over c['repeats'] runs (median, min-max), the GRT/dense
    step ratio and that ratio per FLOP."""
    device_type = 'cuda' if device.startswith('cuda') else device
    cycle = PEER_MODELS['grt']['n_recur']
    iters = -(-c['iters'] // cycle) * cycle  # whole cycles
    flops = {}
    for key in PEER_MODELS:
        model = peer_model(key)
        depth = model.mean_train_steps() if key == 'grt' else None
        flops[key] = model.flops_per_token(SHAPE['block_size'], depth)
    flop_ratio = flops['grt'] / flops['gpt']
    modes = {}
    for dtype, compiled in peer_modes(c, device_type):
        label = f"{dtype} {'compiled' if compiled else 'eager'}"
        print(f"peer: {label}, {c['repeats']} runs of gpt and grt side by side, {c['warmup']} + {iters} "
              f"iterations each ...", file=sys.stderr, flush=True)
        if compiled:
            torch.compiler.reset()
        graphs_before = compiled_graph_count() if compiled else 0
        ms = {key: [] for key in PEER_MODELS}
        step_ratios = []
        for _ in range(c['repeats']):
            run_ms, ratio = peer_repeat(iters, c['warmup'], cycle, device, dtype, compiled)
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
    return dict(shape=dict(SHAPE, batch_size=BATCH), models=PEER_MODELS, iters=iters, warmup=c['warmup'],
                repeats=c['repeats'], flops_per_token=flops, flop_ratio=flop_ratio, modes=modes)


def print_per_flop(result):
    f = result['flops_per_token']
    print(f"GRT against dense: training ms/iteration at nanoGPT's CPU shapes (block {SHAPE['block_size']}, batch "
          f"{BATCH}, d {SHAPE['n_embd']}, {SHAPE['n_head']} heads); forward FLOPs/token at the mean training depth: "
          f"gpt (4 layers) {human(f['gpt'])}, grt (1+1x3+1, mean depth 2) {human(f['grt'])}: {result['flop_ratio']:.3f}x")
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
    print("(per FLOP = step ratio / FLOP ratio)")


# -----------------------------------------------------------------------------
# 2. Our train.py against nanoGPT's


def write_data(text_path, tmp, nanogpt_dir):
    """Tiny Shakespeare's characters for both scripts: ours through prepare_data (tmp/data), nanoGPT's
    in its own layout (raw uint16 train.bin and val.bin, meta.pkl), the same ids and 90/10 split."""
    if not os.path.isfile(text_path):
        fail(f"no text at {text_path}: place Tiny Shakespeare there (README, Quick start) or pass --text=FILE")
    try:
        prepare_data.prepare('shakespeare_char', data_dir=os.path.join(tmp, 'data'), input_path=text_path)
    except ValueError as e:
        fail(e)
    with open(text_path, encoding='utf-8') as f:
        ids, meta = prepare_data.tokenize(f.read(), 'char')
    out = os.path.join(nanogpt_dir, 'data', 'shakespeare_char')
    os.makedirs(out, exist_ok=True)
    n = int(0.9 * len(ids))
    np.asarray(ids[:n], dtype=np.uint16).tofile(os.path.join(out, 'train.bin'))
    np.asarray(ids[n:], dtype=np.uint16).tofile(os.path.join(out, 'val.bin'))
    chars = meta['chars']
    with open(os.path.join(out, 'meta.pkl'), 'wb') as f:
        pickle.dump({'vocab_size': len(chars), 'itos': dict(enumerate(chars)),
                     'stoi': {ch: i for i, ch in enumerate(chars)}}, f)


def run_script(label, argv, cwd):
    """Run a train.py to the end; its output is returned (and shown only if it fails)."""
    print(f"peer: {label}: python {' '.join(argv)}", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{label} failed (exit code {r.returncode}): {(r.stderr.strip() or r.stdout.strip())[-2000:]}")
    return r.stdout


def steady_ms(ms_by_iter, iters):
    """Median ms/iteration over the last five sixths of a run (iterations 50-300 of 300)."""
    steady = [ms for i, ms in ms_by_iter.items() if i >= iters // 6]
    if not steady:
        fail(f"no per-iteration times past iteration {iters // 6}; the train.py's output changed?")
    return statistics.median(steady)


def nanogpt_ms(stdout, iters):
    """From nanoGPT's 'iter 12: loss 4.1752, time 36.18ms, mfu -100.00%' lines."""
    times = {int(m[1]): float(m[2]) for m in re.finditer(r'^iter (\d+): loss \S+, time ([\d.]+)ms', stdout, re.M)}
    return steady_ms(times, iters)


def ours_ms(log_path, iters):
    """From our log.jsonl at log_interval 1: the differences of its cumulative time_s."""
    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if 'iter' in r and 'time_s' in r]
    times = {b['iter']: 1000 * (b['time_s'] - a['time_s']) for a, b in zip(records, records[1:])
             if b['iter'] == a['iter'] + 1}
    return steady_ms(times, iters)


def against_nanogpt(c):
    """c['runs'] runs of each train.py in alternating order: their ms/iteration and ours/nanoGPT."""
    src = c['nanogpt']
    for name in ('train.py', 'model.py', 'configurator.py', 'config/train_shakespeare_char.py'):
        if not os.path.isfile(os.path.join(src, name)):
            fail(f"{src} lacks {name}: pass --nanogpt=<a checkout of https://github.com/karpathy/nanoGPT>")
    commit = subprocess.run(['git', '-C', src, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix='peer_') as tmp:
        nanogpt_dir = os.path.join(tmp, 'nanoGPT')
        shutil.copytree(src, nanogpt_dir, ignore=shutil.ignore_patterns('.git', 'data', 'out*', 'assets'))
        write_data(c['text'], tmp, nanogpt_dir)
        iters = [f"--max_iters={c['train_iters']}"]
        for i in range(c['runs']):
            ms = {}
            for who in (('nanogpt', 'ours') if i % 2 == 0 else ('ours', 'nanogpt')):
                if who == 'nanogpt':
                    out = run_script(f"nanoGPT run {i + 1}", ['train.py', *NANOGPT_ARGS, *iters], nanogpt_dir)
                    ms[who] = nanogpt_ms(out, c['train_iters'])
                else:
                    out_dir = os.path.join(tmp, f'out-ours-{i}')
                    run_script(f"our run {i + 1}", ['train.py', *OURS_ARGS, *iters, f"--out_dir={out_dir}",
                                                   f"--data_dir={os.path.join(tmp, 'data')}"], HERE)
                    ms[who] = ours_ms(os.path.join(out_dir, 'log.jsonl'), c['train_iters'])
            runs.append(dict(ms, ratio=ms['ours'] / ms['nanogpt']))
    nano, ours = [r['nanogpt'] for r in runs], [r['ours'] for r in runs]
    return dict(path=src, commit=commit.stdout.strip() or None, nanogpt_args=NANOGPT_ARGS, ours_args=OURS_ARGS,
                train_iters=c['train_iters'], runs=runs, nanogpt_ms=statistics.median(nano),
                nanogpt_ms_spread=spread(nano), ours_ms=statistics.median(ours), ours_ms_spread=spread(ours),
                ratio_of_medians=statistics.median(ours) / statistics.median(nano))


def print_against_nanogpt(result):
    n = result['train_iters']
    print(f"ours against nanoGPT's train.py ({result['path']} at {result['commit'] or 'an unknown commit'}), "
          f"dense, fp32, eager, {len(result['runs'])} runs each, alternating; median ms/iteration over "
          f"iterations {n // 6}-{n}")
    print(f"{'run':>4s}{'nanoGPT ms/iter':>18s}{'ours ms/iter':>16s}{'ours/nanoGPT':>16s}")
    for i, r in enumerate(result['runs']):
        print(f"{i + 1:4d}{r['nanogpt']:18.1f}{r['ours']:16.1f}{r['ratio']:16.3f}")
    print(f"median {result['nanogpt_ms']:.1f} [{result['nanogpt_ms_spread'][0]:.1f}-"
          f"{result['nanogpt_ms_spread'][1]:.1f}] against {result['ours_ms']:.1f} [{result['ours_ms_spread'][0]:.1f}-"
          f"{result['ours_ms_spread'][1]:.1f}]: ours/nanoGPT {result['ratio_of_medians']:.3f}")


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if c['iters'] < 1 or c['warmup'] < 0 or c['repeats'] < 1 or c['runs'] < 1 or c['train_iters'] < 6:
        fail("iters, repeats and runs must be >= 1, warmup >= 0 and train_iters >= 6")
    device = c['device']
    torch.manual_seed(0)
    cpu, flags = cpu_description()
    try:
        result = dict(mode='peer', device=device, threads=torch.get_num_threads(), torch=torch.__version__, cpu=cpu,
                      cpu_flags=flags, hardware=hardware(device), per_flop=per_flop(c, device))
    except TorchInternalsChanged as e:
        fail(str(e))
    result['bf16_speedup'] = cpu_bf16_speedup() if device == 'cpu' else None
    result['nanogpt'] = against_nanogpt(c) if c['nanogpt'] else None
    print(result['hardware'])
    if result['bf16_speedup'] is not None:  # what decides whether bf16 is timed, not the flags
        print(f"bf16 matrix products measured {result['bf16_speedup']:.2f}x as fast as fp32")
    print_per_flop(result['per_flop'])
    if result['nanogpt']:
        print_against_nanogpt(result['nanogpt'])
    else:
        print("(the comparison with nanoGPT's own train.py needs --nanogpt=<a checkout of karpathy/nanoGPT>)")
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
