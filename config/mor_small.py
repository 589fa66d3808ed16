# Mixture-of-Recursions (Bae et al., 2025) at the paper's small scale (d 768), matched in training FLOPs
# per token to config/grt_small.py: middle-cycle sharing 1 + 3 x 4 + 1 (unique first and last layers, a
# 3-layer middle recursed N_r = 4 times, as MoR shares a multi-layer block a few times), expert-choice
# routing with capacities 4/4, 3/4, 2/4, 1/4 of the tokens. Training FLOPs per token, forward + backward,
# LM head excluded: 476.6 MFLOP (3 x MoR.flops_per_token(1024), routers included) vs GRT's 486.6 MFLOP
# (-2%; the nearest layout). Validation and generation route with the causal auxiliary routers.
#   python prepare_data.py fineweb10B
#   torchrun --standalone --nproc_per_node=8 train.py config/mor_small.py
out_dir = 'out-mor-small'
model_type = 'mor'
n_embd, n_head = 768, 12
n_prelude, n_core, n_coda = 1, 3, 1
n_recur = 4  # N_r
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
