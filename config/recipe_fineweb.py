# The paper's FineWeb10B recipe that every paper-scale config (gpt2_*, grt_*, huginn_small, mor_small)
# starts from (with `from config.recipe_fineweb import *`), then adds its model. These are GPT-2 small's
# settings: config/recipe_fineweb_medium.py and recipe_fineweb_large.py change the micro-batch and the
# learning rate (GPT-3's table) for the larger sizes.
#   python prepare_data.py fineweb10B
dataset = 'fineweb10B'
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls; every id fits

# 16 sequences x 1024 tokens x 32 micro-steps = 524,288 tokens (about 0.5M) per optimizer step; with
# torchrun the micro-steps are shared among the processes (8 GPUs: 4 each). Out of memory: halve
# batch_size, double gradient_accumulation_steps (the product sets the tokens per step)
block_size = 1024
batch_size = 16
gradient_accumulation_steps = 32

max_iters = 20000  # 10.5B tokens
learning_rate = 6e-4
min_lr = 6e-5  # cosine decay to learning_rate / 10
warmup_iters = 2000
lr_decay_iters = 20000
beta1, beta2 = 0.9, 0.95
weight_decay = 0.1
grad_clip = 1.0
dropout = 0.0

eval_interval = 1000
eval_iters = 100
log_interval = 10
dtype = 'bfloat16'
compile = True
