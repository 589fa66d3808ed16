"""
Tests for train.py on tiny generated data: losses fall, resume is exact, DDP (gloo, 2 processes)
matches a single process, bad configs and checkpoints are refused, interrupts and NaNs lose nothing.
Most runs call train.main(argv) in-process; torchrun and Ctrl-C run as subprocesses.
"""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from config import parse_config
from model import build_model
from prepare_data import write_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 16


@pytest.fixture(scope='module')
def data_root(tmp_path_factory):
    """data/tiny/: a Markov chain that mostly steps next = (3 * prev + 1) % 16, so it is learnable."""
    root = tmp_path_factory.mktemp('data')
    rng = np.random.default_rng(0)
    tokens = np.zeros(40_000, dtype=np.int64)
    for i in range(1, len(tokens)):
        tokens[i] = (3 * tokens[i - 1] + 1) % VOCAB if rng.random() < 0.9 else rng.integers(VOCAB)
    os.makedirs(root / 'tiny')
    write_tokens(str(root / 'tiny' / 'train.bin'), tokens[:36_000])
    write_tokens(str(root / 'tiny' / 'val.bin'), tokens[36_000:])
    chars = 'abcdefghijklmnop'
    with open(root / 'tiny' / 'meta.json', 'w') as f:
        json.dump({'tokenizer': 'char', 'vocab_size': VOCAB, 'chars': chars}, f)
    return str(root)


def tiny_args(data_root, out_dir, model='gpt', **overrides):
    """A tiny model and run: fp32, no compile, log every iteration, fixed peak FLOPs (no measuring)."""
    args = dict(data_dir=data_root, dataset='tiny', out_dir=str(out_dir), block_size=16, batch_size=4,
                gradient_accumulation_steps=1, n_embd=32, n_head=2, max_iters=8, eval_interval=4,
                eval_iters=2, log_interval=1, learning_rate=3e-3, warmup_iters=2, lr_decay_iters=0,
                min_lr=3e-4, compile=False, dtype='float32', device='cpu', peak_flops=1e12, dropout=0.0)
    if model == 'gpt':
        args.update(model_type='gpt', n_layer=2)
    else:
        args.update(model_type='grt', n_prelude=1, n_core=1, n_coda=1, n_recur=3)
    args.update(overrides)
    return [f'--{k}={v}' for k, v in args.items()]


def read_log(out_dir):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [json.loads(line) for line in f]


def without_timing(rows):
    return [{k: v for k, v in row.items() if k not in ('time_s', 'mfu')} for row in rows]


def run_error(argv):
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    return str(e.value.code)


# -----------------------------------------------------------------------------


@pytest.mark.parametrize('model', ['gpt', 'grt'])
def test_training_lowers_the_loss(data_root, tmp_path, model):
    result = train.main(tiny_args(data_root, tmp_path, model, max_iters=40, eval_interval=40))
    rows = read_log(tmp_path)
    assert [r['iter'] for r in rows] == list(range(1, 41))
    assert rows[0]['loss'] > 0.9 * math.log(VOCAB)  # a fresh model is near uniform
    assert result['val_loss'] < 0.7 * rows[0]['loss']
    assert np.mean([r['loss'] for r in rows[-5:]]) < 0.7 * rows[0]['loss']
    assert rows[-1]['tokens'] == 40 * 4 * 16
    if model == 'grt':  # every micro-step draws r from 1..R, and all of them occur
        assert {r['r'] for r in rows} == {1, 2, 3}
    else:
        assert all(r['r'] is None for r in rows)
    checkpoint = torch.load(os.path.join(tmp_path, 'ckpt.pt'), weights_only=False)
    assert checkpoint['iter_num'] == 40 and checkpoint['model_type'] == model
    assert {'model_args', 'model', 'optimizer', 'scaler', 'best_val_loss', 'config', 'meta',
            'rng_states'} <= set(checkpoint)
    assert set(checkpoint['rng_states']) >= {'torch', 'numpy', 'python', 'data', 'depth'}
    assert checkpoint['meta']['chars'] == 'abcdefghijklmnop'
    assert not any(k.startswith('_orig_mod.') for k in checkpoint['model'])
    assert checkpoint['model_args']['vocab_size'] == VOCAB  # from meta.json


def test_resume_repeats_the_uninterrupted_run_exactly(data_root, tmp_path):
    """GRT with dropout and both noises on and 2 micro-steps: every random draw is covered."""
    common = dict(max_iters=12, lr_decay_iters=12, eval_interval=6, gradient_accumulation_steps=2, dropout=0.1)
    train.main(tiny_args(data_root, tmp_path / 'full', 'grt', **common))
    train.main(tiny_args(data_root, tmp_path / 'split', 'grt', **{**common, 'max_iters': 6}))
    assert read_log(tmp_path / 'split')[-1]['iter'] == 6
    train.main(tiny_args(data_root, tmp_path / 'split', 'grt', **common, init_from='resume'))
    full, split = read_log(tmp_path / 'full'), read_log(tmp_path / 'split')
    assert [r['iter'] for r in split] == list(range(1, 13))  # no duplicated lines
    assert without_timing(split) == without_timing(full)
    a = torch.load(tmp_path / 'full' / 'ckpt.pt', weights_only=False)['model']
    b = torch.load(tmp_path / 'split' / 'ckpt.pt', weights_only=False)['model']
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_evaluation_does_not_shift_the_training_stream(data_root, tmp_path):
    train.main(tiny_args(data_root, tmp_path / 'often', 'grt', eval_interval=1))
    train.main(tiny_args(data_root, tmp_path / 'rarely', 'grt', eval_interval=100))
    often, rarely = read_log(tmp_path / 'often'), read_log(tmp_path / 'rarely')
    assert all('val_loss' in r for r in often)
    assert [r['loss'] for r in often] == [r['loss'] for r in rarely]


def test_two_process_gloo_run_matches_one_process(data_root, tmp_path):
    """torchrun with 2 CPU processes and 1 micro-step each must equal 1 process with 2 micro-steps: each
    rank reads its own batch (the other process's micro-step) and gradients are averaged once."""
    args = tiny_args(data_root, tmp_path / 'ddp', 'gpt', gradient_accumulation_steps=2, max_iters=4, eval_interval=4)
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           'train.py', *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '2 process(es)' in proc.stdout
    checkpoint = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=False)
    assert checkpoint['iter_num'] == 4
    train.main(tiny_args(data_root, tmp_path / 'single', 'gpt', gradient_accumulation_steps=2, max_iters=4, eval_interval=4))
    ddp, single = read_log(tmp_path / 'ddp'), read_log(tmp_path / 'single')
    assert [r['tokens'] for r in ddp] == [r['tokens'] for r in single]
    np.testing.assert_allclose([r['loss'] for r in ddp], [r['loss'] for r in single], rtol=1e-5)
    np.testing.assert_allclose(ddp[-1]['val_loss'], single[-1]['val_loss'], rtol=1e-5)


def test_ctrl_c_saves_and_resume_rewrites_the_log(data_root, tmp_path):
    args = tiny_args(data_root, tmp_path, 'gpt', max_iters=100000, lr_decay_iters=100, eval_interval=100000)
    proc = subprocess.Popen([sys.executable, 'train.py', *args], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    log_path = tmp_path / 'log.jsonl'
    deadline = time.time() + 120
    while time.time() < deadline and not (log_path.exists() and log_path.read_text().count('\n') >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-2000:]
    assert 'continue with --init_from=resume' in out
    saved = torch.load(tmp_path / 'ckpt.pt', weights_only=False)['iter_num']
    assert saved >= 3
    # The log may hold lines up to the interrupt; resuming cuts it back to the checkpoint and continues.
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=saved + 3, lr_decay_iters=100,
                         eval_interval=100000, init_from='resume'))
    assert [r['iter'] for r in read_log(tmp_path)] == list(range(1, saved + 4))
    assert not glob.glob(str(tmp_path / '*.tmp'))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(data_root, tmp_path):
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=2, eval_interval=2))
    before = (tmp_path / 'ckpt.pt').read_bytes()
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', max_iters=6, eval_interval=2, init_from='resume',
                                  learning_rate=1e38, decay_lr=False))
    assert 'loss is nan' in message or 'loss is inf' in message
    assert 'last good checkpoint' in message
    assert (tmp_path / 'ckpt.pt').read_bytes() == before


def test_bad_config_and_mismatched_checkpoint_are_refused(data_root, tmp_path):
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_layr=3))
    assert "unknown config key 'n_layr'" in message and 'n_layer' in message
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_layer="'two'"))
    assert "'n_layer' must be int" in message
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_recur=4))
    assert 'n_recur' in message and "model_type 'gpt'" in message
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=1, eval_interval=1))
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_layer=3, n_embd=48, init_from='resume'))
    assert 'n_layer (checkpoint 2, config 3)' in message and 'n_embd (checkpoint 32, config 48)' in message
    message = run_error(tiny_args(data_root, tmp_path, 'grt', init_from='resume'))
    assert "model_type (checkpoint 'gpt', config 'grt')" in message


def test_missing_data(data_root, tmp_path):
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', dataset='fineweb10B'))
    assert 'python prepare_data.py fineweb10B' in message
    # shakespeare_char is prepared on the spot (here from a local input.txt instead of the network)
    root = tmp_path / 'data'
    os.makedirs(root / 'shakespeare_char')
    (root / 'shakespeare_char' / 'input.txt').write_text('First Citizen:\nBefore we proceed any further.\n' * 200)
    result = train.main(tiny_args(str(root), tmp_path / 'out', 'gpt', dataset='shakespeare_char',
                                  max_iters=1, eval_interval=1))
    assert result['iter_num'] == 1 and (root / 'shakespeare_char' / 'meta.json').exists()


def test_checkpoint_write_is_atomic(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    train.save_checkpoint(path, {'iter_num': 1})
    with pytest.raises(Exception):
        train.save_checkpoint(path, {'iter_num': 2, 'bad': lambda: 0})  # cannot be pickled mid-write
    assert torch.load(path, weights_only=False) == {'iter_num': 1}
    assert os.listdir(tmp_path) == ['ckpt.pt']


def test_log_truncation_keeps_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / 'log.jsonl'
    path.write_text(''.join(json.dumps({'iter': i, 'loss': 1.0}) + '\n' for i in range(1, 6)) + '{"iter": 6, "lo')
    train.truncate_log(str(path), 3)
    assert [json.loads(line)['iter'] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_learning_rate_schedule():
    c = dict(decay_lr=True, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert train.get_lr(0, c) == pytest.approx(1 / 11)
    assert train.get_lr(10, c) == pytest.approx(1.0)
    assert train.get_lr(60, c) == pytest.approx(0.55)  # halfway through the cosine
    assert train.get_lr(110, c) == train.get_lr(150, c) == 0.1


PAPER_CONFIGS = ['gpt2_small', 'gpt2_medium', 'gpt2_large', 'grt_small', 'grt_medium', 'grt_large',
                 'grt_small_isoparam', 'grt_medium_isoparam', 'grt_large_isoparam']


@pytest.mark.parametrize('name', PAPER_CONFIGS + ['shakespeare_char_gpt', 'shakespeare_char_grt'])
def test_config_files_parse_and_build(name):
    c = parse_config(train.DEFAULTS, [os.path.join(HERE, 'config', f'{name}.py')])
    vocab = 50257 if name in PAPER_CONFIGS else 65
    model_type, args = train.requested_model(c, {'vocab_size': vocab})
    with torch.device('meta'):  # shapes only: no memory, no init time
        model = _build((model_type, args))
    assert model.config.vocab_size >= vocab
    if name in PAPER_CONFIGS:
        tokens = c['batch_size'] * c['block_size'] * c['gradient_accumulation_steps']
        assert 480_000 <= tokens <= 540_000 and c['block_size'] == 1024 and c['dtype'] == 'bfloat16'


@pytest.mark.parametrize('dense, recurrent', [('gpt2_small', 'grt_small'), ('gpt2_medium', 'grt_medium'),
                                              ('gpt2_large', 'grt_large')])
def test_isoflop_twins_pass_through_as_many_blocks(dense, recurrent):
    """The paper's isoFLOP layouts: p + c x R + k block passes at eval depth R = the dense layer count
    (the gate and W_proj add 10 R d^2 on top), same width."""
    def model(name):
        c = parse_config(train.DEFAULTS, [os.path.join(HERE, 'config', f'{name}.py')])
        with torch.device('meta'):
            return _build(train.requested_model(c, {'vocab_size': 50257}))
    gpt, grt = model(dense), model(recurrent)
    assert grt.num_block_passes(grt.config.n_recur) == gpt.config.n_layer
    assert grt.config.n_embd == gpt.config.n_embd


def test_shakespeare_configs_match_in_training_flops():
    models = []
    for name in ('shakespeare_char_gpt', 'shakespeare_char_grt'):
        c = parse_config(train.DEFAULTS, [os.path.join(HERE, 'config', f'{name}.py')])
        models.append((_build(train.requested_model(c, {'vocab_size': 65})), c['block_size']))
    (gpt, s), (grt, _) = models
    assert grt.flops_per_token(s, grt.mean_train_steps()) == pytest.approx(gpt.flops_per_token(s), rel=0.02)


def _build(requested):
    model_type, args = requested
    return build_model(model_type or 'gpt', **args)
