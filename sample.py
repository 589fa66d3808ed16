"""
Sample from a trained model, streaming the text as it is generated.

    python sample.py --out_dir=out-shakespeare-char-grt
    python sample.py --out_dir=out-shakespeare-char-grt --start="ROMEO:" --kv_mode=mean   # at its trained R
    python sample.py --init_from=gpt2 --start=FILE:prompt.txt      # OpenAI's GPT-2 (needs transformers)

Settings are read by the same parser as train.py (config files and --key=value). The checkpoint
carries its tokenizer (meta.json's char vocabulary or the GPT-2 BPE), so no data directory is needed.
"""

import os
import sys

import torch

import prepare_data
from common import autocast_context, fail, load_model, pick_device, pick_dtype, read_settings, share_cores
from early_exit import EarlyExit, ExitingModel, check_early_exit
from model import RecurrentLM

DEFAULTS = dict(
    init_from='resume',  # 'resume' (a checkpoint in out_dir, written by train.py) or 'gpt2', 'gpt2-medium', ...
    out_dir='out',
    ckpt='best.pt',  # in out_dir: 'best.pt' (best val loss) or 'ckpt.pt' (the latest, as training left it)
    start='\n',  # the prompt, or 'FILE:path' to read it from a file
    num_samples=3,
    max_new_tokens=500,
    temperature=0.8,  # 1.0 = the model's distribution, lower = more conservative, 0 = greedy
    top_k=200,  # keep only the top_k most likely tokens; None keeps all
    seed=1337,
    num_steps=None,  # GRT: recurrence steps R at generation; None = the R it was trained with
    kv_mode='per_step',  # GRT core KV cache: 'per_step' (exact), 'shared' or 'mean' (kv_cache.recurrent_kv_cache)
    exit='state',  # early exit's criterion (recurrent models): 'state' (relative state change) or 'kl' (early_exit.py)
    exit_threshold=None,  # per-token early exit below this criterion value; None = every token runs num_steps
    min_steps=1,  # early exit: the fewest recurrence steps a token runs
    device='auto',  # 'auto' (cuda > mps > cpu), 'cpu', 'cuda', ...
    dtype='auto',  # 'auto', 'float32', 'bfloat16' or 'float16', as in train.py
)


def read_prompt(start):
    if start.startswith('FILE:'):
        path = start[len('FILE:'):]
        if not os.path.isfile(path):
            fail(f"prompt file {path} not found; pass --start=FILE:<existing file> or the text itself")
        with open(path, encoding='utf-8') as f:
            return f.read()
    return start


def prompt_ids(c, encode, block_size):
    """The prompt's token ids, cropped to the last block_size with a warning."""
    try:
        ids = encode(read_prompt(c['start']))
    except ValueError as e:  # a char vocabulary lacks some of the prompt's characters
        fail(f"{e}; change --start")
    if not ids:
        fail("the prompt is empty; pass --start with at least one character")
    if len(ids) > block_size:
        print(f"warning: the prompt has {len(ids)} tokens, more than block_size {block_size}; "
              f"keeping its last {block_size}", file=sys.stderr)
        ids = ids[-block_size:]
    return ids


def check_generation_args(model, c):
    """The model that generates (with early exit if asked); every setting it refuses stops with a one-line fix."""
    if c['kv_mode'] not in model.kv_modes:
        fail(f"kv_mode {c['kv_mode']!r} is not available for this {type(model).__name__}; "
             f"choose one of {', '.join(model.kv_modes)}")
    if not isinstance(model, RecurrentLM) and c['num_steps'] is not None:
        fail("num_steps applies to a recurrent model (GRT and the baselines); this checkpoint is dense, leave it unset")
    if c['num_steps'] is not None and (not isinstance(c['num_steps'], int) or c['num_steps'] < 1):
        fail(f"num_steps must be an integer >= 1 (the model was trained with R = {model.config.n_recur}), "
             f"got {c['num_steps']!r}")
    if c['temperature'] < 0:
        fail(f"temperature must be >= 0 (0 = greedy), got {c['temperature']}")
    if c['top_k'] is not None and (not isinstance(c['top_k'], int) or c['top_k'] < 1):
        fail(f"top_k must be an integer >= 1 or None, got {c['top_k']!r}")
    if c['exit_threshold'] is not None:
        try:
            rule = EarlyExit(c['exit_threshold'], c['min_steps'], c['exit'])
            check_early_exit(model, rule, c['num_steps'], c['kv_mode'])
        except ValueError as e:
            fail(str(e))
        return ExitingModel(model, rule)  # runs each token to its own depth
    return model


class StreamDecoder:
    """Turns token ids into text pieces as they arrive. A GPT-2 BPE token can end inside a UTF-8
    character, which decodes to U+FFFD until the next token completes it, so a piece ending in
    U+FFFD is held back until then."""

    def __init__(self, decode):
        self.decode, self.ids, self.emitted = decode, [], 0

    def add(self, token_id):
        self.ids.append(token_id)
        text = self.decode(self.ids)
        if text.endswith('\ufffd'):
            return ''
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

    def flush(self):
        text = self.decode(self.ids)
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


def main(argv=None):
    c = read_settings(DEFAULTS, argv)
    device = pick_device(c['device'], 0)
    share_cores(device)  # torch's threads on the cores other work leaves free
    device_type = 'cuda' if device.startswith('cuda') else device
    if c['dtype'] != 'auto':  # a wrong dtype stops (a slow one warns) before any download
        pick_dtype(c['dtype'], device_type)
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model, checkpoint = load_model(c['init_from'], c['out_dir'], device, c['ckpt'])
    dtype = pick_dtype(c['dtype'], device_type, warn=False, n_embd=model.config.n_embd)  # 'auto' by width
    if checkpoint is not None:  # which weights: best.pt (best val loss) or ckpt.pt (the latest)
        val = f", val loss {checkpoint['val_loss']:.4f}" if checkpoint.get('val_loss') is not None else ''
        print(f"sampling from {os.path.join(c['out_dir'], c['ckpt'])} (iteration {checkpoint.get('iter_num', '?')}"
              f"{val})", file=sys.stderr)
    meta = checkpoint.get('meta') if checkpoint else None
    meta = meta or {'tokenizer': 'gpt2', 'vocab_size': model.config.vocab_size}
    generator = check_generation_args(model, c)  # the model, or the model with early exit
    encode, decode = prepare_data.get_tokenizer(meta)
    start_ids = prompt_ids(c, encode, model.config.block_size)
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]

    torch.manual_seed(c['seed'])  # here, after building the model (its init draws from the same generator)

    with autocast_context(device_type, dtype):
        for _ in range(c['num_samples']):
            print(decode(start_ids), end='', flush=True)
            stream = StreamDecoder(decode)
            depths = []  # early exit: the core steps behind each sampled token
            for token in generator.generate_tokens(x, c['max_new_tokens'], c['temperature'], c['top_k'],
                                                   c['num_steps'], kv_mode=c['kv_mode']):
                print(stream.add(token.item()), end='', flush=True)
                if c['exit_threshold'] is not None:
                    depths.append(generator.exit_steps[0, -1].item())
            print(stream.flush())
            if depths:
                print(f"(early exit: {sum(depths) / len(depths):.2f} core steps per token on average, "
                      f"of {c['num_steps'] or model.config.n_recur})", file=sys.stderr)
            print('---------------')


if __name__ == '__main__':
    main()
