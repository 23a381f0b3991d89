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
