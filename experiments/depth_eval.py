"""
Accuracy of a model trained on a depth task (experiments/depth_tasks.py), by difficulty and test-time
recurrence steps R:

    python -m experiments.depth_eval --out_dir=out-depth-grt                    # reads out_dir/best.pt
    python -m experiments.depth_eval --out_dir=out-depth-grt --steps=1,2,4,8,16,32 --max_difficulty=12

For each difficulty d = 1 .. max_difficulty (default 3D, the model trained on 1..D) a fixed eval set
of `examples` sequences, every query needing exactly d steps, the same for every model; the accuracy of
the argmax prediction at the answers that need d steps, at each R of --steps and the trained R
(model(x, num_steps=R)).
A dense model has no R: one column. Prints the table, writes <out_dir>/depth_eval.png (accuracy
against difficulty, a line per R) when matplotlib is installed, and prints a JSON line last.
"""

import json
import os

import torch

from common import fail, load_model, pick_device, read_settings, rng_key
from experiments.analyze import trace
from experiments.depth_tasks import TaskBatches, make_task
from model import GRT, RecurrentLM
from registry import model_type_of

DEFAULTS = dict(
    out_dir='',  # a train.py out_dir whose run trained on a depth task (dataset='task:NAME')
    ckpt='best.pt',  # 'best.pt' (best val loss) or 'ckpt.pt' (the latest)
    steps='1,2,4,8,16',  # test-time recurrence steps R (recurrent models)
    max_difficulty=0,  # difficulties 1 .. this; 0 = 3 x the trained difficulty D
    examples=128,  # sequences per difficulty
    device='auto',
)


def eval_set(task, d, examples, device):
    """examples sequences whose queries all need d steps: (x, y, steps), fixed by (task, d) alone."""
    gen = torch.Generator().manual_seed(rng_key('depth_eval', type(task).__name__, task.block_size, d))
    return TaskBatches(task, examples, device, d, d).sample(gen)


@torch.no_grad()
def accuracy_table(model, task, difficulties, steps, examples, device):
    """{d: {R: accuracy}} at the answers that need exactly d steps (R None: the model's own depth);
    and {d: number of those answers}."""
    table, answers = {}, {}
    for d in difficulties:
        x, y, need = eval_set(task, d, examples, device)
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
    x, _, _ = eval_set(task, d, examples, device)
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


def plot_lines(path, title, difficulties, lines, chance, trained, styles=None):
    """accuracy against difficulty, one line per entry of lines {label: [accuracy per difficulty]}
    (styles {label: matplotlib line keywords}; default a viridis colour each), chance dotted, the trained
    range shaded; the legend beside the axes, so it hides no line. Returns path, or None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.axvspan(min(difficulties) - 0.5, trained + 0.5, color='0.92', label=f'trained on 1..{trained}')
    colors = plt.cm.viridis([0.9 * i / max(1, len(lines) - 1) for i in range(len(lines))])  # no pale yellow
    for color, (label, accuracy) in zip(colors, lines.items()):
        ax.plot(difficulties, accuracy, marker='o', ms=3, label=label, **(styles or {}).get(label, dict(color=color)))
    ax.axhline(chance, color='gray', ls=':', label=f'chance ({chance:.3f})')
    ax.set(xlabel='difficulty: sequential steps the answer needs', ylabel='accuracy', title=title, ylim=(0, 1.02),
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


def evaluate_checkpoint(out_dir, ckpt='best.pt', steps='1,2,4,8,16', max_difficulty=0, examples=128,
                        device='cpu'):
    """The record depth_eval prints last: the run, its task, and accuracy[i][j] at difficulties[i] and
    steps[j] (steps [None] for a dense model)."""
    model, checkpoint = load_model('resume', out_dir, device, ckpt)
    trained = checkpoint['config']
    if not str(trained.get('dataset', '')).startswith('task:'):
        fail(f"{os.path.join(out_dir, ckpt)} was trained on {trained.get('dataset')!r}, not a depth task; "
             f"train one with e.g. `python train.py config/depth/grt.py`")
    task = make_task(trained['dataset'], trained.get('block_size') or model.config.block_size)
    D = trained['difficulty']
    difficulties = list(range(1, (max_difficulty or 3 * D) + 1))
    recurrent = isinstance(model, RecurrentLM)
    depths = sorted(set(parse_steps(steps)) | {model.config.n_recur}) if recurrent else [None]  # and the trained R
    table, answers = accuracy_table(model, task, difficulties, depths, examples, device)
    return dict(out_dir=out_dir, ckpt=ckpt, task=trained['dataset'], model_type=model_type_of(model),
                trained_difficulty=D, trained_R=model.config.n_recur if recurrent else None, chance=task.chance,
                steps=depths, difficulties=difficulties, answers=[answers[d] for d in difficulties],
                accuracy=[[round(a, 4) for a in table[d].values()] for d in difficulties],
                gate=mean_gates(model, task, D, max(depths) if recurrent else None, examples, device))


def as_table(record):
    """{d: {R: accuracy}} of a record."""
    return {d: dict(zip(record['steps'], row)) for d, row in zip(record['difficulties'], record['accuracy'])}


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not c['out_dir']:
        fail("give --out_dir=DIR, a train.py out_dir trained on a depth task (e.g. out-depth-grt)")
    record = evaluate_checkpoint(c['out_dir'], c['ckpt'], c['steps'], c['max_difficulty'], c['examples'],
                                 pick_device(c['device'], 0))
    D, R = record['trained_difficulty'], record['trained_R']
    print(f"{record['task']}, {record['model_type']} trained on difficulties 1..{D}"
          f"{f' with R = {R}' if R else ''}: accuracy at the answers that need exactly d steps "
          f"(chance {record['chance']:.3f}), {c['examples']} sequences a difficulty")
    print('\n'.join(table_lines(as_table(record), dict(zip(record['difficulties'], record['answers'])), D)))
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
