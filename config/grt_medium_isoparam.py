# The paper's medium isoParam GRT (2 + 20x4 + 2, d 1024): the 24 unique blocks of config/gpt2_medium.py,
# with the 20-block core run R = 4 times.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_medium_isoparam.py
from config.recipe_fineweb_medium import *

out_dir = 'out-grt-medium-isoparam'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 2, 20, 4, 2
n_embd, n_head = 1024, 16
