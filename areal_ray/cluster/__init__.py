"""What a run needs from the cluster, checked before anything starts: where its actors
go and whether shared GPUs have the memory for them (`plan`, `placement`), and whether
the environment has the attention kernels the config asks for (`attention`)."""
