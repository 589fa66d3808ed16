"""
What a model trained on a run task (compose, sum) answers past its trained difficulty D: at each
answer of difficulty d > D (at d <= D nothing is cut), does the prediction equal the right answer
(all d operands of the run combined), or the combination of only the last D operands, as if the
operand D back began the run?

    python -m experiments.depth_probe --out_dir=out-depth-grt-local
    python -m experiments.depth_probe --out_dir='results/depth/compose/runs/*nopos-keep3-2000it-s*' --steps=16 \
        --save=results/depth/probe/keep3.json

A model that learned the step answers right. One that learned "a run has at most D operands", which
holds in every training sequence unless input_difficulty draws longer runs, answers with the last D.
"cut at D" counts only the answers where the two differ. "reads" says how far back an answer looks:
for k = 0 (the answer's own operand) .. d - 1 (the run's first), the share of answers whose prediction
changes when the operand k back is replaced by another value. In a group one changed operand always
changes the right answer, so a model that answers right reads 1 at every k. out_dir may be a glob of
run folders; the eval sets are depth_eval's (one split's fixed seeds). Prints the tables and a JSON
line last; --save writes that JSON too.
"""

import glob
import json
import os

import torch

from common import fail, load_model, read_settings
from experiments.depth_eval import eval_set, parse_splits
from experiments.depth_tasks import RunningSum, make_task

DEFAULTS = dict(
    out_dir='',  # a train.py out_dir trained on compose or sum, or a glob of them
    ckpt='best.pt',
    steps=16,  # the test-time R the model runs at
    split='dev,test',  # the splits whose difficulties are probed (depth_eval's protocol)
    examples=64,  # sequences per difficulty
    save='',  # a .json path for the record; '' = print only
)


def combined(task, operands):
    total = 0  # the identity: 0 mod m, and compose's unchanged order
    for operand in operands:
        total = task.combine(total, operand)
    return total


@torch.no_grad()
def probe(model, task, d, D, steps, examples, split):
    """(share right, share cut at D among the answers where cutting changes the answer, reads) at
    difficulty d."""
    x, y, need = eval_set(task, d, examples, 'cpu', split)
    predictions = model(x, y, num_steps=steps)[0].argmax(-1)
    right = cut = differs = total = 0
    for tokens, predicted, row_need in zip(x.tolist(), predictions.tolist(), need.tolist()):
        for i, n in enumerate(row_need):
            if n != d:
                continue
            answer, last_D = combined(task, tokens[i - d + 1:i + 1]), combined(task, tokens[i - min(d, D) + 1:i + 1])
            total, right = total + 1, right + (predicted[i] == answer)
            if last_D != answer:
                differs, cut = differs + 1, cut + (predicted[i] == last_D)
    return right / total, cut / max(differs, 1), reads(model, task, x, y, need == d, predictions, steps, d)


@torch.no_grad()
def reads(model, task, x, y, scored, predictions, steps, d):
    """For k = 0..d-1, the share of the scored answers whose prediction changes when the operand k back
    is replaced by another value. Alternate runs are changed in two passes, so the runs beside a
    changed one are as they were (those two back are changed too)."""
    rows, cols = torch.nonzero(scored, as_tuple=True)
    alternate = (scored.long().cumsum(1)[rows, cols] - 1) % 2  # each answer's run: even or odd in its row
    gen = torch.Generator().manual_seed(d)
    shares = []
    for k in range(d):
        changed = 0
        for half in (0, 1):
            r, c = rows[alternate == half], cols[alternate == half]
            other = x.clone()
            other[r, c - k] = (other[r, c - k] + torch.randint(1, task.m, (len(r),), generator=gen)) % task.m
            changed += (model(other, y, num_steps=steps)[0].argmax(-1)[r, c] != predictions[r, c]).sum().item()
        shares.append(changed / len(rows))
    return shares


def probe_run(out_dir, c):
    model, checkpoint = load_model('resume', out_dir, 'cpu', c['ckpt'])
    trained = checkpoint['config']
    task = make_task(str(trained.get('dataset', '')), trained.get('block_size') or model.config.block_size)
    if not isinstance(task, RunningSum):
        fail(f"{out_dir} was trained on {trained.get('dataset')!r}: the probe reads runs of operands, "
             f"so it takes compose or sum")
    D, splits = trained['difficulty'], parse_splits(c['split'], trained['difficulty'], task)
    rows = {d: probe(model.eval(), task, d, D, c['steps'], c['examples'], split)
            for split, ds in splits.items() for d in ds}
    difficulties = list(rows)
    return dict(out_dir=out_dir, difficulty=D, input_difficulty=trained.get('input_difficulty', 0),
                steps=c['steps'], difficulties=difficulties,
                right=[round(rows[d][0], 4) for d in difficulties],
                cut_at_D=[round(rows[d][1], 4) for d in difficulties],
                reads=[[round(share, 4) for share in rows[d][2]] for d in difficulties])


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    runs = sorted(glob.glob(c['out_dir'])) if c['out_dir'] else []
    if not runs:
        fail(f"give --out_dir=DIR (or a glob of run folders) trained on compose or sum; {c['out_dir']!r} "
             f"matches none")
    records = [probe_run(run, c) for run in runs]
    ds = records[0]['difficulties']
    print(f"at R = {c['steps']}: share right / share cut at D (the last D operands' answer, where it differs)")
    print('run | ' + ' | '.join(f'd = {d}' for d in ds))
    for r in records:
        print(f"{os.path.basename(r['out_dir'].rstrip('/'))} | "
              + ' | '.join(f'{a:.2f} / {b:.2f}' for a, b in zip(r['right'], r['cut_at_D'])))
    print("reads: the share of answers that change when the operand k back is replaced, k = 0 (the answer's "
          "own) .. d - 1 (the run's first)")
    for r in records:
        for d, shares in zip(ds, r['reads']):
            print(f"{os.path.basename(r['out_dir'].rstrip('/'))} | d = {d} | " + ' '.join(f'{v:.2f}' for v in shares))
    record = dict(settings=c, runs=records)
    if c['save']:
        os.makedirs(os.path.dirname(c['save']) or '.', exist_ok=True)
        with open(c['save'], 'w') as f:
            json.dump(record, f, indent=1)
        print(f"wrote {c['save']}")
    print(json.dumps(record))


if __name__ == '__main__':
    main()
