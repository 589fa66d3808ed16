"""
Per-token early exit on a trained recurrent model: validation loss against the mean core steps a token
runs, for a sweep of thresholds of both criteria (early_exit.EarlyExit 'state' and 'kl') and for the
fixed depths r = 1..R, so the curve shows whether exiting per token beats simply running fewer steps;
and the decode latency of each setting at batch 1 and batch 8.

    OMP_NUM_THREADS=1 python -m benchmarks.exit_sweep --out_dir=out-shakespeare-char-grt --dtype=float32

Every figure is teacher-forced through the KV cache exactly as generation runs (bench.teacher_forced_decode:
the prompt prefilled, then one token a forward pass) on fixed windows of the checkpoint's validation data.
It prints a table (loss, mean steps, saving, the loss against R's and against the fixed-depth curve at the
same mean steps, latencies), writes the plot (--plot, needs matplotlib) and ends with one JSON line.
"""

import json
import os
import sys

import torch

from bench import VAL_WINDOW_LEN, human, synchronizer, teacher_forced_decode, val_windows
from common import fail, load_model, pick_device, pick_dtype, pyplot, read_settings, share_cores
from early_exit import EarlyExit, check_early_exit, probe_flops

DEFAULTS = dict(
    out_dir='',  # a recurrent model's training directory (required)
    ckpt='best.pt',  # 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    device='auto',
    dtype='auto',
    prompt_len=32,  # prompt tokens of each window, prefilled in one pass; the rest is decoded
    min_steps=1,  # the fewest core steps a token runs
    plot='docs/img/exit_curve.png',  # where the plot goes (needs matplotlib)
)
SWEEP = {'state': (0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3),  # thresholds, cheapest criterion first
         'kl': (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03)}
WINDOWS = 64  # validation windows for the loss and the mean steps, decoded 8 at a time
TIMED_WINDOWS = 2  # of those, decoded one at a time for the batch-1 latency (the first 8: batch 8)
TIMING_ROUNDS = 5  # latency: rounds over every setting in turn; a setting's figure is its fastest round
GOAL = dict(saving=0.30, loss_cost=0.01)  # >= 30% fewer core steps at <= 0.01 nats


def point(model, windows, prompt_len, device, batch_size, num_steps=None, rule=None):
    """One point of the curve: teacher_forced_decode over windows, batch_size rows at a time; the loss
    and mean core steps over every prediction, the core steps run and the ms per decode step."""
    runs = [teacher_forced_decode(model, windows[i:i + batch_size], prompt_len, num_steps=num_steps, rule=rule,
                                  sync=synchronizer(device))
            for i in range(0, windows.size(0), batch_size)]
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}  # equal predictions a run


def latencies(model, windows, prompt_len, device, settings):
    """Decode ms per step of every setting (num_steps, rule) at batch 1 (TIMED_WINDOWS windows one at a
    time) and batch 8 (the first 8 at once), with the batch-1 run's mean core steps: TIMING_ROUNDS rounds
    over all settings in turn, each figure the setting's fastest round, so a burst of another job's load
    lands on every setting alike and rarely in a figure."""
    best = [dict(ms_b1=float('inf'), ms_b8=float('inf')) for _ in settings]
    for round_ in range(TIMING_ROUNDS):
        print(f"timing round {round_ + 1}/{TIMING_ROUNDS} ...", file=sys.stderr, flush=True)
        for figures, (num_steps, rule) in zip(best, settings):
            b1 = point(model, windows[:TIMED_WINDOWS], prompt_len, device, 1, num_steps, rule)
            b8 = point(model, windows[:8], prompt_len, device, 8, num_steps, rule)
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


def sweep(c, device, dtype):
    """Every setting's loss and steps at batch 8 over WINDOWS windows, then every setting's latencies."""
    model, checkpoint = load_model('resume', c['out_dir'], device, c['ckpt'])
    try:
        check_early_exit(model, EarlyExit(SWEEP['state'][0], c['min_steps'], 'state'))
    except ValueError as e:
        fail(str(e))
    model.to(dtype=getattr(torch, dtype))
    R = model.config.n_recur
    length = min(VAL_WINDOW_LEN, model.config.block_size) + 1
    windows = val_windows(checkpoint, length, device, count=WINDOWS)
    if not 1 <= c['prompt_len'] < length - 1:
        fail(f"prompt_len must be in 1..{length - 2}: the {length - 1}-token val windows need tokens to decode")
    settings = [dict(exit=None, threshold=None, num_steps=r) for r in range(1, R + 1)]
    settings += [dict(exit=exit, threshold=t, num_steps=None) for exit, ts in SWEEP.items() for t in ts]
    rules = [None if s['exit'] is None else EarlyExit(s['threshold'], c['min_steps'], s['exit']) for s in settings]
    points = []
    for i, (s, rule) in enumerate(zip(settings, rules)):
        label = f"r = {s['num_steps']}" if rule is None else f"{s['exit']} < {s['threshold']:g}"
        print(f"[{i + 1}/{len(settings)}] {label}: loss and steps ...", file=sys.stderr, flush=True)
        b8 = point(model, windows, c['prompt_len'], device, 8, s['num_steps'], rule)
        points.append(dict(s, min_steps=c['min_steps'] if rule else None, loss=b8['loss'],
                           mean_steps=b8['mean_steps'], steps_run_b8=b8['steps_run'], probes_b8=b8['probes']))
    for p, figures in zip(points, latencies(model, windows, c['prompt_len'], device,
                                            [(s['num_steps'], rule) for s, rule in zip(settings, rules)])):
        p.update(figures)
    full = next(p for p in points if p['num_steps'] == R)
    for p in points:
        p['saving'] = 1 - p['mean_steps'] / R
        p['loss_cost'] = p['loss'] - full['loss']
        p['vs_fixed_depth'] = p['loss'] - fixed_depth_loss(points, p['mean_steps'])
    met = [f"{p['exit']} < {p['threshold']:g}" for p in points if p['exit'] and p['saving'] >= GOAL['saving']
           and p['loss_cost'] <= GOAL['loss_cost'] and p['vs_fixed_depth'] < 0]
    return dict(out_dir=c['out_dir'], ckpt=c['ckpt'], device=device, dtype=dtype, threads=torch.get_num_threads(),
                R=R, prompt_len=c['prompt_len'], window_len=length - 1, windows=WINDOWS, timed_windows=TIMED_WINDOWS,
                min_steps=c['min_steps'], probe_flops=probe_flops(model, length - 1),
                step_flops=model.flops_per_token(length - 1, 1) - model.flops_per_token(length - 1, 0),
                points=points, goal=dict(GOAL, met=met))


def print_sweep(result):
    print(f"early exit on {result['out_dir']}/{result['ckpt']}: R = {result['R']}, min_steps {result['min_steps']}, "
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
          f"{TIMING_ROUNDS} rounds over all settings)")
    goal = result['goal']
    print(f"goal (>= {100 * goal['saving']:.0f}% fewer steps at <= {goal['loss_cost']} nats, below fixed depth): "
          + (', '.join(goal['met']) if goal['met'] else 'not met'))


def plot_sweep(result, path):
    """Loss against mean core steps per token (left) and against batch-1 decode ms/token (right)."""
    plt = pyplot("(the plot needs matplotlib: pip install matplotlib; the table above has every figure)")
    if plt is None:
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
    axes[1].set_xlabel('decode ms/token, batch 1')
    for ax in axes:
        ax.set_ylabel('val loss (teacher-forced through the cache)')
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"per-token early exit: {os.path.basename(os.path.normpath(result['out_dir']))} "
                 f"(R = {result['R']}, min_steps {result['min_steps']})", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not c['out_dir']:
        fail("the exit sweep measures a trained model: pass --out_dir=<a recurrent model's training directory>")
    device = pick_device(c['device'], 0)
    share_cores(device)  # torch's threads on the cores other work leaves free
    dtype = pick_dtype(c['dtype'], 'cuda' if device.startswith('cuda') else device)
    result = sweep(c, device, dtype)
    print_sweep(result)
    plot_sweep(result, c['plot'])
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
