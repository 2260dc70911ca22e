"""The console's view: plain step lines in a log, a tqdm bar on a terminal."""

import io
import re

from areal_ray.observe.progress import StepProgress

# what tests/jobs/test_submit.py counts in a job's logs
STEP_LINE = r"\[areal-ray\] step +\d+/%d v"


def rec(step, step_s=2.0, n_tokens=400):
    return {"step": step, "version": step + 1, "reward_mean": 0.25, "staleness_max": 1,
            "staleness_mean": 0.5, "n_tokens": n_tokens, "step_s": step_s}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_one_plain_line_per_step_with_an_eta_from_recent_steps():
    out = io.StringIO()  # not a terminal: a job's log, a pipe
    p = StepProgress(10, stream=out)
    p.step(rec(0, step_s=30.0))  # the first step carries the start-up
    for s in range(1, 7):
        p.step(rec(s))
    lines = out.getvalue().splitlines()
    assert len(lines) == 7 and all(re.match(STEP_LINE % 10, line) for line in lines)
    assert lines[0] == ("[areal-ray] step    1/10 v1    reward 0.250  staleness max 1 mean 0.50"
                        "       13 tok/s  ETA   270s")
    assert lines[-1].endswith("ETA     6s")  # 3 steps left at the last 5 steps' 2 s
    assert "\r" not in out.getvalue()


def test_a_restart_moves_the_count_to_the_checkpoint():
    out = io.StringIO()
    p = StepProgress(8, stream=out)
    for s in range(3):
        p.step(rec(s))
    p.restarted(2)  # the trainer lost version 3
    p.step(rec(2))
    assert p.done == 3 and p.eta_s() == 2.0 * 5
    assert "trainer (re)started from the checkpoint at version 2" in out.getvalue()


def test_a_terminal_gets_a_bar_with_the_steps_numbers():
    term = Terminal()
    p = StepProgress(10, stream=term)
    p.restarted(4)  # a resumed run starts its bar where the checkpoint was
    p.step(rec(4))
    p.note("[areal-ray] interrupted: stopping after this step")
    p.close()
    text = term.getvalue()
    assert "5/10" in text and "v5 reward 0.250 staleness max 1 mean 0.50 200 tok/s ETA 10s" in text
    assert "[areal-ray] interrupted: stopping after this step\n" in text
    assert not re.search(STEP_LINE % 10, text)  # no plain lines under the bar
