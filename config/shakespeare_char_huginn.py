# Huginn-style heavy-tail depth sampling (baselines.py) on Tiny Shakespeare's characters: 1 + 1 x r + 1
# with the concatenation adapter, r ~ min(Poisson(tau) + 1, 12), tau ~ LogNormal(log 4 - 0.125, 0.5)
# (mean r about 4.9), gradients through the last 3 steps only; eval depth r_mean = 4.
#   python train.py config/shakespeare_char_huginn.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-huginn
# Training FLOPs per token (forward + backward, LM head excluded, averaged over training's depth
# draws; d = 128, S = 128) against config/shakespeare_char_gpt.py (6 layers, 8.26 MFLOP) and
# config/shakespeare_char_grt.py (1+1x5+1, 8.36 MFLOP at the mean r = 3):
#   huginn 1+1x4+1, k = 3: 8.22 MFLOP (Huginn.expected_train_flops_per_token: no-grad steps forward only)
#                          = 1.00x dense, 0.98x GRT; eval forward 3.01 MFLOP (GRT 3.44, dense 2.75)
out_dir = 'out-shakespeare-char-huginn'
dataset = 'shakespeare_char'

model_type = 'huginn'
n_prelude = 1
n_core = 1
n_recur = 4  # r_mean: the log-normal's mean and the eval depth
n_coda = 1
backprop_depth = 3  # k
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
always_save_checkpoint = False
device = 'cpu'
dtype = 'auto'  # bf16 autocast where the CPU has native bf16 (AVX-512 BF16 / AMX), else fp32
compile = False
