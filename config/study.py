# The training recipe every run of study.py shares (study.py adds the model, seed, iterations and
# out_dir). nanoGPT's CPU shakespeare_char setting (block 64, batch 12, lr 1e-3 with cosine decay),
# sized so that one dense run takes a couple of minutes on 2 CPU cores.
dataset = 'shakespeare_char'
block_size = 64
batch_size = 12
gradient_accumulation_steps = 1
n_embd = 128
n_head = 4
dropout = 0.0
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99
weight_decay = 0.1
warmup_iters = 100
eval_interval = 250
eval_iters = 50
log_interval = 25
always_save_checkpoint = True  # so an interrupted study resumes from its last evaluation
compile = False  # tiny models: compiling takes longer than it saves in a few-minute run
device = 'cpu'
