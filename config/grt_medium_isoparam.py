# The paper's medium isoParam GRT (2 + 20x4 + 2, d 1024): the 24 unique blocks of GPT-2 medium
# (config/gpt2_medium.py), with the 20-block core run R = 4 times.
# Same data and recipe as config/grt_small.py; learning rate from GPT-3's table for this size.
#   python prepare_data.py fineweb10B
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_medium_isoparam.py
out_dir = 'out-grt-medium-isoparam'
preset = 'grt-medium-isoparam'
dataset = 'fineweb10B'
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls; every id fits

# 8 sequences x 1024 tokens x 64 micro-steps = 524,288 tokens (about 0.5M) per optimizer step,
# the micro-steps shared among the torchrun processes. Out of memory: halve batch_size, double
# gradient_accumulation_steps (the product sets the tokens per step)
block_size = 1024
batch_size = 8
gradient_accumulation_steps = 64

max_iters = 20000  # 10.5B tokens
learning_rate = 0.0003
min_lr = 2.9999999999999997e-05  # cosine decay to learning_rate / 10
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
