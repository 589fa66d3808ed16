"""
Does test-time depth solve harder problems? Issue 19's comparison, with one resumable command:

    python -m experiments.depth_study                                   # S3 running products, eight models, one seed
    python -m experiments.depth_study --tasks=compose,pointer,sum --jobs=2
    python -m experiments.depth_study --tasks=pointer --max_iters=5 --examples=8 --out_dir=/tmp/depth-dry

Eight models, each trained on a depth task's difficulties 1..D and evaluated on 1..3D at several
test-time R (experiments/depth_eval.py):
  grt               the GRT as the paper trains it, 1 + 1x8 + 1, r ~ U{1..8} (config/depth/grt.py)
  grt_fixed         the GRT at a fixed r = R = 5, gate bias 0 (config/depth/grt_fixed.py)
  grt_local         the GRT with local attention (a token and the one before), 1 + 1x4 + 1, heavy-tailed r,
                    gate bias 0 (config/depth/grt_local.py)
  gpt_params        a dense GPT with the GRT's non-embedding parameters, 3 layers (config/depth/gpt_params.py)
  gpt_flops         a dense GPT with the GRT's training FLOPs a token, 8 layers (config/depth/gpt_flops.py)
  gpt_params_local  gpt_params with grt_local's local attention (config/depth/gpt_params_local.py)
  gpt_flops_local   gpt_flops with grt_local's local attention (config/depth/gpt_flops_local.py)
  huginn            Huginn at the GRT's layout and about its training FLOPs (config/depth/huginn.py)

Each run is `python train.py config/depth/<model>.py --dataset=task:<task> --seed=S ...`, kept in
<out_dir>/runs/<run>/ (train.log, log.jsonl, ckpt.pt, best.pt). A run with depth.json (its evaluation
of best.pt) is done and never redone; a run with a checkpoint resumes (--init_from=resume), so Ctrl-C
and rerun loses at most one evaluation interval. At the end it writes <out_dir>/RESULTS.md (the
models, then per task the runs with a GRT's mean gate, and accuracy by model and R against difficulty)
and <out_dir>/<task>.png.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import train
from common import fail, read_settings
from config import parse_config
from experiments.depth_eval import evaluate_checkpoint, plot_lines
from experiments.depth_tasks import TASKS, make_task
from experiments.study import mean_train_flops
from model import RecurrentLM
from registry import build_model

DEFAULTS = dict(
    out_dir='results/depth',
    tasks='compose',
    models='grt,grt_fixed,grt_local,gpt_params,gpt_flops,gpt_params_local,gpt_flops_local,huginn',
    seeds=1,
    max_iters=0,  # iterations of a run; 0 = the configs' (config/depth/recipe.py)
    difficulty=0,  # train on 1..D; 0 = the configs' D
    steps='1,2,4,8,16',  # test-time R of the recurrent models
    examples=128,  # eval sequences per difficulty
    jobs=1,  # runs trained at once, sharing the cores: 1 gives each run all of them
)
CONFIGS = {name: f'config/depth/{name}.py' for name in ('grt', 'grt_fixed', 'grt_local', 'gpt_params', 'gpt_flops',
                                                         'gpt_params_local', 'gpt_flops_local', 'huginn')}


def run_settings(model):
    """train.py's settings of a model's config (train.py's defaults under it)."""
    return parse_config(train.DEFAULTS, [CONFIGS[model]])


def model_of(model, task):
    """The model a config trains on a task (meta device: its shapes, no weights), as train.py builds it."""
    c = run_settings(model)
    model_type, args = train.requested_model(c, dict(vocab_size=make_task(task, c['block_size']).vocab_size))
    with torch.device('meta'):
        return build_model(model_type or 'gpt', **args)


# -----------------------------------------------------------------------------
# Runs


def plan(c):
    """[(task, model, seed)] and each run's iterations and difficulty (the study's, else the configs')."""
    tasks, models = [t for t in c['tasks'].split(',') if t], [m for m in c['models'].split(',') if m]
    unknown = [t for t in tasks if t not in TASKS] + [m for m in models if m not in CONFIGS]
    if unknown or not tasks or not models:
        fail(f"unknown or no tasks/models {unknown}; tasks from {', '.join(TASKS)}, models from {', '.join(CONFIGS)}")
    recipe = run_settings(models[0])
    iters, D = c['max_iters'] or recipe['max_iters'], c['difficulty'] or recipe['difficulty']
    return [(t, m, s) for t in tasks for m in models for s in range(c['seeds'])], iters, D


def run_dir(c, task, model, seed, iters, D):
    return os.path.join(c['out_dir'], 'runs', f"{task}-D{D}-{model}-{iters}it-s{seed}")


def train_run(c, task, model, seed, iters, D):
    """Train one run to max_iters (resuming a started one); stop the study with one line if it fails."""
    out = run_dir(c, task, model, seed, iters, D)
    os.makedirs(out, exist_ok=True)
    resume = os.path.isfile(os.path.join(out, 'ckpt.pt'))
    cmd = [sys.executable, 'train.py', CONFIGS[model], f'--dataset=task:{task}', f'--difficulty={D}',
           f'--seed={seed}', f'--max_iters={iters}', f'--out_dir={out}',
           f"--init_from={'resume' if resume else 'scratch'}"]
    threads = max(1, (os.cpu_count() or 1) // c['jobs'])
    with open(os.path.join(out, 'train.log'), 'a') as log:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        fail(f"run {os.path.basename(out)} failed (exit {done.returncode}); see {out}/train.log, then rerun "
             f"python -m experiments.depth_study to continue")


def evaluate_run(c, task, model, seed, iters, D):
    """The run's depth_eval record with its training time, kept in depth.json."""
    out = run_dir(c, task, model, seed, iters, D)
    path = os.path.join(out, 'depth.json')
    if not os.path.isfile(path):
        record = evaluate_checkpoint(out, 'best.pt', c['steps'], 3 * D, c['examples'], 'cpu')
        log = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
        record.update(model=model, seed=seed, iters=log[-1]['iter'], train_time_s=log[-1]['time_s'],
                      best_val_loss=min(r['val_loss'] for r in log if 'val_loss' in r))
        with open(path + '.tmp', 'w') as f:
            json.dump(record, f)
        os.replace(path + '.tmp', path)
    with open(path) as f:
        return json.load(f)


# -----------------------------------------------------------------------------
# Report


def mean_rows(records):
    """{(model, R): [mean accuracy over seeds, per difficulty]} for one task's records."""
    rows = {}
    for r in records:
        for j, steps in enumerate(r['steps']):
            rows.setdefault((r['model'], steps), []).append([acc[j] for acc in r['accuracy']])
    models = list(dict.fromkeys(r['model'] for r in records))
    order = sorted(rows, key=lambda key: (models.index(key[0]), key[1] or 0))  # by model, then R ascending
    return {key: [statistics.fmean(col) for col in zip(*rows[key])] for key in order}


def accuracy_markdown(records, D):
    """Markdown: a row per model and R, a column per difficulty, and the means within and beyond 1..D."""
    difficulties = records[0]['difficulties']
    lines = ['| model | R | ' + ' | '.join(f'd={d}' for d in difficulties) + f' | mean 1..{D} | mean > {D} |',
             '|---|---|' + '---|' * (len(difficulties) + 2)]
    for (model, steps), accuracy in mean_rows(records).items():
        cells = ' | '.join(f'{a:.3f}' for a in accuracy)
        lines.append(f"| {model} | {steps or 'dense'} | {cells} | {statistics.fmean(accuracy[:D]):.3f} | "
                     f"{statistics.fmean(accuracy[D:]):.3f} |")
    return lines


def models_table(c, task):
    grt = model_of('grt', task)
    seq_len = grt.config.block_size
    lines = ['| model | config | layout | non-embedding params | train FLOPs/token | x GRT |',
             '|---|---|---|---|---|---|']
    for name in [m for m in c['models'].split(',') if m]:
        m = model_of(name, task)
        layout = (f"{m.config.n_prelude}+{m.config.n_core}x{m.config.n_recur}+{m.config.n_coda}"
                  if isinstance(m, RecurrentLM) else f"{m.config.n_layer} layers")
        flops = mean_train_flops(m, seq_len)
        lines.append(f"| {name} | `{CONFIGS[name]}` | {layout} | {m.get_num_params() / 1e6:.3f}M | "
                     f"{flops / 1e6:.2f}M | {flops / mean_train_flops(grt, seq_len):.2f} |")
    return lines


def plot_task(records, D, path):
    """Accuracy against difficulty, a colour per model: the dense models, and each recurrent one at its
    trained R (solid) and its largest (dashed)."""
    rows = mean_rows(records)
    trained = {r['model']: r['trained_R'] for r in records}
    colors = {model: f'C{i}' for i, model in enumerate(dict.fromkeys(r['model'] for r in records))}
    lines, styles = {}, {}
    for (model, steps), accuracy in rows.items():
        deepest = max(s for m, s in rows if m == model) if steps else None
        if steps in (None, trained[model], deepest):
            label = model if steps is None else f"{model}, R = {steps}"
            lines[label] = accuracy
            styles[label] = dict(color=colors[model], ls='--' if steps and steps != trained[model] else '-')
    return plot_lines(path, f"{records[0]['task']}: trained on difficulties 1..{D}", records[0]['difficulties'],
                      lines, records[0]['chance'], D, styles)


def runs_table(records):
    """A row per run; a GRT's mean gate at its first step and at its trained R (difficulty D)."""
    def gate(r):
        return f"{r['gate'][0]:.3f} / {r['gate'][r['trained_R'] - 1]:.3f}" if r.get('gate') else ''
    lines = ['| model | seed | iterations | best val loss | training time (s) | gate at step 1 / R |',
             '|---|---|---|---|---|---|']
    lines += [f"| {r['model']} | {r['seed']} | {r['iters']} | {r['best_val_loss']:.4f} | {r['train_time_s']:.0f} | "
              f"{gate(r)} |" for r in records]
    return lines


def write_report(c, records, D, wall_s):
    tasks = list(dict.fromkeys(r['task'] for r in records))
    lines = ['# Depth study', '',
             f"Trained on difficulties 1..{D}, evaluated on 1..{3 * D}: the accuracy at the answers that need "
             f"exactly d steps, {c['examples']} sequences a difficulty, the mean over {c['seeds']} seed(s). "
             f"`python -m experiments.depth_study` took {wall_s / 60:.1f} min this time (runs already done are "
             f"not redone).", '',
             '## Models', '', 'Training FLOPs a token, LM head excluded, at the depths training draws.', '']
    lines += models_table(c, tasks[0].removeprefix('task:')) + ['']
    for task in tasks:
        mine = [r for r in records if r['task'] == task]
        name = task.removeprefix('task:')
        lines += [f'## {name} (chance {mine[0]["chance"]:.3f})', ''] + runs_table(mine) + ['']
        lines += accuracy_markdown(mine, D) + ['']
        if plot_task(mine, D, os.path.join(c['out_dir'], f'{name}.png')):
            lines += [f'![{name}]({name}.png)', '']
    with open(os.path.join(c['out_dir'], 'RESULTS.md'), 'w') as f:
        f.write('\n'.join(lines))


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if c['jobs'] < 1 or c['seeds'] < 1:
        fail(f"jobs and seeds must be at least 1; got {c['jobs']} and {c['seeds']}")
    runs, iters, D = plan(c)
    t0 = time.time()
    todo = [run for run in runs if not os.path.isfile(os.path.join(run_dir(c, *run, iters, D), 'depth.json'))]
    print(f"{len(runs)} runs of {iters} iterations on difficulties 1..{D}; {len(todo)} to train or finish", flush=True)
    with ThreadPoolExecutor(c['jobs']) as pool:
        list(pool.map(lambda run: train_run(c, *run, iters, D), todo))
    records = []
    for run in runs:
        records.append(evaluate_run(c, *run, iters, D))
        print(f"{os.path.basename(run_dir(c, *run, iters, D))}: evaluated", flush=True)
    write_report(c, records, D, time.time() - t0)
    print(f"wrote {os.path.join(c['out_dir'], 'RESULTS.md')}")


if __name__ == '__main__':
    main()
