import os

import torch
from hypothesis import HealthCheck, settings

# The tests' tensors are tiny: one thread per process avoids oversubscription (CI runs
# two pytest workers on two cores).
torch.set_num_threads(1)

# A fast default profile for the suite; SYMSPEC_HYPOTHESIS=thorough runs many more examples.
settings.register_profile("fast", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SYMSPEC_HYPOTHESIS", "fast"))
