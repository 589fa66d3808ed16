"""The scripts in benchmarks/: train_speed's step and MFU and a tiny run; peer's table and JSON at tiny
settings, its modes, and its comparison with a nanoGPT checkout (a stand-in train.py that prints
nanoGPT's lines); gpu_check's recompile count, its refusal without CUDA and its tiny CPU run;
exit_sweep's table, JSON and plot on a tiny GRT."""

import importlib.util
import json
import math
import os
import textwrap

import numpy as np
import pytest
import torch

import bench
import prepare_data
from benchmarks import exit_sweep, gpu_check, peer, train_speed
from common import compile_regions
from conftest import CHARS, save_checkpoint, tiny_model
from registry import build_model


# -----------------------------------------------------------------------------
# train_speed


def test_train_throughput_steps_the_model_and_gives_a_plausible_mfu():
    m = tiny_model('grt').float()
    before = m.transformer.core[0].mlp.c_fc.weight.detach().clone()
    tokens_per_s, mfu = train_speed.train_throughput(m, dict(train_speed.DEFAULTS, batch_size=2, steps=2), 'cpu',
                                                     'float32')
    assert tokens_per_s > 0 and 0 < mfu < 1
    assert not torch.equal(before, m.transformer.core[0].mlp.c_fc.weight)  # AdamW stepped


def test_training_mfu_is_train_pys_and_never_above_100_percent(monkeypatch, capsys):
    """train.py's formula (common.estimate_mfu against common.peak_flops_for in the run's dtype); above
    100% the CPU peak is measured again, as train.py does, and a figure still above 100% (the peak is
    wrong) is withheld with a warning."""
    m = tiny_model('grt')
    expected = 3 * m.flops_per_token(64, 2.5) * 1000 / 0.5 / 1e11
    assert train_speed.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32', peak_flops=1e11) == pytest.approx(expected)
    assert train_speed.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32', peak_flops=1e9) is None
    assert 'warning: MFU would be' in capsys.readouterr().err
    monkeypatch.setattr(train_speed, 'peak_flops_for', lambda *args: 1e9)  # a peak measured on loaded cores
    monkeypatch.setattr(train_speed, 'measure_cpu_peak', lambda dtype, again: 1e11 if again else 1e9)
    assert train_speed.training_mfu(m, 1000, 0.5, 64, 2.5, 'cpu', 'float32') == pytest.approx(expected)


def test_train_speed_tiny_table_and_json(capsys):
    result = train_speed.main(['--scale=tiny', '--device=cpu', '--dtype=float32', '--compile=False', '--steps=1'])
    out = capsys.readouterr().out
    assert 'train tokens/s (eager)' in out and 'avx2' in out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert set(result['models']) == {'gpt', 'grt_isoflop', 'grt_isoparam'}
    for m in result['models'].values():
        assert m['train_tokens_per_s'] > 0 and 'train_tokens_per_s_compiled' not in m


# -----------------------------------------------------------------------------
# peer

# nanoGPT's train.py as far as peer.py sees it: run in the copied checkout on the data peer.py wrote
# there, it prints nanoGPT's per-iteration lines, iteration i taking 10 + i ms.
FAKE_NANOGPT_TRAIN = textwrap.dedent('''
    import os, pickle, sys
    import numpy as np
    args = dict(a[2:].split('=', 1) for a in sys.argv[2:])
    assert sys.argv[1] == 'config/train_shakespeare_char.py' and os.path.isfile('configurator.py')
    assert (args['n_layer'], args['block_size'], args['batch_size'], args['dtype']) == ('4', '64', '12', 'float32')
    meta = pickle.load(open('data/shakespeare_char/meta.pkl', 'rb'))
    train = np.fromfile('data/shakespeare_char/train.bin', dtype=np.uint16)
    val = np.fromfile('data/shakespeare_char/val.bin', dtype=np.uint16)
    text = ''.join(meta['itos'][i] for i in np.concatenate([train, val]))
    assert text == open(os.environ['PEER_TEXT']).read() and meta['stoi'][meta['itos'][3]] == 3
    for i in range(int(args['max_iters']) + 1):
        print(f"iter {i}: loss 4.0000, time {10 + i:.2f}ms, mfu -100.00%")
''')


@pytest.fixture
def fake_nanogpt(tmp_path, monkeypatch):
    src = tmp_path / 'nanoGPT'
    os.makedirs(src / 'config')
    (src / 'train.py').write_text(FAKE_NANOGPT_TRAIN)
    for name in ('model.py', 'configurator.py', 'config/train_shakespeare_char.py'):
        (src / name).write_text('')
    text = tmp_path / 'input.txt'
    rng = np.random.default_rng(0)
    text.write_text(''.join(CHARS[i] for i in rng.integers(0, len(CHARS), 30_000)))
    monkeypatch.setenv('PEER_TEXT', str(text))
    return src, text


def test_peer_at_tiny_settings_gives_both_tables_and_the_json(fake_nanogpt, capsys):
    src, text = fake_nanogpt
    result = peer.main(['--iters=3', '--warmup=1', '--repeats=2', '--compile=False', '--dtype=float32',
                        f'--nanogpt={src}', f'--text={text}', '--runs=2', '--train_iters=12'])
    out = capsys.readouterr().out
    assert 'grt/gpt step' in out and 'avx512_bf16' in out and 'bf16 matrix products measured' in out
    assert 'ours/nanoGPT' in out
    assert result['bf16_speedup'] > 0
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert result['mode'] == 'peer' and set(result['cpu_flags']) <= set(bench.CPU_FLAGS)
    f = result['per_flop']
    assert f['iters'] == 3 and f['repeats'] == 2
    assert f['flops_per_token']['gpt'] == 4 * (24 * 128 ** 2 + 4 * 64 * 128)
    # GRT 1+1x3+1 at its mean training depth 2: 4 block passes, plus W_proj and the gate twice
    assert f['flops_per_token']['grt'] == f['flops_per_token']['gpt'] + 2 * 10 * 128 ** 2
    assert list(f['modes']) == ['float32 eager']
    m = f['modes']['float32 eager']
    assert len(m['gpt_ms_runs']) == len(m['grt_ms_runs']) == len(m['step_ratio_runs']) == 2
    assert m['gpt_ms'] > 0 and m['grt_ms'] > 0 and m['step_ratio'] > 0 and m['ratio_per_flop'] > 0
    assert m['ratio_per_flop'] == pytest.approx(m['step_ratio'] / f['flop_ratio'])
    assert m['step_ratio_spread'][0] <= m['step_ratio'] <= m['step_ratio_spread'][1]
    # against nanoGPT: the stand-in's iterations 2..12 took 12..22 ms, median 17; ours ran train.py for real
    n = result['nanogpt']
    assert [r['nanogpt'] for r in n['runs']] == [17.0, 17.0] and n['nanogpt_ms'] == 17.0
    assert all(r['ours'] > 0 and r['ratio'] == r['ours'] / 17.0 for r in n['runs'])
    assert n['ratio_of_medians'] == pytest.approx(n['ours_ms'] / 17.0)
    assert sorted(os.listdir(src)) == ['config', 'configurator.py', 'model.py', 'train.py']  # untouched


def test_peer_refuses_a_folder_that_is_not_nanogpt(tmp_path):
    with pytest.raises(SystemExit, match=r'^error: .* lacks train.py: pass --nanogpt=<a checkout'):
        peer.against_nanogpt(dict(peer.DEFAULTS, nanogpt=str(tmp_path)))


def test_ours_ms_reads_the_per_iteration_times_of_our_log(tmp_path):
    log = tmp_path / 'log.jsonl'
    times = np.cumsum([0.5] + [0.03 + 0.001 * i for i in range(1, 13)])  # iteration i took 30 + i ms
    log.write_text(''.join(json.dumps(dict(iter=i, time_s=round(t, 3))) + '\n' for i, t in enumerate(times)))
    assert peer.ours_ms(str(log), 12) == pytest.approx(37.0)  # iterations 2..12


def test_peer_times_bf16_only_where_it_is_faster(monkeypatch):
    c = dict(dtype='auto', compile=False)
    monkeypatch.setattr(peer, 'cpu_bf16_speedup', lambda: 2.5)
    assert peer.peer_modes(c, 'cpu') == [('float32', False), ('bfloat16', False)]
    monkeypatch.setattr(peer, 'cpu_bf16_speedup', lambda: 0.6)
    assert peer.peer_modes(c, 'cpu') == [('float32', False)]
    assert peer.peer_modes(dict(c, compile=True), 'cuda') == [(d, k) for d in ('float32', 'bfloat16')
                                                              for k in (False, True)]


# -----------------------------------------------------------------------------
# gpu_check


def test_recompile_count_sees_none_in_a_grt_trained_at_every_depth_and_one_for_a_new_shape():
    """A compiled GRT at r = 1..3 and in evaluation compiles several graphs and no recompile; a new batch
    size recompiles each of its 6 compiled functions (the block, the step, the step's resumptions after
    its graph breaks at the two noises and at the 2-block core, and the core's run_blocks), once for
    training, once for evaluation."""
    torch.compiler.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    model = build_model('grt', n_prelude=1, n_core=2, n_recur=3, n_coda=1, n_embd=32, n_head=2, block_size=16,
                        vocab_size=16)
    compile_regions(model, backend='eager')  # no codegen: fast

    def train_and_evaluate(batch_size):
        x = torch.randint(16, (batch_size, 16))
        model.train()
        for r in (1, 2, 3):
            model(x, x, num_steps=r)[1].backward()
        model.eval()
        with torch.no_grad():
            model(x, x)

    graphs = bench.compiled_graph_count()
    train_and_evaluate(2)
    assert gpu_check.recompile_count() == 0 and bench.compiled_graph_count() - graphs > 2
    train_and_evaluate(3)
    assert gpu_check.recompile_count() == 12


def test_recompile_count_counts_a_recompile_once_though_its_backward_logs_again():
    torch.compiler.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    f = torch.compile(lambda x: (x.sin() * 2).sum(), backend='aot_eager', dynamic=False)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # compiles 0, 1 and 2: one recompile
        f(torch.randn(3, dtype=dtype, requires_grad=True)).backward()
    assert gpu_check.recompile_count() == 1


def test_gpu_check_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(SystemExit, match='^error: needs a CUDA GPU'):
        gpu_check.main([])


def test_gpu_check_runs_tiny_on_cpu(capsys):
    """--tiny: both shipped configs train eager and compiled from the token file it writes (the GRT's
    several compiled graphs are no recompile), bench.py runs, and the summary's figures are there."""
    result = gpu_check.main(['--tiny=True'])
    out = capsys.readouterr().out
    assert 'grt dense step compiled' in out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert set(result['train']) == {f'{config} {mode}' for config in ('gpt2_small', 'grt_small')
                                    for mode in ('eager', 'compiled')}
    for run in result['train'].values():
        assert run['tokens_per_s'] > 0 and run['val_loss'] > 0 and run['peak_mem_bytes'] is None  # CPU
        assert run['recompiles'] == 0
    assert result['train']['gpt2_small eager']['graphs_compiled'] == 0
    assert result['train']['grt_small compiled']['graphs_compiled'] > 2
    ratios = result['ratios']
    assert ratios['grt_dense_step_eager'] > 0 and ratios['grt_small_compiled_over_eager'] > 0
    assert 'grt_dense_per_flop_eager' not in ratios  # MFUs against two runs' own measured CPU peaks
    assert result['bench']['scale'] == 'tiny'


# -----------------------------------------------------------------------------
# exit_sweep


def test_exit_sweep_table_json_and_plot(tmp_path, capsys, monkeypatch):
    data_dir = tmp_path / 'data'
    os.makedirs(data_dir / 'chars')
    prepare_data.write_tokens(str(data_dir / 'chars' / 'val.bin'),
                              np.random.default_rng(0).integers(0, len(CHARS), 5000))
    out_dir = save_checkpoint(str(tmp_path / 'out'), tiny_model('grt'), 'grt',
                              config=dict(data_dir=str(data_dir), dataset='chars'))
    monkeypatch.setattr(exit_sweep, 'SWEEP', {'state': (0.0, 1e9), 'kl': (0.0,)})
    monkeypatch.setattr(exit_sweep, 'WINDOWS', 8)
    monkeypatch.setattr(exit_sweep, 'TIMED_WINDOWS', 1)
    monkeypatch.setattr(exit_sweep, 'TIMING_ROUNDS', 1)
    plot = tmp_path / 'exit.png'
    result = exit_sweep.main([f'--out_dir={out_dir}', '--device=cpu', '--dtype=float32', '--prompt_len=56',
                              f'--plot={plot}'])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert 'goal (>= 30% fewer steps' in out and 'state < 0' in out
    points = {(p['exit'], p['threshold'], p['num_steps']): p for p in result['points']}
    R = result['R']
    assert [points[(None, None, r)]['mean_steps'] for r in range(1, R + 1)] == list(range(1, R + 1))
    full, one = points[(None, None, R)], points[(None, None, 1)]
    never, always = points[('state', 0.0, None)], points[('state', 1e9, None)]
    assert never['loss'] == full['loss'] and never['mean_steps'] == R and never['steps_run_b8'] == R
    assert always['mean_steps'] == 1 and always['steps_run_b8'] == 1 and always['mean_steps_b1'] == 1
    assert math.isclose(always['loss'], one['loss'], rel_tol=1e-5)
    kl = points[('kl', 0.0, None)]
    assert math.isclose(kl['loss'], full['loss'], rel_tol=1e-5) and kl['probes_b8'] == R  # p_0 .. p_(R-1)
    if importlib.util.find_spec('matplotlib'):
        assert plot.stat().st_size > 0
    else:
        assert 'the plot needs matplotlib' in out
    with pytest.raises(SystemExit, match='exit sweep measures a trained model'):
        exit_sweep.main(['--device=cpu'])


def test_exit_sweep_refuses_a_dense_model(tmp_path):
    out_dir = save_checkpoint(str(tmp_path / 'out'), tiny_model('gpt'), 'gpt')
    with pytest.raises(SystemExit, match='^error: '):
        exit_sweep.main([f'--out_dir={out_dir}', '--device=cpu', '--dtype=float32'])
