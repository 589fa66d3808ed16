# The dense 12-layer GPT-2 small (d 768): the twin of config/grt_small.py (isoFLOP) and
# config/grt_small_isoparam.py (isoParam).
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_small.py
from config.recipe_fineweb import *

out_dir = 'out-gpt2-small'
model_type = 'gpt'
n_layer = 12
n_embd, n_head = 768, 12
