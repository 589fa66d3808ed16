# The GRT trained at a fixed depth r = R = 5 with the gate's bias at 0 (g starts at 0.5): the training
# choices that made it use its recurrence on the depth tasks (docs/depth.md). 1 + 1x5 + 1, training
# FLOPs about the paper-default GRT's (5 steps against a mean of 4.5).
from config.depth.recipe import *

out_dir = 'out-depth-grt-fixed'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 1, 5, 1
train_depth = 'fixed'
gate_bias = 0.0
