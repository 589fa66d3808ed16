"""common.py: bad checkpoints and devices end in one line, Batches draws the same windows without keeping
the token files mapped, and the start-up note and thread count for a busy machine."""

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import common
import prepare_data
from conftest import HERE, save_checkpoint, tiny_model



def one_line_error(excinfo):
    """The message of a common.fail exit, checked to be one line."""
    message = str(excinfo.value.code)
    assert message.startswith('error: ') and '\n' not in message, message
    return message


def run_script(*args, **env):
    """A script of the repository as a user starts it, with env added to the environment: (exit status, stderr)."""
    p = subprocess.run([sys.executable, *args], cwd=HERE, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS='1', **env))
    return p.returncode, p.stderr


# -----------------------------------------------------------------------------
# A truncated checkpoint


@pytest.fixture(scope='module')
def half_dir(tmp_path_factory):
    """A checkpoint directory as train.py writes it, plus half.pt: best.pt cut to half its bytes."""
    out_dir = save_checkpoint(str(tmp_path_factory.mktemp('half')), tiny_model('grt'), 'grt')
    with open(os.path.join(out_dir, 'best.pt'), 'rb') as f:
        data = f.read()
    with open(os.path.join(out_dir, 'half.pt'), 'wb') as f:
        f.write(data[:len(data) // 2])
    return out_dir


def test_truncated_checkpoint_is_one_line_and_the_whole_one_loads(half_dir):
    with pytest.raises(SystemExit) as e:
        common.load_checkpoint(half_dir, 'half.pt')
    message = one_line_error(e)
    assert os.path.join(half_dir, 'half.pt') in message and 'truncated or corrupt' in message
    assert 'PytorchStreamReader' in message and 'miniz' not in message  # torch's reason, without its advice
    assert message.endswith('or use --ckpt=best.pt')  # the whole file beside it
    whole = common.load_checkpoint(half_dir, 'best.pt')
    expected = torch.load(os.path.join(half_dir, 'best.pt'), weights_only=False)
    assert whole.keys() == expected.keys()
    assert all(torch.equal(whole['model'][k], v) for k, v in expected['model'].items())


@pytest.mark.parametrize('content', [b'', b'not a checkpoint\n', 'cut at the end'], ids=['empty', 'text', 'end-cut'])
def test_other_unreadable_files_are_one_line(tmp_path, content):
    """An empty file (EOFError), text (UnpicklingError) and a file missing its last bytes (OSError)."""
    path = tmp_path / 'best.pt'
    if content == 'cut at the end':
        torch.save({'x': torch.arange(1000)}, path)
        content = path.read_bytes()[:-10]
    path.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        common.load_checkpoint(str(tmp_path), 'best.pt')
    assert 'truncated or corrupt' in one_line_error(e)


@pytest.mark.parametrize('script', [['sample.py'], ['bench.py'], ['-m', 'experiments.analyze']])
def test_scripts_say_one_line_for_a_truncated_checkpoint(half_dir, script):
    code, err = run_script(*script, f'--out_dir={half_dir}', '--ckpt=half.pt', '--device=cpu')
    assert code == 1
    assert err.strip().splitlines() == [err.strip()] and 'Traceback' not in err, err
    assert err.startswith(f"error: {os.path.join(half_dir, 'half.pt')} is truncated or corrupt"), err


def test_resume_from_a_truncated_checkpoint_is_one_line(half_dir, tmp_path):
    text = tmp_path / 'text.txt'
    text.write_text('To be, or not to be, that is the question.\n' * 50)
    prepare_data.prepare('mini', data_dir=str(tmp_path), input_path=str(text))
    out_dir = tmp_path / 'out'
    out_dir.mkdir()
    shutil.copy(os.path.join(half_dir, 'half.pt'), out_dir / 'ckpt.pt')
    code, err = run_script('train.py', '--dataset=mini', f'--data_dir={tmp_path}', f'--out_dir={out_dir}',
                           '--init_from=resume', '--device=cpu')
    assert code == 1 and err.strip().splitlines() == [err.strip()] and 'Traceback' not in err, err
    assert err.startswith(f"error: {out_dir / 'ckpt.pt'} is truncated or corrupt (PytorchStreamReader"), err


# -----------------------------------------------------------------------------
# A device this machine lacks


def test_pick_device_cuda_is_one_line_without_cuda():
    if torch.cuda.is_available():  # a CUDA machine: the device is taken as named
        assert common.pick_device('cuda') == 'cuda' and common.pick_device('auto', 0) == 'cuda:0'
        return
    with pytest.raises(SystemExit) as e:
        common.pick_device('cuda:1')
    message = one_line_error(e)
    assert 'use --device=cpu' in message
    if torch.version.cuda is None:  # this CPU-only build
        assert f"torch ({torch.__version__}) was built without CUDA" in message
    assert common.pick_device('auto', 3) in ('mps', 'cpu')


def test_pick_device_mps_and_bad_names():
    if torch.backends.mps.is_available():
        assert common.pick_device('mps') == 'mps'
    else:
        with pytest.raises(SystemExit) as e:
            common.pick_device('mps')
        assert 'MPS is not available' in one_line_error(e)
    for name in ('gpu', 'cuda:x', 'cpu:0:1', 'mps:0'):
        with pytest.raises(SystemExit) as e:
            common.pick_device(name)
        assert one_line_error(e) == f"error: device must be auto, cpu, cuda, cuda:N or mps, got {name!r}"
    assert common.pick_device('cpu') == 'cpu'


@pytest.mark.parametrize('script', ['sample.py', 'train.py'])
def test_device_cuda_is_one_line_without_cuda(half_dir, tmp_path, script):
    # no GPU visible: on a CUDA build as on this CPU-only one, torch.cuda.is_available() is False
    out_dir = half_dir if script == 'sample.py' else tmp_path
    code, err = run_script(script, f'--out_dir={out_dir}', '--device=cuda', CUDA_VISIBLE_DEVICES='')
    assert code == 1 and err.strip().splitlines() == [err.strip()] and 'Traceback' not in err, err
    assert err.startswith("error: device='cuda' but") and 'use --device=cpu' in err


# -----------------------------------------------------------------------------
# Batches over token files


@pytest.fixture
def token_paths(tmp_path):
    """Two token files of different lengths whose every token says where it lies: file k holds
    (k * 30000 + position) % 65536."""
    paths = []
    for k, n in enumerate((5000, 1234)):
        paths.append(str(tmp_path / f'fineweb_train_00000{k + 1}.bin'))
        prepare_data.write_tokens(paths[-1], (k * 30000 + np.arange(n)) % 65536)
    return paths


def old_get(shards, block_size, batch_size, generator):
    """Batches.get as it was before it reopened the files, reading memmaps kept open."""
    windows = torch.tensor([len(s) - block_size for s in shards], dtype=torch.float64)
    ids = torch.multinomial(windows, batch_size, replacement=True, generator=generator)
    offsets = (torch.rand(batch_size, generator=generator, dtype=torch.float64) * windows[ids]).long()
    rows = np.stack([shards[i][o:o + block_size + 1] for i, o in zip(ids.tolist(), offsets.tolist())])
    batch = torch.from_numpy(rows.astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def test_batches_are_the_kept_open_memmaps_windows(token_paths):
    shards = [prepare_data.read_tokens(p) for p in token_paths]
    batches = common.Batches(shards, 64, 8, 'cpu')
    gen, ref_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    files_seen = set()
    for _ in range(20):
        x, y = batches.get(gen)
        ref_x, ref_y = old_get(shards, 64, 8, ref_gen)
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
        assert torch.equal(x[:, 1:], y[:, :-1])
        start = x[:, :1]  # each row: consecutive tokens of one file, the window inside it
        assert torch.equal(torch.cat([x, y[:, -1:]], 1), (start + torch.arange(65)) % 65536)
        files_seen |= set((start // 30000).flatten().tolist())
    assert files_seen == {0, 1}


@pytest.mark.skipif(not os.path.isfile('/proc/self/maps'), reason='/proc/self/maps lists mappings on Linux only')
def test_batches_leave_no_token_file_mapped(token_paths):
    """What kept resident memory flat over a long run: once the caller drops its memmaps, no token
    file stays mapped into the process between batches."""
    shards = [prepare_data.read_tokens(p) for p in token_paths]
    batches = common.Batches(shards, 64, 8, 'cpu')

    def mapped():
        with open('/proc/self/maps') as f:
            return {p for line in f for p in token_paths if line.rstrip().endswith(p)}

    assert mapped() == set(token_paths)
    del shards
    assert mapped() == set()
    x, _ = batches.get(torch.Generator().manual_seed(0))
    assert x.shape == (8, 64) and mapped() == set()


# -----------------------------------------------------------------------------
# Cores shared with other work

linux_only = pytest.mark.skipif(common.cpu_times() is None, reason='/proc/stat is Linux only')


@linux_only
def test_others_busy_counts_other_processes_and_not_this_one():
    """Invariants that hold however loaded the machine is: a child's busy loop is in others_busy
    (at least its own CPU time over the wall time), this process's own loop is not (it leaves at
    most the other cores). 0.1 covers /proc/stat's 10 ms ticks."""
    before, since, t0 = os.times(), common.cpu_times(), time.monotonic()
    subprocess.run([sys.executable, '-c', 'import time\nt = time.time()\nwhile time.time() - t < 1: pass'], check=True)
    busy, wall, after = common.others_busy(since), time.monotonic() - t0, os.times()
    child = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    assert child > 0.1 and busy >= child / wall - 0.1, (busy, child, wall)

    since, t0, own0 = common.cpu_times(), time.monotonic(), time.process_time()
    while time.monotonic() - t0 < 1:
        pass
    busy, wall, own = common.others_busy(since), time.monotonic() - t0, time.process_time() - own0
    assert 0 <= busy <= os.cpu_count() - own / wall + 0.1, (busy, own, wall)


@pytest.mark.parametrize('busy, cores, default, threads', [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (1.0, 2, 2, 1), (0.7, 2, 2, 1), (2.0, 2, 2, 1),  # at least 1
    (2.0, 64, 32, 32), (10.2, 64, 64, 54)])  # never above torch's default
def test_cpu_threads_are_the_free_cores(busy, cores, default, threads):
    assert common.cpu_threads(busy, cores, default) == threads


@pytest.fixture
def two_threads(monkeypatch):
    """torch on 2 threads of a 2-core machine, OMP_NUM_THREADS unset; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(os, 'cpu_count', lambda: 2)
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    yield
    torch.set_num_threads(threads)


def busy_cores(monkeypatch, busy):
    monkeypatch.setattr(common, 'others_busy', lambda since: busy)


def test_share_cores_gives_torch_the_free_cores_and_says_so(two_threads, monkeypatch):
    busy_cores(monkeypatch, 1.04)  # a job on one core at start-up
    assert common.share_cores('cpu') == ("note: other work keeps 1.0 of 2 cores busy, so torch runs 1 thread(s), "
                                         "one per core it leaves free")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert common.share_cores('cuda:0') == '' and common.share_cores('mps') == ''
    assert torch.get_num_threads() == 2


def test_share_cores_leaves_a_quiet_machine_and_omp_num_threads_alone(two_threads, monkeypatch):
    busy_cores(monkeypatch, 0.3)
    assert common.share_cores('cpu') == '' and torch.get_num_threads() == 2
    busy_cores(monkeypatch, 1.5)
    monkeypatch.setenv('OMP_NUM_THREADS', '2')
    assert common.share_cores('cpu') == '' and torch.get_num_threads() == 2  # the user's choice stands


def test_a_resumed_run_takes_its_checkpoints_threads_unless_omp_num_threads_says_otherwise(two_threads, monkeypatch,
                                                                                            capsys):
    busy_cores(monkeypatch, 1.04)  # share_cores would pick 1
    common.resume_threads('cpu', 2)
    assert torch.get_num_threads() == 2
    assert capsys.readouterr().err == ("resuming on 2 thread(s), the count the checkpoint trained on, for a bit-exact "
                                       "continuation (OMP_NUM_THREADS=N sets another, and the run drifts)\n")
    common.resume_threads('cpu', None)  # a checkpoint without the count: share_cores decides
    assert torch.get_num_threads() == 1 and capsys.readouterr().err.startswith('note: other work keeps 1.0 of 2')
    monkeypatch.setenv('OMP_NUM_THREADS', '1')
    common.resume_threads('cpu', 2)
    assert torch.get_num_threads() == 1  # the user's choice stands, and the line says what it costs
    assert capsys.readouterr().err == ("note: OMP_NUM_THREADS=1 but the checkpoint trained on 2 thread(s), so the "
                                       "resumed run will not repeat the uninterrupted one bit for bit; "
                                       "OMP_NUM_THREADS=2 would\n")
    common.resume_threads('cpu', 1)
    common.resume_threads('cuda:0', 2)
    assert torch.get_num_threads() == 1


@linux_only
def test_share_cores_reads_the_machine(two_threads):
    """Unmocked: it reads 0.2 s of /proc/stat and picks the threads for what it read."""
    t0 = time.monotonic()
    common.share_cores('cpu')
    assert 0.2 <= time.monotonic() - t0 < 2
    assert torch.get_num_threads() in (1, 2)


def test_a_peak_measured_beside_other_work_says_it_reads_low(two_threads, monkeypatch, capsys):
    monkeypatch.setattr(common, '_time_linear', lambda n, dtype, repeats: 2 * n ** 3 / 5.37e10)
    monkeypatch.setattr(common, '_cpu_peak_cache', {})
    monkeypatch.setattr(common, '_cpu_peak_busy', {})
    busy_cores(monkeypatch, 1.1)
    assert common.peak_flops_for('cpu', torch.float32, 0.0, verbose=True) == pytest.approx(5.37e10)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["measuring the CPU's peak FLOP/s in float32 for MFU ... 53.7 GFLOP/s on 2 thread(s)",
                     "note: other work kept 1.1 of 2 cores busy while the peak was measured on 2 thread(s), so it "
                     "may read low and MFU high; --peak_flops=... sets a fixed peak"]
    torch.set_num_threads(1)  # one thread beside one busy core: the peak of the thread the run has
    assert common.cpu_peak_contended(torch.float32) == ''
    busy_cores(monkeypatch, 0.1)
    torch.set_num_threads(2)
    common.measure_cpu_peak(torch.bfloat16)
    assert common.cpu_peak_contended(torch.bfloat16) == ''


def test_training_mfu_measures_the_peak_again_once_a_run_then_withholds_for_good(monkeypatch, capsys):
    """A CPU peak measured at 1 GFLOP/s; the model trains at 4 (MFU 400%). Measuring again finds 10: the MFU
    is 40%. Where every measurement says 1, 3 of them are made at that one line, then one warning and no
    MFU for the rest of the run, without measuring again, even for a figure that would fit."""
    model = tiny_model('grt')
    flops = common.train_flops_per_token(model, 64, 2.0) * 1000  # of 1,000 tokens at r = 2
    for later_rate, expected in ((1e10, 0.4), (1e9, None)):
        rate, calls = {'now': 1e9}, []
        def time_linear(n, dtype, repeats):
            calls.append(n)
            return 2 * n ** 3 / rate['now']
        monkeypatch.setattr(common, '_time_linear', time_linear)
        monkeypatch.setattr(common, '_cpu_peak_cache', {})
        run_mfu = common.TrainingMFU('cpu', 'float32')
        assert run_mfu.peak == pytest.approx(1e9)
        measured, rate['now'] = len(calls), later_rate
        mfu = run_mfu(model, 1000, flops / 4e9, 64, 2.0)  # 4 GFLOP/s
        assert mfu == expected if expected is None else mfu == pytest.approx(expected)
        if expected is None:
            assert len(calls) == 4 * measured  # 3 measurements more, each as long as the first
            assert capsys.readouterr().err.count('warning: MFU would be 400% against a float32 peak of 1.0') == 1
            assert run_mfu(model, 1000, flops / 1e8, 64, 2.0) is None and len(calls) == 4 * measured
        assert capsys.readouterr().err == ''
    given = common.TrainingMFU('cpu', 'float32', peak_flops=1e9)  # a peak the user set is not measured again
    assert given(model, 1000, flops / 4e9, 64, 2.0) is None and given.peak == 0.0
    assert 'warning: MFU would be 400%' in capsys.readouterr().err
