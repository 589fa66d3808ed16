"""
Tests for train.py on tiny generated data: losses fall, resume is exact, DDP (gloo, 2 processes)
matches a single process, bad configs and checkpoints are refused, interrupts and NaNs lose nothing,
ckpt.pt and best.pt each mean one thing, the run says what it is doing, a depth task trains, and the
start-up helpers (CPU peak, MFU, dtype warning, compile='auto') hold. Most runs call
train.main(argv) in-process; torchrun and Ctrl-C run as subprocesses. No test depends on how fast
the machine is.
"""

import fcntl
import glob
import json
import math
import os
import platform
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
import torch

import common
import prepare_data
import train
from conftest import HERE, tiny_hf_gpt2
from model import GRT
from prepare_data import write_tokens
from registry import build_model
from experiments.depth_tasks import task_batches

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
    message = str(e.value.code)
    assert message.startswith('error: ') and '\n' not in message, message  # every error: one line
    return message


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
    assert set(checkpoint) == {'model_type', 'model_args', 'model', 'optimizer', 'scaler', 'iter_num',
                               'best_val_loss', 'config', 'meta', 'tokens', 'time_s', 'threads'}  # no RNG state: draws are keyed
    assert checkpoint['threads'] == torch.get_num_threads() == 1  # a resumed CPU run takes as many
    assert checkpoint['meta']['chars'] == 'abcdefghijklmnop'
    assert not any(k.startswith('_orig_mod.') for k in checkpoint['model'])
    assert checkpoint['model_args']['vocab_size'] == VOCAB  # from meta.json
    best = torch.load(os.path.join(tmp_path, 'best.pt'), weights_only=False)
    assert set(best) == {'model_type', 'model_args', 'model', 'meta', 'config', 'iter_num', 'val_loss'}
    assert best['iter_num'] == 40 and best['val_loss'] == result['val_loss'] == result['best_val_loss']
    assert all(torch.equal(best['model'][k], checkpoint['model'][k]) for k in checkpoint['model'])


def test_resume_repeats_the_uninterrupted_run_exactly(data_root, tmp_path):
    """GRT with dropout, both noises on (the gate noise ramping) and 2 micro-steps: every random draw is covered."""
    common = dict(max_iters=12, lr_decay_iters=12, eval_interval=6, gradient_accumulation_steps=2, dropout=0.1,
                  final_gate_noise=0.5)
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


def test_the_gate_noise_ramps_linearly_to_final_gate_noise(data_root, tmp_path, monkeypatch):
    """eps_g's std in each training step: gate_noise at iteration 0, + (final - start) * it / max_iters after."""
    stds = []
    noise = GRT.noise

    def recording_noise(self, like, std):
        if self.training and std != self.config.state_noise:
            stds.append(std)
        return noise(self, like, std)

    monkeypatch.setattr(GRT, 'noise', recording_noise)
    train.main(tiny_args(data_root, tmp_path, 'grt', max_iters=4, eval_interval=4, gate_noise=1.0,
                         final_gate_noise=2.0, state_noise=0.0, train_depth="'fixed'"))
    assert stds == [1.0] * 3 + [1.25] * 3 + [1.5] * 3 + [1.75] * 3  # r = 3 steps an iteration
    saved = torch.load(tmp_path / 'ckpt.pt', weights_only=False)['model_args']
    assert saved['gate_noise'] == 1.0  # where the ramp starts, so resume rebuilds the same run
    assert [train.get_gate_noise(it, dict(final_gate_noise=0.0, lr_decay_iters=10, max_iters=20), 0.5)
            for it in (0, 5, 10, 15)] == [0.5, 0.25, 0.0, 0.0]  # over lr_decay_iters, then held


def test_init_from_gpt2_fine_tunes_gpt2s_weights_and_resumes_exactly(data_root, tmp_path, monkeypatch):
    """--init_from=gpt2 starts from Hugging Face's GPT-2 (here a tiny random one saved as ./gpt2, which
    transformers finds before the hub, offline): the first logged loss is HF's own loss on the run's
    first batch, and a run stopped at 2 and resumed repeats the uninterrupted one."""
    hf = tiny_hf_gpt2(tmp_path / 'gpt2')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    run = dict(data_dir=data_root, dataset='tiny', init_from='gpt2', block_size=16, batch_size=4,
               gradient_accumulation_steps=1, max_iters=4, eval_interval=2, eval_iters=2, log_interval=1,
               learning_rate=1e-3, warmup_iters=1, compile=False, dtype='float32', device='cpu', peak_flops=1e12)
    argv = lambda out, **over: [f'--{k}={v}' for k, v in {**run, 'out_dir': tmp_path / out, **over}.items()]
    result = train.main(argv('full'))
    train.main(argv('split', max_iters=2))
    train.main(argv('split', init_from='resume'))
    full, split = read_log(tmp_path / 'full'), read_log(tmp_path / 'split')
    assert result['iter_num'] == 4 and all(math.isfinite(r['loss']) for r in full)
    assert without_timing(split) == without_timing(full)
    x, y = common.Batches([prepare_data.read_tokens(f) for f in prepare_data.token_files(os.path.join(data_root, 'tiny'), 'train')],
                          16, 4, 'cpu').get(
        torch.Generator().manual_seed(common.rng_key(1337, 'data', 0, 0)))
    with torch.no_grad():
        hf_loss = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert full[0]['loss'] == pytest.approx(hf_loss, rel=1e-5)
    args = torch.load(tmp_path / 'full' / 'ckpt.pt', weights_only=False)['model_args']
    assert args['vocab_size'] == 50257 and args['block_size'] == 64 and args['gelu_approximate'] == 'tanh'


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores for share_cores to pick 2 threads")
def test_resume_on_a_busier_machine_continues_bit_exact(data_root, tmp_path, monkeypatch, capsys):
    """share_cores gives a fresh run torch's threads by the load it sees; a resumed run takes its
    checkpoint's count instead. The run trains on 2 threads (a quiet machine) and resumes while other
    work keeps a core busy, where share_cores would pick 1: it repeats the uninterrupted run exactly,
    while a run on 1 thread, at this width, gives other losses."""
    busy = {'cores': 0.0}
    monkeypatch.delenv('OMP_NUM_THREADS')
    monkeypatch.setattr(common, 'others_busy', lambda since: busy['cores'])
    run = dict(n_embd=128, n_head=4, block_size=64, max_iters=6, lr_decay_iters=6, eval_interval=3)

    def main(out, **overrides):
        torch.set_num_threads(2)  # torch's default on 2 cores: share_cores gives at most as many
        try:
            train.main(tiny_args(data_root, tmp_path / out, 'grt', **{**run, **overrides}))
        finally:
            torch.set_num_threads(1)
    main('full')
    main('split', max_iters=3)
    busy['cores'] = 1.0
    main('one')
    capsys.readouterr()
    main('split', init_from='resume')
    assert "resuming on 2 thread(s), the count the checkpoint trained on" in capsys.readouterr().err
    full, split, one = (without_timing(read_log(tmp_path / out)) for out in ('full', 'split', 'one'))
    assert split == full
    assert one != full and torch.load(tmp_path / 'one' / 'ckpt.pt', weights_only=False)['threads'] == 1


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
                           'train.py', *args], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '2 process(es)' in proc.stdout
    checkpoint = torch.load(tmp_path / 'ddp' / 'ckpt.pt', weights_only=False)
    assert checkpoint['iter_num'] == 4
    train.main(tiny_args(data_root, tmp_path / 'single', 'gpt', gradient_accumulation_steps=2, max_iters=4, eval_interval=4))
    ddp, single = read_log(tmp_path / 'ddp'), read_log(tmp_path / 'single')
    assert [r['tokens'] for r in ddp] == [r['tokens'] for r in single]
    np.testing.assert_allclose([r['loss'] for r in ddp], [r['loss'] for r in single], rtol=1e-5)
    np.testing.assert_allclose(ddp[-1]['val_loss'], single[-1]['val_loss'], rtol=1e-5)


def start_training_until_logged(command, out_dir, **popen_kwargs):
    """Start a training command (train.py, or torchrun running it) and return it once out_dir's
    log.jsonl holds 3 lines, still running."""
    proc = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, 'OMP_NUM_THREADS': '1'},
                            # a shell that started pytest in the background ignores SIGINT, and its children
                            # inherit that: give train.py Ctrl-C back, as a terminal would
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen_kwargs)
    log_path = out_dir / 'log.jsonl'
    deadline = time.time() + 600  # only against a hang: a loaded machine may take minutes
    while proc.poll() is None and time.time() < deadline and not (
            log_path.exists() and log_path.read_text().count('\n') >= 3):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-2000:]
    return proc


def test_ctrl_c_saves_and_resume_rewrites_the_log(data_root, tmp_path):
    args = tiny_args(data_root, tmp_path, 'gpt', max_iters=100000, lr_decay_iters=100, eval_interval=100000)
    proc = start_training_until_logged([sys.executable, 'train.py', *args], tmp_path)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out[-2000:]
    assert 'continue with --init_from=resume' in out
    saved = torch.load(tmp_path / 'ckpt.pt', weights_only=False)['iter_num']
    assert saved >= 3
    # The log may hold lines up to the interrupt; resuming cuts it back to the checkpoint and continues.
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=saved + 3, lr_decay_iters=100,
                         eval_interval=100000, init_from='resume'))
    assert [r['iter'] for r in read_log(tmp_path)] == list(range(1, saved + 4))
    assert not glob.glob(str(tmp_path / '*.tmp'))


def test_ctrl_c_under_torchrun_stops_every_rank_at_one_iteration_and_saves(data_root, tmp_path):
    """Ctrl-C in a terminal reaches torchrun and both workers (one process group), and torchrun passes
    it on again: the ranks agree on one iteration to stop at, rank 0 saves, and nobody hangs in an
    all-reduce the other rank has left."""
    args = tiny_args(data_root, tmp_path, 'gpt', gradient_accumulation_steps=2, max_iters=100000,
                     lr_decay_iters=100, eval_interval=100000)
    proc = start_training_until_logged([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                        '--nproc_per_node=2', 'train.py', *args], tmp_path, start_new_session=True)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"torchrun did not stop after Ctrl-C: {proc.communicate()[0][-2000:]}")
    assert 'continue with --init_from=resume' in out, out[-2000:]
    saved = torch.load(tmp_path / 'ckpt.pt', weights_only=False)['iter_num']
    assert saved >= 3 and read_log(tmp_path)[-1]['iter'] == saved  # weights and log at one iteration


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
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', always_save_checkpoint=True))
    assert "unknown config key 'always_save_checkpoint'" in message  # ckpt.pt is written at every evaluation
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', compile='sometimes'))
    assert "compile must be True, False or 'auto'" in message
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', final_gate_noise=1.0))
    assert "a gpt has none" in message
    message = run_error(tiny_args(data_root, tmp_path, 'grt', final_gate_noise=1.0, compile=True))
    assert 'recompiles' in message and '--compile=False' in message
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=1, eval_interval=1))
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_layer=3, n_embd=48, init_from='resume'))
    assert 'n_layer (checkpoint 2, config 3)' in message and 'n_embd (checkpoint 32, config 48)' in message
    message = run_error(tiny_args(data_root, tmp_path, 'grt', init_from='resume'))
    assert "model_type (checkpoint 'gpt', config 'grt')" in message


def test_a_new_run_never_overwrites_another(data_root, tmp_path):
    """A new run into an out_dir that holds ckpt.pt or best.pt is refused, the files untouched, unless
    --overwrite=True; evaluating a fresh model there writes nothing and is allowed."""
    train.main(tiny_args(data_root, tmp_path, 'gpt', max_iters=2, eval_interval=2))
    before = {name: (tmp_path / name).read_bytes() for name in ('ckpt.pt', 'best.pt', 'log.jsonl')}
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', n_embd=48))
    assert message == (f"error: {tmp_path} holds a run (ckpt.pt and best.pt): continue it with --init_from=resume, "
                       f"pick another --out_dir, or replace it with --overwrite=True")
    os.remove(tmp_path / 'ckpt.pt')
    before.pop('ckpt.pt')
    assert 'holds a run (best.pt)' in run_error(tiny_args(data_root, tmp_path, 'gpt', n_embd=48))
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert train.main(tiny_args(data_root, tmp_path, 'gpt', eval_only=True))['iter_num'] == 0
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    train.main(tiny_args(data_root, tmp_path, 'gpt', n_embd=48, max_iters=3, eval_interval=3, overwrite=True))
    for name in ('ckpt.pt', 'best.pt'):
        checkpoint = torch.load(tmp_path / name, weights_only=False)
        assert checkpoint['model_args']['n_embd'] == 48 and checkpoint['iter_num'] == 3
    assert [r['iter'] for r in read_log(tmp_path)] == [1, 2, 3]


def test_missing_data(data_root, tmp_path, capsys):
    message = run_error(tiny_args(data_root, tmp_path, 'gpt', dataset='fineweb10B'))
    assert 'python prepare_data.py fineweb10B' in message
    # shakespeare_char is prepared on the spot, here from the input.txt placed there, and says so
    root = tmp_path / 'data'
    os.makedirs(root / 'shakespeare_char')
    (root / 'shakespeare_char' / 'input.txt').write_text('First Citizen:\nBefore we proceed any further.\n' * 200)
    result = train.main(tiny_args(str(root), tmp_path / 'out', 'gpt', dataset='shakespeare_char',
                                  max_iters=1, eval_interval=1))
    assert result['iter_num'] == 1 and (root / 'shakespeare_char' / 'meta.json').exists()
    out = capsys.readouterr().out
    assert f"preparing {root / 'shakespeare_char'} from {root / 'shakespeare_char' / 'input.txt'}\n" in out
    assert 'is missing' not in out and 'downloading' not in out


def test_a_depth_task_trains_on_its_own_batches(tmp_path):
    """dataset='task:NAME' draws from experiments/depth_tasks.py (no token files): the first logged loss
    is the fresh model's loss on the task batch keyed (seed, 'data', 0, 0), whose y is -1 off the answers."""
    args = tiny_args('no-data-here', tmp_path, 'grt', dataset='task:pointer', difficulty=2, block_size=48,
                     max_iters=2, eval_interval=2)
    result = train.main(args)
    source, _ = task_batches('pointer', 48, 4, 'cpu', 1337, 2)
    torch.manual_seed(1337)
    model = build_model('grt', n_prelude=1, n_core=1, n_coda=1, n_recur=3, n_embd=32, n_head=2, dropout=0.0,
                        block_size=48, vocab_size=source.vocab_size)
    x, y = source.get(torch.Generator().manual_seed(common.rng_key(1337, 'data', 0, 0)))
    r = model.sample_depth(torch.Generator().manual_seed(common.rng_key(1337, 'depth', 0, 0)))
    torch.manual_seed(common.rng_key(1337, 'noise', 0, 0, 0))
    _, loss = model(x, y, num_steps=r)
    rows = read_log(tmp_path)
    assert (y == -1).any() and (y >= 0).any()
    assert rows[0]['r'] == r and rows[0]['loss'] == pytest.approx(loss.item(), rel=1e-6)
    checkpoint = torch.load(tmp_path / 'ckpt.pt', weights_only=False)
    assert checkpoint['meta'] == {'task': 'task:pointer', 'vocab_size': source.vocab_size}
    assert result['iter_num'] == 2 and math.isfinite(result['val_loss'])


def test_checkpoint_write_is_atomic(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    common.save_checkpoint(path, {'iter_num': 1})
    with pytest.raises(Exception):
        common.save_checkpoint(path, {'iter_num': 2, 'bad': lambda: 0})  # cannot be pickled mid-write
    assert torch.load(path, weights_only=False) == {'iter_num': 1}
    assert os.listdir(tmp_path) == ['ckpt.pt']


def test_log_truncation_keeps_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / 'log.jsonl'
    path.write_text(''.join(json.dumps({'iter': i, 'loss': 1.0}) + '\n' for i in range(1, 6)) + '{"iter": 6, "lo')
    common.truncate_log(str(path), 3)
    assert [json.loads(line)['iter'] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_learning_rate_schedule():
    c = dict(decay_lr=True, learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert train.get_lr(0, c) == pytest.approx(1 / 11)
    assert train.get_lr(10, c) == pytest.approx(1.0)
    assert train.get_lr(60, c) == pytest.approx(0.55)  # halfway through the cosine
    assert train.get_lr(110, c) == train.get_lr(150, c) == 0.1


def test_ckpt_is_the_latest_state_and_best_the_best_weights(data_root, tmp_path, monkeypatch):
    """With learning rate 0 the val loss never improves after the first evaluation: best.pt is written
    once, ckpt.pt at every evaluation (and at max_iters), and resume reads ckpt.pt."""
    saved = []
    real_save = train.save_checkpoint
    def save(path, checkpoint):
        saved.append((os.path.basename(path), checkpoint['iter_num']))
        real_save(path, checkpoint)
    monkeypatch.setattr(train, 'save_checkpoint', save)
    args = dict(max_iters=12, eval_interval=4, learning_rate=0.0, min_lr=0.0)
    train.main(tiny_args(data_root, tmp_path, 'gpt', **args))
    assert saved == [('best.pt', 4), ('ckpt.pt', 4), ('ckpt.pt', 8), ('ckpt.pt', 12)]
    best = torch.load(tmp_path / 'best.pt', weights_only=False)
    assert best['iter_num'] == 4 and 'optimizer' not in best
    assert best['val_loss'] == torch.load(tmp_path / 'ckpt.pt', weights_only=False)['best_val_loss']
    os.remove(tmp_path / 'best.pt')  # resume needs only ckpt.pt
    result = train.main(tiny_args(data_root, tmp_path, 'gpt', **{**args, 'max_iters': 16}, init_from='resume'))
    assert result['iter_num'] == 16 and saved[-1] == ('ckpt.pt', 16)


def test_the_run_says_what_it_does_and_prints_the_result_once(data_root, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: True)  # the bars a terminal shows
    train.main(tiny_args(data_root, tmp_path, 'grt', compile='auto', eval_iters=3))
    out, err = capsys.readouterr()
    assert "compile='auto': off on cpu" in out and 'compile=False' in out
    assert 'GB' not in out  # the GPU memory estimate is benchmarks/memory.py's
    assert out.count('iter 4: train loss') == 1 and out.count('iter 8: train loss') == 1
    assert out.index('iter 4: train loss') < out.index('iter 8: train loss') < out.index('done:')
    assert out.count('done:') == 1 and str(tmp_path / 'best.pt') in out.splitlines()[-1]
    # no silent evaluation on a terminal: a counter per split (3 batches each, shown as each split begins), and saving
    assert err.count('evaluating train:   0%') == 2 and err.count('evaluating val:  50%') == 2, err
    assert err.count('/6 [') >= 4 and err.count(f"saving {tmp_path / 'best.pt'} and {tmp_path / 'ckpt.pt'}") == 2


def bar_rates(text):
    """(iterations, it/s) of each redraw of the training bar in text."""
    found = re.findall(r"train: +\d+%\|[^|]*\| *(\d+)/\d+ \[[^,]*, +([\d.]+)(it/s|s/it)", text)
    return [(int(n), float(rate) if unit == 'it/s' else 1 / float(rate)) for n, rate, unit in found]


def test_on_a_terminal_the_eta_counts_iterations_not_evaluations(data_root, tmp_path):
    """A real terminal (a pty): the bar's rate right after a long evaluation (2 x 1,000 batches) is the
    iterations' rate, as before it. tqdm's own would count the evaluation as the next iterations' time,
    and its ETA jump (4x on 2 x 400 batches)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack('HHHH', 24, 200, 0, 0))  # 200 columns
    args = tiny_args(data_root, tmp_path, 'gpt', max_iters=150, eval_interval=100, eval_iters=1000)
    proc = subprocess.Popen([sys.executable, 'train.py', *args], cwd=HERE, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the run has ended and closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=600) == 0
    text = b''.join(chunks).decode(errors='replace')
    assert 'evaluating train:' in text and 'evaluating val:' in text  # a terminal shows the evaluation's bar
    rates = bar_rates(text)
    before = [rate for n, rate in rates if 10 <= n < 100]
    after = [rate for n, rate in rates if 100 < n < 150]
    assert before and after, text[-3000:]
    assert after[0] > 0.4 * before[-1], rates


def test_written_to_a_file_the_output_is_plain_lines(data_root, tmp_path):
    """stderr to a file: no evaluation bar and no escape codes or carriage returns, only a few whole lines
    (the bar at each save and at the end; every 30 s in a longer run)."""
    args = tiny_args(data_root, tmp_path / 'out', 'grt', max_iters=12, eval_interval=4)
    with open(tmp_path / 'stderr.txt', 'w') as err:
        proc = subprocess.run([sys.executable, 'train.py', *args], cwd=HERE, stdout=subprocess.PIPE, stderr=err,
                              text=True, timeout=600)
    assert proc.returncode == 0, (tmp_path / 'stderr.txt').read_text()[-2000:]
    text = (tmp_path / 'stderr.txt').read_text()
    assert '\x1b' not in text and '\r' not in text and 'evaluating' not in text, repr(text)
    lines = text.splitlines()
    saves = [line for line in lines if line.startswith(f"saving {tmp_path / 'out'}")]
    assert [n for n, _ in bar_rates('\n'.join(lines))][-1] == 12
    assert len(saves) == 3 and [line.split('|')[2].split('/')[0].strip() for line in saves] == ['4', '8', '12']
    assert len(lines) <= 6, text  # the start, 3 saves, the end: no redraw per iteration
    assert proc.stdout.count('train loss') == 3


# -----------------------------------------------------------------------------
# Start-up: the CPU's peak and MFU, the bf16 warning, compile='auto'


def fake_linear_timer(flops_per_s, calls):
    """A stand-in for common._time_linear on a CPU of the given rate: no clock involved."""
    def time_linear(n, dtype, repeats):
        calls.append((n, dtype))
        return 2 * n ** 3 / flops_per_s
    return time_linear


@pytest.mark.parametrize('rate', [1e9, 1e11, 1e14])  # emulated bf16, a laptop's fp32, beyond max_n
def test_cpu_peak_grows_its_size_within_the_time_budget(monkeypatch, rate):
    calls = []
    monkeypatch.setattr(common, '_time_linear', fake_linear_timer(rate, calls))
    monkeypatch.setattr(common, '_cpu_peak_cache', {})
    peak = common.measure_cpu_peak(torch.bfloat16, budget_s=1.0, max_n=4096, repeats=3)
    assert peak == pytest.approx(rate)
    sizes = [n for n, _ in calls]
    assert sizes[0] == 128 and sizes == [128 * 2 ** i for i in range(len(sizes))] and sizes[-1] <= 4096
    assert sum(4 * 2 * n ** 3 / rate for n in sizes) <= 1.0 or sizes == [128]  # 4 products a size
    if rate == 1e9:
        assert sizes[-1] <= 512  # never the 2048^3 products that took 20 s each
    if rate == 1e14:
        assert sizes[-1] == 4096
    assert {dtype for _, dtype in calls} == {torch.bfloat16}


def test_peak_flops_are_measured_in_the_runs_dtype(monkeypatch):
    calls = []
    monkeypatch.setattr(common, '_time_linear', fake_linear_timer(1e10, calls))
    monkeypatch.setattr(common, '_cpu_peak_cache', {})
    assert common.peak_flops_for('cpu', torch.float32, 0.0) == pytest.approx(1e10)
    assert common.peak_flops_for('cpu', torch.bfloat16, 0.0) == pytest.approx(1e10)
    assert [dtype for _, dtype in calls][0] == torch.float32 and calls[-1][1] == torch.bfloat16
    n = len(calls)
    common.peak_flops_for('cpu', torch.float32, 0.0)
    assert len(calls) == n  # measured once per dtype and process
    assert common.peak_flops_for('cpu', torch.float32, 5e12) == 5e12  # --peak_flops wins


def test_real_cpu_peak_is_positive_and_plausible():
    peak = common.measure_cpu_peak(torch.float32, budget_s=0.5, max_n=512)
    assert 1e7 < peak < 1e15


def test_mfu_of_a_run_is_between_0_and_1(data_root, tmp_path, monkeypatch):
    """MFU is against the peak measured in the run's dtype. A peak measured while other work loads
    the cores comes out too low, so a run faster than it measures again; here the first measurement
    says 1 MFLOP/s (any real run beats it) and later ones 100 GFLOP/s (no 32-wide model reaches it)."""
    calls = []
    rates = iter([1e6] + [1e11] * 1000)  # at 1 MFLOP/s the first size (n = 128) spends the time budget
    def time_linear(n, dtype, repeats):
        calls.append(dtype)
        return 2 * n ** 3 / next(rates)
    monkeypatch.setattr(common, '_time_linear', time_linear)
    monkeypatch.setattr(common, '_cpu_peak_cache', {})
    train.main(tiny_args(data_root, tmp_path, 'grt', peak_flops=0.0))
    mfus = [r['mfu'] for r in read_log(tmp_path)]
    assert all(0 < m <= 1 for m in mfus), mfus
    assert set(calls) == {torch.float32} and common._cpu_peak_cache[torch.float32] == pytest.approx(1e11)


def test_an_mfu_above_100_percent_is_withheld_with_a_warning(data_root, tmp_path, capsys):
    """--peak_flops=1e6 (1 MFLOP/s, below any real run's rate) is a wrong peak: no MFU is shown,
    one warning says why."""
    train.main(tiny_args(data_root, tmp_path, 'gpt', peak_flops=1e6))
    assert all(r['mfu'] is None for r in read_log(tmp_path))
    assert capsys.readouterr().err.count('warning: MFU would be') == 1


def test_forced_bf16_where_it_is_slower_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(common, 'cpu_bf16_speedup', lambda: 0.05)  # emulated bf16: 20x slower
    assert common.pick_dtype('bfloat16', 'cpu') == 'bfloat16'
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('warning: bf16 matrix products run 20.0x slower than float32')
    assert '--dtype=float32' in err
    assert common.pick_dtype('auto', 'cpu') == 'float32'
    assert common.pick_dtype('bfloat16', 'cpu', warn=False) == 'bfloat16'  # DDP ranks other than 0
    assert common.pick_dtype('float32', 'cpu') == 'float32'
    assert capsys.readouterr().err == ''
    monkeypatch.setattr(common, 'cpu_bf16_speedup', lambda: 2.5)  # AMX
    assert common.pick_dtype('bfloat16', 'cpu') == 'bfloat16' and common.pick_dtype('auto', 'cpu') == 'bfloat16'
    assert capsys.readouterr().err == ''


def test_auto_dtype_on_a_cpu_picks_bf16_only_for_wide_models_where_it_is_faster(monkeypatch):
    monkeypatch.setattr(common, 'cpu_bf16_speedup', lambda: 2.5)
    wide, narrow = common.CPU_BF16_MIN_WIDTH, common.CPU_BF16_MIN_WIDTH - 1
    assert common.pick_dtype('auto', 'cpu', n_embd=wide) == 'bfloat16'
    assert common.pick_dtype('auto', 'cpu', n_embd=narrow) == 'float32'  # the quick start's width 128 too
    assert common.pick_dtype('bfloat16', 'cpu', n_embd=narrow) == 'bfloat16'  # a forced dtype stands
    monkeypatch.setattr(common, 'cpu_bf16_speedup', lambda: 0.6)  # AVX-512 BF16 without AMX, as measured
    assert common.pick_dtype('auto', 'cpu', n_embd=wide) == 'float32'


def test_auto_dtype_says_what_the_measured_speed_chose(data_root, tmp_path, monkeypatch, capsys):
    for module in (common, train):  # pick_dtype's and the announcement's
        monkeypatch.setattr(module, 'cpu_bf16_speedup', lambda: 0.6)
    train.main(tiny_args(data_root, tmp_path, 'gpt', dtype='auto', n_embd=common.CPU_BF16_MIN_WIDTH, n_head=4,
                         max_iters=1, eval_interval=1))
    assert "dtype='auto' chose float32: bf16 matrix products measured 0.60x as fast as fp32" in capsys.readouterr().out


def test_measuring_the_cpu_leaves_the_global_generator_alone():
    state = torch.get_rng_state()
    assert common.cpu_bf16_speedup.__wrapped__() > 0  # uncached: it measures now
    common.measure_cpu_peak(torch.float32, budget_s=0.05, max_n=256, again=True)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'), reason="ONEDNN_MAX_CPU_ISA=AVX2 is x86's")
def test_a_cpu_without_native_bf16_is_measured_and_the_run_warns(data_root, tmp_path):
    """A CPU without native bf16, made real: oneDNN limited to AVX2 emulates bf16 matrix products (a
    1024-wide a @ b at about 0.9 GFLOP/s on an AVX2-only CPU). The measured speed-up
    says so whatever /proc/cpuinfo lists, 'auto' picks fp32 for a wide model, and a forced bf16 run
    warns once, measures its MFU peak in bf16 (the emulated rate) and shows every MFU, none above 100%."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA='AVX2')
    probe = subprocess.run([sys.executable, '-c', "import common; print(common.cpu_bf16_speedup(), "
                            "common.pick_dtype('auto', 'cpu', n_embd=768))"],
                           cwd=HERE, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    speedup, auto = probe.stdout.split()
    assert float(speedup) < 0.5 and auto == 'float32', probe.stdout
    args = tiny_args(data_root, tmp_path, 'grt', dtype='bfloat16', peak_flops=0.0, max_iters=4)
    run = subprocess.run([sys.executable, 'train.py', *args], cwd=HERE, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith('warning: ')]
    assert len(warnings) == 1 and warnings[0].startswith('warning: bf16 matrix products run'), run.stderr[-2000:]
    assert '--dtype=float32' in warnings[0]  # and no 'warning: MFU would be ...' (a peak below the run's rate)
    peak = re.search(r"peak FLOP/s in bfloat16 for MFU \.\.\. ([\d,.]+) GFLOP/s", run.stdout)
    assert peak and float(peak.group(1).replace(',', '')) < 100, run.stdout  # emulated; fp32 here: 100s
    mfus = [row['mfu'] for row in read_log(tmp_path)]
    assert mfus and all(m is not None and 0 < m <= 1 for m in mfus), mfus


def test_compile_auto_turns_off_where_it_loses():
    assert common.resolve_compile(None, 'cuda', 768) == (True, None)
    assert common.resolve_compile('auto', 'cuda', 768) == (True, None)
    on, why = common.resolve_compile('auto', 'cpu', 768)
    assert not on and "off on cpu" in why and '--compile=True' in why
    on, why = common.resolve_compile('auto', 'cuda', 128)
    assert not on and 'n_embd=128' in why
    assert common.resolve_compile(True, 'cpu', 32) == (True, None)  # True and False force it
    assert common.resolve_compile(False, 'cuda', 768) == (False, None)


def test_the_scripts_import_no_experiment():
    """model.py, train.py and sample.py stand alone: experiments/ is imported only by a run that needs it
    (a depth task's dataset), so a reader sees what the method needs."""
    code = ("import sys, model, sample, train; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'experiments'))")
    proc = subprocess.run([sys.executable, '-c', code], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == '[]'
