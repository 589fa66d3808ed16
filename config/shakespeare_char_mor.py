# Mixture-of-Recursions (baselines.py) on Tiny Shakespeare's characters: middle-cycle sharing 1 + 1x7 + 1,
# expert-choice routing with capacities 7/7, 6/7, ..., 1/7 of the tokens in training; validation and
# sampling route with the causal auxiliary routers.
#   python train.py config/shakespeare_char_mor.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-mor
# Training FLOPs per token (forward + backward, LM head excluded, averaged over training's depth
# draws; d = 128, S = 128) against config/shakespeare_char_gpt.py (6 layers, 8.26 MFLOP) and
# config/shakespeare_char_grt.py (1+1x5+1, 8.36 MFLOP at the mean r = 3):
#   mor 1+1x7+1:           8.38 MFLOP (3 x MoR.flops_per_token at the capacity schedule, routers included)
#                          = 1.02x dense, 1.00x GRT
out_dir = 'out-shakespeare-char-mor'
dataset = 'shakespeare_char'

model_type = 'mor'
n_prelude = 1
n_core = 1
n_recur = 7  # N_r
n_coda = 1
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
