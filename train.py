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

Every micro-step's randomness is a function of (seed, iteration, micro-step): the recurrence depth r
(the same on every DDP rank), the training batch (different on every rank) and the dropout / GRT
noise. So a resumed run repeats the uninterrupted one exactly, and evaluation, which draws its own
fixed batches, never shifts the training stream.
"""

import hashlib
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import MISSING, asdict, fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import prepare_data
from config import ConfigError, parse_config
from model import GPT, MODELS, PRESETS, build_model, from_checkpoint

# -----------------------------------------------------------------------------
# Settings (every key a config file or --key=value may set)

TRAIN_DEFAULTS = dict(
    # I/O
    out_dir='out',
    eval_interval=1000,  # evaluate (and maybe checkpoint) every this many iterations, and at max_iters
    eval_iters=100,  # batches per split and evaluation, split across DDP ranks
    log_interval=10,  # log.jsonl line and progress-bar update every this many iterations
    eval_only=False,  # evaluate once and exit
    always_save_checkpoint=False,  # checkpoint at every evaluation, not only when val loss improves
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
    compile=True,  # torch.compile by regions: every block once, never the whole model
    seed=1337,
    peak_flops=0.0,  # per-device peak for MFU; 0 = measured (CPU) or the datasheet figure (CUDA)
)
MODEL_FIELDS = sorted({f.name for config_class, _ in MODELS.values() for f in fields(config_class)})
DEFAULTS = {**TRAIN_DEFAULTS, **{name: None for name in MODEL_FIELDS}}

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (FLOP/s), matched against the device name
# in this order; set peak_flops for any other GPU.
GPU_PEAK_FLOPS = [('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12), ('GH200', 989e12),
                  ('A100', 312e12), ('L40S', 362e12), ('L4', 121e12), ('A10', 125e12), ('V100', 125e12)]


def fail(message):
    sys.exit(f"error: {message}")


# -----------------------------------------------------------------------------
# Devices, precision, randomness


def pick_device(name, local_rank):
    if name != 'auto':
        return name
    if torch.cuda.is_available():
        return f'cuda:{local_rank}'
    if torch.backends.mps.is_available():
        return 'mps'
    return 'cpu'


def cpu_has_native_bf16():
    """bf16 arithmetic in hardware (AVX-512 BF16 or AMX on x86, the BF16 extension on Arm): only then
    is CPU autocast faster than fp32; elsewhere it is emulated and slower."""
    try:
        with open('/proc/cpuinfo') as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {'avx512_bf16', 'amx_bf16', 'bf16'})


def pick_dtype(name, device_type):
    if name == 'auto':
        if device_type == 'cuda':
            return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'
        return 'bfloat16' if device_type == 'cpu' and cpu_has_native_bf16() else 'float32'
    if name not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    if name == 'float16' and device_type != 'cuda':
        fail("dtype=float16 needs CUDA (it trains with a GradScaler); use --dtype=bfloat16 or --dtype=float32")
    return name


def autocast_context(device_type, dtype):
    """Mixed precision: autocast to bf16/fp16, nothing for fp32 (train.py, sample.py and bench.py)."""
    if dtype == 'float32':
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def rng_key(*parts):
    """A 63-bit seed from any tuple of values, e.g. (seed, 'data', rank, iteration, micro_step)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), 'little') >> 1


_cpu_peak_cache = {}


def measure_cpu_peak(dtype, n=2048, repeats=5):
    """FLOP/s of one large matmul in the training dtype, best of a few: the CPU's practical peak."""
    if dtype not in _cpu_peak_cache:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm up
        best = float('inf')
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        _cpu_peak_cache[dtype] = 2 * n ** 3 / best
    return _cpu_peak_cache[dtype]


def peak_flops_for(device, ptdtype, override):
    if override > 0:
        return override
    if device.startswith('cuda'):
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:
            if key in name:
                return flops
        print(f"note: no datasheet peak for {name}; MFU is against A100's 312 TFLOPS, set --peak_flops=...")
        return 312e12
    if device == 'cpu':
        return measure_cpu_peak(ptdtype)
    return 0.0  # mps: unknown, MFU not shown


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


class Batches:
    """Windows of block_size + 1 tokens at uniformly random positions over all shards (a shard is
    picked in proportion to its windows, then an offset in it), nanoGPT-style from np.memmap."""

    def __init__(self, shards, block_size, batch_size, device):
        self.shards, self.block_size, self.batch_size, self.device = shards, block_size, batch_size, device
        self.windows = torch.tensor([len(s) - block_size for s in shards], dtype=torch.float64)
        if self.windows.max() < 1:
            fail(f"the data holds at most {int(self.windows.max()) + block_size} tokens a file, too few for "
                 f"block_size {block_size}; use a smaller block_size or more data")
        self.windows.clamp_(min=0)

    def get(self, generator):
        ids = torch.multinomial(self.windows, self.batch_size, replacement=True, generator=generator)
        offsets = (torch.rand(self.batch_size, generator=generator, dtype=torch.float64) * self.windows[ids]).long()
        rows = np.stack([self.shards[i][o:o + self.block_size + 1] for i, o in zip(ids.tolist(), offsets.tolist())])
        batch = torch.from_numpy(rows.astype(np.int64))
        if self.device.startswith('cuda'):
            batch = batch.pin_memory().to(self.device, non_blocking=True)  # overlaps with the GPU's work
        else:
            batch = batch.to(self.device)
        return batch[:, :-1], batch[:, 1:]


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
        foreign = sorted(set(explicit) - {f.name for f in fields(config_class)})
        if foreign:
            fail(f"{', '.join(foreign)} do not apply to model_type {model_type or 'gpt'!r}; "
                 f"remove them or set model_type")
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
# Schedule, checkpoints, log


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


def save_checkpoint(path, checkpoint):
    """Write to a temporary file, then rename: a crash or Ctrl-C mid-write never leaves a torn ckpt.pt."""
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
# Training


def main(argv=None):
    """Train as the command line (or argv) says; return {'iter_num', 'best_val_loss', 'val_loss'}."""
    try:
        c = parse_config(DEFAULTS, sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(e)

    for key in ('eval_interval', 'eval_iters', 'log_interval', 'batch_size', 'gradient_accumulation_steps'):
        if c[key] < 1:
            fail(f"{key} must be >= 1, got {c[key]}")

    # --- devices and processes: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE
    ddp = 'RANK' in os.environ and 'WORLD_SIZE' in os.environ
    rank, local_rank, world = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')) if ddp else (0, 0, 1)
    device = pick_device(c['device'], local_rank)
    device_type = device.split(':')[0]
    if ddp:
        if device_type == 'cuda':
            torch.cuda.set_device(device)
        dist.init_process_group('nccl' if device_type == 'cuda' else 'gloo')
    master = rank == 0
    if c['gradient_accumulation_steps'] % world:
        fail(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by the "
             f"{world} processes; it counts micro-steps over all ranks together")
    accum = c['gradient_accumulation_steps'] // world  # this rank's micro-steps per optimizer step
    dtype = pick_dtype(c['dtype'], device_type)
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
    autocast = autocast_context(device_type, dtype)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # --- data, model, optimizer
    train_shards, val_shards, meta = load_dataset(c['data_dir'], c['dataset'], master)
    ckpt_path = os.path.join(c['out_dir'], 'ckpt.pt')
    raw_model, checkpoint = init_model(c, meta, ckpt_path)
    model_type = next(name for name, (_, cls) in MODELS.items() if type(raw_model) is cls)
    block_size = c['block_size'] or raw_model.config.block_size  # may be shorter than a GPT-2's 1024
    if block_size > raw_model.config.block_size:
        fail(f"block_size={block_size} exceeds the model's {raw_model.config.block_size}; lower it")
    raw_model.to(device)
    optimizer = raw_model.configure_optimizers(c['weight_decay'], c['learning_rate'], (c['beta1'], c['beta2']), device_type)
    scaler = torch.amp.GradScaler('cuda', enabled=dtype == 'float16')
    data_gen = torch.Generator()  # reseeded for every batch: (seed, iteration, global micro-step)
    depth_gen = torch.Generator()  # reseeded for every micro-step: (seed, iteration, micro-step), rank-free
    iter_num, best_val_loss, tokens_seen, time_before = 0, float('inf'), 0, 0.0
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint['optimizer'])
        scaler.load_state_dict(checkpoint['scaler'])
        restore_rng_states(checkpoint['rng_states'], data_gen, depth_gen)
        iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
        tokens_seen, time_before = checkpoint['tokens'], checkpoint['time_s']
        checkpoint = None  # free the memory
    if c['compile']:
        raw_model.compile_regions()
    model = DDP(raw_model, device_ids=[local_rank] if device_type == 'cuda' else None) if ddp else raw_model
    train_batches = Batches(train_shards, block_size, c['batch_size'], device)
    val_batches = {'train': train_batches, 'val': Batches(val_shards, block_size, c['batch_size'], device)}
    tokens_per_iter = c['batch_size'] * block_size * accum * world
    peak = peak_flops_for(device, ptdtype, c['peak_flops']) if master else 0.0

    def train_batch(it, micro):
        # keyed on the global micro-step, so 2 ranks x 1 micro-step read what 1 rank x 2 would
        data_gen.manual_seed(rng_key(c['seed'], 'data', it, rank * accum + micro))
        return train_batches.get(data_gen)

    @torch.no_grad()
    def estimate_loss():
        """Mean loss over eval_iters fixed batches per split (the same every evaluation), split across ranks."""
        raw_model.eval()
        out = {}
        for split, batches in val_batches.items():
            total = torch.zeros(2, device=device)  # sum of losses, number of batches
            for k in range(rank, c['eval_iters'], world):
                gen = torch.Generator().manual_seed(rng_key(c['seed'], 'eval', split, k))
                x, y = batches.get(gen)
                with autocast:
                    _, loss = raw_model(x, y)
                total += torch.stack([loss.float(), torch.ones((), device=device)])
            if ddp:
                dist.all_reduce(total)
            out[split] = (total[0] / total[1]).item()
        raw_model.train()
        return out

    def checkpoint_dict():
        state = {k.removeprefix('_orig_mod.'): v for k, v in raw_model.state_dict().items()}
        return dict(model_type=model_type, model_args=asdict(raw_model.config), model=state,
                    optimizer=optimizer.state_dict(), scaler=scaler.state_dict(), iter_num=iter_num,
                    best_val_loss=best_val_loss, config=c, meta=meta, tokens=tokens_seen,
                    time_s=time_before + time.time() - t_start, rng_states=rng_states(data_gen, depth_gen))

    t_start = time.time()
    if c['eval_only']:
        losses = estimate_loss()
        if master:
            print(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        return dict(iter_num=iter_num, best_val_loss=best_val_loss, val_loss=losses['val'])

    # --- the log: a fresh run starts it, a resumed run cuts it back to the checkpoint
    log_path = os.path.join(c['out_dir'], 'log.jsonl')
    log = None
    if master:
        os.makedirs(c['out_dir'], exist_ok=True)
        if c['init_from'] == 'resume':
            truncate_log(log_path, iter_num)
        log = open(log_path, 'a' if c['init_from'] == 'resume' else 'w')
        n_params = raw_model.get_num_params()
        print(f"{model_type} model, {n_params / 1e6:.2f}M non-embedding parameters; {device}, {dtype}, "
              f"compile={c['compile']}, {world} process(es); {tokens_per_iter:,} tokens per iteration")

    pbar = tqdm(total=c['max_iters'], initial=iter_num, disable=not master, dynamic_ncols=True, desc='train')
    val_loss = None
    t_log, iters_since_log, depth_sum, depth_count = time.time(), 0, 0, 0
    x, y = train_batch(iter_num, 0)
    try:
        while iter_num < c['max_iters']:
            lr = get_lr(iter_num, c)
            for group in optimizer.param_groups:
                group['lr'] = lr
            iter_loss = torch.zeros((), device=device)
            depths = []
            for micro in range(accum):
                # r and the noise of this micro-step, drawn outside any compiled region
                depth_gen.manual_seed(rng_key(c['seed'], 'depth', iter_num, micro))
                num_steps = raw_model.sample_depth(depth_gen)
                torch.manual_seed(rng_key(c['seed'], 'noise', rank, iter_num, micro))
                if ddp:  # all-reduce gradients only on the last micro-step; must be set before forward
                    model.require_backward_grad_sync = micro == accum - 1
                with autocast:
                    _, loss = model(x, y, num_steps=num_steps)
                    loss = loss / accum
                # fetch the next batch while the device works on this one
                x, y = train_batch(iter_num, micro + 1) if micro + 1 < accum else train_batch(iter_num + 1, 0)
                scaler.scale(loss).backward()
                iter_loss += loss.detach()
                if num_steps is not None:
                    depths.append(num_steps)
            if c['grad_clip'] > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(raw_model.parameters(), c['grad_clip'])
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            iter_num += 1
            tokens_seen += tokens_per_iter
            iters_since_log += 1
            depth_sum, depth_count = depth_sum + sum(depths), depth_count + len(depths)
            pbar.update(1)

            evaluating = iter_num % c['eval_interval'] == 0 or iter_num == c['max_iters']
            if iter_num % c['log_interval'] and not evaluating:
                continue  # no host-device sync on the other iterations
            if ddp:
                dist.all_reduce(iter_loss, op=dist.ReduceOp.AVG)  # every rank sees the same loss
            lossf = iter_loss.item()
            if not math.isfinite(lossf):
                kept = f"the last good checkpoint {ckpt_path} is kept" if os.path.isfile(ckpt_path) else "no checkpoint was written"
                fail(f"loss is {lossf} at iteration {iter_num}; training stopped and {kept}; "
                     f"lower learning_rate, raise warmup_iters or use dtype=float32")
            dt = (time.time() - t_log) / iters_since_log
            mean_depth = depth_sum / depth_count if depth_count else None
            mfu = raw_model.estimate_mfu(tokens_per_iter // world, dt, peak, block_size, mean_depth) if peak else None
            record = dict(iter=iter_num, loss=lossf, lr=lr,
                          r=(depths[0] if len(depths) == 1 else sum(depths) / len(depths)) if depths else None,
                          tokens=tokens_seen, time_s=round(time_before + time.time() - t_start, 3),
                          mfu=None if mfu is None else round(mfu, 5))
            if master:
                postfix = dict(loss=f"{lossf:.4f}", tok_s=f"{tokens_per_iter / dt:,.0f}")
                if mfu is not None:
                    postfix['mfu'] = f"{100 * mfu:.1f}%"
                pbar.set_postfix(postfix, refresh=False)
            if evaluating:
                losses = estimate_loss()
                val_loss = record['val_loss'] = losses['val']
                record['eval_train_loss'] = losses['train']
                if master:
                    pbar.write(f"iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                improved = val_loss < best_val_loss
                best_val_loss = min(best_val_loss, val_loss)
                if master and (improved or c['always_save_checkpoint'] or iter_num == c['max_iters']):
                    save_checkpoint(ckpt_path, checkpoint_dict())
            if master:
                log.write(json.dumps(record) + '\n')
                log.flush()
            t_log, iters_since_log, depth_sum, depth_count = time.time(), 0, 0, 0
    except KeyboardInterrupt:
        pbar.close()
        if master:
            if iter_num > 0 and all(torch.isfinite(p).all() for p in raw_model.parameters()):
                save_checkpoint(ckpt_path, checkpoint_dict())
                print(f"\ninterrupted at iteration {iter_num}: saved {ckpt_path}; continue with --init_from=resume")
            else:
                print(f"\ninterrupted at iteration {iter_num}: nothing saved")
        sys.exit(130)
    pbar.close()
    if log is not None:
        log.close()
    if ddp:
        dist.destroy_process_group()
    return dict(iter_num=iter_num, best_val_loss=best_val_loss, val_loss=val_loss)


if __name__ == '__main__':
    main()
