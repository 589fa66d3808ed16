# The Tiny Shakespeare characters recipe that every config/shakespeare_char_*.py starts from (with
# `from config.recipe_shakespeare_char import *`), then adds its model: nanoGPT's char setting at width
# 128, sized to train on 2 CPU cores in minutes (README, Quick start). The data is prepared on the first run.
dataset = 'shakespeare_char'
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0  # ~6 passes over the text: too few to overfit

batch_size = 32
gradient_accumulation_steps = 1
max_iters = 1500
lr_decay_iters = 1500
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
beta2 = 0.99  # few tokens per step: a shorter second-moment memory, as nanoGPT's char configs
weight_decay = 0.1

eval_interval = 250
eval_iters = 20
log_interval = 10
device = 'cpu'
dtype = 'auto'  # fp32 at this width even where bf16 matmuls are the faster: it trains faster (common.pick_dtype)
compile = False
