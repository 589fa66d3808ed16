# Ablation ladder rung 2, + prelude/coda split (GRTConfig.rung): h0 = e = Prelude(embeddings),
# h = Core(h) repeated r ~ Uniform{1..7} times in training (7 at eval), then the coda.
#   python train.py config/shakespeare_char_rung2.py     (prepares data/shakespeare_char/ if missing)
#   python sample.py --out_dir=out-shakespeare-char-rung2
# Training FLOPs per token (forward + backward, LM head excluded, averaged over training's depth
# draws; d = 128, S = 128) against config/shakespeare_char_gpt.py (6 layers, 8.26 MFLOP) and
# config/shakespeare_char_grt.py (1+1x5+1, 8.36 MFLOP at the mean r = 3):
#   rung 2, 1+1x7+1:       8.26 MFLOP = 1.00x dense, 0.99x GRT (the parts it lacks buy it more steps)
out_dir = 'out-shakespeare-char-rung2'
dataset = 'shakespeare_char'

model_type = 'grt'
rung = 2
n_prelude = 1
n_core = 1
n_recur = 7
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
