# Huginn-style heavy-tail depth sampling (Geiping et al., 2025) at the paper's small scale (d 768), matched
# in training FLOPs per token to config/grt_small.py: 1 + 1 x r + 1 with the concatenation adapter,
# r ~ min(Poisson(tau) + 1, 27), tau ~ LogNormal(log 9 - 0.125, 0.5) (mean r 9.92), gradients through the
# last k = 5 steps only. Expected training FLOPs per token, forward + backward, LM head excluded:
# 486.6 MFLOP (Huginn.expected_train_flops_per_token(1024)) vs GRT's 486.6 MFLOP (3 x forward at the mean
# r 5.5 of Uniform{1..10}); eval forward at r = 9: 211.6 MFLOP vs GRT's 266.6 at R = 10.
#   python prepare_data.py fineweb10B
#   torchrun --standalone --nproc_per_node=8 train.py config/huginn_small.py
out_dir = 'out-huginn-small'
model_type = 'huginn'
n_embd, n_head = 768, 12
n_prelude, n_core, n_coda = 1, 1, 1
n_recur = 9  # r_mean: the log-normal's mean and the eval depth
backprop_depth = 5
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
