# The paper's large isoFLOP GRT (1 + 5x6 + 5, d 1280).
# FLOPs: at eval depth R = 6 the same FLOPs a token as the 36-layer config/gpt2_large.py.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_large.py
from config.recipe_fineweb_large import *

out_dir = 'out-grt-large'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 5, 6, 5
n_embd, n_head = 1280, 20
