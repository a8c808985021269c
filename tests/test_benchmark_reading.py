"""benchmarks/reading.py: the computed reading under a run's tables."""
import math

import pytest

from benchmarks.reading import geomean, reading_lines
from benchmarks.results import Row


def _row(model, config, speedup, noise=0.01, label=None, mode="train", error=None):
    return Row(model=model, mode=mode, config=config, label=label or config, speedup=speedup,
               noise=noise, error=error)


def test_geomean_of_each_configuration_over_the_models():
    rows = [_row("a", "compile", 1.10), _row("b", "compile", 1.21),
            _row("a", "optimize", 1.44), _row("b", "optimize", 1.00),
            _row("a", "eager", 1.0), _row("b", "eager", 1.0)]
    first = reading_lines(rows)[0]
    assert "over 2 model(s)" in first
    assert f"compile {math.sqrt(1.10 * 1.21):.2f}x" in first and "optimize 1.20x" in first
    assert "eager" not in first  # the noise-floor row is not a configuration to rank


def test_ahead_level_and_behind_count_both_rows_noise():
    rows = [_row("m1", "expert", 1.10), _row("m1", "optimize", 1.20),            # 0.10 > 2*0.014
            _row("m2", "expert", 1.10, 0.03), _row("m2", "optimize", 1.15, 0.03),  # 0.05 < 2*0.042
            _row("m3", "expert", 1.10), _row("m3", "compile", 1.30), _row("m3", "optimize", 1.20)]
    standing = reading_lines(rows)[1]
    assert "m1 ahead (1.20x, expert 1.10x" in standing
    assert "m2 level (1.15x, expert 1.10x" in standing
    assert "m3 behind (1.20x, compile 1.30x" in standing  # the best peer, not the first


def test_failed_rows_and_missing_models_are_said():
    rows = [_row("a", "compile", 1.2), _row("b", "compile", 1.2),
            _row("a", "optimize", 1.3), _row("b", "optimize", None, error="boom")]
    lines = reading_lines(rows)
    assert "optimize 1.30x (1 of 2)" in lines[0]
    assert "b " not in lines[1]
    assert reading_lines([]) == ["- No row was measured."]
    only_ours = reading_lines([_row("a", "optimize", 1.3)])
    assert len(only_ours) == 1  # no peer measured: no standing line


@pytest.mark.parametrize("values", [[1.0], [2.0, 0.5], [1.1, 1.2, 1.3]])
def test_geomean(values):
    assert geomean(values) == pytest.approx(math.prod(values) ** (1 / len(values)))
