"""common.py: bad checkpoints and devices end in one line, Batches draws the same windows without keeping
the token files mapped, and the start-up note and thread count for a busy machine."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
import prepare_data
from conftest import save_checkpoint, tiny_model

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


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


def test_sample_with_device_cuda_is_one_line_without_cuda(half_dir):
    # no GPU visible: on a CUDA build as on this CPU-only one, torch.cuda.is_available() is False
    code, err = run_script('sample.py', f'--out_dir={half_dir}', '--device=cuda', CUDA_VISIBLE_DEVICES='')
    assert code == 1 and err.strip().splitlines() == [err.strip()] and 'Traceback' not in err, err
    assert err.startswith("error: device='cuda' but") and 'use --device=cpu' in err
