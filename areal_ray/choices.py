"""The named choices the config validates against, in a module that imports nothing.

They live here rather than next to the code that implements them (`algo/`, `weights`)
because those modules import torch, and the config is unpickled in processes that
never run a tensor op: Ray Train's controller, Ray Data's coordinator and the job's
`--help`. Importing torch there costs seconds of start-up and ~300 MB per process.
The implementing modules re-export these names.
"""

ADV_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
ADV_NORMS = ("none", "batch")
KL_ESTIMATORS = ("k1", "k2", "k3")
WEIGHT_PATHS = ("auto", "collective", "shm", "object_store", "disk")
