# The paper's medium isoFLOP GRT (2 + 5x4 + 2, d 1024).
# FLOPs: at eval depth R = 4 the same FLOPs a token as the 24-layer config/gpt2_medium.py.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_medium.py
from config.recipe_fineweb_medium import *

out_dir = 'out-grt-medium'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 2, 5, 4, 2
n_embd, n_head = 1024, 16
