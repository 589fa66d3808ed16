"""
Does test-time depth solve harder problems? The comparison over models and seeds, with one resumable command:

    python -m experiments.depth_study                                   # S3 running products, eight models (all but the ablations loop_local, gated_local), one seed
    python -m experiments.depth_study --models=grt_local --seeds=8 --jobs=2 --out_dir=results/depth/compose
    python -m experiments.depth_study --models=grt_local --seeds=2 --split=train,dev --variant=bias-3 \
        --overrides='--gate_bias=-3' --out_dir=results/depth/dev       # a training choice, measured on dev alone
    python -m experiments.depth_study --tasks=pointer --max_iters=5 --examples=8 --out_dir=/tmp/depth-dry

Ten models, each trained on a depth task's difficulties 1..D and evaluated on the splits of
experiments/depth_eval.py (train 1..D, dev D+1..D+2, test D+3..3D, stretch 3D+1..6D) at several test-time R:
  grt               the GRT as the paper trains it, 1 + 1x8 + 1, r ~ U{1..8} (config/depth/grt.py)
  grt_fixed         the GRT at a fixed r = R = 5, gate bias 0 (config/depth/grt_fixed.py)
  grt_local         the GRT with local attention (a token and the one before), 1 + 1x4 + 1, heavy-tailed r,
                    gate bias 0 (config/depth/grt_local.py)
  loop_local        grt_local with the gate removed, h = Core(W_proj [h + eps_x ; e]) (config/depth/loop_local.py)
  gated_local       grt_local with the re-injection of e removed, u = h + eps_x (config/depth/gated_local.py)
  gpt_params        a dense GPT with the GRT's non-embedding parameters, 3 layers (config/depth/gpt_params.py)
  gpt_flops         a dense GPT with the GRT's training FLOPs a token, 8 layers (config/depth/gpt_flops.py)
  gpt_params_local  gpt_params with grt_local's local attention (config/depth/gpt_params_local.py)
  gpt_flops_local   gpt_flops with grt_local's local attention (config/depth/gpt_flops_local.py)
  huginn            Huginn at the GRT's layout and about its training FLOPs (config/depth/huginn.py)

Each run is `python train.py config/depth/<model>.py --dataset=task:<task> --seed=S ... <overrides>`, kept
in <out_dir>/runs/<run>/ (train.log, log.jsonl, ckpt.pt, best.pt; not committed). Its evaluation of
best.pt, with its settings, goes to <out_dir>/seeds/<run>.json (committed): a run with one is done and
never redone; a run with a checkpoint resumes (--init_from=resume), so Ctrl-C and rerun loses at most one
evaluation interval. With --redraw=K a run whose mean dev accuracy at its best R is below DEV_FLOOR
(0.9) trains again from seed S + 1000 k into <run>-drawk/ (k = 1..K) until a draw reaches the floor
or K are spent; its JSON is the last draw's (draw, train_seed; a JSON without them is a first draw)
with every earlier draw's record, as it was evaluated, in earlier_draws, and the report shows them.
At the end it writes <out_dir>/RESULTS.md from every JSON in seeds/ (no seed left out): the models, per
task each run's best R on dev and its split means there, the mean and lowest seed per model, and
accuracy by model and R against difficulty; and <out_dir>/<task>.png.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

import train
from bench import cpu_line
from common import fail, read_settings
from config import parse_config
from experiments.depth_eval import best_steps, evaluate_checkpoint, parse_steps, plot_lines, split_means
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
    steps='1,2,4,8,16,32,64',  # test-time R of the recurrent models
    split='train,dev,test,stretch',  # the splits evaluated (experiments/depth_eval.py); choose on dev alone
    examples=128,  # eval sequences per difficulty
    variant='',  # a name for overrides, part of each run's name
    overrides='',  # train.py settings added to every run, e.g. '--gate_bias=-3 --gate_noise=0'
    jobs=1,  # runs trained at once, sharing the cores: 1 gives each run all of them
    threads=0,  # torch threads a run; 0 = the cores shared equally among the jobs
    device='cpu',  # where the runs train and are evaluated: 'cpu', 'cuda', ...
    redraw=0,  # draws a run may take past its first while its dev accuracy stays below DEV_FLOOR
)
DEV_FLOOR = 0.9  # mean dev accuracy at the best R under which a run has not learned the step (docs/depth.md)
DRAW_SEED_STEP = 1000  # draw k of seed S trains with --seed=S + 1000 k (train_seed)
CONFIGS = {name: f'config/depth/{name}.py' for name in ('grt', 'grt_fixed', 'grt_local', 'loop_local', 'gated_local',
                                                         'gpt_params', 'gpt_flops', 'gpt_params_local', 'gpt_flops_local',
                                                         'huginn')}


def run_settings(model, overrides=''):
    """train.py's settings of a model's config and overrides (train.py's defaults under them)."""
    return parse_config(train.DEFAULTS, [CONFIGS[model]] + overrides.split())


def model_of(model, task, overrides=''):
    """The model a config and overrides train on a task (meta device: its shapes, no weights), as
    train.py builds it."""
    c = run_settings(model, overrides)
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
    if bool(c['variant']) != bool(c['overrides']):
        fail("give --variant=NAME and --overrides='--key=value ...' together (the name goes into each run's)")
    return [(t, m, s) for t in tasks for m in models for s in range(c['seeds'])], iters, D


def run_name(c, task, model, seed, iters, D):
    return f"{task}-D{D}-{model}{'+' + c['variant'] if c['variant'] else ''}-{iters}it-s{seed}"


def run_dir(c, task, model, seed, iters, D, draw=0):
    suffix = f'-draw{draw}' if draw else ''  # draw 0 keeps the run's name
    return os.path.join(c['out_dir'], 'runs', run_name(c, task, model, seed, iters, D) + suffix)


def record_path(c, task, model, seed, iters, D):
    """Where a run's evaluation is kept, committed beside RESULTS.md (runs/ is not)."""
    return os.path.join(c['out_dir'], 'seeds', run_name(c, task, model, seed, iters, D) + '.json')


def train_seed(seed, draw):
    """The --seed that draw k of a run's seed trains with."""
    return seed + DRAW_SEED_STEP * draw


def train_run(c, task, model, seed, iters, D, draw=0):
    """Train one run's draw to max_iters (resuming a started one); stop the study with one line if it fails."""
    out = run_dir(c, task, model, seed, iters, D, draw)
    os.makedirs(out, exist_ok=True)
    resume = os.path.isfile(os.path.join(out, 'ckpt.pt'))
    cmd = [sys.executable, 'train.py', CONFIGS[model], f'--dataset=task:{task}', f'--difficulty={D}',
           f'--seed={train_seed(seed, draw)}', f'--max_iters={iters}', f'--out_dir={out}', f"--device={c['device']}",
           f"--init_from={'resume' if resume else 'scratch'}"] + c['overrides'].split()
    threads = c['threads'] or max(1, (os.cpu_count() or 1) // c['jobs'])
    with open(os.path.join(out, 'train.log'), 'a') as log:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        fail(f"run {os.path.basename(out)} failed (exit {done.returncode}); see {out}/train.log, then rerun "
             f"python -m experiments.depth_study to continue")


def evaluate_run(c, task, model, seed, iters, D, draw=0, earlier=None):
    """The depth_eval record of a run's draw with its settings and training time, kept in
    <out_dir>/seeds/<run>.json with the records of the draws before it (earlier: the last of them)."""
    out = run_dir(c, task, model, seed, iters, D, draw)
    path = record_path(c, task, model, seed, iters, D)
    kept = json.load(open(path)) if os.path.isfile(path) else {}
    if not kept or kept.get('draw', 0) != draw or not evaluated_as_asked(c, kept):
        record = evaluate_checkpoint(out, 'best.pt', c['steps'], c['split'], c['examples'], c['device'])
        log = [json.loads(line) for line in open(os.path.join(out, 'log.jsonl'))]
        record.update(model=model, config=CONFIGS[model], variant=c['variant'], overrides=c['overrides'],
                      device=c['device'], machine=cpu_line(), seed=seed, draw=draw,
                      train_seed=train_seed(seed, draw), iters=log[-1]['iter'],
                      train_time_s=log[-1]['time_s'],
                      ms_per_step=round(1000 * log[-1]['time_s'] / max(1, log[-1]['iter']), 1),
                      best_val_loss=min(r['val_loss'] for r in log if 'val_loss' in r),
                      earlier_draws=earlier_draws(earlier) if earlier else kept.get('earlier_draws', []))
    else:
        record = kept
    record['best_R'] = best_steps(record)  # by best_steps' rule, also in a record written before it
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        json.dump(record, f)
    os.replace(path + '.tmp', path)
    return record


def earlier_draws(record):
    """The records of a draw and of every draw before it, oldest first."""
    return record.get('earlier_draws', []) + [{k: v for k, v in record.items() if k != 'earlier_draws'}]


def redraw_due(c, record):
    """Whether a run's draw is below DEV_FLOOR on dev with draws left (--redraw) to try again."""
    dev = at_best(record, 'dev')
    return dev is not None and dev < DEV_FLOOR and record.get('draw', 0) < c['redraw']


def evaluated_as_asked(c, record):
    """Whether a run's record holds the splits, steps and examples this command asks for."""
    asked = set(parse_steps(c['steps'])) | ({record['trained_R']} if record['trained_R'] else set())
    return (list(record['splits']) == c['split'].split(',') and record['examples'] == c['examples']
            and (record['steps'] == [None] or set(record['steps']) == asked))


# -----------------------------------------------------------------------------
# Report


def mean_rows(records):
    """{(model, R): {difficulty: mean accuracy over the seeds that evaluated it}} for one task's records."""
    rows = {}
    for r in records:
        for j, steps in enumerate(r['steps']):
            for d, acc in zip(r['difficulties'], r['accuracy']):
                rows.setdefault((label(r), steps), {}).setdefault(d, []).append(acc[j])
    models = list(dict.fromkeys(label(r) for r in records))
    order = sorted(rows, key=lambda key: (models.index(key[0]), key[1] or 0))  # by model, then R ascending
    return {key: {d: statistics.fmean(v) for d, v in rows[key].items()} for key in order}


def difficulties_and_splits(records):
    """Every difficulty and split the records evaluated (runs of one folder may differ in --split)."""
    splits = {}
    for r in records:
        splits.update(r['splits'])
    return sorted({d for r in records for d in r['difficulties']}), splits


def accuracy_markdown(records):
    """Markdown: a row per model and R, a column per difficulty, and the mean over each split."""
    difficulties, splits = difficulties_and_splits(records)
    lines = ['| model | R | ' + ' | '.join(f'd={d}' for d in difficulties) + ' | ' +
             ' | '.join(f'{s} {ds[0]}..{ds[-1]}' for s, ds in splits.items()) + ' |',
             '|---|---|' + '---|' * (len(difficulties) + len(splits))]
    for (model, steps), by_d in mean_rows(records).items():
        means = [statistics.fmean(by_d[d] for d in ds) if all(d in by_d for d in ds) else None
                 for ds in splits.values()]
        lines.append(f"| {model} | {steps or 'dense'} | "
                     f"{' | '.join('' if a is None else f'{a:.3f}' for a in map(by_d.get, difficulties))} | "
                     f"{' | '.join('' if m is None else f'{m:.3f}' for m in means)} |")
    return lines


def models_table(records, task):
    """A row per model and variant, built from its config and overrides."""
    grt = model_of('grt', task)
    seq_len = grt.config.block_size
    lines = ['| model | config | layout | non-embedding params | train FLOPs/token | x GRT |',
             '|---|---|---|---|---|---|']
    for r in {label(r): r for r in records}.values():
        m = model_of(r['model'], task, r.get('overrides', ''))
        layout = (f"{m.config.n_prelude}+{m.config.n_core}x{m.config.n_recur}+{m.config.n_coda}"
                  if isinstance(m, RecurrentLM) else f"{m.config.n_layer} layers")
        flops = mean_train_flops(m, seq_len)
        lines.append(f"| {label(r)} | `{CONFIGS[r['model']]}` | {layout} | {m.get_num_params() / 1e6:.3f}M | "
                     f"{flops / 1e6:.2f}M | {flops / mean_train_flops(grt, seq_len):.2f} |")
    return lines


def plot_task(records, D, path):
    """Accuracy against difficulty, a colour per model: the dense models, and each recurrent one at its
    trained R (solid) and its largest (dashed)."""
    rows = mean_rows(records)
    trained = {label(r): r['trained_R'] for r in records}
    colors = {model: f'C{i}' for i, model in enumerate(dict.fromkeys(label(r) for r in records))}
    lines, styles = {}, {}
    difficulties, _ = difficulties_and_splits(records)
    for (model, steps), by_d in rows.items():
        deepest = max(s for m, s in rows if m == model) if steps else None
        if steps in (None, trained[model], deepest):
            name = model if steps is None else f"{model}, R = {steps}"
            lines[name] = [by_d.get(d, math.nan) for d in difficulties]  # a gap where no seed evaluated d
            styles[name] = dict(color=colors[model], ls='--' if steps and steps != trained[model] else '-')
    return plot_lines(path, f"{records[0]['task']}: trained on difficulties 1..{D}", difficulties,
                      lines, records[0]['chance'], D, styles)


def label(r):
    """A report's row: the model, its variant and its iterations (runs differing in any are not pooled)."""
    return r['model'] + ('+' + r['variant'] if r.get('variant') else '') + f" ({r['iters']} it)"


def at_best(record, split, factor=1):
    """Mean accuracy over a split at factor x the run's best R on dev (a dense model: its one
    column); None where the split or that R was not evaluated."""
    if split not in record['splits']:
        return None
    R = best_steps(record)
    R = R and R * factor
    return split_means(record, split).get(R)


def seeds_table(records):
    """A row per run, every seed: its best R on dev and the split means there, the test mean at 4x
    that R (overthinking), and a GRT's mean gate at step 1 and at its trained R (difficulty D)."""
    def cell(v):
        return '' if v is None else f'{v:.3f}'

    def gate(r):
        return f"{r['gate'][0]:.3f} / {r['gate'][r['trained_R'] - 1]:.3f}" if r.get('gate') else ''

    def seed(r):
        return f"{r['seed']} (trained as {r['train_seed']})" if r.get('draw') else str(r['seed'])

    def draws(r):  # each earlier draw's training seed: its dev / test at its own best R
        return '; '.join(f"{d.get('train_seed', d['seed'])}: {cell(at_best(d, 'dev'))} / {cell(at_best(d, 'test'))}"
                         for d in r.get('earlier_draws', []))
    lines = ['| model | seed | best val loss | training time (s) | best R (dev) | train | dev | test | stretch | '
             'test at 4R | gate at step 1 / R | earlier draws: dev / test |', '|---' * 12 + '|']
    lines += [f"| {label(r)} | {seed(r)} | {r['best_val_loss']:.4f} | {r['train_time_s']:.0f} | "
              f"{best_steps(r) or 'dense'} | {cell(at_best(r, 'train'))} | {cell(at_best(r, 'dev'))} | "
              f"{cell(at_best(r, 'test'))} | {cell(at_best(r, 'stretch'))} | "
              f"{cell(at_best(r, 'test', 4) if best_steps(r) else None)} | {gate(r)} | {draws(r)} |" for r in records]
    return lines


def summary_table(records):
    """Per model over its seeds: the mean and the lowest seed of each split at each seed's best R."""
    lines = ['| model | seeds | train mean (min) | dev mean (min) | test mean (min) | stretch mean (min) |',
             '|---|---|---|---|---|---|']
    for name in dict.fromkeys(label(r) for r in records):
        mine = [r for r in records if label(r) == name]
        cells = []
        for split in ('train', 'dev', 'test', 'stretch'):
            values = [v for v in (at_best(r, split) for r in mine) if v is not None]
            cells.append(f'{statistics.fmean(values):.3f} ({min(values):.3f})' if values else '')
        lines.append(f"| {name} | {len(mine)} | {' | '.join(cells)} |")
    return lines


def all_records(c, runs, iters, D):
    """Every run evaluated in out_dir (its seeds/*.json): this command's in its order, then earlier
    ones' by name; none is left out."""
    folder = os.path.join(c['out_dir'], 'seeds')
    mine = [record_path(c, *run, iters, D) for run in runs]
    others = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith('.json'))
    return [json.load(open(path)) for path in mine + [p for p in others if p not in mine]]


def devices(records):
    """{device: runs trained there}; a record without the field trained on the CPU."""
    return dict(Counter(r.get('device', 'cpu') for r in records))


def write_report(c, records, D, wall_s):
    tasks = list(dict.fromkeys(r['task'] for r in records))
    lines = ['# Depth study', '',
             f"Trained on difficulties 1..{D}, evaluated on the splits of experiments/depth_eval.py (train 1..D, "
             f"dev D+1..D+2, test D+3..3D, stretch 3D+1..6D, each from its own seeds): the accuracy at the answers "
             f"that need exactly d steps, {c['examples']} sequences a difficulty. Every run in seeds/ (one JSON "
             f"a run, with its settings) is here. The last `python -m experiments.depth_study` into this folder "
             f"took {wall_s / 60:.1f} min (runs already done are not redone), on {cpu_line()}. Runs by the device "
             f"they trained on: {', '.join(f'{d}: {n}' for d, n in devices(records).items())}; a JSON's "
             f"machine (where recorded) is the one that evaluated it.", '',
             '## Models', '', 'Training FLOPs a token, LM head excluded, at the depths training draws.', '']
    lines += models_table(records, tasks[0].removeprefix('task:')) + ['']
    variants = {label(r): r['overrides'] for r in records if r.get('variant')}
    if variants:
        lines += ['Variants: ' + '; '.join(f"{name}: `{o}`" for name, o in variants.items()), '']
    for task in tasks:
        mine = [r for r in records if r['task'] == task]
        name = task.removeprefix('task:')
        lines += [f'## {name} (chance {mine[0]["chance"]:.3f})', '',
                  'Every seed; each run\'s R is chosen on dev alone, the other splits read at that R.', '']
        lines += summary_table(mine) + [''] + seeds_table(mine) + ['']
        lines += ['The mean over seeds at each R:', ''] + accuracy_markdown(mine) + ['']
        if plot_task(mine, D, os.path.join(c['out_dir'], f'{name}.png')):
            lines += [f'![{name}]({name}.png)', '']
    with open(os.path.join(c['out_dir'], 'RESULTS.md'), 'w') as f:
        f.write('\n'.join(lines))


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if c['jobs'] < 1 or c['seeds'] < 1:
        fail(f"jobs and seeds must be at least 1; got {c['jobs']} and {c['seeds']}")
    if c['redraw'] < 0 or c['redraw'] and 'dev' not in c['split'].split(','):
        fail(f"--redraw={c['redraw']} needs a count of at least 0 and dev in --split (the floor is read on dev)")
    runs, iters, D = plan(c)
    t0 = time.time()
    kept = {run: json.load(open(path)) for run in runs if os.path.isfile(path := record_path(c, *run, iters, D))}
    todo = [run for run in runs if run not in kept or not evaluated_as_asked(c, kept[run])]
    again = [run for run in kept if run not in todo and redraw_due(c, kept[run])]
    print(f"{len(runs)} runs of {iters} iterations on difficulties 1..{D}; {len(todo)} to train or finish, "
          f"{len(again)} to draw again", flush=True)

    def train_and_evaluate(run):  # each draw's JSON as soon as it is trained: a stopped study keeps it
        draw = kept.get(run, {}).get('draw', 0)
        if run in todo:
            train_run(c, *run, iters, D, draw)
        record = evaluate_run(c, *run, iters, D, draw)
        while redraw_due(c, record):  # below DEV_FLOOR on dev: train the run again from another seed
            draw += 1
            train_run(c, *run, iters, D, draw)
            record = evaluate_run(c, *run, iters, D, draw, earlier=record)
        print(f"{run_name(c, *run, iters, D)}: evaluated" + (f" (draw {draw})" if draw else ''), flush=True)

    with ThreadPoolExecutor(c['jobs']) as pool:
        list(pool.map(train_and_evaluate, runs))
    write_report(c, all_records(c, runs, iters, D), D, time.time() - t0)
    print(f"wrote {os.path.join(c['out_dir'], 'RESULTS.md')}")


if __name__ == '__main__':
    main()
