"""
Depth chosen per token on a depth task: early exit (early_exit.py) on a recurrent model trained on a
depth task, against the fixed depths R:

    python -m experiments.depth_exit --out_dir=results/depth/compose/runs/compose-D4-grt_local-2000it-s0
    python -m experiments.depth_exit --out_dir=DIR --thresholds=0.01,0.003,0.001 --max_steps=32 --split=dev
    python -m experiments.depth_exit --out_dir=DIR --criterion=kl --thresholds=1e-4,1e-6,1e-8
    python -m experiments.depth_exit --out_dir=DIR --in_order=True --tie=0
    python -m experiments.depth_exit --out_dir=DIR --split=dev --mixed=256

Each token runs up to max_steps recurrence steps and stops after the first step whose criterion falls
below the threshold: 'state', the relative state change ||h_s - h_(s-1)|| / ||h_(s-1)||, or 'kl',
KL(p_(s-1) || p_s) between the predictions of exiting after steps s - 1 and s; with --in_order=True
a token stops only once the token before it has (early_exit.EarlyExit.in_order). On each split's eval sets
(experiments/depth_eval.py) it reports, per threshold and per difficulty d, the accuracy at the answers
that need d steps and their mean exit step, beside the accuracy at each fixed R. Writes
<save_dir>/depth_exit.png (mean exit step against d, a line per threshold) and depth_exit.json, the JSON
line it prints last (save_dir: out_dir unless given). With a dev split it chooses the threshold there:
the largest (fewest steps) whose mean dev accuracy is within `tie` of the best threshold's.

With --mixed=N it also scores N sequences drawn from MIXED_SEED whose runs need 1..3D steps each (the
trained, dev and test difficulties in one sequence, as a prompt mixes them), by the steps each answer
needs, and the mean exit step over every token of them. In order a token never stops before the tokens
before it, so there an easy answer after a hard run pays for the hard run's steps.
"""

import json
import os

import torch

from common import fail, load_model, read_settings
from early_exit import EXIT_CRITERIA, EarlyExit, ExitingModel
from experiments.depth_eval import (DEV_TIE, eval_set, largest_of_ties, parse_splits, parse_steps, plot_lines,
                                    split_difficulties)
from experiments.depth_tasks import TaskBatches, make_task
from model import RecurrentLM

DEFAULTS = dict(
    out_dir='',  # a train.py out_dir whose recurrent model trained on a depth task
    ckpt='best.pt',
    thresholds='0.1,0.03,0.01,0.003',  # exit when the state's relative change falls below this
    max_steps=32,  # the most steps a token runs (and the fixed R it is compared with)
    steps='1,2,4,8,16,32',  # the fixed R beside it
    split='train,dev,test',
    examples=64,  # sequences per difficulty
    save_dir='',  # where depth_exit.png and depth_exit.json go; '' = out_dir
    criterion='state',  # early_exit.py's: 'state' (the state's relative change) or 'kl' (the prediction's change)
    in_order=False,  # a token stops only once the token before it has
    tie=DEV_TIE,  # dev accuracies this close to the best count as tied; 0: never give up dev accuracy for steps
    mixed=0,  # also score this many sequences whose runs need 1..3D steps each
)
MIXED_SEED = 50_000  # the mixed set's generator seed, apart from depth_eval.SPLIT_SEEDS'


@torch.no_grad()
def score(model, x, y, need, difficulties, thresholds, max_steps, steps, criterion, in_order):
    """{d: {'fixed': {R: accuracy}, 'exit': {threshold: (accuracy, mean exit step)}}} at the answers of
    (x, y) that need exactly d steps, and {threshold: mean exit step over every token}."""
    right_at = {r: model(x, y, num_steps=r)[0].argmax(-1) == y for r in steps}
    exits = {}
    for t in thresholds:
        exiting = ExitingModel(model, EarlyExit(threshold=t, criterion=criterion, in_order=in_order))
        logits, _ = exiting(x, y, num_steps=max_steps)
        exits[t] = (logits.argmax(-1) == y, exiting.exit_steps.float())
    rows = {}
    for d in difficulties:
        scored = need == d
        rows[d] = dict(fixed={r: right[scored].float().mean().item() for r, right in right_at.items()},
                       exit={t: (right[scored].float().mean().item(), depth[scored].mean().item())
                             for t, (right, depth) in exits.items()})
    return rows, {t: depth.mean().item() for t, (_, depth) in exits.items()}


def mixed_set(task, D, examples):
    """examples sequences whose runs need 1..hi steps each, hi = 3D (test's largest, within the task's):
    ((x, y, steps), hi)."""
    test = split_difficulties('test', D, task)
    if not test:
        fail(f"--mixed draws runs up to test's difficulties, but {type(task).__name__} at block_size "
             f"{task.block_size} has none past D + 2 = {D + 2}; leave --mixed out")
    hi = test[-1]
    return TaskBatches(task, examples, 'cpu', 1, hi).sample(torch.Generator().manual_seed(MIXED_SEED)), hi


def exit_table(model, task, splits, thresholds, max_steps, steps, examples, criterion='state', in_order=False):
    """{d: {'fixed': {R: accuracy}, 'exit': {threshold: (accuracy, mean exit step)}}} at the answers
    that need exactly d steps, on each split's eval set of difficulty d."""
    table = {}
    for split, ds in splits.items():
        for d in ds:
            x, y, need = eval_set(task, d, examples, 'cpu', split)
            table.update(score(model, x, y, need, [d], thresholds, max_steps, steps, criterion, in_order)[0])
    return table


def dev_threshold(table, splits, thresholds, tie=DEV_TIE):
    """The largest threshold (fewest steps) whose mean dev accuracy is within tie of the best one's; None
    without dev."""
    if 'dev' not in splits:
        return None
    return largest_of_ties({t: sum(table[d]['exit'][t][0] for d in splits['dev']) / len(splits['dev'])
                            for t in thresholds}, tie)


def print_rows(rows, steps, thresholds):
    """A line a difficulty: accuracy at each fixed R, then accuracy / mean exit step at each threshold."""
    print('d  | ' + ' '.join(f'R={r:<5}' for r in steps) + ' | ' + ' '.join(f'exit<{t:<12g}' for t in thresholds))
    for d, row in rows.items():
        fixed = ' '.join(f"{row['fixed'][r]:<7.3f}" for r in steps)
        exits = ' '.join(f"{a:.3f} / {s:<5.1f}" for a, s in row['exit'].values())
        print(f"{d:<2} | {fixed} | {exits}")


def as_lists(rows, steps, thresholds):
    """The JSON's rows, a list a difficulty: accuracy at each fixed R, and at each threshold's exit with its
    mean exit step."""
    return dict(fixed=[[round(row['fixed'][r], 4) for r in steps] for row in rows.values()],
                exit_accuracy=[[round(row['exit'][t][0], 4) for t in thresholds] for row in rows.values()],
                exit_steps=[[round(row['exit'][t][1], 3) for t in thresholds] for row in rows.values()])


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not c['out_dir']:
        fail("give --out_dir=DIR, a train.py out_dir whose GRT trained on a depth task")
    if c['criterion'] not in EXIT_CRITERIA:
        fail(f"criterion must be one of {', '.join(EXIT_CRITERIA)}, e.g. --criterion=kl; got {c['criterion']!r}")
    model, checkpoint = load_model('resume', c['out_dir'], 'cpu', c['ckpt'])
    trained = checkpoint['config']
    if not isinstance(model, RecurrentLM) or not str(trained.get('dataset', '')).startswith('task:'):
        fail(f"{os.path.join(c['out_dir'], c['ckpt'])} is not a recurrent model trained on a depth task; "
             f"early exit needs one, e.g. `python train.py config/depth/grt_local.py`")
    try:
        thresholds = [float(t) for t in c['thresholds'].split(',')]
    except ValueError:
        thresholds = []
    if not thresholds or min(thresholds) <= 0:
        fail(f"thresholds must be comma-separated numbers > 0, e.g. --thresholds=0.01,0.001; got {c['thresholds']!r}")
    if c['tie'] < 0:
        fail(f"tie must be a number >= 0 (how far below the best dev accuracy a chosen threshold may be), "
             f"got {c['tie']}")
    if c['mixed'] < 0:  # read_settings has already made it an int
        fail(f"mixed must be a number of sequences >= 0 (0: none), e.g. --mixed=256; got {c['mixed']!r}")
    task = make_task(trained['dataset'], trained.get('block_size') or model.config.block_size)
    splits = parse_splits(c['split'], trained['difficulty'], task)
    steps = sorted(set(parse_steps(c['steps'])) | {c['max_steps']})
    table = exit_table(model, task, splits, thresholds, c['max_steps'], steps, c['examples'], c['criterion'],
                       c['in_order'])
    order = ', in order' if c['in_order'] else ''
    print(f"{trained['dataset']}: accuracy at fixed R, and with early exit on '{c['criterion']}'{order} (up to "
          f"{c['max_steps']} steps) accuracy / mean exit step, {c['examples']} sequences a difficulty")
    print_rows(table, steps, thresholds)
    chosen = dev_threshold(table, splits, thresholds, c['tie'])
    if chosen is not None:
        means = [f"{s} {sum(table[d]['exit'][chosen][0] for d in ds) / len(ds):.3f} at "
                 f"{sum(table[d]['exit'][chosen][1] for d in ds) / len(ds):.1f} steps" for s, ds in splits.items()]
        print(f"threshold chosen on dev: {chosen:g}; mean accuracy: {', '.join(means)}")
    mixed = None
    if c['mixed']:
        (x, y, need), hi = mixed_set(task, trained['difficulty'], c['mixed'])
        rows, token_steps = score(model, x, y, need, need[need > 0].unique().tolist(), thresholds, c['max_steps'],
                                  steps, c['criterion'], c['in_order'])
        print(f"mixed: {c['mixed']} sequences whose runs need 1..{hi} steps each, by the steps an answer needs")
        print_rows(rows, steps, thresholds)
        print('mean exit step over every token: ' + ', '.join(f'{s:.1f} (exit<{t:g})' for t, s in token_steps.items()))
        mixed = dict(sequences=c['mixed'], seed=MIXED_SEED, tokens=need.numel(), difficulties=list(rows),
                     answers=[int((need == d).sum()) for d in rows], **as_lists(rows, steps, thresholds),
                     token_steps=[round(token_steps[t], 3) for t in thresholds])
    difficulties = list(table)
    lines = {f'exit < {t:g}': [table[d]['exit'][t][1] for d in difficulties] for t in thresholds}
    save_dir = c['save_dir'] or c['out_dir']
    os.makedirs(save_dir, exist_ok=True)
    path = plot_lines(os.path.join(save_dir, 'depth_exit.png'), f"{trained['dataset']}: mean exit step",
                      difficulties, lines, None, trained['difficulty'], ylabel='mean exit step')
    if path:
        print(f"wrote {path}")
    record = json.dumps(dict(
        out_dir=c['out_dir'], task=trained['dataset'], criterion=c['criterion'], in_order=c['in_order'],
        max_steps=c['max_steps'], steps=steps, thresholds=thresholds,
        dev_threshold=chosen, tie=c['tie'], splits=splits, examples=c['examples'],
        **as_lists(table, steps, thresholds), mixed=mixed))
    with open(os.path.join(save_dir, 'depth_exit.json'), 'w') as f:
        f.write(record + '\n')
    print(record)


if __name__ == '__main__':
    main()
