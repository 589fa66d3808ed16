# Huginn on a depth task: 1 + 1x8 + 1, r = Poisson(tau) + 1 with mean tau 8, gradients through the last 4 steps;
# training FLOPs 1.03x the depth GRT's, eval at R = 8 unless depth_eval says otherwise.
from config.depth.recipe import *

out_dir = 'out-depth-huginn'
model_type = 'huginn'
n_prelude, n_core, n_recur, n_coda = 1, 1, 8, 1
backprop_depth = 4
