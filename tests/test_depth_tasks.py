"""The depth tasks (experiments/depth_tasks.py) and their evaluation (experiments/depth_eval.py): seeded
generators, answers and step counts that a written-out solver confirms, a loss that reads only the
answers, and an accuracy table equal to a prediction-by-prediction computation."""

import glob
import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from conftest import HERE, save_checkpoint, scramble
from experiments import depth_eval, depth_study, study
from experiments.depth_tasks import TASKS, TaskBatches, make_task, task_batches
from registry import build_model

BLOCK = 64


def tiny(model_type, vocab_size, seed=0):
    torch.manual_seed(seed)
    layout = dict(n_layer=2) if model_type == 'gpt' else dict(n_prelude=1, n_core=1, n_recur=3, n_coda=1)
    model = build_model(model_type, n_embd=32, n_head=2, block_size=BLOCK, vocab_size=vocab_size, **layout)
    return scramble(model).eval()  # large weights: predictions that vary from position to position


def examples(name, lo, hi, seeds=range(30)):
    task = make_task(name, BLOCK)
    return task, [task.example(torch.Generator().manual_seed(s), lo, hi) for s in seeds]


def queries(steps):
    """The step counts of each query's answers: runs of 1, 2, 3, ... between the 0s."""
    runs = []
    for s in steps:
        if s == 0:
            runs.append([])
        elif runs:
            runs[-1].append(s)
    return [run for run in runs if run]


@pytest.mark.parametrize('name', TASKS)
def test_a_generator_is_deterministic_given_its_seed(name):
    source, _ = task_batches(f'task:{name}', BLOCK, 4, 'cpu', 0, 3)
    a, b, c = (source.sample(torch.Generator().manual_seed(s)) for s in (7, 7, 8))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    assert a[0].shape == a[1].shape == a[2].shape == (4, BLOCK) and a[0].dtype == torch.long


@pytest.mark.parametrize('name', TASKS)
@pytest.mark.parametrize('lo, hi', [(1, 4), (3, 3), (9, 9)])
def test_difficulty_is_the_steps_the_solver_takes(name, lo, hi):
    """The solver reads only the tokens and works each answer out one step at a time: its answers and
    step counts are the generator's, every query but the one the block's end cuts needs lo..hi steps,
    and at lo = hi = d every whole query ends in an answer of exactly d steps."""
    task, drawn = examples(name, lo, hi)
    for tokens, answers, steps in drawn:
        assert len(tokens) == BLOCK and max(tokens) < task.vocab_size
        assert task.solve(tokens) == (answers, steps)
        runs = queries(steps)
        assert all(run == list(range(1, len(run) + 1)) for run in runs)
        assert all(lo <= len(run) <= hi for run in runs[:-1]) and len(runs[-1]) <= hi
        assert all((a >= 0) == (s > 0) for a, s in zip(answers, steps))
    seen = sorted({len(run) for _, _, steps in drawn for run in queries(steps)[:-1]})
    assert seen == list(range(lo, hi + 1))  # every difficulty of the range is drawn


def test_pointer_answers_never_come_back_to_the_query():
    """On one cycle of n nodes, fewer than n hops never return to the start."""
    task, drawn = examples('pointer', 1, 15)
    for tokens, answers, steps in drawn:
        query = None
        for token, answer, step in zip(tokens[2 * task.nodes + 1:], answers[2 * task.nodes + 1:],
                                       steps[2 * task.nodes + 1:]):
            query = token if step == 0 else query
            assert step == 0 or answer != query


def test_sum_answers_are_the_sums_so_far_mod_m():
    """Each answer is the sum of the run's operands so far, mod m, summed here from scratch."""
    task, drawn = examples('sum', 1, 6)
    for tokens, answers, _ in drawn:
        starts = [i for i, t in enumerate(tokens) if t == task.reset]
        for i, answer in enumerate(answers):
            if answer >= 0:
                start = max(s for s in starts if s < i)
                assert answer == sum(tokens[start + 1:i + 1]) % task.m


def test_compose_answers_are_the_permutations_applied_in_turn():
    """Each answer, as a permutation matrix, is the product of the run's operands' matrices so far,
    the latest on the left; and the group is not commutative, so the operands' order matters."""
    task, drawn = examples('compose', 1, 6)
    matrix = [torch.eye(3)[list(p)].T for p in task.PERMUTATIONS]  # column i: where item i goes
    for tokens, answers, _ in drawn:
        product = None
        for token, answer in zip(tokens, answers):
            if token == task.reset:
                product = torch.eye(3)
            else:
                product = matrix[token] @ product
                assert torch.equal(product, matrix[answer])
    assert any(task.combine(a, b) != task.combine(b, a) for a in range(6) for b in range(6))


@pytest.mark.parametrize('name', TASKS)
@pytest.mark.parametrize('model_type', ['gpt', 'grt'])
def test_the_loss_reads_only_the_answers(name, model_type):
    """y is -1 exactly where no answer is, and the model's loss is the cross-entropy at the answers alone."""
    source, _ = task_batches(name, BLOCK, 3, 'cpu', 0, 4)
    x, y, steps = source.sample(torch.Generator().manual_seed(1))
    assert torch.equal(y >= 0, steps > 0) and (y == -1).sum() + (y >= 0).sum() == y.numel()
    model = tiny(model_type, source.vocab_size)
    logits, loss = model(x, y, num_steps=2)
    answers = steps > 0
    assert torch.allclose(loss, F.cross_entropy(logits[answers], y[answers]))


@pytest.mark.parametrize('name', TASKS)
def test_longer_inputs_score_only_the_trained_difficulties(name):
    """input_difficulty draws the queries of 1..8 steps, and y keeps only the answers of 1..4 steps: the
    solver's answers there, -1 past them, while the tokens still hold the longer queries."""
    source, _ = task_batches(name, BLOCK, 8, 'cpu', 0, 4, input_difficulty=8)
    x, y, steps = source.sample(torch.Generator().manual_seed(3))
    assert steps.max() > 4  # the inputs run past the scored difficulties
    task = make_task(name, BLOCK)
    for tokens, answers, row_steps in zip(x.tolist(), y.tolist(), steps.tolist()):
        solved, solved_steps = task.solve(tokens)
        assert solved_steps == row_steps
        assert answers == [a if 1 <= s <= 4 else -1 for a, s in zip(solved, solved_steps)]
    with pytest.raises(SystemExit, match='input_difficulty must be 0'):
        task_batches(name, BLOCK, 2, 'cpu', 0, 4, input_difficulty=3)


@pytest.mark.parametrize('name', TASKS)
def test_bad_difficulties_stop_with_one_line(name):
    with pytest.raises(SystemExit, match='difficulty = an int D >= 1'):
        task_batches(name, BLOCK, 2, 'cpu', 0, 0)
    task = make_task(name, BLOCK)
    with pytest.raises(SystemExit, match=f'must lie in 1..{task.max_difficulty}'):
        TaskBatches(task, 2, 'cpu', 1, task.max_difficulty + 1)
    with pytest.raises(SystemExit, match='unknown depth task'):
        make_task('task:nesting', BLOCK)


# ---------------------------------------------------------------------------------------------
# Evaluation


def direct_accuracy(model, x, y, need, d, r):
    """Accuracy at the answers of d steps, one prediction at a time: the model reads the tokens up to
    the answer's position and predicts the next one (its last position)."""
    hits = []
    for i, t in (need == d).nonzero().tolist():
        logits, _ = model(x[i:i + 1, :t + 1], num_steps=r)
        hits.append(logits[0, -1].argmax().item() == y[i, t].item())
    return sum(hits) / len(hits)


@pytest.mark.parametrize('model_type, steps', [('grt', [1, 3, 5]), ('gpt', [None])])
def test_the_eval_table_equals_a_direct_computation(model_type, steps):
    task = make_task('pointer', BLOCK)
    model = tiny(model_type, task.vocab_size)
    table, answers = depth_eval.accuracy_table(model, task, [1, 2, 4], steps, 3, 'cpu')
    for d in (1, 2, 4):
        x, y, need = depth_eval.eval_set(task, d, 3, 'cpu')
        assert answers[d] == int((need == d).sum()) > 0
        for r in steps:
            assert table[d][r] == pytest.approx(direct_accuracy(model, x, y, need, d, r))
    assert any(a > 0 for row in table.values() for a in row.values())  # not all zero: the test can fail


def test_the_eval_set_is_fixed_by_task_and_difficulty():
    task = make_task('sum', BLOCK)
    a, b = depth_eval.eval_set(task, 5, 4, 'cpu'), depth_eval.eval_set(task, 5, 4, 'cpu')
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], depth_eval.eval_set(task, 6, 4, 'cpu')[0])
    assert int(a[2].max()) == 5


def test_the_command_prints_the_table_and_a_json_line(tmp_path, capsys):
    """From a checkpoint trained on difficulties 1..2: difficulties 1..6 (3D) by default, a column
    per R, the PNG, and the JSON line last, which equals accuracy_table."""
    task = make_task('sum', BLOCK)
    model = tiny('grt', task.vocab_size)
    out = save_checkpoint(str(tmp_path / 'run'), model, 'grt', config=dict(dataset='task:sum', difficulty=2,
                                                                         block_size=None))
    depth_eval.main([f'--out_dir={out}', '--steps=1,4', '--examples=2', '--device=cpu'])
    lines = capsys.readouterr().out.strip().splitlines()
    record = json.loads(lines[-1])
    assert record['difficulties'] == [1, 2, 3, 4, 5, 6] and record['steps'] == [1, 3, 4]  # and the trained R = 3
    assert record['splits'] == {'train': [1, 2], 'dev': [3, 4], 'test': [5, 6]}  # the default: no stretch
    assert record['trained_difficulty'] == 2 and record['trained_R'] == 3 and record['model_type'] == 'grt'
    table = {}
    for split, ds in record['splits'].items():  # each split scored on its own eval sets
        table.update(depth_eval.accuracy_table(model, task, ds, [1, 3, 4], 2, 'cpu', split)[0])
    assert record['accuracy'] == [[round(table[d][r], 4) for r in (1, 3, 4)] for d in record['difficulties']]
    dev = {r: (table[3][r] + table[4][r]) / 2 for r in (1, 3, 4)}
    assert record['best_R'] == max(r for r in (1, 3, 4) if dev[r] >= max(dev.values()) - 0.005)
    assert len(record['gate']) == 4 and any(line.startswith('mean gate g at steps 1..4') for line in lines)
    assert any('beyond training (d > 2)' in line for line in lines)
    assert os.path.getsize(os.path.join(out, 'depth_eval.png')) > 0


def test_the_splits_are_disjoint_in_seed_and_difficulty():
    """At D = 4: train 1..4, dev 5-6, test 7..12, stretch 13..24 (pointer's cut at its 15); no seed
    serves two splits, and one difficulty drawn for two splits gives different sequences."""
    compose, pointer = make_task('compose', BLOCK), make_task('pointer', BLOCK)
    splits = depth_eval.parse_splits('train,dev,test,stretch', 4, compose)
    assert splits == {'train': [1, 2, 3, 4], 'dev': [5, 6], 'test': list(range(7, 13)),
                      'stretch': list(range(13, 25))}
    assert depth_eval.parse_splits('stretch', 4, pointer) == {'stretch': [13, 14, 15]}
    seeds = [depth_eval.SPLIT_SEEDS[s] + d for s in depth_eval.SPLIT_SEEDS for d in range(1, compose.max_difficulty + 1)]
    assert len(set(seeds)) == len(seeds)
    dev, test = depth_eval.eval_set(compose, 5, 4, 'cpu', 'dev'), depth_eval.eval_set(compose, 5, 4, 'cpu', 'test')
    assert not torch.equal(dev[0], test[0]) and int(dev[2].max()) == int(test[2].max()) == 5
    with pytest.raises(SystemExit, match='split must be'):
        depth_eval.parse_splits('dev,holdout', 4, compose)
    with pytest.raises(SystemExit, match='split stretch is empty'):
        depth_eval.parse_splits('stretch', 6, pointer)  # 19..36 is past pointer's 15


def test_the_best_R_is_chosen_on_dev_alone():
    """Where test would pick another R, the dev split decides: the largest R up to 64 within 0.005 of
    the best dev mean, so a tie goes to more steps and an R whose dev accuracy drifts down is passed over."""
    record = dict(steps=[1, 2, 4, 8], splits={'dev': [5], 'test': [7]}, difficulties=[5, 7],
                  accuracy=[[0.2, 0.9, 0.85, 0.5], [0.2, 0.3, 0.8, 0.9]])
    assert depth_eval.best_steps(record) == 2  # test's best is 8; dev drops at 4 and 8
    assert depth_eval.split_means(record, 'test') == {1: 0.2, 2: 0.3, 4: 0.8, 8: 0.9}
    tied = dict(record, accuracy=[[0.2, 0.9, 0.897, 0.894], [0.2, 0.3, 0.8, 0.9]])
    assert depth_eval.best_steps(tied) == 4  # 0.897 ties with 0.9, 0.894 does not
    assert depth_eval.best_steps(dict(record, steps=[None], accuracy=[[0.5], [0.5]])) is None
    flat = dict(record, steps=[1, 64, 128, 256], accuracy=[[0.2, 1.0, 1.0, 1.0], [0.2, 0.9, 0.9, 0.5]])
    assert depth_eval.best_steps(flat) == 64  # R is chosen up to MAX_R; 256 = 4 x 64 reads overthinking


def test_every_committed_run_stores_the_R_that_dev_chooses():
    """A reader of a committed depth_eval record (depth_study's results/depth/*/seeds/, depth_eval's JSON
    lines in results/depth/dev_variants/) finds in best_R what the reports use: best_steps' choice."""
    depth = os.path.join(HERE, 'results', 'depth')
    paths = sorted(glob.glob(os.path.join(depth, '*', 'seeds', '*.json')) +
                   glob.glob(os.path.join(depth, 'dev_variants', '*.json')))
    assert len(paths) > 100
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        assert record['best_R'] == depth_eval.best_steps(record), (path, record['best_R'])


def test_the_gate_is_eq_5_at_every_step():
    """The mean gate at each of 5 steps equals Eq. 5 on the eval set, with Eq. 2-4 written out
    (eval: no noise; tau = 2), past the trained R = 3 too."""
    task = make_task('compose', BLOCK)
    assert depth_eval.mean_gates(tiny('gpt', task.vocab_size), task, 2, 4, 2, 'cpu') is None
    torch.manual_seed(0)
    model = scramble(build_model('grt', n_embd=32, n_head=2, block_size=BLOCK, vocab_size=task.vocab_size,
                                 n_prelude=1, n_core=1, n_recur=3, n_coda=1, gate_tau=2.0)).eval()
    gates = depth_eval.mean_gates(model, task, 2, 5, 2, 'cpu')
    x, _, _ = depth_eval.eval_set(task, 2, 2, 'cpu', 'train')
    expected = []
    with torch.no_grad():
        e = model.transformer.prelude[0](model.transformer.wte(x) + model.transformer.wpe(torch.arange(BLOCK)))
        h = e
        for _ in range(5):
            g = torch.sigmoid(model.gate_out(F.silu(model.gate_in(torch.cat([model.ln_h(h), model.ln_e(e)], -1)))) / 2)
            o = model.transformer.core[0](model.W_proj(torch.cat([h, e], dim=-1)))
            h = g * h + (1 - g) * o
            expected.append(g.mean().item())
    assert gates == pytest.approx(expected, abs=1e-4) and len(set(gates)) == 5


def test_the_command_refuses_a_language_checkpoint(tmp_path):
    out = save_checkpoint(str(tmp_path / 'lm'), tiny('gpt', 65), 'gpt', config=dict(dataset='shakespeare_char'))
    with pytest.raises(SystemExit, match="not a depth task"):
        depth_eval.main([f'--out_dir={out}', '--device=cpu'])


# ---------------------------------------------------------------------------------------------
# The comparison (experiments/depth_study.py), its training faked


def test_the_study_models_match_the_grt_as_their_configs_say():
    """gpt_params: the layer count nearest the GRT's non-embedding parameters; gpt_flops and huginn:
    within 5% of its training FLOPs a token, grt_local within 10%; the local dense models are the
    dense ones with grt_local's attention window."""
    grt = depth_study.model_of('grt', 'pointer')
    flops = lambda m: study.mean_train_flops(m, grt.config.block_size)
    per_layer = depth_study.model_of('gpt_params', 'pointer').get_num_params() / 3
    assert depth_study.model_of('gpt_params', 'pointer').config.n_layer == round(grt.get_num_params() / per_layer)
    for name in ('gpt_flops', 'huginn'):
        assert flops(depth_study.model_of(name, 'pointer')) == pytest.approx(flops(grt), rel=0.05), name
    huginn = depth_study.model_of('huginn', 'pointer').config
    assert (huginn.n_prelude, huginn.n_core, huginn.n_recur, huginn.n_coda) == \
        (grt.config.n_prelude, grt.config.n_core, grt.config.n_recur, grt.config.n_coda)
    assert flops(depth_study.model_of('grt_local', 'pointer')) == pytest.approx(flops(grt), rel=0.1)
    for name in ('gpt_params', 'gpt_flops'):  # the local twins differ in their attention alone
        full, local = depth_study.run_settings(name), depth_study.run_settings(name + '_local')
        assert {k for k in full if full[k] != local[k]} == {'out_dir', 'attn_window'}
        assert local['attn_window'] == depth_study.run_settings('grt_local')['attn_window'] == 2


def fake_train_py(calls):
    """Stands in for `python train.py ...`: a tiny model of the config's type in out_dir, and its log."""
    def run(cmd, **kwargs):
        args = dict(a[2:].split('=', 1) for a in cmd if a.startswith('--'))
        calls.append((cmd[2], args))
        config = next(m for m, p in depth_study.CONFIGS.items() if p == cmd[2])
        model_type = depth_study.run_settings(config)['model_type']
        task = make_task(args['dataset'], BLOCK)
        save_checkpoint(args['out_dir'], tiny(model_type, task.vocab_size), model_type,
                        config=dict(dataset=args['dataset'], difficulty=int(args['difficulty']), block_size=None))
        with open(os.path.join(args['out_dir'], 'log.jsonl'), 'w') as f:
            f.write(json.dumps(dict(iter=int(args['max_iters']), time_s=1.5, val_loss=2.0 + int(args['seed']) / 1e4)) + '\n')
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_the_study_trains_each_run_once_and_resumes_a_started_one(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(depth_study.subprocess, 'run', fake_train_py(calls))
    argv = [f'--out_dir={tmp_path}', '--tasks=sum', '--models=grt,gpt_params', '--max_iters=5', '--difficulty=2',
            '--steps=4,1', '--examples=2']
    depth_study.main(argv)
    assert [(config, args['dataset'], args['difficulty'], args['max_iters'], args['init_from'])
            for config, args in calls] == [('config/depth/grt.py', 'task:sum', '2', '5', 'scratch'),
                                           ('config/depth/gpt_params.py', 'task:sum', '2', '5', 'scratch')]
    report = open(tmp_path / 'RESULTS.md').read()
    rows = ['| grt (5 it) | 1 |', '| grt (5 it) | 3 |', '| grt (5 it) | 4 |',  # the trained R = 3 added
            '| gpt_params (5 it) | dense |']
    accuracy = report.split('The mean over seeds at each R')[1]
    assert sorted(rows, key=accuracy.index) == rows  # by model, then R ascending
    assert '| grt (5 it) | `config/depth/grt.py` | 1+1x8+1 |' in report
    record = json.load(open(tmp_path / 'seeds' / 'sum-D2-grt-5it-s0.json'))  # one JSON a run, every split
    assert record['seed'] == 0 and record['config'] == 'config/depth/grt.py' and record['overrides'] == ''
    assert record['splits'] == {'train': [1, 2], 'dev': [3, 4], 'test': [5, 6], 'stretch': [7, 8, 9, 10, 11, 12]}
    R, gate = record['best_R'], record['gate']
    means = {s: depth_study.split_means(record, s)[R] for s in record['splits']}
    four = depth_study.split_means(record, 'test').get(4 * R)  # R = 1: 4 is evaluated; R = 3 or 4: 4R is not
    assert (f"| grt (5 it) | 0 | 2.0000 | 2 | {R} | {means['train']:.3f} | {means['dev']:.3f} | "
            f"{means['test']:.3f} | {means['stretch']:.3f} | {'' if four is None else f'{four:.3f}'} | "
            f"{gate[0]:.3f} / {gate[2]:.3f} |") in report
    assert '| d=12 | train 1..2 | dev 3..4 | test 5..6 | stretch 7..12 |' in report
    assert os.path.getsize(tmp_path / 'sum.png') > 0
    depth_study.main(argv)  # everything done: nothing trains again
    assert len(calls) == 2
    run = tmp_path / 'runs' / 'sum-D2-grt-5it-s0'
    os.remove(tmp_path / 'seeds' / 'sum-D2-grt-5it-s0.json')  # a run stopped before its evaluation resumes
    depth_study.main(argv)
    assert len(calls) == 3 and calls[-1][1]['init_from'] == 'resume' and calls[-1][1]['out_dir'] == str(run)


def test_each_run_is_evaluated_before_the_next_trains_on_the_device_asked(tmp_path, monkeypatch):
    """A study stopped mid-way keeps the JSON of every run it finished; --device reaches train.py."""
    calls, seen = [], []
    fake = fake_train_py(calls)

    def run(cmd, **kwargs):
        seen.append(sorted(os.listdir(tmp_path / 'seeds')) if os.path.isdir(tmp_path / 'seeds') else [])
        return fake(cmd, **kwargs)
    monkeypatch.setattr(depth_study.subprocess, 'run', run)
    depth_study.main([f'--out_dir={tmp_path}', '--tasks=sum', '--models=grt', '--max_iters=5', '--difficulty=2',
                      '--steps=1', '--examples=2', '--split=dev', '--seeds=2', '--device=cpu'])
    assert seen == [[], ['sum-D2-grt-5it-s0.json']]
    assert [a['device'] for _, a in calls] == ['cpu', 'cpu']


def test_a_variant_passes_its_overrides_and_every_seed_is_reported(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(depth_study.subprocess, 'run', fake_train_py(calls))
    argv = [f'--out_dir={tmp_path}', '--tasks=sum', '--models=grt', '--max_iters=5', '--difficulty=2',
            '--steps=1,2', '--examples=2', '--split=train,dev']
    depth_study.main(argv + ['--seeds=2', '--variant=bias3',
                             '--overrides=--gate_bias=3.0 --gate_noise=0.0 --n_recur=5'])
    assert [a['out_dir'] for _, a in calls] == [str(tmp_path / 'runs' / f'sum-D2-grt+bias3-5it-s{s}') for s in (0, 1)]
    assert all(a['gate_bias'] == '3.0' and a['gate_noise'] == '0.0' for _, a in calls)
    depth_study.main(argv)  # another study into the same folder: its report keeps the variant's seeds
    report = open(tmp_path / 'RESULTS.md').read()
    assert sorted(os.listdir(tmp_path / 'seeds')) == ['sum-D2-grt+bias3-5it-s0.json', 'sum-D2-grt+bias3-5it-s1.json',
                                                      'sum-D2-grt-5it-s0.json']
    assert '| grt+bias3 (5 it) | 2 |' in report and '| grt (5 it) | 1 |' in report
    assert '| grt+bias3 (5 it) | 1 |' in report
    assert '| grt+bias3 (5 it) | `config/depth/grt.py` | 1+1x5+1 |' in report  # the model as its overrides made it
    assert '| grt (5 it) | `config/depth/grt.py` | 1+1x8+1 |' in report
    depth_study.main([a.replace('--max_iters=5', '--max_iters=6') for a in argv])  # trained longer: its own row
    summary = open(tmp_path / 'RESULTS.md').read().split('| model | seed |')[0]
    assert '| grt (5 it) | 1 |' in summary and '| grt (6 it) | 1 |' in summary
    with pytest.raises(SystemExit, match='--variant=NAME and --overrides'):
        depth_study.main(argv + ['--overrides=--gate_bias=3.0'])


def test_another_split_into_the_same_folder_reevaluates_and_reports_both(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(depth_study.subprocess, 'run', fake_train_py(calls))
    argv = [f'--out_dir={tmp_path}', '--tasks=sum', '--models=grt', '--max_iters=5', '--difficulty=2',
            '--steps=1,2', '--examples=2']
    depth_study.main(argv + ['--seeds=2'])
    depth_study.main(argv + ['--split=train,dev'])  # seed 0 evaluated again on fewer splits; seed 1 kept
    assert len(calls) == 3 and calls[-1][1]['init_from'] == 'resume'
    seed0, seed1 = (json.load(open(tmp_path / 'seeds' / f'sum-D2-grt-5it-s{s}.json')) for s in (0, 1))
    assert list(seed0['splits']) == ['train', 'dev'] and list(seed1['splits']) == ['train', 'dev', 'test', 'stretch']
    accuracy = open(tmp_path / 'RESULTS.md').read().split('The mean over seeds at each R')[1]
    row = next(line for line in accuracy.splitlines() if line.startswith('| grt (5 it) | 1 |')).split(' | ')
    by_d = lambda r: dict(zip(r['difficulties'], (a[r['steps'].index(1)] for a in r['accuracy'])))
    assert row[2] == f"{(by_d(seed0)[1] + by_d(seed1)[1]) / 2:.3f}"  # d = 1: the mean of both seeds
    assert row[2 + 11] == f"{by_d(seed1)[12]:.3f}"  # d = 12: seed 1's alone
    assert os.path.getsize(tmp_path / 'sum.png') > 0


def test_a_model_without_positions_reads_order_from_the_causal_mask_alone():
    """position='none': no wpe table; one layer's last prediction is then the same for any order of the
    tokens before it (its attention sums over a set), which the learned positions break."""
    x = torch.randint(6, (2, 12), generator=torch.Generator().manual_seed(0))
    shuffled = torch.cat([x[:, :-1][:, torch.randperm(11, generator=torch.Generator().manual_seed(1))], x[:, -1:]], 1)
    last = {}
    for position in ('none', 'learned'):
        torch.manual_seed(0)
        model = scramble(build_model('gpt', n_layer=1, n_embd=32, n_head=2, block_size=BLOCK, vocab_size=6,
                                     position=position)).eval()
        with torch.no_grad():
            last[position] = model(x)[0], model(shuffled)[0]
        if position == 'none':
            assert model.transformer.wpe is None and 'transformer.wpe.weight' not in model.state_dict()
    assert torch.allclose(*last['none'], atol=1e-5)
    assert not torch.allclose(*last['learned'], atol=1e-3)


@pytest.mark.parametrize('criterion, in_order', [('state', False), ('kl', False), ('state', True)])
def test_early_exit_on_a_depth_task_spans_the_fixed_depths(tmp_path, capsys, monkeypatch, criterion, in_order):
    """depth_exit: a threshold no step reaches runs every token max_steps steps (the accuracy of fixed
    R = max_steps), one every step passes stops each token after step 1 (that of R = 1), on the
    criterion and order asked for."""
    from experiments import depth_exit
    from early_exit import ExitingModel
    probes = []  # the 'kl' probes of every exiting forward: none under 'state'

    class CountingExits(ExitingModel):
        def __call__(self, *args, **kwargs):
            out = super().__call__(*args, **kwargs)
            probes.append(self.exit_stats['probes'])
            assert self.rule.in_order is in_order
            return out
    monkeypatch.setattr(depth_exit, 'ExitingModel', CountingExits)
    task = make_task('compose', BLOCK)
    model = tiny('grt', task.vocab_size)
    out = save_checkpoint(str(tmp_path / 'run'), model, 'grt', config=dict(dataset='task:compose', difficulty=2,
                                                                         block_size=None))
    depth_exit.main([f'--out_dir={out}', '--thresholds=1e9,1e-12', '--max_steps=5', '--steps=1', '--examples=2',
                     '--split=train,dev', f'--save_dir={tmp_path / "saved"}', f'--criterion={criterion}',
                     f'--in_order={in_order}', '--mixed=3'])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.load(open(tmp_path / 'saved' / 'depth_exit.json')) == record
    assert record['criterion'] == criterion and record['in_order'] is in_order
    assert len(probes) == 2 * 5  # two thresholds, d = 1..4 and the mixed set
    assert (min(probes) > 0) if criterion == 'kl' else (max(probes) == 0)
    assert record['steps'] == [1, 5] and record['splits'] == {'train': [1, 2], 'dev': [3, 4]}
    for fixed, accuracy, steps in zip(record['fixed'], record['exit_accuracy'], record['exit_steps']):
        assert accuracy == fixed and steps == [1.0, 5.0]  # (R = 1, R = 5) and the two thresholds
    assert len({a for row in record['fixed'] for a in row}) > 1  # the accuracies differ: the test can fail
    mixed = record['mixed']  # 3 sequences whose runs need 1..3D = 1..6 steps, drawn from seed 50000
    (x, y, need), hi = depth_exit.mixed_set(task, 2, 3)
    assert hi == 6 and mixed['difficulties'] == sorted(set(need[need > 0].tolist())) == list(range(1, 7))
    assert torch.equal(x, TaskBatches(task, 3, 'cpu', 1, 6).sample(torch.Generator().manual_seed(50_000))[0])
    assert task.solve(x[0].tolist())[0] == y[0].tolist()
    assert mixed['answers'] == [int((need == d).sum()) for d in range(1, 7)] and mixed['tokens'] == 3 * BLOCK
    for fixed, accuracy, steps in zip(mixed['fixed'], mixed['exit_accuracy'], mixed['exit_steps']):
        assert accuracy == fixed and steps == [1.0, 5.0]
    assert mixed['token_steps'] == [1.0, 5.0]  # every token of the set, answers or not
    assert len({a for row in mixed['fixed'] for a in row}) > 1
    assert os.path.getsize(tmp_path / 'saved' / 'depth_exit.png') > 0
    dev = [sum(row[i] for row in record['exit_accuracy'][2:]) / 2 for i in (0, 1)]  # d = 3, 4
    assert record['dev_threshold'] == (1e9 if dev[0] >= max(dev) - 0.005 else 1e-12)
    table = {3: dict(exit={0.1: (0.897, 4.0), 0.01: (0.9, 9.0)})}  # (accuracy, mean exit step) at d = 3
    assert depth_exit.dev_threshold(table, {'dev': [3]}, [0.1, 0.01]) == 0.1  # within 0.005: the fewer steps
    assert depth_exit.dev_threshold(table, {'dev': [3]}, [0.1, 0.01], tie=0) == 0.01  # no tie: the best
    table[3]['exit'][0.1] = (0.89, 4.0)
    assert depth_exit.dev_threshold(table, {'dev': [3]}, [0.1, 0.01]) == 0.01
    with pytest.raises(SystemExit, match='criterion must be one of state, kl'):
        depth_exit.main([f'--out_dir={out}', '--criterion=entropy'])
    with pytest.raises(SystemExit, match='mixed must be a number of sequences >= 0'):
        depth_exit.main([f'--out_dir={out}', '--mixed=-1'])
    depth_exit.main([f'--out_dir={out}', '--thresholds=1e9', '--max_steps=2', '--steps=1', '--examples=1',
                     '--split=dev', f'--save_dir={tmp_path / "default"}', f'--criterion={criterion}',
                     f'--in_order={in_order}'])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])['mixed'] is None  # not asked for


@pytest.mark.parametrize('threshold, in_order', [(1.0, False), (2.0, True)])
def test_depth_exit_scores_each_answer_by_the_steps_it_needs(threshold, in_order):
    """depth_exit.score on mixed sequences: each d's accuracy and mean exit step are those of the answers
    that need d steps, and the token mean is over every token, answers or not, counted one by one."""
    from experiments import depth_exit
    from early_exit import EarlyExit, ExitingModel
    task = make_task('compose', BLOCK)
    model = tiny('grt', task.vocab_size)
    (x, y, need), _ = depth_exit.mixed_set(task, 2, 3)
    rows, token_steps = depth_exit.score(model, x, y, need, [1, 2, 6], [threshold], 5, [1, 5], 'state', in_order)
    exiting = ExitingModel(model, EarlyExit(threshold=threshold, in_order=in_order))
    exit_right = (exiting(x, y, num_steps=5)[0].argmax(-1) == y).tolist()
    depth = exiting.exit_steps.tolist()
    fixed_right = {r: (model(x, y, num_steps=r)[0].argmax(-1) == y).tolist() for r in (1, 5)}
    cells = [(b, i) for b in range(x.size(0)) for i in range(x.size(1))]
    assert len(set(d for row in depth for d in row)) > 1  # tokens stop at different steps: the means can differ
    for d in (1, 2, 6):
        at_d = [(b, i) for b, i in cells if need[b, i] == d]
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        assert rows[d]['exit'][threshold] == pytest.approx((mean([exit_right[b][i] for b, i in at_d]),
                                                            mean([depth[b][i] for b, i in at_d])))
        for r in (1, 5):
            assert rows[d]['fixed'][r] == pytest.approx(mean([fixed_right[r][b][i] for b, i in at_d]))
    assert token_steps[threshold] == pytest.approx(sum(depth[b][i] for b, i in cells) / len(cells))
    assert token_steps[threshold] != pytest.approx(sum(depth[b][i] for b, i in cells if y[b, i] >= 0) /
                                                   sum(1 for b, i in cells if y[b, i] >= 0))


class Oracle(torch.nn.Module):
    """A 'model' whose prediction at each answer combines the last `reach` operands of its run (all of
    them when reach is None), written from the tokens with the task's own combine. across_resets: the
    last `reach` operands of the sequence, runs before this one's included."""

    def __init__(self, task, reach=None, across_resets=False):
        super().__init__()
        self.task, self.reach, self.across_resets = task, reach, across_resets

    def forward(self, x, y=None, num_steps=None):
        logits = torch.zeros(*x.shape, self.task.vocab_size)
        for b, tokens in enumerate(x.tolist()):
            run = []
            for i, t in enumerate(tokens):
                if t == self.task.reset:
                    run = run if self.across_resets else []
                else:
                    run = run + [t]
                total = 0
                for operand in run[-self.reach:] if self.reach else run:
                    total = self.task.combine(total, operand)
                logits[b, i, total] = 1.0
        return logits, None


@pytest.mark.parametrize('name', ['compose', 'sum'])
def test_the_probe_tells_the_step_from_a_run_cut_at_D(name):
    """An oracle that combines the whole run is right everywhere, never cut, and reads every operand;
    one that combines the last 4 operands is cut at D = 4 wherever that differs, right only where it
    does not, and reads the last 4 operands alone."""
    from experiments.depth_probe import probe
    task = make_task(name, BLOCK)
    assert probe(Oracle(task), task, 6, 4, 1, 8, 'dev') == (1.0, 0.0, [1.0] * 6)
    assert probe(Oracle(task), task, 2, 4, 1, 8, 'train') == (1.0, 0.0, [1.0] * 2)  # d <= D: nothing to cut
    assert probe(Oracle(task, reach=1), task, 2, 4, 1, 8, 'train')[1] == 0.0  # not the run before's operands
    right, cut, reads = probe(Oracle(task, reach=4), task, 6, 4, 1, 8, 'dev')
    assert cut == 1.0 and 0 < right < 0.5  # right only where the first two operands combine to the identity
    assert reads == [1.0] * 4 + [0.0] * 2


@pytest.mark.parametrize('name', ['compose', 'sum'])
def test_the_probe_reads_one_run_at_a_time(name):
    """An oracle that combines the last 8 operands across resets reads its own run's 6 in full: the run
    before is left as it was. Changed together, a change there could undo one here (at k = 0, 1, in a
    fifth of the answers with a run before them on compose, a quarter on sum)."""
    from experiments.depth_probe import probe
    task = make_task(name, BLOCK)
    right, _, reads = probe(Oracle(task, reach=8, across_resets=True), task, 6, 4, 1, 8, 'dev')
    assert right < 0.5 and reads == [1.0] * 6


def test_a_run_below_the_dev_floor_is_drawn_again_and_every_draw_is_kept(tmp_path, monkeypatch):
    """--redraw=1: a run whose dev accuracy at its best R is under DEV_FLOOR (an untrained model's is)
    trains once more from seed + 1000 in its own folder; its JSON keeps the first draw's record."""
    calls = []
    monkeypatch.setattr(depth_study.subprocess, 'run', fake_train_py(calls))
    argv = [f'--out_dir={tmp_path}', '--tasks=sum', '--models=grt', '--max_iters=5', '--difficulty=2',
            '--steps=1,2', '--examples=2', '--split=dev,test']
    depth_study.main(argv)  # --redraw=0: the draw below the floor is kept as it is
    first = json.load(open(tmp_path / 'seeds' / 'sum-D2-grt-5it-s0.json'))
    assert depth_study.at_best(first, 'dev') < depth_study.DEV_FLOOR
    assert len(calls) == 1 and first['draw'] == 0 and first['train_seed'] == 0 and first['earlier_draws'] == []
    depth_study.main(argv + ['--redraw=1'])
    assert [(a['seed'], a['out_dir'], a['init_from']) for _, a in calls[1:]] == [
        ('1000', str(tmp_path / 'runs' / 'sum-D2-grt-5it-s0-draw1'), 'scratch')]
    record = json.load(open(tmp_path / 'seeds' / 'sum-D2-grt-5it-s0.json'))
    assert record['seed'] == 0 and record['draw'] == 1 and record['train_seed'] == 1000
    assert record['best_val_loss'] == 2.1  # draw 1's own run, not draw 0's
    assert [{k: v for k, v in d.items() if k != 'best_R'} for d in record['earlier_draws']] == [
        {k: v for k, v in first.items() if k not in ('earlier_draws', 'best_R')}]
    report = open(tmp_path / 'RESULTS.md').read()
    dev, test = (depth_study.at_best(first, s) for s in ('dev', 'test'))
    assert "| grt (5 it) | 0 (trained as 1000) | 2.1000 |" in report
    assert f"| 0: {dev:.3f} / {test:.3f} |" in report
    depth_study.main(argv + ['--redraw=1'])  # draws spent: nothing trains again
    assert len(calls) == 2
    depth_study.main(argv + ['--redraw=2'])  # one more draw, appended after the first two
    record = json.load(open(tmp_path / 'seeds' / 'sum-D2-grt-5it-s0.json'))
    assert [a['seed'] for _, a in calls] == ['0', '1000', '2000']
    assert (record['draw'], [d['train_seed'] for d in record['earlier_draws']]) == (2, [0, 1000])
    monkeypatch.setattr(depth_study, 'DEV_FLOOR', 0.0)  # every draw reaches the floor: none is drawn again
    depth_study.main(argv + ['--redraw=3'])
    assert len(calls) == 3
    with pytest.raises(SystemExit, match='dev in --split'):
        depth_study.main(argv[:-1] + ['--split=test', '--redraw=1'])
