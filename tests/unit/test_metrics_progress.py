"""Progress output (issue 17 row 7): a tqdm bar on a terminal, plain lines in files (Slurm .out)."""
import io

from megatron_fp4.training.metrics import MetricsLogger


class Terminal(io.StringIO):
    def isatty(self):
        return True


def drive(stream, steps=25, initial=0):
    logger = MetricsLogger(None, steps, initial, progress=True, enabled=True, stream=stream)
    for i in range(initial, steps):
        logger.advance(4.0 - i / 10, {"lr": "1.00e-03"})
    logger.write("step 3: a message")
    logger.close()
    return stream.getvalue()


def test_not_a_terminal_gets_plain_lines_every_ten_steps_and_the_last():
    out = drive(io.StringIO())
    assert "\r" not in out
    assert out.splitlines() == ["train step 10/25: loss 3.1000, lr 1.00e-03", "train step 20/25: loss 2.1000, lr 1.00e-03",
                                "train step 25/25: loss 1.6000, lr 1.00e-03", "step 3: a message"]


def test_resumed_run_counts_from_its_first_step():
    assert drive(io.StringIO(), steps=12, initial=8).splitlines()[0] == "train step 10/12: loss 3.1000, lr 1.00e-03"


def test_a_terminal_gets_the_bar():
    out = drive(Terminal())
    assert "\r" in out and "25/25" in out and "train step" not in out


def test_progress_off_or_another_rank_prints_nothing():
    stream = io.StringIO()
    for kwargs in ({"progress": False}, {"enabled": False}):
        logger = MetricsLogger(None, 5, **kwargs, stream=stream)
        for _ in range(5):
            logger.advance(1.0)
        logger.close()
    assert stream.getvalue() == ""
