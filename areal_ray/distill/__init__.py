"""On-policy distillation (`algo.distill`): a served teacher scores the student's own
samples token by token (`deployments/teacher.py`, `stage.py`), and the per-token
advantage is the teacher's logprob minus the student's (`advantage.py`)."""
