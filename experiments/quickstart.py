"""
The README's quick-start pair, trained side by side on one machine, and the GRT's steps measured:

    python -m experiments.quickstart                 # writes results/quickstart/RESULTS.md and results.json

Trains config/shakespeare_char_grt.py and config/shakespeare_char_gpt.py with nothing changed but out_dir
(<out_dir>/runs/<name>/, holding train.log, log.jsonl, ckpt.pt, best.pt), both at once, one thread each.
A run with result.json is done; a run with ckpt.pt resumes (--init_from=resume), so Ctrl-C and rerun
loses at most one evaluation interval. Then experiments.analyze reads the GRT's best.pt: the exit loss
and the mean gate at every recurrence step r = 1 .. 2R (<out_dir>/analysis/). max_iters (0: the configs' own) shortens both
runs for a quick check of the script; a run's name records it.
"""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import prepare_data
from bench import cpu_line
from common import fail, read_checkpoint, read_settings
from experiments import analyze
from registry import from_checkpoint

DEFAULTS = dict(
    out_dir='results/quickstart',
    data_dir='data',
    max_iters=0,  # 0: each config's own (1,500); another value only to try the script quickly
)
CONFIGS = {'grt': 'config/shakespeare_char_grt.py', 'gpt': 'config/shakespeare_char_gpt.py'}


def run_dir(c, name):
    return os.path.join(c['out_dir'], 'runs', name + (f"-{c['max_iters']}it" if c['max_iters'] else ''))


def train(c, name):
    """Train one config to its end (resuming a started run); return its result dict."""
    out = run_dir(c, name)
    result_path = os.path.join(out, 'result.json')
    if os.path.isfile(result_path):
        with open(result_path) as f:
            return json.load(f)
    os.makedirs(out, exist_ok=True)
    resume = os.path.isfile(os.path.join(out, 'ckpt.pt'))
    cmd = [sys.executable, 'train.py', CONFIGS[name], f"--out_dir={out}", f"--data_dir={c['data_dir']}",
           f"--init_from={'resume' if resume else 'scratch'}"]
    cmd += [f"--max_iters={c['max_iters']}", f"--lr_decay_iters={c['max_iters']}"] if c['max_iters'] else []
    with open(os.path.join(out, 'train.log'), 'a') as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS='1'))
    if done.returncode != 0:
        fail(f"{name} failed (exit {done.returncode}); see {out}/train.log, then rerun to continue")
    records = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
    evals = [(r['iter'], r['val_loss']) for r in records if 'val_loss' in r]
    result = dict(config=CONFIGS[name], best_val_loss=min(v for _, v in evals), evals=evals,
                  iters=records[-1]['iter'], train_time_s=records[-1]['time_s'])
    with open(result_path + '.tmp', 'w') as f:
        json.dump(result, f, indent=1)
    os.replace(result_path + '.tmp', result_path)
    return result


def size(c, name):
    """(non-embedding parameters, forward FLOPs a token at the run's block_size) of a run's best.pt."""
    model = from_checkpoint(read_checkpoint(os.path.join(run_dir(c, name), 'best.pt')))
    return model.get_num_params(), model.flops_per_token(model.config.block_size)


def report(c, results, steps):
    R = steps['R']
    grt, gpt = results['grt'], results['gpt']
    lines = ['# The quick-start pair', '',
             f"Written by `python -m experiments.quickstart`. Machine: {cpu_line()}. The two runs trained at "
             f"the same time, one thread each (OMP_NUM_THREADS=1): the times "
             f"compare the two runs with each other, not with another machine.", '',
             '| config | non-embedding params | forward FLOPs/token | best val loss | iterations | training time (s) |',
             '|---|---|---|---|---|---|']
    for name in ('gpt', 'grt'):
        r = results[name]
        lines.append(f"| `{r['config']}` | {r['params'] / 1e6:.2f}M | {r['flops_per_token'] / 1e6:.3f}M | "
                     f"{r['best_val_loss']:.4f} | {r['iters']} | {r['train_time_s']:.0f} |")
    lines += ['', f"GRT - GPT: {grt['best_val_loss'] - gpt['best_val_loss']:+.4f} nats.", '',
              f"## The GRT at each recurrence step (experiments.analyze on its best.pt; trained R = {R})", '',
              f"On the val batches training evaluated ({steps['eval_iters']} batches, {steps['tokens']:,} tokens); "
              f"the exit loss is the val loss when the coda reads h_r, at r = R the model's own. Past R the "
              f"model runs deeper than it trained.", '',
              '| r | exit loss | mean gate g | relative state change |', '|---|---|---|---|']
    for r in range(1, len(steps['exit_loss']) + 1):
        mark = ' (R)' if r == R else ''
        lines.append(f"| {r}{mark} | {steps['exit_loss'][r - 1]:.4f} | {steps['gate'][r - 1]:.3f} | "
                     f"{steps['change'][r - 1]:.3f} |")
    lines.append('')
    return '\n'.join(lines)


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not os.path.isfile(os.path.join(c['data_dir'], 'shakespeare_char', 'meta.json')):
        prepare_data.prepare('shakespeare_char', data_dir=c['data_dir'])  # once, before two runs read it
    with ThreadPoolExecutor(len(CONFIGS)) as pool:
        futures = {name: pool.submit(train, c, name) for name in CONFIGS}
        results = {name: future.result() for name, future in futures.items()}
    for name, r in results.items():
        r['params'], r['flops_per_token'] = size(c, name)
    out = run_dir(c, 'grt')
    steps = analyze.analyze(dict(analyze.DEFAULTS, out_dir=out, analysis_dir=os.path.join(c['out_dir'], 'analysis')))
    summary = dict(machine=cpu_line(), threads_per_run=1, runs_at_once=len(CONFIGS), runs=results,
                   grt_steps={k: steps[k] for k in ('R', 'exit_loss', 'gate', 'change', 'eval_iters', 'tokens')})
    with open(os.path.join(c['out_dir'], 'results.json'), 'w') as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(c['out_dir'], 'RESULTS.md'), 'w') as f:
        f.write(report(c, results, steps))
    print(f"wrote {c['out_dir']}/RESULTS.md and results.json")


if __name__ == '__main__':
    main()
