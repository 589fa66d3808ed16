# The dense 24-layer GPT-2 medium (d 1024): the twin of config/grt_medium.py (isoFLOP) and
# config/grt_medium_isoparam.py (isoParam).
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_medium.py
from config.recipe_fineweb_medium import *

out_dir = 'out-gpt2-medium'
model_type = 'gpt'
n_layer = 24
n_embd, n_head = 1024, 16
