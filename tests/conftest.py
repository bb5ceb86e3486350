import os

import torch

# Tiny models gain nothing from intra-op threads, and on shared cores a second OpenMP thread waiting
# for a descheduled peer makes each op 10-100x slower.
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The longest files (torchrun pairs, whole training runs in subprocesses), measured with --durations: they run
# first, so the pytest workers of `make test` (-n JOBS --dist loadfile: a file is one unit of work) start on them
# together and the many short files fill in at the end, instead of one long file running alone at the end.
LONGEST_FIRST = (
    "test_dist.py",
    "test_dist_phases.py",
    "test_fsdp.py",
    "test_dist_scope.py",
    "test_python_api.py",
    "test_imports.py",
    "test_rewards_math.py",
    "test_srpo.py",
    "test_plugins.py",
    "test_bf16.py",
    "test_run_folder.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep their order
