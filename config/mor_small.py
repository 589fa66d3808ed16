# Mixture-of-Recursions (Bae et al., 2025) at the paper's small scale (d 768): unique first and last layers,
# a 3-layer middle recursed N_r = 4 times, expert-choice routing with capacities 4/4, 3/4, 2/4, 1/4.
# FLOPs a trained token within 3% of config/grt_small.py's, the nearest layout (tests/test_configs.py).
#   torchrun --standalone --nproc_per_node=8 train.py config/mor_small.py
from config.recipe_fineweb import *

out_dir = 'out-mor-small'
model_type = 'mor'
n_prelude, n_core, n_recur, n_coda = 1, 3, 4, 1  # n_recur: N_r
n_embd, n_head = 768, 12
