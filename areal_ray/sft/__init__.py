"""Supervised fine-tuning (`python -m jobs.sft`) on the RL trainer's workers: rows and
their completion masks (`dataset.py`), the completion-NLL step (`step.py`), the Ray
Train worker loop (`loop.py`) and the job (`job.py`)."""
