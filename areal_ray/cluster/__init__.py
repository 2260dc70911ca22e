"""What the job needs from the cluster, checked before anything starts."""
