# The paper's small isoParam GRT (1 + 10x10 + 1, d 768): the 12 unique blocks of config/gpt2_small.py,
# with the 10-block core run R = 10 times.
#   torchrun --standalone --nproc_per_node=8 train.py config/grt_small_isoparam.py
from config.recipe_fineweb import *

out_dir = 'out-grt-small-isoparam'
model_type = 'grt'
n_prelude, n_core, n_recur, n_coda = 1, 10, 10, 1
n_embd, n_head = 768, 12
batch_size, gradient_accumulation_steps = 8, 64  # the same 524,288 tokens a step in smaller micro-batches
