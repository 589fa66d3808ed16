# A GRT (1 + 1x5 + 1) on Tiny Shakespeare's characters, sized to train on 2 CPU cores in about 10 minutes.
#   python train.py config/shakespeare_char_grt.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-grt
# Its dense twin, config/shakespeare_char_gpt.py, costs the same training FLOPs per token:
#   GPT, 6 layers:  6 * (24 d^2 + 4 S d)                               = 2,752,512 forward FLOPs a token
#   GRT 1+1x5+1:    (2 + r) * (24 d^2 + 4 S d) + 10 r d^2 at the mean training depth r = (R + 1) / 2 = 3
#                                                                      = 2,785,280 (+1.2%)
# (d = 128, S = 128, LM head excluded as in model.py's flops_per_token; training = 3x forward.)
# MEASURED (2026-11-30, AMD EPYC, 2 vCPUs with AVX-512 BF16, torch 2.13.0 CPU, bf16 autocast, no compile,
# machine otherwise idle): val loss 1.8168 at iteration 1500 (1.8437 at 1250), 525 s of training,
# 8 min 52 s for the whole command (data ready, evaluations included). Dense twin: see shakespeare_char_gpt.py.
out_dir = 'out-shakespeare-char-grt'
dataset = 'shakespeare_char'

model_type = 'grt'
n_prelude = 1
n_core = 1
n_recur = 5  # R: training draws r ~ Uniform{1..5} per micro-step; eval and sampling use 5
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
