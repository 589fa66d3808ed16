# The dense 36-layer GPT-2 large (d 1280): the twin of config/grt_large.py (isoFLOP) and
# config/grt_large_isoparam.py (isoParam).
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_large.py
from config.recipe_fineweb_large import *

out_dir = 'out-gpt2-large'
model_type = 'gpt'
n_layer = 36
n_embd, n_head = 1280, 20
