# The paper's small isoFLOP GRT (1 + 1x10 + 1, d 768).
# FLOPs: at eval depth R = 10 the same FLOPs a token as the 12-layer config/gpt2_small.py.
# Depth in training: the paper's r ~ Uniform{1..R}, gate bias +4 (GRTConfig's defaults); when to change
# them (train_depth='fixed', gate_bias=0): docs/analysis.md, Two ways to train the depth.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_small.py
from config.recipe_fineweb import *

out_dir = 'out-grt-small'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 10, 1
n_embd, n_head = 768, 12
