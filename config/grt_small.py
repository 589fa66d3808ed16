# The paper's small isoFLOP GRT (1 + 1x10 + 1, d 768) on FineWeb10B: same FLOPs per token at eval depth
# R = 10 as the 12-layer GPT-2 of config/gpt2_small.py, which trains with the same recipe.
#   python prepare_data.py fineweb10B
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_small.py
out_dir = 'out-grt-small'
preset = 'grt-small-isoflop'
dataset = 'fineweb10B'
vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls; every id fits

# 16 sequences x 1024 tokens x 32 micro-steps = 524,288 tokens (about 0.5M) per optimizer step; with
# torchrun the 32 micro-steps are shared among the processes (8 GPUs: 4 each)
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
