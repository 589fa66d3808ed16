"""
Train a dense GPT-2 or a Gated Recurrent Transformer (GRT), on one device or many.

    python train.py config/shakespeare_char_grt.py                  # CPU, about 10 minutes
    python train.py config/grt_small.py --batch_size=8 --compile=False
    python train.py config/grt_small.py --init_from=resume         # continue exactly where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/grt_small.py

A config file is plain Python assignments; `--key=value` overrides it (config/__init__.py parses
both and refuses unknown keys). The model is `model_type` ('gpt', 'grt', ...) with its config fields
(n_layer, n_embd, n_recur, ...), or a named `preset` from model.py with fields overriding it; the
vocabulary size comes from the dataset's meta.json unless a config sets it.

out_dir receives log.jsonl (a line every log_interval iterations), ckpt.pt (the latest state, for
--init_from=resume: written at every evaluation, at max_iters and on Ctrl-C) and best.pt (the
weights with the best val loss so far, which sample.py and bench.py load by default).

Every micro-step's randomness is a function of (seed, iteration, micro-step): the recurrence depth r
(the same on every DDP rank), the training batch (different on every rank) and the dropout / GRT
noise. So a resumed run repeats the uninterrupted one exactly, and evaluation, which draws its own
fixed batches, never shifts the training stream.
"""

import json
import math
import os
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import prepare_data
from common import (CPU_BF16_MIN_WIDTH, Batches, autocast_context, cpu_bf16_speedup, fail, measure_cpu_peak,
                    peak_flops_for, pick_device, pick_dtype, read_settings, rng_key)
from model import GPT
from registry import MODELS, PRESETS, build_model, foreign_fields, from_checkpoint, model_type_of

# -----------------------------------------------------------------------------
# Settings (every key a config file or --key=value may set)

TRAIN_DEFAULTS = dict(
    # I/O
    out_dir='out',  # log.jsonl, ckpt.pt (the latest state, for resume) and best.pt (the best val loss)
    eval_interval=1000,  # evaluate and write ckpt.pt (and best.pt if val loss improved) every this many
                         # iterations and at max_iters; Ctrl-C writes ckpt.pt too
    eval_iters=100,  # batches per split and evaluation, split across DDP ranks
    log_interval=10,  # log.jsonl line and progress-bar update every this many iterations
    eval_only=False,  # evaluate once and exit
    init_from='scratch',  # 'scratch', 'resume' (from out_dir/ckpt.pt) or 'gpt2', 'gpt2-medium', ...
    # data
    dataset='fineweb10B',
    data_dir='data',  # datasets live in data_dir/<dataset>/, written by prepare_data.py
    batch_size=16,  # micro-batch per device
    gradient_accumulation_steps=32,  # micro-steps per optimizer step, over all DDP ranks together
    # model: model_type + fields, or a preset (the model fields are listed below, default None = unset)
    model_type='',  # a key of model.py's MODELS; '' = the preset's, else 'gpt'
    preset='',  # a key of model.py's PRESETS, e.g. 'grt-small-isoflop'
    # AdamW, warmup then cosine decay
    learning_rate=6e-4,
    max_iters=20000,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # clip the global gradient norm at this value; 0 disables
    decay_lr=True,
    warmup_iters=2000,
    lr_decay_iters=0,  # iterations of cosine decay to min_lr; 0 = max_iters
    min_lr=6e-5,
    # system
    device='auto',  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype='auto',  # 'auto', 'float32', 'bfloat16' or 'float16' (float16 only on CUDA, with a GradScaler)
    compile=None,  # True / False; None or 'auto': compile only on CUDA at n_embd >= 256, where it pays.
                   # torch.compile by regions: every block once, never the whole model
    seed=1337,
    peak_flops=0.0,  # per-device peak for MFU; 0 = measured (CPU) or the datasheet figure (CUDA)
)
MODEL_FIELDS = sorted({f.name for config_class, _ in MODELS.values() for f in fields(config_class)})
DEFAULTS = {**TRAIN_DEFAULTS, **{name: None for name in MODEL_FIELDS}}

# -----------------------------------------------------------------------------
# Data: random windows from memory-mapped token files, drawn by a seeded generator


def load_dataset(data_root, dataset, master):
    """(train shards, val shards, meta) as memmaps; shakespeare_char is prepared on the spot."""
    data_dir = os.path.join(data_root, dataset)
    if dataset == 'shakespeare_char' and not os.path.isfile(os.path.join(data_dir, 'meta.json')):
        if master:
            print(f"{data_dir} is missing: preparing it now (python prepare_data.py shakespeare_char)")
            try:
                prepare_data.prepare('shakespeare_char', data_dir=data_root)
            except ValueError as e:
                fail(e)
        if dist.is_initialized():
            dist.barrier()
    try:
        meta = prepare_data.load_meta(data_dir)
        splits = {split: [prepare_data.read_tokens(p) for p in prepare_data.token_files(data_dir, split)]
                  for split in ('train', 'val')}
    except ValueError as e:
        fail(e)
    return splits['train'], splits['val'], meta


# -----------------------------------------------------------------------------
# The model: from the config, a checkpoint or pretrained GPT-2


def requested_model(config, meta):
    """(model_type, fields) the config asks for: preset, then fields set explicitly, then the
    dataset's vocab_size unless set. model_type is '' when the config names none (a fresh model is
    then a 'gpt'; a resumed one is whatever the checkpoint holds)."""
    args = {}
    model_type = config['model_type']
    if config['preset']:
        if config['preset'] not in PRESETS:
            fail(f"unknown preset {config['preset']!r}; known presets: {', '.join(PRESETS)}")
        args = dict(PRESETS[config['preset']])
        preset_type = args.pop('model_type')
        if model_type and model_type != preset_type:
            fail(f"model_type={model_type!r} conflicts with preset {config['preset']!r} (a {preset_type!r}); drop one")
        model_type = preset_type
    if model_type and model_type not in MODELS:
        fail(f"unknown model_type {model_type!r}; known: {', '.join(MODELS)}")
    explicit = {k: config[k] for k in MODEL_FIELDS if config[k] is not None}
    config_class = MODELS[model_type or 'gpt'][0]
    for f in fields(config_class):
        if f.name in explicit and f.default not in (None, MISSING) and not _same_type(explicit[f.name], f.default):
            fail(f"config key {f.name!r} must be {type(f.default).__name__}, got {explicit[f.name]!r}")
    if model_type or config['init_from'] != 'resume':
        foreign = foreign_fields(model_type or 'gpt', explicit)
        if foreign:
            fail(f"{foreign}; leave out what does not apply, or set model_type")
    args.update(explicit)
    if 'vocab_size' not in explicit:
        args['vocab_size'] = meta['vocab_size']  # the dataset's vocabulary over any preset's
    elif explicit['vocab_size'] < meta['vocab_size']:
        fail(f"vocab_size={explicit['vocab_size']} is smaller than the dataset's {meta['vocab_size']}; raise it or drop it")
    return model_type, args


def _same_type(value, default):
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    return isinstance(value, type(default)) or (isinstance(default, float) and isinstance(value, int))


def check_checkpoint_matches(checkpoint, model_type, args, path):
    """Refuse a checkpoint whose model differs from what the config asks for, naming every field."""
    diffs = []
    if model_type and model_type != checkpoint['model_type']:
        diffs.append(f"model_type (checkpoint {checkpoint['model_type']!r}, config {model_type!r})")
    for k, v in args.items():
        if k != 'dropout' and checkpoint['model_args'].get(k, '<absent>') != v:  # dropout may change
            diffs.append(f"{k} (checkpoint {checkpoint['model_args'].get(k, '<absent>')!r}, config {v!r})")
    if diffs:
        fail(f"{path} holds a different model than the config: {'; '.join(diffs)}; "
             f"resume with the config it was trained with, or pick another out_dir")


def init_model(config, meta, ckpt_path):
    """(model, checkpoint or None). The seed is set first, so a fresh model is the same every run."""
    torch.manual_seed(config['seed'])
    model_type, args = requested_model(config, meta)
    init_from = config['init_from']
    try:
        if init_from == 'scratch':
            return build_model(model_type or 'gpt', **args), None
        if init_from == 'resume':
            if not os.path.isfile(ckpt_path):
                fail(f"init_from='resume' but {ckpt_path} does not exist; train from scratch first or fix out_dir")
            checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=False)  # our own file: RNG states
            check_checkpoint_matches(checkpoint, model_type, args, ckpt_path)
            dropout = {} if config['dropout'] is None else {'dropout': config['dropout']}
            return from_checkpoint(checkpoint, **dropout), checkpoint
        if init_from.startswith('gpt2'):
            model = GPT.from_pretrained(init_from, dropout=config['dropout'] or 0.0)
            if model.config.vocab_size < meta['vocab_size']:
                fail(f"{init_from} has {model.config.vocab_size} tokens, the dataset {meta['vocab_size']}")
            return model, None
    except (ValueError, TypeError) as e:
        fail(e)
    except OSError as e:
        fail(f"could not load pretrained {init_from!r} ({e}); it needs the Hugging Face hub or its cache")
    fail(f"init_from must be 'scratch', 'resume' or a GPT-2 name such as 'gpt2', got {init_from!r}")


# -----------------------------------------------------------------------------
# Schedule, memory, compile, checkpoints, log


def get_lr(it, c):
    """Linear warmup, then cosine decay from learning_rate to min_lr over lr_decay_iters."""
    if not c['decay_lr']:
        return c['learning_rate']
    if it < c['warmup_iters']:
        return c['learning_rate'] * (it + 1) / (c['warmup_iters'] + 1)
    decay_iters = c['lr_decay_iters'] or c['max_iters']
    if it >= decay_iters:
        return c['min_lr']
    ratio = (it - c['warmup_iters']) / max(1, decay_iters - c['warmup_iters'])
    return c['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (c['learning_rate'] - c['min_lr'])


def stored_block_passes(model):
    """Block passes whose activations backward keeps, at the deepest training pass: n_layer for a
    dense model; n_prelude + n_core * R + n_coda for a recurrent one (training draws r up to R;
    Huginn keeps only its last backprop_depth steps)."""
    c = model.config
    if not hasattr(model, 'num_block_passes'):
        return c.n_layer
    return model.num_block_passes(getattr(c, 'backprop_depth', c.n_recur))


def memory_estimate(model, batch_size, block_size, dtype, attention_matrix=False):
    """Analytic training memory per device, in bytes, for a micro-batch of batch_size x block_size:

      weights      the parameters as stored (fp32: autocast computes in 16-bit, keeps fp32 weights)
      grads        the same again
      optimizer    AdamW's two moments, the same again twice
      activations  stored_block_passes(model) x per pass, plus the logits:
                   per block pass 34 B T d + 5 B a T^2 bytes in 16-bit (Korthikanti et al. 2022,
                   "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1, no
                   parallelism; d = n_embd, a = n_head); in fp32 every 2-byte value takes 4 and the
                   dropout masks stay 1 byte: 66 B T d + 9 B a T^2. The a T^2 term is the attention
                   matrix: counted only with attention_matrix=True (compiled CPU training writes
                   attention out); F.scaled_dot_product_attention's fused kernels, used otherwise,
                   do not store it. Logits: B T V x (2 or 4 bytes + 4 for the fp32 log-softmax that
                   cross_entropy keeps).

    Not counted: GRT's W_proj, gate and update (about 8 B T d values a step), the embeddings' output,
    temporaries, the CUDA context and allocator slack (together typically 1-3 GB on a GPU)."""
    c = model.config
    B, T, d, a, V = batch_size, block_size, c.n_embd, c.n_head, c.vocab_size
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    half = dtype in ('bfloat16', 'float16')
    per_pass = (34 if half else 66) * B * T * d + (((5 if half else 9) * B * a * T * T) if attention_matrix else 0)
    passes = stored_block_passes(model)
    activations = passes * per_pass + B * T * V * ((2 if half else 4) + 4)
    total = weights + weights + 2 * weights + activations
    return dict(weights=weights, grads=weights, optimizer=2 * weights, activations=activations,
                block_passes=passes, total=total)


def describe_memory(est, device, batch_size, block_size):
    """One line of memory_estimate in GiB, against this GPU's memory or the 80 GB the paper configs assume."""
    gib = 2 ** 30
    if device.startswith('cuda'):
        capacity = torch.cuda.get_device_properties(device).total_memory
        against = f"this GPU has {capacity / gib:.1f} GiB"
    else:
        capacity = 80e9
        against = f"an 80 GB GPU, as the paper configs assume, has {capacity / gib:.1f} GiB"
    return (f"memory per device (analytic, micro-batch {batch_size} x {block_size}): weights "
            f"{est['weights'] / gib:.2f} + grads {est['grads'] / gib:.2f} + AdamW {est['optimizer'] / gib:.2f} + "
            f"activations {est['activations'] / gib:.2f} ({est['block_passes']} block passes) = "
            f"{est['total'] / gib:.2f} GiB ({against})"), est['total'] > capacity


def resolve_compile(setting, device_type, n_embd):
    """(compile or not, a line saying why 'auto' turned it off, else None). compile=True or False
    forces it; 'auto' (or None, the default) compiles only on CUDA with n_embd >= 256: on a CPU,
    and for narrow models, compiling (a minute or more) costs more than it saves."""
    if setting is True or setting is False:
        return setting, None
    if setting not in (None, 'auto'):
        fail(f"compile must be True, False or 'auto', got {setting!r}")
    if device_type != 'cuda':
        return False, (f"compile='auto': off on {device_type}, where compiling costs more than it saves; "
                       f"--compile=True forces it")
    if n_embd < 256:
        return False, (f"compile='auto': off at n_embd={n_embd} (< 256), where compiling costs more than it "
                       f"saves; --compile=True forces it")
    return True, None


def save_checkpoint(path, checkpoint):
    """Write to a temporary file, then rename: a crash or Ctrl-C mid-write never leaves a torn file."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def truncate_log(path, iter_num):
    """Keep the log lines up to the checkpoint's iteration: the resumed run writes the rest again."""
    if not os.path.isfile(path):
        return
    def keep(line):
        try:
            return json.loads(line)['iter'] <= iter_num
        except (ValueError, KeyError):
            return False  # a line torn by a hard kill
    with open(path) as f:
        lines = [line for line in f if keep(line)]
    with open(path + '.tmp', 'w') as f:
        f.writelines(lines)
    os.replace(path + '.tmp', path)


def rng_states(data_gen, depth_gen):
    states = dict(torch=torch.get_rng_state(), numpy=np.random.get_state(), python=random.getstate(),
                  data=data_gen.get_state(), depth=depth_gen.get_state())
    if torch.cuda.is_available():
        states['cuda'] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states, data_gen, depth_gen):
    torch.set_rng_state(states['torch'])
    np.random.set_state(states['numpy'])
    random.setstate(states['python'])
    data_gen.set_state(states['data'])
    depth_gen.set_state(states['depth'])
    if 'cuda' in states and torch.cuda.is_available() and len(states['cuda']) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states['cuda'])


# -----------------------------------------------------------------------------
# Setup: what training builds once, and what it has done so far


@dataclass
class Run:
    """Everything setup() builds, fixed while training runs."""
    c: dict  # the config
    ddp: bool
    rank: int
    world: int  # processes
    device: str
    dtype: str
    autocast: object  # the mixed-precision context of every forward pass
    accum: int  # this rank's micro-steps per iteration
    model: torch.nn.Module
    trained: torch.nn.Module  # what the training step calls: the model, or its DDP wrapper
    model_type: str
    meta: dict  # the dataset's meta.json, stored in checkpoints for sample.py
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    batches: dict  # 'train', 'val' -> Batches
    data_gen: torch.Generator  # reseeded for every batch: (seed, iteration, global micro-step)
    depth_gen: torch.Generator  # reseeded for every micro-step: (seed, iteration, micro-step), rank-free
    block_size: int
    tokens_per_iter: int  # over all ranks
    compiled: bool
    peak: float = 0.0  # per-device peak FLOP/s for MFU (rank 0 only); 0 = not shown
    peak_remeasured: int = 0  # times the CPU's peak was measured again (see log_record)
    mfu_withheld: bool = False  # an MFU above 100% was withheld, with a warning (see log_record)

    @property
    def master(self):
        return self.rank == 0

    @property
    def ckpt_path(self):
        return os.path.join(self.c['out_dir'], 'ckpt.pt')

    @property
    def best_path(self):
        return os.path.join(self.c['out_dir'], 'best.pt')


@dataclass
class Progress:
    """What the run has done; ckpt.pt stores it, and a resumed run continues from it."""
    iter_num: int = 0
    best_val_loss: float = math.inf
    tokens: int = 0  # training tokens seen, all ranks together
    time_before: float = 0.0  # training seconds of the runs this one resumes
    started: float = 0.0  # time.time() when this process's training began

    def time_s(self):
        return self.time_before + time.time() - self.started


def start_processes(c):
    """(ddp, rank, local_rank, world, device): one process, or torchrun's (it sets RANK, LOCAL_RANK
    and WORLD_SIZE), each on its device."""
    ddp = 'RANK' in os.environ and 'WORLD_SIZE' in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
    device = pick_device(c['device'], local_rank)
    if ddp:
        if device.startswith('cuda'):
            torch.cuda.set_device(device)
        dist.init_process_group('nccl' if device.startswith('cuda') else 'gloo')
    if c['gradient_accumulation_steps'] % world:
        fail(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by the "
             f"{world} processes; it counts micro-steps over all ranks together")
    if device.startswith('cuda'):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return ddp, rank, local_rank, world, device


def setup(c):
    """Everything before the first step: processes, device and dtype, data, model, optimizer, the
    resumed state, compilation and the peak for MFU. Returns (Run, Progress)."""
    for key in ('eval_interval', 'eval_iters', 'log_interval', 'batch_size', 'gradient_accumulation_steps'):
        if c[key] < 1:
            fail(f"{key} must be >= 1, got {c[key]}")
    ddp, rank, local_rank, world, device = start_processes(c)
    device_type = device.split(':')[0]
    if c['dtype'] != 'auto':  # a wrong dtype stops (a slow one warns) before any download
        pick_dtype(c['dtype'], device_type, warn=rank == 0)
    train_shards, val_shards, meta = load_dataset(c['data_dir'], c['dataset'], rank == 0)
    ckpt_path = os.path.join(c['out_dir'], 'ckpt.pt')
    if rank == 0:
        print({'scratch': "initializing a new model", 'resume': f"resuming from {ckpt_path}"}.get(
            c['init_from'], f"loading pretrained {c['init_from']}"), flush=True)
    model, checkpoint = init_model(c, meta, ckpt_path)
    dtype = pick_dtype(c['dtype'], device_type, warn=False, n_embd=model.config.n_embd)  # 'auto' by width
    if ddp and device_type == 'cpu':  # each rank measured its own bf16 speed for 'auto': all train in rank 0's choice
        choice = [dtype]
        dist.broadcast_object_list(choice, src=0)
        dtype = choice[0]
    block_size = c['block_size'] or model.config.block_size  # may be shorter than a GPT-2's 1024
    if block_size > model.config.block_size:
        fail(f"block_size={block_size} exceeds the model's {model.config.block_size}; lower it")
    model.to(device)
    optimizer = model.configure_optimizers(c['weight_decay'], c['learning_rate'], (c['beta1'], c['beta2']), device_type)
    scaler = torch.amp.GradScaler('cuda', enabled=dtype == 'float16')
    data_gen, depth_gen = torch.Generator(), torch.Generator()
    progress = Progress()
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        scaler.load_state_dict(checkpoint['scaler'])
        restore_rng_states(checkpoint['rng_states'], data_gen, depth_gen)
        progress = Progress(checkpoint['iter_num'], checkpoint['best_val_loss'], checkpoint['tokens'],
                            checkpoint['time_s'])
        checkpoint = None  # free the memory
    compiled, compile_note = resolve_compile(c['compile'], device_type, model.config.n_embd)
    if compiled:
        model.compile_regions()  # compiles each block on first use: the first iterations are slow
    accum = c['gradient_accumulation_steps'] // world
    run = Run(c=c, ddp=ddp, rank=rank, world=world, device=device, dtype=dtype,
              autocast=autocast_context(device_type, dtype), accum=accum, model=model,
              trained=DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None) if ddp else model,
              model_type=model_type_of(model), meta=meta, optimizer=optimizer, scaler=scaler,
              batches={'train': Batches(train_shards, block_size, c['batch_size'], device),
                       'val': Batches(val_shards, block_size, c['batch_size'], device)},
              data_gen=data_gen, depth_gen=depth_gen, block_size=block_size,
              tokens_per_iter=c['batch_size'] * block_size * accum * world, compiled=compiled)
    if run.master:
        announce(run, progress, compile_note)
        run.peak = peak_flops_for(device, getattr(torch, dtype), c['peak_flops'], verbose=True)
    return run, progress


def announce(run, progress, compile_note):
    """Rank 0's start-up lines: the model and run, why compile='auto' chose off, the memory estimate."""
    c, model = run.c, run.model
    resumed = f"; from iteration {progress.iter_num}" if progress.iter_num else ""
    print(f"{run.model_type} model, {model.get_num_params() / 1e6:.2f}M non-embedding parameters; {run.device}, "
          f"{run.dtype}, compile={run.compiled}, {run.world} process(es); {run.tokens_per_iter:,} tokens per "
          f"iteration{resumed}")
    if compile_note:
        print(compile_note)
    on_cpu = run.device == 'cpu'
    if on_cpu and c['dtype'] == 'auto' and model.config.n_embd >= CPU_BF16_MIN_WIDTH:  # the speed decided it
        print(f"dtype='auto' chose {run.dtype}: bf16 matrix products measured {cpu_bf16_speedup():.2f}x as fast "
              "as fp32 on this CPU")
    estimate = memory_estimate(model, c['batch_size'], run.block_size, run.dtype, attention_matrix=run.compiled and on_cpu)
    line, too_big = describe_memory(estimate, run.device, c['batch_size'], run.block_size)
    print(line)
    if too_big and run.device.startswith('cuda'):
        print("warning: the estimate exceeds this GPU's memory; lower batch_size and raise "
              "gradient_accumulation_steps by the same factor", file=sys.stderr)


# -----------------------------------------------------------------------------
# The step, evaluation, checkpoints


def train_batch(run, it, micro):
    """This rank's batch for micro-step `micro` of iteration it, keyed on the global micro-step, so
    2 ranks x 1 micro-step read what 1 rank x 2 would."""
    run.data_gen.manual_seed(rng_key(run.c['seed'], 'data', it, run.rank * run.accum + micro))
    return run.batches['train'].get(run.data_gen)


def train_step(run, it, batch, lr):
    """Iteration it: accum micro-steps of forward and backward, clipping, one AdamW step. batch is
    its first batch; the next one is fetched while the device works. Returns (mean loss, a tensor;
    the depths r drawn; the next iteration's first batch)."""
    c, model = run.c, run.trained
    for group in run.optimizer.param_groups:
        group['lr'] = lr
    if hasattr(run.model, 'set_iteration'):  # a schedule inside the model (MoR's capacity warm-up)
        run.model.set_iteration(it)
    loss_sum, depths = torch.zeros((), device=run.device), []
    x, y = batch
    for micro in range(run.accum):
        # r and the noise of this micro-step, drawn outside any compiled region
        run.depth_gen.manual_seed(rng_key(c['seed'], 'depth', it, micro))
        num_steps = run.model.sample_depth(run.depth_gen)
        torch.manual_seed(rng_key(c['seed'], 'noise', run.rank, it, micro))
        if run.ddp:  # all-reduce gradients only on the last micro-step; must be set before forward
            model.require_backward_grad_sync = micro == run.accum - 1
        with run.autocast:
            _, loss = model(x, y, num_steps=num_steps)
            loss = loss / run.accum
        x, y = train_batch(run, it, micro + 1) if micro + 1 < run.accum else train_batch(run, it + 1, 0)
        run.scaler.scale(loss).backward()
        loss_sum += loss.detach()
        if num_steps is not None:
            depths.append(num_steps)
    if c['grad_clip'] > 0:
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), c['grad_clip'])
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum, depths, (x, y)


@torch.no_grad()
def evaluate(run):
    """Mean loss over eval_iters fixed batches per split (the same every evaluation), split across
    ranks; evaluation draws from its own generators, so it never shifts the training stream."""
    c, model = run.c, run.model
    model.eval()
    out = {}
    for split, batches in run.batches.items():
        total = torch.zeros(2, device=run.device)  # sum of losses, number of batches
        for k in range(run.rank, c['eval_iters'], run.world):
            x, y = batches.get(torch.Generator().manual_seed(rng_key(c['seed'], 'eval', split, k)))
            with run.autocast:
                _, loss = model(x, y)
            total += torch.stack([loss.float(), torch.ones((), device=run.device)])
        if run.ddp:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


def model_state(model):
    return {k.removeprefix('_orig_mod.'): v for k, v in model.state_dict().items()}


def latest_checkpoint(run, progress):
    """ckpt.pt: everything a resumed run needs to continue exactly as if never stopped."""
    return dict(model_type=run.model_type, model_args=asdict(run.model.config), model=model_state(run.model),
                optimizer=run.optimizer.state_dict(), scaler=run.scaler.state_dict(), iter_num=progress.iter_num,
                best_val_loss=progress.best_val_loss, config=run.c, meta=run.meta, tokens=progress.tokens,
                time_s=progress.time_s(), rng_states=rng_states(run.data_gen, run.depth_gen))


def best_checkpoint(run, progress, val_loss):
    """best.pt: the weights with the best val loss so far (no optimizer state), for sample.py,
    bench.py and analyze.py."""
    return dict(model_type=run.model_type, model_args=asdict(run.model.config), model=model_state(run.model),
                meta=run.meta, config=run.c, iter_num=progress.iter_num, val_loss=val_loss)


def stop_non_finite(run, what, value, it):
    kept = f"the last good checkpoint {run.ckpt_path} is kept" if os.path.isfile(run.ckpt_path) else "no checkpoint was written"
    fail(f"{what} is {value} at iteration {it}; training stopped and {kept}; "
         f"lower learning_rate, raise warmup_iters or use dtype=float32")


def say(run, bar, text):
    """Say what the run is doing: as the progress bar's label while the bar runs, else as a line."""
    if not run.master:
        return
    if bar is None:
        print(f"{text} ...", flush=True)
    else:
        bar.set_description(text, refresh=True)


def evaluate_and_save(run, progress, bar):
    """Evaluate; then (rank 0) write best.pt if val loss improved, and ckpt.pt. bar: the running
    progress bar, or None after the last iteration. Returns the losses."""
    say(run, bar, f"evaluating ({run.c['eval_iters']} batches a split)")
    losses = evaluate(run)
    if not math.isfinite(losses['val']):
        stop_non_finite(run, 'val loss', losses['val'], progress.iter_num)
    improved = losses['val'] < progress.best_val_loss
    progress.best_val_loss = min(progress.best_val_loss, losses['val'])
    if run.master:
        (print if bar is None else bar.write)(f"iter {progress.iter_num}: train loss {losses['train']:.4f}, "
                                              f"val loss {losses['val']:.4f}")
        say(run, bar, f"saving {' and '.join([run.best_path] * improved + [run.ckpt_path])}")
        if improved:
            save_checkpoint(run.best_path, best_checkpoint(run, progress, losses['val']))
        save_checkpoint(run.ckpt_path, latest_checkpoint(run, progress))
        if bar is not None:
            bar.set_description('train', refresh=False)
    return losses


def log_record(run, progress, loss, lr, depths, window_depths, dt):
    """The log.jsonl line of the iteration just done; stops the run on a non-finite loss. depths:
    its r's; window_depths: every r since the last line, for MFU; dt: seconds per iteration."""
    if run.ddp:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # every rank sees the same loss
    lossf = loss.item()
    if not math.isfinite(lossf):
        stop_non_finite(run, 'loss', lossf, progress.iter_num)
    mean_depth = sum(window_depths) / len(window_depths) if window_depths else None
    mfu = (run.model.estimate_mfu(run.tokens_per_iter // run.world, dt, run.peak, run.block_size, mean_depth)
           if run.peak else None)
    if mfu is not None and mfu > 1 and run.device == 'cpu' and run.c['peak_flops'] <= 0 and run.peak_remeasured < 3:
        # faster than the measured peak: that measurement ran while other work loaded the cores, so
        # measure again (keeping the higher figure) rather than show an MFU above 100%
        run.peak_remeasured += 1
        run.peak = measure_cpu_peak(getattr(torch, run.dtype), again=True)
        mfu = run.model.estimate_mfu(run.tokens_per_iter // run.world, dt, run.peak, run.block_size, mean_depth)
    if mfu is not None and mfu > 1:  # the peak is wrong for this device: say so once, never show the figure
        if not run.mfu_withheld:
            tqdm.write(f"warning: MFU would be {100 * mfu:.0f}% against a {run.dtype} peak of {run.peak / 1e9:.1f} "
                       f"GFLOP/s, so that peak is wrong for this device; MFU not reported (set --peak_flops=...)",
                       file=sys.stderr)
        run.mfu_withheld, mfu = True, None
    return dict(iter=progress.iter_num, loss=lossf, lr=lr,
                r=(depths[0] if len(depths) == 1 else sum(depths) / len(depths)) if depths else None,
                tokens=progress.tokens, time_s=round(progress.time_s(), 3), mfu=None if mfu is None else round(mfu, 5))


def open_log(run, iter_num):
    """out_dir/log.jsonl on rank 0: a fresh run starts it, a resumed one cuts it back to the
    checkpoint's iteration and appends."""
    if not run.master:
        return None
    os.makedirs(run.c['out_dir'], exist_ok=True)
    path = os.path.join(run.c['out_dir'], 'log.jsonl')
    resume = run.c['init_from'] == 'resume'
    if resume:
        truncate_log(path, iter_num)
    return open(path, 'a' if resume else 'w')


# -----------------------------------------------------------------------------
# Training


@contextmanager
def stop_signals_between_iterations():
    """Within it, Ctrl-C (SIGINT) and SIGTERM (how torchrun passes a stop on to its workers, and how
    clusters preempt) set the yielded event instead of interrupting, and train stops at the next
    iteration boundary: a checkpoint then never holds weights a step ahead of its iter_num, nor a
    log one missing the iteration before it. A signal that is ignored or handled by someone else,
    or every signal off the main thread, is left as it was."""
    interrupted = threading.Event()
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                installed[sig] = signal.signal(sig, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


def stop_requested(run, interrupted):
    """Whether a stop signal arrived, here or under DDP on any rank: the ranks agree (one small
    all-reduce an iteration), so all stop at the same iteration and none is left waiting in a
    collective that the others have left."""
    if not run.ddp:
        return interrupted.is_set()
    flag = torch.tensor(float(interrupted.is_set()), device=run.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def train(run, progress):
    """Steps until max_iters: a log line every log_interval iterations; evaluation, best.pt (if
    better) and ckpt.pt every eval_interval and at max_iters; ckpt.pt on Ctrl-C or SIGTERM. Returns the last
    val loss (None if it did not evaluate)."""
    c = run.c
    log = open_log(run, progress.iter_num)
    bar = tqdm(total=c['max_iters'], initial=progress.iter_num, disable=not run.master, dynamic_ncols=True,
               desc='compiling' if run.compiled else 'train')
    losses, since_log, window_depths = None, 0, []
    progress.started = t_log = time.time()
    batch = train_batch(run, progress.iter_num, 0)
    with stop_signals_between_iterations() as interrupted:
        try:
            while progress.iter_num < c['max_iters']:
                if stop_requested(run, interrupted):
                    raise KeyboardInterrupt
                lr = get_lr(progress.iter_num, c)
                loss, depths, batch = train_step(run, progress.iter_num, batch, lr)
                progress.iter_num += 1
                progress.tokens += run.tokens_per_iter
                since_log += 1
                window_depths += depths
                if run.compiled and since_log == 1:
                    bar.set_description('train', refresh=False)
                bar.update(1)
                last = progress.iter_num == c['max_iters']
                evaluating = progress.iter_num % c['eval_interval'] == 0 or last
                if progress.iter_num % c['log_interval'] and not evaluating:
                    continue  # no host-device sync on the other iterations
                dt = (time.time() - t_log) / since_log
                record = log_record(run, progress, loss, lr, depths, window_depths, dt)
                postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{run.tokens_per_iter / dt:,.0f}")
                if record['mfu'] is not None:
                    postfix['mfu'] = f"{100 * record['mfu']:.1f}%"
                bar.set_postfix(postfix, refresh=False)
                if last:
                    bar.close()  # the final evaluation and checkpoint say so on lines of their own
                if evaluating:
                    losses = evaluate_and_save(run, progress, None if last else bar)
                    record.update(val_loss=losses['val'], eval_train_loss=losses['train'])
                if log:
                    log.write(json.dumps(record) + '\n')
                    log.flush()
                since_log, window_depths, t_log = 0, [], time.time()
        except KeyboardInterrupt:
            bar.close()
            if run.master:
                if progress.iter_num > 0 and all(torch.isfinite(p).all() for p in run.model.parameters()):
                    print(f"\ninterrupted at iteration {progress.iter_num}: saving {run.ckpt_path} ...", flush=True)
                    save_checkpoint(run.ckpt_path, latest_checkpoint(run, progress))
                    print(f"saved {run.ckpt_path}; continue with --init_from=resume")
                else:
                    print(f"\ninterrupted at iteration {progress.iter_num}: nothing saved")
            sys.exit(130)
    bar.close()
    if log:
        log.close()
    if run.master and losses is not None:
        print(f"done: {progress.iter_num} iterations, {progress.tokens:,} tokens, {progress.time_s():.0f} s of "
              f"training; best val loss {progress.best_val_loss:.4f} in {run.best_path}, the latest state in "
              f"{run.ckpt_path}")
    elif run.master:
        print(f"nothing to train: {run.ckpt_path} is at iteration {progress.iter_num}, max_iters is "
              f"{c['max_iters']}; raise max_iters to continue")
    return None if losses is None else losses['val']


def main(argv=None):
    """Train as the command line (or argv) says; return {'iter_num', 'best_val_loss', 'val_loss'}."""
    c = read_settings(DEFAULTS, argv)
    try:
        run, progress = setup(c)
    except KeyboardInterrupt:
        print("\ninterrupted before training began: nothing saved")
        sys.exit(130)
    if c['eval_only']:
        say(run, None, f"evaluating ({c['eval_iters']} batches a split)")
        losses = evaluate(run)
        if run.master:
            print(f"iter {progress.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        val_loss = losses['val']
    else:
        val_loss = train(run, progress)
    if run.ddp:
        dist.destroy_process_group()
    return dict(iter_num=progress.iter_num, best_val_loss=progress.best_val_loss, val_loss=val_loss)


if __name__ == '__main__':
    main()
