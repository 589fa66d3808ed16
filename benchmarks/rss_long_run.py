"""
Does a long run's resident memory stay flat? Writes a multi-GB token file in the shard format to /tmp,
trains a tiny GPT on thousands of common.Batches batches from it, and samples this process's resident
memory (/proc/self/status: VmRSS, split into RssAnon and RssFile) every --every batches. The file is
deleted at the end. Linux only (/proc). Results: docs/long_runs.md.

    OMP_NUM_THREADS=1 python -m benchmarks.rss_long_run --label=after
    OMP_NUM_THREADS=1 python -m benchmarks.rss_long_run --gb=0.01 --batches=20 --every=5 --json=/tmp/r.json  # dry run

Each run merges {label: curve} into --json and redraws --png with every label's curve.
"""

import argparse
import json
import os
import time

import numpy as np
import torch

import prepare_data
from common import Batches, pyplot
from registry import build_model

VOCAB = 256  # the tokens are random ids below it: the memory under test is the token file's, not the model's


def write_token_file(path, n_tokens, chunk=1 << 26):
    """n_tokens random ids in prepare_data's token-file layout (its header, then uint16), written in
    chunks so this process never holds the file in its own memory."""
    header = np.zeros(prepare_data.HEADER_INTS, dtype=np.int32)
    header[:3] = prepare_data.MAGIC, prepare_data.VERSION, n_tokens
    rng = np.random.default_rng(0)
    with open(path, 'wb') as f:
        f.write(header.tobytes())
        for start in range(0, n_tokens, chunk):
            f.write(rng.integers(0, VOCAB, min(chunk, n_tokens - start), dtype=np.uint16).tobytes())


def memory_mib():
    """This process's resident memory in MiB: VmRSS and its anonymous and file-backed parts."""
    fields = {}
    with open('/proc/self/status') as f:
        for line in f:
            key, _, value = line.partition(':')
            if key in ('VmRSS', 'RssAnon', 'RssFile'):
                fields[key] = int(value.split()[0]) / 1024  # kB
    return fields


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument('--gb', type=float, default=2.0, help='size of the token file in GB (2 bytes a token)')
    p.add_argument('--batches', type=int, default=5000)
    p.add_argument('--every', type=int, default=100, help='sample the memory every this many batches')
    p.add_argument('--batch_size', type=int, default=8)
    p.add_argument('--block_size', type=int, default=1024)  # FineWeb configs' block_size
    p.add_argument('--label', default='run')
    p.add_argument('--path', default='/tmp/rss_long_run_tokens.bin')
    p.add_argument('--json', default='docs/img/rss_long_run.json')
    p.add_argument('--png', default='docs/img/rss_long_run.png', help="'' for none")
    args = p.parse_args()

    n_tokens = int(args.gb * 1e9 / 2)
    try:
        t0 = time.time()
        write_token_file(args.path, n_tokens)
        print(f"wrote {args.path}: {n_tokens:,} tokens, {os.path.getsize(args.path) / 1e9:.2f} GB "
              f"in {time.time() - t0:.0f} s")
        batches = Batches([prepare_data.read_tokens(args.path)], args.block_size, args.batch_size, 'cpu')
        torch.manual_seed(0)
        model = build_model('gpt', n_layer=1, n_head=2, n_embd=32, block_size=args.block_size, vocab_size=VOCAB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        curve = []
        t0 = time.time()
        for i in range(args.batches + 1):
            if i % args.every == 0:
                curve.append({'batch': i, 'seconds': round(time.time() - t0, 1),
                              **{k: round(v, 1) for k, v in memory_mib().items()}})
                print(curve[-1], flush=True)
            if i == args.batches:
                break
            x, y = batches.get(gen)
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        if os.path.exists(args.path):
            os.remove(args.path)

    results = {}
    if os.path.isfile(args.json):
        with open(args.json) as f:
            results = json.load(f)
    results[args.label] = {'gb': args.gb, 'batch_size': args.batch_size, 'block_size': args.block_size,
                           'torch': torch.__version__, 'curve': curve}
    os.makedirs(os.path.dirname(args.json) or '.', exist_ok=True)
    with open(args.json, 'w') as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")
    if args.png:
        plot(results, args.png)


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, r in results.items():
        batch = [p['batch'] for p in r['curve']]
        line, = ax.plot(batch, [p['VmRSS'] for p in r['curve']], label=f"{label}: VmRSS")
        ax.plot(batch, [p['RssFile'] for p in r['curve']], ls='--', color=line.get_color(), label=f"{label}: RssFile")
    first = next(iter(results.values()))
    ax.set(xlabel='batch', ylabel='resident memory (MiB)',
           title=f"{first['gb']:g} GB token file, batch {first['batch_size']} x {first['block_size']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == '__main__':
    main()
