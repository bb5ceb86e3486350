import os

import torch

# Two cores: keep each test process to a predictable thread count.
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
