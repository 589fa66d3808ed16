# Huginn-style heavy-tail depth sampling (Geiping et al., 2025) at the paper's small scale (d 768):
# r ~ min(Poisson(tau) + 1, 27), tau ~ LogNormal(log 9 - 0.125, 0.5), gradients through the last k = 5 steps.
# FLOPs: 486.6 MFLOP a trained token (expected over depths), as config/grt_small.py's 486.6.
#   torchrun --standalone --nproc_per_node=8 train.py config/huginn_small.py
from config.recipe_fineweb import *

out_dir = 'out-huginn-small'
model_type = 'huginn'
n_prelude, n_core, n_recur, n_coda = 1, 1, 9, 1  # n_recur: r_mean, the log-normal's mean and the eval depth
n_embd, n_head = 768, 12
backprop_depth = 5  # k
