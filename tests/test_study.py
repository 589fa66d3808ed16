"""study.py's design claims that can be checked without running the study (the FLOP matching of its
models is in test_configs.py)."""

import json
import math
import os
import threading
import time

import numpy as np
import pytest
import torch

from experiments import study
from conftest import save_checkpoint
from prepare_data import write_tokens


def test_every_section_names_known_models():
    for runs in study.SECTIONS.values():
        assert all(model in study.MODELS or model in study.FIXED_LADDER_MODELS for model, _ in runs)
    assert [study.MODELS[m]['model_type'] for m in study.LADDER] == ['rung1', 'rung2', 'rung3', 'rung4', 'grt']


# ---------------------------------------------------------------------------------------------
# The fixed-layout ladder, learning-rate tuning, "clear" gaps, MoR's eval routing (no training: the
# runs are faked, or a tiny checkpoint stands in for a trained one)


def test_fixed_ladder_keeps_the_grt_layout():
    """Every rung of ladder_fixed at the GRT's R and unique blocks; only the rung's parts differ."""
    grt = study.MODELS['grt']
    unique = grt['n_prelude'] + grt['n_core'] + grt['n_coda']
    assert [study.spec(m)['model_type'] for m in study.FIXED_LADDER] == ['rung1', 'rung2', 'rung3', 'rung4', 'grt']
    for name in study.FIXED_LADDER:
        f = study.spec(name)
        assert f['n_recur'] == grt['n_recur'] and f['n_prelude'] + f['n_core'] + f['n_coda'] == unique, name
        assert study.model_of(name).get_num_params() > 0
    for name in study.FIXED_LADDER[1:]:  # rungs 2..5 share the layout exactly
        assert {k: study.spec(name)[k] for k in ('n_prelude', 'n_core', 'n_recur', 'n_coda')} == \
            {k: grt[k] for k in ('n_prelude', 'n_core', 'n_recur', 'n_coda')}


def test_gap_is_clear_only_beyond_twice_the_combined_spread():
    a, b = (2.00, 0.010, 3), (2.05, 0.010, 3)  # 2 sqrt(2) 0.01 = 0.0283 < 0.05
    assert study.gap(a, b) == (pytest.approx(-0.05), True)
    assert study.gap(a, (2.02, 0.010, 3)) == (pytest.approx(-0.02), False)
    assert study.gap(a, (2.05, None, 1)) == (pytest.approx(-0.05), None)  # one seed: undecided
    assert 2 * math.hypot(0.01, 0.01) == pytest.approx(0.0283, abs=1e-4)


def fake_result(model, mult, seed, lr, loss):
    return dict(model=model, mult=mult, seed=seed, lr=lr, best_val_loss=loss, final_val_loss=loss,
                tokens=768 * 10, train_time_s=1.0, wall_s=1.0, evals=[(10, 7680, loss)], train_curve=[(7680, loss)])


def test_tune_picks_each_models_lowest_loss(tmp_path, monkeypatch):
    """Every model of the tuned sections runs once per rate, at the tuning seed, named by its rate."""
    calls = []

    def fake_training(c, model, mult, seed, runs_dir, lr=None):
        calls.append((model, seed, lr, study.run_name(c, model, mult, seed, lr)))
        return fake_result(model, mult, seed, lr, 2.0 + abs(math.log(lr / (2e-3 if model == 'gpt' else 1e-3))))

    monkeypatch.setattr(study, 'run_training', fake_training)
    c = dict(study.DEFAULTS, out_dir=str(tmp_path), iters=10)
    tuning = study.tune(c, str(tmp_path / 'runs'))
    expected_models = {m for s in study.TUNED for m, _ in study.SECTIONS[s]}
    assert set(tuning) == expected_models and len(calls) == 5 * len(expected_models)
    assert all(seed == c['tune_seed'] for _, seed, _, _ in calls)
    assert ('gpt', 100, 2e-3, 'gpt-10it-lr0.002-s100') in calls
    chosen = json.load(open(tmp_path / 'tune.json'))['chosen']
    assert chosen['gpt'] == 2e-3 and chosen['grt'] == 1e-3
    assert '**2.0000**' in open(tmp_path / 'tune.md').read()


def test_a_models_rate_reaches_train_py(tmp_path, monkeypatch):
    """LEARNING_RATES[model] becomes --learning_rate and --min_lr (a tenth), and names the run."""
    monkeypatch.setattr(study, 'LEARNING_RATES', {'grt': 2e-3})
    commands = []

    def fake_run(cmd, stdout=None, stderr=None, env=None):
        commands.append((cmd, env))
        out = next(a for a in cmd if a.startswith('--out_dir=')).split('=', 1)[1]
        with open(os.path.join(out, 'log.jsonl'), 'w') as f:
            f.write(json.dumps(dict(iter=10, loss=2.0, tokens=7680, time_s=1.0, val_loss=2.1)) + '\n')
        return type('Done', (), {'returncode': 0})()

    monkeypatch.setattr(study.subprocess, 'run', fake_run)
    monkeypatch.setattr(study.os, 'cpu_count', lambda: 8)
    c = dict(study.DEFAULTS, out_dir=str(tmp_path), iters=10, jobs=2)
    result = study.run_training(c, 'grt', 1, 0, str(tmp_path))
    assert '--learning_rate=0.002' in commands[0][0] and '--min_lr=0.0002' in commands[0][0]
    assert commands[0][1]['OMP_NUM_THREADS'] == '4'  # 2 jobs share 8 cores
    assert result['lr'] == 2e-3 and os.path.isdir(tmp_path / 'grt-10it-lr0.002-s0')
    study.run_training(c, 'mor', 1, 0, str(tmp_path))  # no rate listed: the recipe's
    assert not any(a.startswith(('--learning_rate', '--min_lr')) for a in commands[1][0])
    assert os.path.isdir(tmp_path / 'mor-10it-s0')


def test_train_all_runs_jobs_at_once_and_keeps_the_order(tmp_path, monkeypatch):
    """With 2 jobs two runs are in flight together; results come back in the order asked, whatever
    order the runs finish in."""
    in_flight, most = [], []
    lock, both_started = threading.Lock(), threading.Barrier(2, timeout=10)

    def fake_training(c, model, mult, seed, runs_dir, lr=None):
        with lock:
            in_flight.append(model)
            most.append(len(in_flight))
        both_started.wait()  # deadlocks (times out) unless two runs are in flight at once
        time.sleep(0.05 if model == 'gpt' else 0)  # the first asked finishes last
        with lock:
            in_flight.remove(model)
        return fake_result(model, mult, seed, lr, {'gpt': 2.0, 'grt': 2.1}[model])

    monkeypatch.setattr(study, 'run_training', fake_training)
    c = dict(study.DEFAULTS, out_dir=str(tmp_path), jobs=2)
    results = study.train_all(c, [('gpt', 1, 0, None), ('grt', 1, 0, None)], str(tmp_path), 'test')
    assert [r['model'] for r in results] == ['gpt', 'grt'] and max(most) == 2


@pytest.fixture(scope='module')
def char_data(tmp_path_factory):
    """data/shakespeare_char/ with 5000 random training tokens and 2000 val tokens."""
    root = tmp_path_factory.mktemp('data')
    os.makedirs(root / 'shakespeare_char')
    tokens = np.random.default_rng(0).integers(65, size=7000)
    write_tokens(str(root / 'shakespeare_char' / 'train.bin'), tokens[:5000])
    write_tokens(str(root / 'shakespeare_char' / 'val.bin'), tokens[5000:])
    return str(root)


def test_report_marks_clear_gaps_and_counts_passes(tmp_path, char_data):
    losses = {'gpt': [2.00, 2.01, 2.02], 'grt': [2.10, 2.11, 2.12], 'huginn': [2.00, 2.05, 1.97]}
    results = [fake_result(m, 1, s, None, v) for m, vs in losses.items() for s, v in enumerate(vs)]
    c = dict(study.DEFAULTS, out_dir=str(tmp_path), data_dir=char_data, iters=10)
    routing = {0: dict(keep=[1.0, 0.5], eval_flops=2e6, schedule_flops=2.5e6, dense_flops=2.56e6)}
    study.write_report(c, results, {}, {}, 60.0, str(tmp_path), routing=routing)
    report = open(tmp_path / 'RESULTS.md').read()
    assert '| grt | 1+1x5+1 | recipe | 2.1100 ± 0.0100 | 3 | +0.1000 | **clear** |' in report
    assert '| huginn | 1+1x4+1 | recipe | 2.0067 ± 0.0404 | 3 | -0.0033 | no |' in report  # inside the spread
    assert '7,680 tokens = 1.54 passes over the 5,000-token training text' in report
    assert '| 0 | 1.000 | 0.500 | 2.00M | 0.80 | 0.78 |' in report


def test_mor_routing_of_a_trained_checkpoint(tmp_path, char_data):
    """The fraction of tokens each recursion keeps at eval, and the eval FLOPs they imply."""
    torch.manual_seed(0)
    model = study.model_of('mor').to_empty(device='cpu')
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for aux in model.aux_routers:  # routing that keeps some tokens and drops others
            aux[0].weight.normal_(0.0, 1.0)
            aux[-1].weight.normal_(0.0, 2.0)
            aux[-1].bias.fill_(1.0)
    c = dict(study.DEFAULTS, out_dir=str(tmp_path), data_dir=char_data, iters=10, depth_eval_iters=2)
    out = os.path.join(str(tmp_path), study.run_name(c, 'mor', 1, 0))
    save_checkpoint(out, model, 'mor', config=dict(batch_size=2))
    routing = study.mor_routing(c, str(tmp_path), 0)
    keep = routing['keep']
    assert len(keep) == 7 and keep[0] == 1.0 and all(later <= earlier for earlier, later in zip(keep, keep[1:]))
    assert 0 < keep[-1] < 1
    assert routing['schedule_flops'] == pytest.approx(model.flops_per_token(64))
    assert routing['eval_flops'] == pytest.approx(model.eval_flops_per_token(64, keep), rel=0.05)
    assert os.path.isfile(os.path.join(out, 'routing.json'))


def legends_clear_of_axes(fig):
    """True when no legend's box overlaps the plotting area of a visible axes (where the curves are)."""
    fig.draw_without_rendering()
    legends = [*fig.legends, *[ax.get_legend() for ax in fig.axes if ax.get_legend()]]
    areas = [ax.get_window_extent() for ax in fig.axes if ax.get_visible()]
    return legends and not any(leg.get_window_extent().overlaps(area) for leg in legends for area in areas)


def test_plots_show_a_line_per_model_and_keep_legends_off_the_curves(tmp_path):
    """loss_curves: a panel per section, in it one line per model (the mean over seeds) and a band from the
    lowest to the highest seed; depth: a line per seed. No legend covers a plotting area."""
    pytest.importorskip('matplotlib')
    rng = np.random.default_rng(0)
    runs = dict.fromkeys((model, mult) for section in study.SECTIONS.values() for model, mult in section)
    results = [dict(fake_result(model, mult, seed, None, 2.0),
                    evals=[(i, 768 * i, 2.5 - i / 1000 + rng.uniform(0, 0.05)) for i in (250, 500, 800)])
               for model, mult in runs for seed in range(3)]
    fig = study.plot_loss_curves(results)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ['isoFLOPs', 'twice the tokens', 'isoParams',
                                               'ablation ladder, FLOP-matched', 'ablation ladder at R = 5']
    for ax, section in zip(shown, study.SECTIONS.values()):
        assert len(ax.get_lines()) == len(section) == len(ax.collections)  # a line and a band per model
        assert [t.get_text().split()[0] for t in ax.get_legend().get_texts()] == [m for m, _ in section]
        for line, (model, mult) in zip(ax.get_lines(), section):
            seeds = [r['evals'] for r in results if r['model'] == model and r['mult'] == mult]
            assert list(line.get_xdata()) == pytest.approx([768 * i / 1e6 for i in (250, 500, 800)])
            assert list(line.get_ydata()) == pytest.approx([np.mean([s[k][2] for s in seeds]) for k in range(3)])
    assert legends_clear_of_axes(fig)
    depth = {seed: {r: 1.99 + 0.005 * seed + 1e-4 * r for r in range(1, 11)} for seed in range(3)}
    fig = study.plot_depth(depth)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ['GRT seed 0', 'GRT seed 1', 'GRT seed 2',
                                                                     'trained R']
    assert legends_clear_of_axes(fig)
    assert study.plot(results, depth, str(tmp_path)) == ['loss_curves.png', 'depth.png']
    assert os.path.getsize(tmp_path / 'loss_curves.png') > 0 and os.path.getsize(tmp_path / 'depth.png') > 0
