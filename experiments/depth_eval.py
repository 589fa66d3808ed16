"""
Accuracy of a model trained on a depth task (experiments/depth_tasks.py), by difficulty and test-time
recurrence steps R:

    python -m experiments.depth_eval --out_dir=out-depth-grt-local             # reads out_dir/best.pt
    python -m experiments.depth_eval --out_dir=out-depth-grt-local --split=dev --steps=1,2,4,8,16,32

The protocol: a model trained on difficulties 1..D is scored on four splits of difficulties, each drawn
from its own fixed seeds, so that choices made on one never see another's sequences:
    train    1 .. D           seeds 10000 + d
    dev      D+1 .. D+2       seeds 20000 + d   (5, 6 at D = 4): every training choice is made here
    test     D+3 .. 3D        seeds 30000 + d   (7 .. 12): reported, never used to choose
    stretch  3D+1 .. 6D       seeds 40000 + d   (13 .. 24), cut at the task's largest difficulty
At difficulty d an eval set is `examples` sequences whose queries all need exactly d steps; the
accuracy of the argmax prediction at those answers, at each R of --steps and the trained R
(model(x, num_steps=R)). A dense model has no R: one column. The best R is the largest R whose mean
dev accuracy is within 0.005 of the highest. Prints the table, writes <out_dir>/depth_eval.png
(accuracy against difficulty, a line per R) when matplotlib is installed, and prints a JSON line last.
"""

import json
import os

import torch

from common import fail, load_model, pick_device, pyplot, read_settings
from experiments.analyze import trace
from experiments.depth_tasks import TaskBatches, make_task
from model import GRT, RecurrentLM
from registry import model_type_of

DEFAULTS = dict(
    out_dir='',  # a train.py out_dir whose run trained on a depth task (dataset='task:NAME')
    ckpt='best.pt',  # 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    steps='1,2,4,8,16',  # test-time recurrence steps R (recurrent models)
    split='train,dev,test',  # comma-separated, from train, dev, test, stretch (the protocol above)
    examples=128,  # sequences per difficulty
    device='auto',
)


SPLIT_SEEDS = dict(train=10_000, dev=20_000, test=30_000, stretch=40_000)  # difficulty d: seed + d


def split_difficulties(split, D, task):
    """The difficulties of a split for a model trained on 1..D, within the task's largest."""
    lo, hi = dict(train=(1, D), dev=(D + 1, D + 2), test=(D + 3, 3 * D), stretch=(3 * D + 1, 6 * D))[split]
    return list(range(lo, min(hi, task.max_difficulty) + 1))


def parse_splits(text, D, task):
    """{split: [difficulties]} in the order given; one line if a name is unknown or a split is empty."""
    names = [s for s in text.split(',') if s]
    unknown = [s for s in names if s not in SPLIT_SEEDS]
    if unknown or not names:
        fail(f"split must be comma-separated names from {', '.join(SPLIT_SEEDS)}, e.g. --split=dev; got {text!r}")
    splits = {s: split_difficulties(s, D, task) for s in names}
    for s, ds in splits.items():
        if not ds:
            fail(f"split {s} is empty: {type(task).__name__} at block_size {task.block_size} has difficulties "
                 f"up to {task.max_difficulty}; leave it out of --split")
    return splits


def eval_set(task, d, examples, device, split='test'):
    """examples sequences whose queries all need d steps: (x, y, steps), fixed by (task, split, d)."""
    gen = torch.Generator().manual_seed(SPLIT_SEEDS[split] + d)
    return TaskBatches(task, examples, device, d, d).sample(gen)


@torch.no_grad()
def accuracy_table(model, task, difficulties, steps, examples, device, split='test'):
    """{d: {R: accuracy}} at the answers that need exactly d steps (R None: the model's own depth) on
    the split's eval sets; and {d: number of those answers}."""
    table, answers = {}, {}
    for d in difficulties:
        x, y, need = eval_set(task, d, examples, device, split)
        scored = need == d
        answers[d] = int(scored.sum())
        table[d] = {}
        for r in steps:
            logits, _ = model(x, y, num_steps=r)  # with targets: logits at every position
            table[d][r] = (logits.argmax(-1) == y)[scored].float().mean().item()
    return table, answers


@torch.no_grad()
def mean_gates(model, task, d, steps, examples, device):
    """A GRT's mean gate g (Eq. 5) at each step 1..steps on the eval set of difficulty d; None for
    other models. Near 1 the step keeps the state: the recurrence is switched off."""
    if not isinstance(model, GRT):
        return None
    x, _, _ = eval_set(task, d, examples, device, 'train')
    with trace(model) as record:
        model(x, num_steps=steps)
    return [round(g.mean().item(), 4) for g in record['gates']]


def table_lines(table, answers, trained):
    """The table as text; a rule under the trained difficulty D."""
    steps = list(next(iter(table.values())))
    head = ' '.join(f"{'R=' + str(r) if r is not None else 'dense':>6}" for r in steps)
    lines = [f"difficulty | {head} | answers"]
    for d, row in table.items():
        if d == trained + 1:
            lines.append(f"---------- beyond training (d > {trained}) ----------")
        lines.append(f"{d:>10} | {' '.join(f'{row[r]:>6.3f}' for r in steps)} | {answers[d]:>7}")
    return lines


def plot_lines(path, title, difficulties, lines, chance, trained, styles=None, ylabel='accuracy'):
    """accuracy (or ylabel) against difficulty, one line per entry of lines {label: [value per difficulty]}
    (styles {label: matplotlib line keywords}; default a viridis colour each), chance dotted (None: no
    chance line, the y axis from the data), the trained range shaded; the legend beside the axes, so it
    hides no line. Returns path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.axvspan(min(difficulties) - 0.5, trained + 0.5, color='0.92', label=f'trained on 1..{trained}')
    colors = plt.cm.viridis([0.9 * i / max(1, len(lines) - 1) for i in range(len(lines))])  # no pale yellow
    for color, (label, accuracy) in zip(colors, lines.items()):
        ax.plot(difficulties, accuracy, marker='o', ms=3, label=label, **(styles or {}).get(label, dict(color=color)))
    if chance is not None:
        ax.axhline(chance, color='gray', ls=':', label=f'chance ({chance:.3f})')
        ax.set(ylim=(0, 1.02))
    ax.set(xlabel='difficulty: sequential steps the answer needs', ylabel=ylabel, title=title,
           xticks=list(difficulties))
    ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_steps(text):
    try:
        steps = [int(s) for s in text.split(',')]
    except ValueError:
        steps = []
    if not steps or min(steps) < 1:
        fail(f"steps must be comma-separated integers >= 1, e.g. --steps=1,2,4,8,16; got {text!r}")
    return steps


def evaluate_checkpoint(out_dir, ckpt='best.pt', steps='1,2,4,8,16', split='train,dev,test', examples=128,
                        device='cpu'):
    """The record depth_eval prints last: the run, its task, the splits' difficulties, accuracy[i][j]
    at difficulties[i] and steps[j] (steps [None] for a dense model), and the best R on dev."""
    model, checkpoint = load_model('resume', out_dir, device, ckpt)
    trained = checkpoint['config']
    if not str(trained.get('dataset', '')).startswith('task:'):
        fail(f"{os.path.join(out_dir, ckpt)} was trained on {trained.get('dataset')!r}, not a depth task; "
             f"train one with e.g. `python train.py config/depth/grt.py`")
    task = make_task(trained['dataset'], trained.get('block_size') or model.config.block_size)
    D = trained['difficulty']
    splits = parse_splits(split, D, task)
    recurrent = isinstance(model, RecurrentLM)
    depths = sorted(set(parse_steps(steps)) | {model.config.n_recur}) if recurrent else [None]  # and the trained R
    table, answers = {}, {}
    for s, ds in splits.items():
        t, a = accuracy_table(model, task, ds, depths, examples, device, s)
        table.update(t), answers.update(a)
    difficulties = [d for ds in splits.values() for d in ds]
    record = dict(out_dir=out_dir, ckpt=ckpt, task=trained['dataset'], model_type=model_type_of(model),
                  trained_difficulty=D, trained_R=model.config.n_recur if recurrent else None, chance=task.chance,
                  examples=examples, splits=splits, steps=depths, difficulties=difficulties,
                  answers=[answers[d] for d in difficulties],
                  accuracy=[[round(a, 4) for a in table[d].values()] for d in difficulties],
                  gate=mean_gates(model, task, D, max(depths) if recurrent else None, examples, device))
    record['best_R'] = best_steps(record)
    return record


def split_means(record, split):
    """{R: mean accuracy over the split's difficulties} of a record."""
    rows = [row for d, row in zip(record['difficulties'], record['accuracy']) if d in record['splits'][split]]
    return {r: sum(col) / len(col) for r, col in zip(record['steps'], zip(*rows))}


DEV_TIE = 0.005  # dev means this close to the highest count as equal


def largest_of_ties(dev_means, tie=DEV_TIE):
    """The largest key of {key: mean dev accuracy} among those within tie of the highest mean."""
    return max(k for k, mean in dev_means.items() if mean >= max(dev_means.values()) - tie)


MAX_R = 64  # R is chosen among the evaluated R up to this; larger R are there to read overthinking (4R)


def best_steps(record):
    """The largest R <= MAX_R whose mean dev accuracy is within DEV_TIE of the highest (None for a dense
    model or without a dev split): the most steps dev still supports. Dev's few difficulties are solved
    from some R on, and a longer problem needs more steps; a state that drifts at large R loses dev accuracy."""
    if record['steps'] == [None] or 'dev' not in record['splits']:
        return None
    dev = split_means(record, 'dev')
    return largest_of_ties({r: mean for r, mean in dev.items() if r <= MAX_R} or dev)


def as_table(record):
    """{d: {R: accuracy}} of a record."""
    return {d: dict(zip(record['steps'], row)) for d, row in zip(record['difficulties'], record['accuracy'])}


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not c['out_dir']:
        fail("give --out_dir=DIR, a train.py out_dir trained on a depth task (e.g. out-depth-grt)")
    record = evaluate_checkpoint(c['out_dir'], c['ckpt'], c['steps'], c['split'], c['examples'],
                                 pick_device(c['device'], 0))
    D, R = record['trained_difficulty'], record['trained_R']
    print(f"{record['task']}, {record['model_type']} trained on difficulties 1..{D}"
          f"{f' with R = {R}' if R else ''}: accuracy at the answers that need exactly d steps "
          f"(chance {record['chance']:.3f}), {c['examples']} sequences a difficulty")
    print('\n'.join(table_lines(as_table(record), dict(zip(record['difficulties'], record['answers'])), D)))
    for s in record['splits']:
        means = ' '.join(f"{'R=' + str(r) if r else 'dense'} {a:.3f}" for r, a in split_means(record, s).items())
        print(f"mean over {s} (d = {record['splits'][s][0]}..{record['splits'][s][-1]}): {means}")
    if record['best_R']:
        print(f"best R on dev: {record['best_R']}")
    if record['gate']:
        gates = ' '.join(f'{g:.3f}' for g in record['gate'])
        print(f"mean gate g at steps 1..{len(record['gate'])} (difficulty {D}): {gates}")
    lines = {('own depth' if r is None else f'R = {r}'): [row[i] for row in record['accuracy']]
             for i, r in enumerate(record['steps'])}
    title = f"{record['task']}: {record['model_type']}" + (f", trained at R = {R}" if R else '')
    path = plot_lines(os.path.join(c['out_dir'], 'depth_eval.png'), title, record['difficulties'], lines,
                      record['chance'], D)
    if path:
        print(f"wrote {path}")
    print(json.dumps(record))


if __name__ == '__main__':
    main()
