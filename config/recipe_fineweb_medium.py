# The FineWeb10B recipe at GPT-2 medium's size (d 1024), for config/gpt2_medium.py and the medium GRTs.
from config.recipe_fineweb import *

batch_size, gradient_accumulation_steps = 8, 64  # the same 524,288 tokens a step in smaller micro-batches
learning_rate = 3e-4  # GPT-3's table for this size
min_lr = learning_rate / 10
