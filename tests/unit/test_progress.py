"""Progress bars drawn for a log: few lines, no cursor moves (a journey counted 297 stderr lines for
a 3.6-minute serve comparison, each nested redraw a newline and an ``ESC[A``)."""

import io
import sys

from moelayers._progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _draw(monkeypatch, stream: io.StringIO, nested: bool = False) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar(total=500, desc="serve", unit="req", nested=nested)
    for _ in range(500):
        bar.update(1)
    bar.close()
    return stream.getvalue()


def test_a_bar_into_a_log_draws_its_start_and_end_only(monkeypatch):
    out = _draw(monkeypatch, io.StringIO())
    assert out.count("\r") <= 3 and "500/500" in out and "\x1b[A" not in out


def test_a_nested_bar_into_a_log_is_not_drawn(monkeypatch):
    assert _draw(monkeypatch, io.StringIO(), nested=True) == ""


def test_a_bar_on_a_terminal_draws_as_tqdm_does(monkeypatch):
    assert "500/500" in _draw(monkeypatch, _Terminal())
    assert "serve" in _draw(monkeypatch, _Terminal(), nested=True)  # on its line, cleared at its end


def test_bars_take_a_thread_lock_not_a_semaphore():
    """A journey saw "resource_tracker: ... leaked semaphore" after Ctrl-C of a spawned serve run:
    tqdm's default lock is a multiprocessing semaphore, left behind by the killed rank 0."""
    import subprocess

    code = ("from moelayers._progress import progress_bar\nfrom tqdm.auto import tqdm\n"
            "bar = progress_bar(total=1, desc='x')\nbar.close()\n"
            "print(type(bar.get_lock()).__name__, hasattr(tqdm, '_lock'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # ours a thread lock; the user's tqdm class untouched (its process_map sends its lock to spawned workers)
    assert out.stdout.strip() == "RLock False", out.stderr[-2000:]


def test_a_closed_stderr_draws_nothing_and_the_work_goes_on():
    """With stderr closed (2>&-) every recipe failed at its first bar and wrote nothing (an
    environment journey): fd 2 is then closed, or a file opened since for reading."""
    import os
    import subprocess
    import sys

    code = ("from moelayers._progress import progress_bar\n"
            "print(sum(progress_bar(range(5), desc='x')), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, timeout=60,
                          preexec_fn=lambda: os.close(2))
    assert proc.returncode == 0 and proc.stdout.strip() == "10"
