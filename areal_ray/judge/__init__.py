"""Served model rewards: a generative judge and a scalar reward model, each its own Serve
app (deployments/judge.py). The pure parts are here: the prompt (`prompt.py`), the
judge's text to a score (`parse.py`), the per-call deadline and its reasons
(`deadline.py`); `models.py` builds the embedded tiny judge and reward model on first
use; `client.py` is the reward stage's side of the calls."""
