# Huginn-style heavy-tail depth sampling (Geiping et al., 2025) at the paper's small scale (d 768):
# r = Poisson(tau) + 1, tau ~ LogNormal(log 9 - 0.125, 0.5), gradients through the last k = 5 steps.
# FLOPs a trained token (the mean over its depth draws) matched to config/grt_small.py's within 1% (tests/test_configs.py).
#   torchrun --standalone --nproc_per_node=8 train.py config/huginn_small.py
from config.recipe_fineweb import *

out_dir = 'out-huginn-small'
model_type = 'huginn'
n_prelude, n_core, n_recur, n_coda = 1, 1, 9, 1  # n_recur: r_mean, the log-normal's mean and the eval depth
n_embd, n_head = 768, 12
backprop_depth = 5  # k
