"""Suite-wide settings."""

import torch

# Tiny models on a 2-core machine: one intra-op thread is faster and leaves a core to the
# processes that end-to-end tests start.
torch.set_num_threads(1)
