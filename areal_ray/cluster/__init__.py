"""What a run needs from the cluster, checked before anything starts: where its actors go
(`plan`), whether shared GPUs have the memory for them, and what the environment offers."""
