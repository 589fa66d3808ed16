"""
Is a CUDA machine ready for the paper-scale runs? One command, no download, about 5-8 minutes on one GPU:
trains config/gpt2_small.py and config/grt_small.py for 50 iterations each, eager and compiled, in bf16
on random GPT-2 tokens it writes to a temporary directory, then runs `bench.py --scale=large`.

    python -m benchmarks.gpu_check               # on a CUDA GPU
    python -m benchmarks.gpu_check --tiny=True   # the same steps at tiny shapes on the CPU (~1-2 minutes):
                                                 # checks the script itself, no figure means anything

It reports, per config and mode: tokens/s and MFU (against the GPU's datasheet peak) after the first
logged interval (which holds the compilation), peak memory (torch.cuda.max_memory_allocated), the
graphs compiled and any recompile, the final val loss; then the GRT/dense step time and that ratio per
FLOP (on CUDA, from the MFUs, which share one datasheet peak), compiled against eager, and bench.py's
table (params, peak decode memory and decode latency, eager and compiled). Each training run is its own
process, as a user's command would be, so one run's memory and graphs never count in another's. The
last line is one JSON object.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import prepare_data
from bench import TorchInternalsChanged, human
from common import fail, read_settings

DEFAULTS = dict(
    tiny=False,  # tiny shapes on the CPU: a check of this script where there is no GPU
)
CONFIGS = ('config/gpt2_small.py', 'config/grt_small.py')
TRAIN_ARGS = ('--max_iters=50', '--eval_interval=50', '--eval_iters=5', '--log_interval=10',
              '--gradient_accumulation_steps=4', '--dtype=bfloat16')
BENCH_ARGS = ('--scale=large',)
TOKENS = 2_000_000  # random GPT-2 token ids for training (and a tenth as many for validation)
# --tiny: every shape small, on the CPU in fp32
TINY_TRAIN_ARGS = ('--device=cpu', '--dtype=float32', '--block_size=32', '--batch_size=2', '--n_embd=32',
                   '--n_head=2', '--max_iters=4', '--log_interval=2', '--eval_interval=4', '--eval_iters=1',
                   '--gradient_accumulation_steps=1')
TINY_MODEL_ARGS = {'config/gpt2_small.py': ('--n_layer=2',), 'config/grt_small.py': ('--n_recur=2',)}
TINY_BENCH_ARGS = ('--scale=tiny', '--device=cpu', '--dtype=float32', '--compile=False', '--prompt_len=8',
                   '--new_tokens=4')
TINY_TOKENS = 20_000
DATASET = 'gpu_check'  # written into a temporary data_dir
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root

# Runs train.main in a fresh process and writes what only that process can see: train.main's result,
# the peak device memory, the graphs compiled and the recompiles. argv: the JSON file, then train.py's argv.
TRAIN_DRIVER = """
import json, sys
import torch
import train
from bench import compiled_graph_count
from benchmarks.gpu_check import recompile_count
graphs_before = compiled_graph_count()
result = train.main(sys.argv[2:])
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
with open(sys.argv[1], 'w') as f:
    json.dump(dict(result=result, peak_mem_bytes=peak, graphs_compiled=compiled_graph_count() - graphs_before,
                   recompiles=recompile_count()), f, default=str)
"""


def recompile_count():
    """Recompiles in this process: compiles of one compiled function beyond its first two, since
    common.compile_regions compiles each function once for training and once for evaluation (under
    no_grad). The graph count cannot say: a GRT step breaks into several graphs around its noise. Read
    from Dynamo's compilation metrics, ids 'frame/attempt', one or two entries a compile (its backward
    may add one); they keep the last 64 entries, enough for one run in a fresh process."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
        ids = {str(m.compile_id) for m in get_compilation_metrics()}
        attempts = [re.search(r'(\d+)/(\d+)(_\d+)?$', compile_id) for compile_id in ids]
        return sum(int(match.group(2)) >= 2 for match in attempts if match)
    except (ImportError, AttributeError, TypeError) as e:
        raise TorchInternalsChanged(
            f"torch {torch.__version__} changed torch._dynamo.utils.get_compilation_metrics ({type(e).__name__}: "
            f"{e}); the recompile count needs benchmarks.gpu_check.recompile_count updated") from None


def write_data(data_root, tokens):
    """data_root/DATASET/: random GPT-2 token ids as train.bin and val.bin, and a GPT-2 meta.json."""
    data_dir = os.path.join(data_root, DATASET)
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = prepare_data.GPT2_VOCAB_SIZE
    prepare_data.write_tokens(os.path.join(data_dir, 'train.bin'), rng.integers(0, vocab, tokens))
    prepare_data.write_tokens(os.path.join(data_dir, 'val.bin'), rng.integers(0, vocab, max(tokens // 10, 10_000)))
    with open(os.path.join(data_dir, 'meta.json'), 'w') as f:
        json.dump({'tokenizer': 'gpt2', 'vocab_size': vocab}, f)  # as prepare_data.py writes fineweb10B's


def train_run(argv, out_dir):
    """Train in its own process; its tokens/s and MFU after the first logged interval (which includes
    compilation), peak memory, graphs compiled, recompiles and final val loss."""
    report = os.path.join(out_dir, 'gpu_check.json')
    print(f"gpu_check: python train.py {' '.join(argv)}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, '-c', TRAIN_DRIVER, report, *argv], cwd=HERE)
    if r.returncode != 0 or not os.path.isfile(report):
        fail(f"training {argv[0]} failed (exit code {r.returncode}); its output is above")
    with open(report) as f:
        run = json.load(f)
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [rec for rec in records if 'tokens' in rec and 'time_s' in rec]
    tokens_per_s = mfu = None
    if len(records) > 1:  # the first logged interval includes compilation
        seconds = records[-1]['time_s'] - records[0]['time_s']
        tokens_per_s = (records[-1]['tokens'] - records[0]['tokens']) / seconds if seconds > 0 else None
        mfus = [rec['mfu'] for rec in records[1:] if rec.get('mfu') is not None]
        mfu = statistics.median(mfus) if mfus else None
    return dict(tokens_per_s=tokens_per_s, mfu=mfu, peak_mem_bytes=run['peak_mem_bytes'],
                graphs_compiled=run['graphs_compiled'], recompiles=run['recompiles'],
                val_loss=(run.get('result') or {}).get('val_loss'), wall_s=time.perf_counter() - t)


def bench_run(bench_args):
    """bench.py in its own process: its output passes through, its JSON line returns."""
    print(f"gpu_check: python bench.py {' '.join(bench_args)}", file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, 'bench.py', *bench_args], cwd=HERE, stdout=subprocess.PIPE, text=True)
    print(r.stdout, end='')
    if r.returncode != 0:
        fail(f"bench.py {' '.join(bench_args)} failed (exit code {r.returncode}); its output is above")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ratios(runs, on_cuda):
    """Per mode, the GRT's step time over the dense model's, and (on CUDA) that per FLOP from the MFUs,
    which there divide by one datasheet peak (a CPU measures its peak anew in each run); per config,
    compiled tokens/s over eager."""
    out = {}
    for mode in ('eager', 'compiled'):
        dense, grt = runs.get(f'gpt2_small {mode}'), runs.get(f'grt_small {mode}')
        if dense and grt and dense['tokens_per_s'] and grt['tokens_per_s']:
            out[f'grt_dense_step_{mode}'] = dense['tokens_per_s'] / grt['tokens_per_s']  # same tokens an iteration
            if on_cuda and dense['mfu'] and grt['mfu']:
                out[f'grt_dense_per_flop_{mode}'] = dense['mfu'] / grt['mfu']
    for config in ('gpt2_small', 'grt_small'):
        eager, compiled = runs.get(f'{config} eager'), runs.get(f'{config} compiled')
        if eager and compiled and eager['tokens_per_s'] and compiled['tokens_per_s']:
            out[f'{config}_compiled_over_eager'] = compiled['tokens_per_s'] / eager['tokens_per_s']
    return out


def print_summary(result):
    print(f"gpu_check on {result['device']}, torch {result['torch']}: {result['train_args']}")
    print(f"{'run':24s}{'tokens/s':>14s}{'MFU':>10s}{'peak memory':>14s}{'graphs':>8s}{'recompiles':>12s}"
          f"{'val loss':>10s}")
    for name, run in result['train'].items():
        cells = ['-' if run['tokens_per_s'] is None else f"{run['tokens_per_s']:,.0f}",
                 '-' if run['mfu'] is None else f"{100 * run['mfu']:.1f}%",
                 '-' if run['peak_mem_bytes'] is None else human(run['peak_mem_bytes'], 'B'),
                 str(run['graphs_compiled']), str(run['recompiles']),
                 '-' if run['val_loss'] is None else f"{run['val_loss']:.3f}"]
        print(f"{name:24s}{cells[0]:>14s}{cells[1]:>10s}{cells[2]:>14s}{cells[3]:>8s}{cells[4]:>12s}{cells[5]:>10s}")
    for key, value in result['ratios'].items():
        print(f"{key.replace('_', ' ')}: {value:.3f}x")
    print(f"(graphs: compiled by torch.compile; recompiles: compiles of a function beyond one for training and one "
          f"for evaluation. Total {result['wall_s']:.0f} s.)")


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    if not c['tiny'] and not torch.cuda.is_available():
        fail("needs a CUDA GPU (torch.cuda.is_available() is False): it trains the paper-scale configs; "
             "`python -m benchmarks.gpu_check --tiny=True` checks the script on a CPU")
    train_args, tokens = (TINY_TRAIN_ARGS, TINY_TOKENS) if c['tiny'] else (TRAIN_ARGS, TOKENS)
    t = time.perf_counter()
    runs = {}
    with tempfile.TemporaryDirectory(prefix='gpu_check_') as tmp:
        write_data(tmp, tokens)
        for path in CONFIGS:
            config = os.path.splitext(os.path.basename(path))[0]
            for mode in ('eager', 'compiled'):
                out_dir = os.path.join(tmp, f'out-{config}-{mode}')
                argv = [path, f'--data_dir={tmp}', f'--dataset={DATASET}', f'--out_dir={out_dir}', *train_args,
                        *(TINY_MODEL_ARGS[path] if c['tiny'] else ()), f"--compile={mode == 'compiled'}"]
                runs[f'{config} {mode}'] = train_run(argv, out_dir)
    on_cuda = torch.cuda.is_available() and not c['tiny']
    result = dict(mode='gpu_check', device=torch.cuda.get_device_name() if on_cuda else 'cpu', torch=torch.__version__,
                  train_args=' '.join(train_args), train=runs, ratios=ratios(runs, on_cuda))
    result['bench'] = bench_run(list(TINY_BENCH_ARGS if c['tiny'] else BENCH_ARGS))
    result['wall_s'] = time.perf_counter() - t
    print_summary(result)
    print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
