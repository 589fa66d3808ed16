# The paper's large isoParam GRT (3 + 30x6 + 3, d 1280): the 36 unique blocks of config/gpt2_large.py,
# with the 30-block core run R = 6 times.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_large_isoparam.py
from config.recipe_fineweb_large import *

out_dir = 'out-grt-large-isoparam'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 3, 30, 6, 3
n_embd, n_head = 1280, 20
