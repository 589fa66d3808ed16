# The recipe every run of study.py shares: the shakespeare_char recipe at nanoGPT's CPU shapes
# (block 64, batch 12), so one dense run takes a couple of minutes on 2 CPU cores. study.py adds the
# model, seed, max_iters and out_dir.
from config.recipe_shakespeare_char import *

block_size = 64
batch_size = 12
lr_decay_iters = 0  # decay over the run's own max_iters
eval_iters = 50
log_interval = 25
