"""
Training memory per GPU, estimated analytically, for config files at their own micro-batch, against
the 80 GB the paper configs assume. Each model is built on the meta device (no memory, no time) with
the config's real block_size, width and layout, as train.py builds it.

    python -m benchmarks.memory config/grt_small.py
    python -m benchmarks.memory config/gpt2_*.py config/grt_*.py
    python -m benchmarks.memory config/grt_large.py --batch_size=8     # --key=value applies to each config

Per device (DDP keeps a whole copy on each), in bytes, for a micro-batch of B x T:

  weights      the parameters in fp32 (autocast computes in 16-bit, keeps fp32 weights)
  grads        the same again
  AdamW        its two moments: twice the weights
  activations  34 B T d bytes a block pass in 16-bit, 66 in fp32 (Korthikanti et al. 2022, "Reducing
               Activation Recomputation in Large Transformer Models", Sec. 4.1, without the 5 B a T^2
               attention matrix, which F.scaled_dot_product_attention does not store), over the block
               passes backward keeps at the deepest training depth, plus the logits: B T V x (2 or 4
               bytes + 4 for cross_entropy's fp32 log-softmax)

Not counted: the GRT's W_proj and gate (about 8 B T d values a step), temporaries, the CUDA context
and the allocator's slack (together typically 1-3 GB).
"""

import os
import sys

import torch

import prepare_data
import train
from common import fail, read_settings
from registry import build_model

GPU_BYTES = 80e9
GIB = 2 ** 30
KNOWN_VOCAB = {'shakespeare_char': 65, 'shakespeare': prepare_data.GPT2_VOCAB_SIZE,
               'fineweb10B': prepare_data.GPT2_VOCAB_SIZE}  # when the dataset is not prepared here


def stored_block_passes(model):
    """Block passes whose activations backward keeps at the deepest training depth: n_layer for a
    dense model; n_prelude + n_core * steps + n_coda for a recurrent one, steps = R, or backprop_depth
    where it is smaller (truncated backprop). Huginn's heavy-tailed draw has no deepest depth: its
    configs set backprop_depth, and without one R is counted."""
    c = model.config
    if not hasattr(model, 'num_block_passes'):
        return c.n_layer
    if c.train_depth == 'heavy':
        return model.num_block_passes(c.backprop_depth or c.n_recur)
    return model.num_block_passes(min(c.backprop_depth or c.n_recur, c.n_recur))


def memory_estimate(model, batch_size, block_size, dtype):
    """The analytic training memory per device in bytes, by part (see the module docstring)."""
    c = model.config
    B, T, d, V = batch_size, block_size, c.n_embd, c.vocab_size
    weights = sum(p.numel() * 4 for p in model.parameters())  # fp32; the tied head counts once
    half = dtype in ('bfloat16', 'float16')
    passes = stored_block_passes(model)
    activations = passes * (34 if half else 66) * B * T * d + B * T * V * ((2 if half else 4) + 4)
    return dict(weights=weights, grads=weights, optimizer=2 * weights, activations=activations,
                block_passes=passes, total=4 * weights + activations)


def config_estimate(path, overrides=()):
    """(settings, model on the meta device, memory_estimate) of one config file as train.py reads it;
    dtype 'auto' is a GPU's bf16."""
    c = read_settings(train.DEFAULTS, [path, *overrides])
    if c['dataset'].startswith('task:'):
        fail(f"{path} trains on a depth task; its memory is a CPU run's, not a GPU's")
    try:
        meta = prepare_data.load_meta(os.path.join(c['data_dir'], c['dataset']))
    except ValueError:
        meta = {'vocab_size': c['vocab_size'] or KNOWN_VOCAB.get(c['dataset'])}
        if not meta['vocab_size']:
            fail(f"{path}: dataset {c['dataset']!r} is not prepared and sets no vocab_size; set --vocab_size=...")
    model_type, args = train.requested_model(c, meta)
    with torch.device('meta'):
        model = build_model(model_type or 'gpt', **args)
    block_size = c['block_size'] or model.config.block_size
    dtype = 'bfloat16' if c['dtype'] == 'auto' else c['dtype']
    return c, model, memory_estimate(model, c['batch_size'], block_size, dtype)


def main(argv=None):
    """Print a line per config; return {path: estimate} (the command exits 1 if any does not fit)."""
    argv = sys.argv[1:] if argv is None else argv
    paths, overrides = [a for a in argv if not a.startswith('--')], [a for a in argv if a.startswith('--')]
    if not paths:
        fail("name one or more config files, e.g. python -m benchmarks.memory config/grt_small.py")
    estimates = {}
    for path in paths:
        c, model, est = config_estimate(path, overrides)
        estimates[path] = est
        fits = est['total'] <= GPU_BYTES
        print(f"{path}: micro-batch {c['batch_size']} x {c['block_size'] or model.config.block_size}, "
              f"{est['block_passes']} block passes: weights {est['weights'] / GIB:.2f} + "
              f"grads {est['grads'] / GIB:.2f} "
              f"+ AdamW {est['optimizer'] / GIB:.2f} + activations {est['activations'] / GIB:.2f} = "
              f"{est['total'] / GIB:.2f} GiB of {GPU_BYTES / GIB:.1f} GiB (80 GB): "
              + ("fits" if fits else "does not fit; halve batch_size and double gradient_accumulation_steps"))
    return estimates


if __name__ == '__main__':
    sys.exit(1 if any(est['total'] > GPU_BYTES for est in main().values()) else 0)
