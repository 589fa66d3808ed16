"""
The quick start on cores shared with another job: train.py config/shakespeare_char_grt.py for --iters
iterations (ms/iteration from log.jsonl, iterations --from_iter to the last, and the measured peak),
then sample.py's 100 tokens (wall seconds of the process). A case is WHERE-THREADS: WHERE is idle,
load (the --load job started first) or late (started 8 s into the run); THREADS is default (no setting: the scripts' own, common.share_cores),
1thread (OMP_NUM_THREADS=1), passive (OMP_WAIT_POLICY=PASSIVE) or proposed (torch's defaults, for a
--repo whose scripts choose their threads). Each measurement waits until other work leaves the cores
idle, and one during which other work took more than 0.15 of a core is taken again (3 tries). Linux
only (/proc/stat). It prints a table; docs/training.md#sharing-the-cores says how the scripts pick threads.

    python -m benchmarks.shared_cores                   # alone and beside a 1-thread matmul loop, twice
    python -m benchmarks.shared_cores --load=train --cases=load-default,load-1thread,load-passive
    python -m benchmarks.shared_cores --load=train --cases=late-default,late-passive --iters=80 --from_iter=50 --sample=False
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from common import cpu_times, others_busy

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_ENV = {'default': {}, '1thread': {'OMP_NUM_THREADS': '1'}, 'passive': {'OMP_WAIT_POLICY': 'PASSIVE'},
              'proposed': {}}  # proposed: --repo's train.py chooses its threads itself
LOADS = {  # one-thread jobs that keep one core busy
    'matmul': ['-c', "import torch\na, b = torch.randn(256, 256), torch.randn(256, 256)\nwhile True:\n    a @ b"],
    'train': ['train.py', 'config/shakespeare_char_grt.py', '--max_iters=1000000', '--eval_interval=1000000',
              '--out_dir={work}/out-load', '--data_dir={work}/data'],  # the quick start itself, on 1 thread
}
LOADS['train2'] = LOADS['train']  # the same on torch's default threads: two jobs that each take both cores


def wait_until_quiet(limit, max_wait):
    """Wait until other work keeps less than `limit` cores busy over 3 s; returns the last reading."""
    t0 = time.time()
    while True:
        since = cpu_times()
        time.sleep(3)
        busy = others_busy(since)
        if busy < limit or time.time() - t0 > max_wait:
            return busy
        time.sleep(10)


def measure(command, env, load, late, cwd, work):
    """Run command with the job `load` beside it (None: alone), started first or, if late, 8 s after
    the command: (wall seconds, its stdout, the cores other work kept busy meanwhile: all busy time
    less this process's, the command's and the job's)."""
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_NUM_THREADS', 'OMP_WAIT_POLICY')} | env
    before, since = os.times(), cpu_times()

    def start_load():
        return subprocess.Popen([sys.executable, *(a.format(work=work) for a in LOADS[load])], cwd=cwd,
                                env=env if load == 'train2' else dict(env, OMP_NUM_THREADS='1'),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    job = None
    if load and not late:
        job = start_load()
        time.sleep(1 if load == 'matmul' else 15)  # train.py: past its start-up, into the loop
    t0 = time.time()
    p = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if load and late:
        try:
            p.wait(timeout=8)  # a short command may end first, then never meets the job
        except subprocess.TimeoutExpired:
            job = start_load()
    stdout, stderr = p.communicate()
    wall = time.time() - t0
    if p.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    if job:
        job.kill()
        job.wait()
    after = os.times()
    children = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    total = cpu_times()
    others = (total[1] - since[1] - (total[2] - since[2]) - children) / (total[0] - since[0])
    return wall, stdout, max(0.0, others)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument('--repo', default=HERE, help='the checkout whose train.py and sample.py run')
    p.add_argument('--cases', default='idle-default,idle-1thread,idle-passive,load-default,load-1thread,load-passive')
    p.add_argument('--load', default='matmul', choices=list(LOADS), help='the job beside it in the load-* cases')
    p.add_argument('--iters', type=int, default=40)
    p.add_argument('--from_iter', type=int, default=10, help='ms/iteration over iterations from_iter to iters')
    p.add_argument('--repeats', type=int, default=2)
    p.add_argument('--sample', default='True', help="False: train.py only")
    p.add_argument('--work', default='/tmp/shared_cores')
    p.add_argument('--json', default='/tmp/shared_cores/results.json')
    p.add_argument('--max_wait', type=float, default=3600, help='seconds to wait for a quiet machine')
    args = p.parse_args()

    data_dir = os.path.join(args.work, 'data')
    if not os.path.isfile(os.path.join(data_dir, 'shakespeare_char', 'meta.json')):
        sys.path.insert(0, args.repo)
        import prepare_data
        prepare_data.prepare('shakespeare_char', data_dir=data_dir,
                             input_path=os.path.join(HERE, '..', 'shared', 'data', 'tinyshakespeare', 'input.txt'))
    results = []
    if os.path.isfile(args.json):
        with open(args.json) as f:
            results = json.load(f)
    for repeat in range(args.repeats):
        for case in args.cases.split(','):
            where, threads = case.split('-')
            for what in ('train', 'sample') if args.sample == 'True' else ('train',):
                out_dir = os.path.join(args.work, f'out-{case}')
                if what == 'train':
                    shutil.rmtree(out_dir, ignore_errors=True)  # train.py refuses to train over another run
                    command = [sys.executable, 'train.py', 'config/shakespeare_char_grt.py', f'--max_iters={args.iters}',
                               '--eval_interval=1000', f'--out_dir={out_dir}', f'--data_dir={data_dir}']
                else:
                    command = [sys.executable, 'sample.py', f'--out_dir={out_dir}', '--num_samples=1',
                               '--max_new_tokens=100', '--device=cpu']
                for attempt in range(3):
                    quiet = wait_until_quiet(0.15, args.max_wait)
                    load = args.load if where in ('load', 'late') else None
                    wall, stdout, others = measure(command, THREAD_ENV[threads], load, where == 'late', args.repo,
                                                   args.work)
                    if others < 0.15:
                        break
                    print(f"  {case} {what}: other work took {others:.2f} cores meanwhile, measuring again", flush=True)
                r = dict(case=case, load=load, what=what, repeat=repeat, wall_s=round(wall, 2), others_before=round(quiet, 2),
                         others_during=round(others, 2))
                if what == 'train':
                    with open(os.path.join(out_dir, 'log.jsonl')) as f:
                        log = {rec['iter']: rec for rec in map(json.loads, f)}
                    r['ms_per_iter'] = round(1000 * (log[args.iters]['time_s'] - log[args.from_iter]['time_s'])
                                             / (args.iters - args.from_iter), 1)
                    r['notes'] = [line for line in stdout.splitlines() if line.startswith('note:')]
                    r['mfu'] = [rec['mfu'] for rec in log.values()]
                    peak = re.search(r"for MFU \.\.\. ([\d,.]+) GFLOP/s", stdout)
                    r['peak_gflops'] = peak and float(peak.group(1).replace(',', ''))
                results.append(r)
                print(json.dumps(r), flush=True)
                with open(args.json, 'w') as f:
                    json.dump(results, f, indent=1)


if __name__ == '__main__':
    main()
