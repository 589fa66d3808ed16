# The FineWeb10B recipe at GPT-2 large's size (d 1280), for config/gpt2_large.py and the large GRTs.
from config.recipe_fineweb import *

batch_size, gradient_accumulation_steps = 4, 128  # the same 524,288 tokens a step in smaller micro-batches
learning_rate = 2.5e-4  # GPT-3's table for this size
min_lr = learning_rate / 10
