import os

import torch

# Tiny models gain nothing from intra-op threads, and on shared cores a second OpenMP thread waiting
# for a descheduled peer makes each op 10-100x slower.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
